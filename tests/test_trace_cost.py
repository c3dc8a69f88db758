"""The trace-cost benchmark's statistics: adjacent on/off pairs, ratio of total rates, bootstrap interval."""

from __future__ import annotations

import importlib.util

import pandas as pd
import pytest

from conftest import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("trace_cost", REPO / "benchmarks" / "trace_cost.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _runs(slow_on: float, drift: float = 0.0, rounds: int = 6, units: int = 5) -> pd.DataFrame:
    rows = []
    for r in range(rounds):
        for u in range(units):
            base = 1.0 + drift * (r * units + u)  # slow drift across the run, shared by both runs of a pair
            for on in (True, False):
                rows.append({"round": r, "unit": u, "concurrency": "c1", "trace": on, "tokens": 100,
                             "seconds": base * (slow_on if on else 1.0), "traced_steps": 20 if on else 0,
                             "trace_host_ms": 2.0 if on else 0.0})
    return pd.DataFrame(rows)


def test_cost_is_read_from_adjacent_pairs_and_drift_cancels():
    t = _bench().summarize(_runs(slow_on=1.04, drift=0.01)).iloc[0]
    # a trace that makes each run 4 % longer costs 1 - 1/1.04 of the rate, whatever the drift
    assert t["cost"] == pytest.approx(1 - 1 / 1.04, abs=1e-9)
    assert t["cost_ci95_lo"] <= t["cost"] <= t["cost_ci95_hi"]
    assert t["pairs"] == 30
    assert t["trace_host_us_per_step"] == pytest.approx(100.0)  # 2 ms over 20 steps


def test_free_trace_has_zero_cost():
    t = _bench().summarize(_runs(slow_on=1.0, drift=0.02)).iloc[0]
    assert abs(t["cost"]) < 1e-12 and abs(t["pair_cost_median"]) < 1e-12


def test_unpaired_or_unequal_runs_are_refused():
    bench = _bench()
    runs = _runs(1.0)
    with pytest.raises(ValueError, match="exactly one run with the trace on and one off"):
        bench.summarize(runs.iloc[:-1])
    runs.loc[0, "tokens"] = 99
    with pytest.raises(ValueError, match="different token counts"):
        bench.summarize(runs)
    with pytest.raises(ValueError, match="lack columns"):
        bench.summarize(runs.drop(columns=["traced_steps"]))
