"""Two cost-ladder runs of the same cells, side by side: is each cell's step time equal within noise?

    python -m workbench.ladder_compare RUN_DIR --against REFERENCE_RUN

For every cell and role both runs measured (``ladder.role_rows``: the vanilla decode step, the verify, the
propose, a single-token draft step, per size, batch, γ and drafter graph mode), the median of each run's
steps, their ratio (``RUN_DIR`` over the reference), and each run's own noise: the spread of its repeats'
medians (largest over smallest, minus one). A cell is **equal within noise** when the ratio is off 1 by no
more than the larger of the two spreads, or ``floor`` (1 %) where both runs repeat more tightly than that.
Made for the same run done two ways (the local executor and Ray's, docs/ray.md), or on two days.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from . import ladder

__all__ = ["compare_runs", "compare_markdown", "FLOOR"]

FLOOR = 0.01  # below this, two runs' medians count as equal whatever their repeats' spread
KEYS = ["size", "batch", "gamma", "draft_graphs", "role"]


def _cells(run_dir: str | Path) -> pd.DataFrame:
    """Per cell and role: the median step, the number of steps, and the spread of the repeats' medians."""
    long = ladder.role_rows(ladder.load(run_dir)[0])
    long = long.assign(gamma=long["gamma"].fillna(0).astype(int), draft_graphs=long["draft_graphs"].fillna(True))
    grouped = long.groupby(KEYS)
    reps = long.groupby([*KEYS, "rep"])["ms"].median().groupby(level=KEYS)
    return pd.DataFrame({"median_ms": grouped["ms"].median(), "n": grouped["ms"].size(),
                         "spread": reps.max() / reps.min() - 1})


def compare_runs(run_dir: str | Path, reference: str | Path, floor: float = FLOOR) -> pd.DataFrame:
    """One row per cell and role both runs hold (``KEYS``; γ 0 and drafter graphs true on the vanilla rows):
    each run's median and spread, ``ratio`` (``run_dir`` over ``reference``), ``noise`` and ``equal``."""
    a, ref = _cells(run_dir), _cells(reference)
    both = ref.add_suffix("_ref").join(a.add_suffix("_run"), how="inner")
    if both.empty:
        raise ValueError(f"{run_dir} and {reference} have no cell in common (size, batch, γ, drafter graphs)")
    both["ratio"] = both["median_ms_run"] / both["median_ms_ref"]
    both["noise"] = both[["spread_ref", "spread_run"]].max(axis=1).clip(lower=floor)
    both["equal"] = (both["ratio"] - 1).abs() <= both["noise"]
    return both.reset_index()


def compare_markdown(run_dir: str | Path, reference: str | Path, floor: float = FLOOR) -> str:
    t = compare_runs(run_dir, reference, floor)
    lines = [f"`{Path(run_dir).name}` against `{Path(reference).name}`: step medians, ms (repeats' spread)", "",
             "| size | batch | γ | drafter graphs | role | reference | this run | ratio | noise | equal within noise |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in t.itertuples():
        vanilla = r.role == "target decode"
        lines.append(f"| {r.size} | {r.batch} | {'' if vanilla else r.gamma} | "
                     f"{'' if vanilla else ('on' if r.draft_graphs else 'eager')} | {r.role} | "
                     f"{r.median_ms_ref:.2f} ({r.spread_ref:.1%}) | {r.median_ms_run:.2f} ({r.spread_run:.1%}) | "
                     f"{r.ratio:.3f} | {r.noise:.1%} | {'yes' if r.equal else '**no**'} |")
    lines += ["", f"{int(t['equal'].sum())} of {len(t)} cells equal within noise "
                  f"(the larger of the two runs' repeat spreads, at least {floor:.0%})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m workbench.ladder_compare",
                                 description="two cost-ladder runs (E16) cell by cell: step medians, each run's "
                                             "repeat spread, equal within noise or not")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--against", type=Path, required=True, metavar="REFERENCE_RUN", help="the run to compare with")
    ap.add_argument("--floor", type=float, default=FLOOR,
                    help=f"the smallest difference counted as noise, as a fraction (default {FLOOR})")
    args = ap.parse_args(argv)
    try:
        print(compare_markdown(args.run_dir, args.against, args.floor))
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
