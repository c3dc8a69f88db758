"""Time the explorer's slider callbacks over a run of 100,000 prompt records (goal: < 200 ms a move).

    python benchmarks/bench_explorer.py [--records 100000] [--moves 15] [--steps 12] [--results results]

Builds a synthetic run in memory (seven legs, bracketed: vanilla / strict gamma 2, 4 /
vanilla / strict gamma 6 / relaxed gamma 6 / vanilla, every spec prompt traced), builds
the explorer once (precomputation, reported separately), then times what a move of
each slider runs: ``Explorer.on_relax`` (counterfactual acceptance from the traces,
every figure edited in place) and ``Explorer.on_gamma`` (legs shown for one gamma).
The timings go to a run folder ``results/explorer_bench/<run id>/`` (run.json with the
parameters, env.json, ``tables/benchmark.json``); the synthetic records are not kept.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from synthetic_runs import LADDER_LEGS as LEGS, bulk_records  # noqa: E402

from runs import write_numbers  # noqa: E402

from workbench import envcapture, metrics  # noqa: E402
from workbench.results import LEG_COLUMNS, Run, new_run_id, run_dir  # noqa: E402
from workbench.runfolder import write_json_atomic  # noqa: E402
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--moves", type=int, default=15)
    ap.add_argument("--steps", type=int, default=12, help="draft steps per traced prompt")
    ap.add_argument("--results", default=str(ROOT / "results"), help="results root (default: results)")
    args = ap.parse_args(argv)

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

    rdir = run_dir(args.results, "explorer_bench", new_run_id())
    rdir.mkdir(parents=True)
    write_json_atomic(rdir / "run.json", {
        "experiment": "explorer_bench", "run_id": rdir.name, "legs": [],
        "parameters": {"records": args.records, "moves": args.moves, "steps": args.steps,
                       "legs": [leg["name"] for leg in LEGS]}})
    envcapture.write_env(rdir / "env.json")
    numbers = {"run": f"explorer_bench/{rdir.name}", "records": len(run.records), "traced_steps": n_steps,
               "synthetic_data_s": t_gen, "explorer_build_s": t_build,
               "relax_logtau_move_ms": metrics.median_iqr(relax_ms) | {"max": max(relax_ms)},
               "gamma_move_ms": metrics.median_iqr(gamma_ms) | {"max": max(gamma_ms)}}
    write_numbers(rdir, numbers)
    print(f"run folder: {rdir}")
    print(f"records: {len(run.records):,} prompt records in {run.records['leg'].nunique()} legs; "
          f"{n_steps:,} traced draft steps")
    print(f"synthetic data: {t_gen:.1f} s; explorer build (precompute + figures): {t_build:.2f} s")
    for name, key in (("relax_logtau move (on_relax)", "relax_logtau_move_ms"), ("gamma move (on_gamma)", "gamma_move_ms")):
        ms = numbers[key]
        print(f"{name}: median {ms['median']:.1f} ms, max {ms['max']:.1f} ms over {ms['n']} moves"
              f" -> {'OK' if ms['median'] < 200 else 'SLOW'} (goal < 200 ms)")


if __name__ == "__main__":
    main()
