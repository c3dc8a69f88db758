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
from workbench.ladder_compare import KEYS, compare_runs

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


def _slowed(src, dst, factor, legs=None):
    """A copy of run ``src`` whose steps (every role, in ``legs`` or all legs) took ``factor`` × as long."""
    shutil.copytree(src, dst)
    for steps in sorted((dst / "legs").glob("*/steps.jsonl")):
        if legs is not None and steps.parent.name not in legs:
            continue
        rows = [json.loads(line) for line in steps.read_text().splitlines()]
        for r in rows:
            for key in ("target_ms", "draft_ms", "draft_loop_ms"):
                if r.get(key) is not None:
                    r[key] *= factor
        steps.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dst


def test_two_references_count_their_run_to_run_spread_as_noise(tmp_path):
    # two references 6 % apart: a run 4 % off the first is within their run-to-run noise, one 20 % off is not
    ref2 = _slowed(LOCAL, tmp_path / "ref2", 1.06)
    near = _slowed(LOCAL, tmp_path / "near", 1.04)
    far = _slowed(LOCAL, tmp_path / "far", 1.20, legs={"forced_g4"})
    one = compare_runs(near, LOCAL)
    two = compare_runs(near, [LOCAL, ref2])
    assert len(two) == len(one) == 30
    assert (two["between_ref"].round(6) == 0.06).all()
    # the reference is the references' median (of two: their mean) and the ratio is taken against it
    assert two["ratio"].round(6).eq(round(1.04 / 1.03, 6)).all()
    assert two["equal"].all()
    assert not one.loc[one["spread_ref"].lt(0.04) & one["spread_run"].lt(0.04), "equal"].any()
    t = compare_runs(far, [LOCAL, ref2])
    spec = t["role"] != "target decode"
    assert t.loc[~spec, "equal"].all()  # the vanilla leg was not slowed
    assert not t.loc[spec & (t["noise"] < 0.1), "equal"].any()
    out = subprocess.run([sys.executable, "-m", "workbench.ladder_compare", str(near), "--against", str(LOCAL),
                          str(ref2)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "(their median)" in out.stdout and "| run to run |" in out.stdout
    assert out.stdout.strip().endswith("30 of 30 cells equal within noise (the largest of the runs' repeat spreads "
                                       "and the references' run-to-run spread, at least 1%)")


def test_a_series_judges_each_run_between_its_neighbours(tmp_path):
    from workbench.ladder_compare import series

    slow = _slowed(LOCAL, tmp_path / "slow", 1.5, legs={"forced_g4"})
    t = series([LOCAL, RAY, LOCAL, slow])
    assert t["run"].tolist() == [RAY.name, LOCAL.name]
    assert t["executor"].tolist() == ["ray", "local"]
    # the Ray run between two copies of one local run: the pair's verdicts (no run-to-run spread to add)
    assert (t.iloc[0]["equal"], t.iloc[0]["cells"]) == (24, 30)
    assert t.iloc[0]["furthest"] == "draft propose, batch 1 eager" and t.iloc[0]["furthest_ratio"] > 2
    # the local run between the Ray run and a copy whose spec leg took 1.5x: where the Ray run agreed, the
    # references differ by 1.5x, noise now; in 5 of the 6 cells where Ray was 1.05-2.1x slower, the local run
    # is further from the references' mean than they are from each other, and those stay unequal
    t2 = compare_runs(LOCAL, [RAY, slow])
    pair = compare_runs(RAY, LOCAL)
    assert t.iloc[1]["equal"] == t2["equal"].sum() == 25
    off, off_pair = t2.loc[~t2["equal"], KEYS], pair.loc[~pair["equal"], KEYS]
    assert len(off.merge(off_pair)) == 5 and (pair.loc[~pair["equal"], "ratio"] > 1.05).all()
    with pytest.raises(ValueError, match="at least 3 runs"):
        series([LOCAL, RAY])
    bad = subprocess.run([sys.executable, "-m", "workbench.ladder_compare", str(RAY), "--series", str(LOCAL)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--series RUN RUN RUN" in bad.stderr


def test_the_documented_series_is_what_the_command_prints():
    runs = sorted((REPO / "results" / "E16").glob("20261205T21????Z-*"))
    assert len(runs) == 13
    out = subprocess.run([sys.executable, "-m", "workbench.ladder_compare", "--series",
                          *(str(r.relative_to(REPO)) for r in runs)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    page = (REPO / "docs" / "ray.md").read_text()
    assert "<!-- ladder-series -->\n" + out.stdout.rstrip("\n") + "\n\n" in page
    # the series the page describes: 6 Ray runs, 5 local ones judged, Ray within its neighbours' noise
    assert "ray: 81 of 84 cells equal in 6 runs" in out.stdout
    assert "local: 48 of 70 cells equal in 5 runs" in out.stdout
