"""The smoke run of every experiment E1–E15 (those made of workbench.leg legs; the cost ladder E16 has its
own end-to-end test in test_cost_ladder.py) under the tiny profile at smoke size, with the real leg runner and
engine: what tests/test_experiments_smoke.py (E1–E8) and tests/test_experiments_smoke_e9_e15.py (E9–E15)
share. Two modules, so that two test workers run them side by side.

Run with `pytest -m vllm tests/test_experiments_smoke*.py`; the total time is printed at the end.
`WORKBENCH_SMOKE_PROFILE=organism` runs them under the trained organism instead (trained and built on first
use, ~20 min a variant; not part of CI): E14 then compares the thinking organism with the instruct one (the
profile's stand_ins), and the data-set checks follow the organism's own prompt set.
Shared data (MM-Vet / MathVista copies) is used where `<repo>/../shared/data` (or $WORKBENCH_SHARED_DATA)
has it; otherwise E13/E15 fall back to the built-in tiny set, and run.json says so.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest

import leg_zygote
from workbench import protocol
from workbench.registry import load_registry

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("WORKBENCH_SHARED_DATA", REPO.parent / "shared" / "data"))
IDS = [e.id for e in load_registry().experiments.values() if e.runner == "legs"]
PROFILE = os.environ.get("WORKBENCH_SMOKE_PROFILE", "tiny")
# experiments a profile refuses, with the words of the refusal (none today)
REFUSED: dict[str, dict[str, str]] = {}


def _sources() -> dict[str, str]:
    out = {}
    if (SHARED / "mm-vet" / "mm-vet.json").is_file():
        out["mmvet"] = str(SHARED / "mm-vet")
    if (SHARED / "mathvista" / "testmini.json").is_file():
        out["mathvista"] = str(SHARED / "mathvista")
    return out


def run_smoke(tmp_path_factory, ids: list[str]) -> dict:
    """Run the legs of the experiments ``ids``, two experiments at a time.

    A CPU leg is one process with one OpenMP thread, so the two cores of a
    CI machine take two legs at once; timing figures of smoke runs are not
    used for anything.
    """
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.monotonic()

    from workbench.registry import RegistryError

    def run(exp_id):
        root = tmp_path_factory.mktemp(exp_id)
        try:
            rdir = protocol.prepare_run(exp_id, PROFILE, None, True, root, dataset_sources=_sources())
        except RegistryError as exc:
            return exp_id, exc
        t = time.monotonic()
        statuses = protocol.execute(rdir, leg_timeout=300)
        return exp_id, (rdir, statuses, time.monotonic() - t)

    workers = int(os.environ.get("WORKBENCH_SMOKE_WORKERS", "2"))
    # the legs fork from this process's leg zygote (tests/leg_zygote.py): no `import vllm` each
    with leg_zygote.protocol_legs(), ThreadPoolExecutor(max_workers=workers) as pool:
        results = dict(pool.map(run, ids))
    print(f"\nsmoke suite {ids[0]}–{ids[-1]} ({PROFILE}): {time.monotonic() - t0:.0f} s total, {workers} at a time")
    return results


def check_smoke(smoke_runs: dict, exp_id: str) -> None:
    """Every leg complete; spec legs drafted and timed; strict twin legs pass the exactness rule; the knobs the
    engine read back are the plan's; the experiment's own analyses where it has them."""
    refusal = REFUSED.get(PROFILE, {}).get(exp_id)
    if refusal or isinstance(smoke_runs[exp_id], Exception):
        assert refusal and refusal in str(smoke_runs[exp_id]), smoke_runs[exp_id]
        return
    rdir, statuses, elapsed = smoke_runs[exp_id]
    failures = {k: json.loads((rdir / "legs" / k / "failure.json").read_text()).get("error")
                for k, v in statuses.items() if v == "failed"}
    assert not failures, failures
    assert all(v == "complete" for v in statuses.values())
    t0 = time.monotonic() - elapsed
    summary = protocol.analyze_run(rdir)
    summary.pop("_figures")
    cfg = json.loads((rdir / "run.json").read_text())
    print(f"{exp_id}: {len(statuses)} legs in {time.monotonic() - t0:.0f} s, dataset {cfg['dataset']['resolved']}")
    spec_legs = [l["name"] for l in cfg["legs"] if l["kind"] == "spec"]
    speed = {r["leg"]: r["speedup"] for r in summary["speedup"]}
    acc = {r["leg"]: r for r in summary["acceptance"]}
    for leg in spec_legs:
        assert math.isfinite(speed[leg]) and speed[leg] > 0, (leg, speed)
        assert acc[leg]["draft_tokens"] > 0, (leg, acc[leg])
    strict = [l["name"] for l in cfg["legs"] if l["kind"] == "spec" and l["tier"] == "strict"
              and l["draft"] in ("twin", "twin@8b-thinking", "twin@8b-instruct")]
    verdicts = {r["leg"]: r for r in summary["exactness"]}
    for leg in strict:
        # the one exactness rule (workbench.exactness): equal, or in bf16 near-ties only
        print(f"  {leg}: {verdicts[leg]['classification']}")
        assert verdicts[leg]["rule_ok"], f"strict leg {leg}: {verdicts[leg]['classification']}"
    # the knobs the engine read back agree with the plan
    from workbench.results import load_run
    run = load_run(rdir)
    for leg in cfg["legs"]:
        if leg["kind"] != "spec":
            continue
        knobs = run.records[run.records["leg"] == leg["name"]]["knobs"].iloc[0]
        assert knobs.get("blind_mm", False) == leg["knobs"]["blind_mm"], leg["name"]
        assert float(knobs.get("relax_logtau", 0.0)) == pytest.approx(leg["knobs"]["relax_logtau"])
    if exp_id == "E7":
        assert summary["agreement"] and all(0 <= r["agreement"] <= 1 for r in summary["agreement"])
        assert "agreement_vs_acceptance" in summary["figures"], summary["not_computed"]
    if exp_id == "E13" and cfg["dataset"]["resolved"] == "mathvista":
        assert {r["leg"] for r in summary["mathvista_accuracy"]} >= set(spec_legs)
        assert cfg["dataset"]["stand_in_images"] is True
    if exp_id == "E15":
        expected = "organism" if PROFILE == "organism" else "mmvet" if "mmvet" in _sources() else "tiny"
        assert cfg["dataset"]["resolved"] == expected
        if expected == "mmvet":
            assert summary["mmvet_capability"]
