"""The explorer notebook executed by papermill: the numbers it shows are the run's, recomputed from raw records."""

from __future__ import annotations

import json
import statistics

import papermill as pm
import pytest

from conftest import REPO
from synthetic_runs import LADDER_LEGS, write_run


def _notebook_numbers(executed: dict) -> dict:
    for cell in executed["cells"]:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "application/json" in data and "speedup" in data["application/json"]:
                return data["application/json"]
    raise AssertionError("the explorer notebook displayed no numbers")


def test_explorer_notebook_under_papermill(tmp_path):
    root = tmp_path / "results"
    rdir = write_run(root, experiment="E2", run_id="20260101T000000Z-abcd", legs=LADDER_LEGS, n_prompts=12)
    out = tmp_path / "explorer.ipynb"
    pm.execute_notebook(str(REPO / "notebooks" / "explorer.ipynb"), str(out),
                        parameters={"results_root": str(root), "experiment": "E2", "run_id": None},
                        kernel_name="python3", cwd=str(REPO / "notebooks"), progress_bar=False)
    numbers = _notebook_numbers(json.loads(out.read_text()))
    assert numbers["run"] == "E2/20260101T000000Z-abcd"

    # Recompute from the raw records, independently of the workbench's metrics.
    recs = {}
    for leg in LADDER_LEGS:
        lines = (rdir / "legs" / leg["name"] / "records.jsonl").read_text().splitlines()
        recs[leg["name"]] = {r["pid"]: r for r in map(json.loads, lines)}
    order = [l["name"] for l in LADDER_LEGS]
    speed = {row["leg"]: row for row in numbers["speedup"]}
    for i, leg in enumerate(order):
        if leg.startswith("vanilla"):
            continue
        before = next(l for l in reversed(order[:i]) if l.startswith("vanilla"))
        after = next(l for l in order[i + 1:] if l.startswith("vanilla"))
        ratios = [r["tok_s"] / ((recs[before][pid]["tok_s"] + recs[after][pid]["tok_s"]) / 2)
                  for pid, r in recs[leg].items()]
        assert speed[leg]["speedup"] == pytest.approx(statistics.median(ratios))
    acc = {row["leg"]: row for row in numbers["acceptance"]}
    for leg in ("strict_g2", "strict_g6", "relaxed_g6_x0.693"):
        accepted = sum(r["spec"]["accepted"] for r in recs[leg].values())
        drafted = sum(r["spec"]["draft_tokens"] for r in recs[leg].values())
        assert acc[leg]["acceptance_rate"] == pytest.approx(accepted / drafted)
