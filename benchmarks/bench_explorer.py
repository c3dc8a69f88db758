"""Time the explorer's slider callbacks over a run of 100,000 prompt records (goal: < 200 ms a move).

    python benchmarks/bench_explorer.py [--records 100000] [--moves 15] [--steps 12]

Builds a synthetic run in memory (seven legs, bracketed: vanilla / strict gamma 2, 4 /
vanilla / strict gamma 6 / relaxed gamma 6 / vanilla, every spec prompt traced), builds
the explorer once (precomputation, reported separately), then times what a move of
each slider runs: ``Explorer.on_relax`` (counterfactual acceptance from the traces,
every figure edited in place) and ``Explorer.on_gamma`` (legs shown for one gamma).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from synthetic_runs import LADDER_LEGS as LEGS, bulk_records  # noqa: E402

from workbench.results import LEG_COLUMNS, Run  # noqa: E402
from workbench.widgets import Explorer  # noqa: E402



def in_memory_run(n_records: int, steps: int) -> Run:
    per_leg = -(-n_records // len(LEGS))
    records = pd.DataFrame(bulk_records(LEGS, per_leg, steps=steps)).iloc[:n_records]
    legs = pd.DataFrame([{**{c: None for c in LEG_COLUMNS}, "leg": leg["name"], "leg_index": i,
                          "status": "complete", "tier": leg["tier"], "gamma": leg.get("gamma"),
                          "mode": "vanilla" if leg["tier"] == "vanilla" else "spec"}
                         for i, leg in enumerate(LEGS)], columns=LEG_COLUMNS)
    return Run(path=Path("in-memory"), records=records, legs=legs,
               config={"experiment": "BENCH", "run_id": "in-memory"}, env={})


def timed(fn, values) -> list[float]:
    out = []
    for v in values:
        t0 = time.perf_counter()
        fn(v)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--moves", type=int, default=15)
    ap.add_argument("--steps", type=int, default=12, help="draft steps per traced prompt")
    args = ap.parse_args()

    t0 = time.perf_counter()
    run = in_memory_run(args.records, args.steps)
    t_gen = time.perf_counter() - t0
    n_steps = int(run.records["trace"].map(lambda t: len(t["steps"]) if isinstance(t, dict) else 0).sum())
    t0 = time.perf_counter()
    ex = Explorer(run=run)
    t_build = time.perf_counter() - t0

    xs = [round(0.05 + 2.9 * i / max(1, args.moves - 1), 2) for i in range(args.moves)]
    relax_ms = timed(ex.on_relax, xs)
    gammas = [g for _ in range(args.moves) for g in ex.gamma_slider.options][: args.moves]
    gamma_ms = timed(ex.on_gamma, gammas)

    print(f"records: {len(run.records):,} prompt records in {run.records['leg'].nunique()} legs; "
          f"{n_steps:,} traced draft steps")
    print(f"synthetic data: {t_gen:.1f} s; explorer build (precompute + figures): {t_build:.2f} s")
    for name, ms in (("relax_logtau move (on_relax)", relax_ms), ("gamma move (on_gamma)", gamma_ms)):
        print(f"{name}: median {statistics.median(ms):.1f} ms, max {max(ms):.1f} ms over {len(ms)} moves"
              f" -> {'OK' if statistics.median(ms) < 200 else 'SLOW'} (goal < 200 ms)")


if __name__ == "__main__":
    main()
