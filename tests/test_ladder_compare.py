"""Two cost-ladder runs side by side, cell by cell (workbench.ladder_compare; docs/ray.md).

From the committed E16 runs of one H100: the same command with the local executor and through Ray."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pandas as pd
import pytest

from conftest import REPO
from workbench import ladder
from workbench.ladder_compare import compare_runs

LOCAL = REPO / "results" / "E16" / "20261205T185901Z-dad0d920"
RAY = REPO / "results" / "E16" / "20261205T190454Z-3310b937"
OTHER_SIZE = REPO / "results" / "E16" / "20261203T143840Z-b9f5ab16"  # 32B only


def _cell(t, mode, batch, graphs, role):
    hit = t[t["size"].str.contains(f"\\[marlin {mode}\\]") & (t["batch"] == batch) & (t["role"] == role)
            & ((t["draft_graphs"] == graphs) | (role == "target decode"))]
    assert len(hit) == 1, (mode, batch, graphs, role)
    return hit.iloc[0]


def test_gpu_bound_cells_agree_and_cpu_bound_ones_are_told_apart():
    t = compare_runs(RAY, LOCAL)
    # every target step, and the drafter under its full graphs, within 1 % of the local run
    for mode in ("full", "full_all", "piecewise"):
        for batch in (1, 16):
            assert _cell(t, mode, batch, True, "target decode")["equal"]
            assert _cell(t, mode, batch, True, "target verify")["equal"]
    for batch in (1, 16):
        row = _cell(t, "full_all", batch, True, "draft propose")
        assert row["equal"] and abs(row["ratio"] - 1) < 0.01
    # the launch-bound draft cells at batch 1 were 1.2-2.1x slower through Ray (its workers at niceness 15)
    for mode, graphs in (("full_all", False), ("piecewise", True), ("full", True)):
        row = _cell(t, mode, 1, graphs, "draft propose")
        assert not row["equal"] and row["ratio"] > 1.2, row.to_dict()


def test_a_run_against_itself_is_equal_everywhere_and_a_planted_change_is_found(tmp_path):
    same = compare_runs(LOCAL, LOCAL)
    assert same["equal"].all() and (same["ratio"] == 1).all() and len(same) == 30
    run = tmp_path / "run"
    shutil.copytree(LOCAL, run)
    steps = run / "legs" / "forced_g4" / "steps.jsonl"
    rows = [json.loads(line) for line in steps.read_text().splitlines()]
    for r in rows:  # the drafter 30 % slower in one cell: full_all, graphs on, batch 16
        if r["draft_cudagraph_mode"] == "full_all" and r["batch"] == 16 and r["draft_graphs"] and r["draft_ms"]:
            r["draft_ms"] *= 1.3
    steps.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = compare_runs(run, LOCAL)
    off = t[~t["equal"]]
    assert len(off) == 1, off
    row = off.iloc[0]
    assert (row["size"], row["batch"], row["role"], bool(row["draft_graphs"])) == (
        "8b [marlin full_all]", 16, "draft propose", True)
    assert row["ratio"] == pytest.approx(1.3, rel=1e-6)
    # the step table itself reads the same rows as before the comparison existed
    assert ladder.step_costs(ladder.load(LOCAL)[0])["median_ms"].round(4).tolist() == \
        pd.read_csv(LOCAL / "tables" / "step_costs.csv")["median_ms"].round(4).tolist()


def test_runs_with_no_cell_in_common_are_refused():
    with pytest.raises(ValueError, match="no cell in common"):
        compare_runs(OTHER_SIZE, LOCAL)
    out = subprocess.run([sys.executable, "-m", "workbench.ladder_compare", str(OTHER_SIZE), "--against", str(LOCAL)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no cell in common" in out.stderr and not out.stdout


def test_the_documented_command_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "workbench.ladder_compare", str(RAY.relative_to(REPO)), "--against",
                          str(LOCAL.relative_to(REPO))], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| 8b [marlin full_all] | 1 | 4 | eager | draft propose |" in out.stdout
    assert out.stdout.strip().endswith("24 of 30 cells equal within noise (the larger of the two runs' repeat "
                                       "spreads, at least 1%)")
