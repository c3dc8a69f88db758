"""`workbench run E2 --profile tiny --smoke --executor ray` on the tiny models, on a local Ray instance with
two logical GPUs (#39): a complete run folder, every leg's placement, strict legs exact, each bracket on one
placement, all from the raw records. Kill -9 and resume are tests/test_ray_executor.py's (fake legs)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")]


def test_workbench_run_e2_tiny_through_ray_is_complete_exact_and_on_one_placement_per_bracket(tmp_path, tiny_models):
    results = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "run", "E2", "--profile", "tiny", "--smoke",
                           "--executor", "ray", "--gpus", "2", "-p", "max_tokens=16", "--results", str(results),
                           "--no-notebook", "--formats", "html"], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (rdir,) = list((results / "E2").iterdir())
    cfg = json.loads((rdir / "run.json").read_text())
    assert cfg["brackets"] == "own" and [l["name"] for l in cfg["legs"]] == ["vanilla_1", "strict_g3", "vanilla_2"]
    out = proc.stdout
    assert out.count(" started on ") == 1 and out.count(" finished on ") == 1 and "3/3 legs complete" in out
    state = json.loads((rdir / "protocol.json").read_text())
    assert state["state"] == "finished" and state["executor"]["name"] == "ray"
    assert state["groups"][0]["status"] == "complete"

    from workbench.metrics import bracketed_speedup, exactness
    from workbench.results import load_run
    run = load_run(rdir)
    assert set(run.legs["status"]) == {"complete"}
    for leg in cfg["legs"]:
        where = json.loads((rdir / "legs" / leg["name"] / "placement.json").read_text())
        assert where["executor"] == "ray" and where["node_id"] and where["device"] == "cpu", where
        assert where["cuda_visible_devices"] in ("0", "1") and where["group"] == 0
    # from the raw records: one placement for the bracket, the strict leg token for token the vanilla leg's
    assert run.records["placement"].nunique() == 1 and run.records["placement"].notna().all()
    ex = exactness(run.records, "vanilla_1", "strict_g3")
    summary = json.loads((rdir / "tables" / "summary.json").read_text())
    verdicts = {r["leg"]: r for r in summary["exactness"]}  # the one rule: equal, or bf16 near-ties only
    print(f"\nstrict_g3: {int(ex['exact'].sum())}/{len(ex)} prompts token for token; "
          + "; ".join(f"{leg}: {r['classification']}" for leg, r in verdicts.items()))
    assert set(verdicts) == {"strict_g3"} and all(r["rule_ok"] for r in verdicts.values()), verdicts
    sp = bracketed_speedup(run.records)
    assert list(sp["leg"]) == ["strict_g3"] and sp["speedup"].iloc[0] > 0
