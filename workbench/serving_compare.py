"""Serving runs of the same cells, side by side: does a cell's speedup differ by more than its requests vary?

    python -m workbench.serving_compare RUN_DIR --against OTHER_RUN [--metric tpot_speedup|ttft_ratio]

For every spec leg and concurrency both runs measured (``serving.paired_speedups``): each run's value (the TPOT
speedup, or the TTFT ratio) with its 95 % interval over the cell's requests, and their ratio RUN / OTHER with a
95 % bootstrap interval of that ratio (each run's spec and vanilla requests resampled, the same statistic as
the tables'). A cell is **apart** where that interval excludes 1: the two runs differ by more than their
requests explain. Made for the questions the README and results/E18 answer by hand: fresh against cached
prompts, one card against another, a change against the run before it. Where the bracket's vanilla legs
themselves moved between the runs (a faster card, another day), the vanilla TPOT ratio says so beside it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from workbench import metrics, serving

__all__ = ["compare", "main"]

METRICS = serving.CI_METRICS  # the metric's per-request column and its direction, as the tables have them
COLUMNS = ["leg", "concurrency", "run", "run_lo", "run_hi", "other", "other_lo", "other_hi", "ratio", "ratio_lo",
           "ratio_hi", "apart", "vanilla_tpot_ratio"]


def _cells(run: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    _, speed, requests = serving.load(run)
    return speed, requests


def _sides(speed_row: pd.Series) -> list[str]:
    return [v for v in (speed_row["vanilla_before"], speed_row["vanilla_after"]) if isinstance(v, str)]


def _draws(speed_row: pd.Series, requests: pd.DataFrame, metric: str, seed: int) -> np.ndarray | None:
    col, spec_over_side = METRICS[metric]
    spec, sides = serving.cell_groups(requests, speed_row["concurrency"], speed_row["leg"], _sides(speed_row), col)
    return metrics.median_ratio_draws(spec, sides, spec_over_side, seed=seed)


def _vanilla_tpot(speed_row: pd.Series, requests: pd.DataFrame) -> float:
    _, sides = serving.cell_groups(requests, speed_row["concurrency"], speed_row["leg"], _sides(speed_row), "tpot_ms")
    return float(np.median(np.concatenate(sides)))


def compare(run: str | Path, other: str | Path, metric: str = "tpot_speedup", level: float = 0.95) -> pd.DataFrame:
    """One row per (spec leg, concurrency) both runs have (``COLUMNS``; ``vanilla_tpot_ratio``: the vanilla
    legs' median TPOT, run over other)."""
    if metric not in METRICS:
        raise ValueError(f"metric {metric!r}: one of {', '.join(METRICS)}")
    a_speed, a_req = _cells(Path(run))
    b_speed, b_req = _cells(Path(other))
    tail = (1.0 - level) / 2.0
    rows = []
    for _, ra in a_speed.iterrows():
        hit = b_speed[(b_speed["leg"] == ra["leg"]) & (b_speed["concurrency"] == ra["concurrency"])]
        if hit.empty:
            continue
        rb = hit.iloc[0]
        da, db = _draws(ra, a_req, metric, seed=0), _draws(rb, b_req, metric, seed=1)
        qa = np.quantile(da, [tail, 1 - tail]) if da is not None else (np.nan, np.nan)
        qb = np.quantile(db, [tail, 1 - tail]) if db is not None else (np.nan, np.nan)
        lo, hi = np.quantile(da / db, [tail, 1 - tail]) if da is not None and db is not None else (np.nan, np.nan)
        rows.append({"leg": ra["leg"], "concurrency": ra["concurrency"], "run": ra[metric], "run_lo": qa[0],
                     "run_hi": qa[1], "other": rb[metric], "other_lo": qb[0], "other_hi": qb[1],
                     "ratio": ra[metric] / rb[metric], "ratio_lo": lo, "ratio_hi": hi,
                     "apart": bool(np.isfinite(lo) and (lo > 1.0 or hi < 1.0)),
                     "vanilla_tpot_ratio": _vanilla_tpot(ra, a_req) / _vanilla_tpot(rb, b_req)})
    return pd.DataFrame(rows, columns=COLUMNS)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.serving_compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("run")
    ap.add_argument("--against", required=True, help="the other serving run folder")
    ap.add_argument("--metric", default="tpot_speedup", choices=sorted(METRICS))
    args = ap.parse_args(argv)
    for folder in (args.run, args.against):
        if not serving.has_serving(Path(folder)):
            print(f"{folder}: no serving legs (a run folder of E17 or E18 with legs/*/summary.json)", file=sys.stderr)
            return 2
    table = compare(args.run, args.against, args.metric)
    if table.empty:
        print("no spec leg and concurrency the two runs share", file=sys.stderr)
        return 1
    print(f"{args.metric}: {args.run} (run) against {args.against} (other); 95 % intervals over requests")
    for _, r in table.iterrows():
        print(f"  {r['leg']:<24} c {int(r['concurrency']):>3}  {r['run']:.3f} ({r['run_lo']:.3f}-{r['run_hi']:.3f})"
              f"  {r['other']:.3f} ({r['other_lo']:.3f}-{r['other_hi']:.3f})  run/other {r['ratio']:.3f}"
              f" ({r['ratio_lo']:.3f}-{r['ratio_hi']:.3f}) {'APART' if r['apart'] else 'same within requests'}"
              f"  vanilla TPOT run/other {r['vanilla_tpot_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
