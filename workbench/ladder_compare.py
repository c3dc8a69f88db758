"""Cost-ladder runs of the same cells, side by side: is each cell's step time equal within noise?

    python -m workbench.ladder_compare RUN_DIR --against REFERENCE_RUN [REFERENCE_RUN ...]

For every cell and role the runs all measured (``ladder.role_rows``: the vanilla decode step, the verify, the
propose, a single-token draft step, per size, batch, γ and drafter graph mode), the median of each run's
steps, their ratio (``RUN_DIR`` over the reference), and the noise: the spread of each run's repeats'
medians (largest over smallest, minus one) and, with several references, the spread of the references'
medians (run to run: two runs of one command differ by more than one run's repeats do). The reference is
the median of the references' medians. A cell is **equal within noise** when the ratio is off 1 by no
more than the largest of those spreads, or ``floor`` (1 %) where all are tighter than that. Made for the
same run done two ways (the local executor and Ray's, docs/ray.md: a Ray run between two local ones), or on
two days.

    python -m workbench.ladder_compare --series RUN_1 RUN_2 ... RUN_n

A series of runs of one command (say local, ray, local, ray, ..., local): each run between two others
against those two, one line a run: its executor, the cells equal within noise, its median ratio and the
cell furthest off. Whether Ray's runs are off more often than the local runs between them are is the
question it answers.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from . import ladder
from .runfolder import LEGS, PLACEMENT, read_json

__all__ = ["compare_runs", "compare_markdown", "series", "series_markdown", "FLOOR"]

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


def _references(reference: str | Path | Sequence[str | Path]) -> list[Path]:
    refs = [reference] if isinstance(reference, (str, Path)) else list(reference)
    if not refs:
        raise ValueError("no reference run to compare with")
    return [Path(r) for r in refs]


def _reference_cells(refs: list[Path]) -> pd.DataFrame:
    """The references' cells they all hold: the median of their medians, the largest of their repeat
    spreads, and the spread between their medians (``between``: 0 with one reference)."""
    cells = [_cells(r) for r in refs]
    med = pd.concat([c["median_ms"] for c in cells], axis=1, join="inner")
    spread = pd.concat([c["spread"] for c in cells], axis=1, join="inner")
    return pd.DataFrame({"median_ms": med.median(axis=1), "n": sum(c["n"] for c in cells).loc[med.index],
                         "spread": spread.max(axis=1), "between": med.max(axis=1) / med.min(axis=1) - 1})


def compare_runs(run_dir: str | Path, reference: str | Path | Sequence[str | Path],
                 floor: float = FLOOR) -> pd.DataFrame:
    """One row per cell and role all runs hold (``KEYS``; γ 0 and drafter graphs true on the vanilla rows):
    the run's and the references' median and repeat spread, ``between_ref`` (the references' run-to-run
    spread), ``ratio`` (``run_dir`` over the references' median), ``noise`` and ``equal``."""
    refs = _references(reference)
    ref = _reference_cells(refs)
    between = ref.pop("between")
    both = ref.add_suffix("_ref").assign(between_ref=between).join(_cells(run_dir).add_suffix("_run"), how="inner")
    if both.empty:
        names = ", ".join(str(r) for r in refs)
        raise ValueError(f"{run_dir} and {names} have no cell in common (size, batch, γ, drafter graphs)")
    both["ratio"] = both["median_ms_run"] / both["median_ms_ref"]
    both["noise"] = both[["spread_ref", "spread_run", "between_ref"]].max(axis=1).clip(lower=floor)
    both["equal"] = (both["ratio"] - 1).abs() <= both["noise"]
    return both.reset_index()


def compare_markdown(run_dir: str | Path, reference: str | Path | Sequence[str | Path],
                     floor: float = FLOOR) -> str:
    refs = _references(reference)
    t = compare_runs(run_dir, refs, floor)
    several = len(refs) > 1
    against = " and ".join(f"`{r.name}`" for r in refs)
    head = (f"`{Path(run_dir).name}` against {against}" + (" (their median)" if several else "")
            + ": step medians, ms (repeats' spread)")
    cols = ["size", "batch", "γ", "drafter graphs", "role", "reference", *(["run to run"] if several else []),
            "this run", "ratio", "noise", "equal within noise"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in t.itertuples():
        vanilla = r.role == "target decode"
        between = [f"{r.between_ref:.1%}"] if several else []
        cells = [str(r.size), str(r.batch), "" if vanilla else str(r.gamma),
                 "" if vanilla else ("on" if r.draft_graphs else "eager"), r.role,
                 f"{r.median_ms_ref:.2f} ({r.spread_ref:.1%})", *between,
                 f"{r.median_ms_run:.2f} ({r.spread_run:.1%})", f"{r.ratio:.3f}", f"{r.noise:.1%}",
                 "yes" if r.equal else "**no**"]
        lines.append("| " + " | ".join(cells) + " |")
    what = ("the largest of the runs' repeat spreads and the references' run-to-run spread" if several
            else "the larger of the two runs' repeat spreads")
    lines += ["", f"{int(t['equal'].sum())} of {len(t)} cells equal within noise ({what}, at least {floor:.0%})"]
    return "\n".join(lines)


def _executor(run_dir: Path) -> str:
    """The executor that ran the run's legs (``placement.json``; several: joined by ``+``)."""
    seen = []
    for f in sorted((run_dir / LEGS).glob(f"*/{PLACEMENT}")):
        ex = str(read_json(f).get("executor", "?"))
        if ex not in seen:
            seen.append(ex)
    return "+".join(seen) or "?"


def series(runs: Sequence[str | Path], floor: float = FLOOR) -> pd.DataFrame:
    """Each run between two others (``runs[i]``, 0 < i < n − 1) against its neighbours ``runs[i − 1]`` and
    ``runs[i + 1]``: its executor, the cells, the cells equal within noise, the median ratio over its cells,
    and the cell furthest from 1 (role, batch, ratio)."""
    runs = [Path(r) for r in runs]
    if len(runs) < 3:
        raise ValueError(f"a series needs at least 3 runs (each judged between two), got {len(runs)}")
    rows = []
    for before, run, after in zip(runs, runs[1:], runs[2:]):
        t = compare_runs(run, [before, after], floor)
        worst = t.loc[(t["ratio"] - 1).abs().idxmax()]
        graphs = "" if worst["role"] == "target decode" else (" graphs on" if worst["draft_graphs"] else " eager")
        rows.append({"run": run.name, "executor": _executor(run), "cells": len(t), "equal": int(t["equal"].sum()),
                     "median_ratio": float(t["ratio"].median()),
                     "furthest": f"{worst['role']}, batch {worst['batch']}{graphs}",
                     "furthest_ratio": float(worst["ratio"])})
    return pd.DataFrame(rows)


def series_markdown(runs: Sequence[str | Path], floor: float = FLOOR) -> str:
    t = series(runs, floor)
    lines = [f"{len(runs)} runs; each run between two others against those two (noise: the largest of the "
             f"repeat spreads and the two neighbours' run-to-run spread, at least {floor:.0%})", "",
             "| run | executor | cells equal within noise | median ratio | furthest off | its ratio |",
             "|---|---|---|---|---|---|"]
    for r in t.itertuples():
        lines.append(f"| `{r.run}` | {r.executor} | {r.equal} of {r.cells} | {r.median_ratio:.3f} | {r.furthest} | "
                     f"{r.furthest_ratio:.3f} |")
    lines.append("")
    for ex, g in t.groupby("executor", sort=False):
        lines.append(f"{ex}: {int(g['equal'].sum())} of {int(g['cells'].sum())} cells equal in {len(g)} runs; "
                     f"runs with every cell equal: {int((g['equal'] == g['cells']).sum())} of {len(g)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m workbench.ladder_compare",
                                 description="cost-ladder runs (E16) cell by cell: step medians, each run's "
                                             "repeat spread, equal within noise or not")
    ap.add_argument("run_dir", type=Path, nargs="?")
    ap.add_argument("--series", type=Path, nargs="+", metavar="RUN",
                    help="runs of one command in the order they ran: each judged against its two neighbours")
    ap.add_argument("--against", type=Path, nargs="+", metavar="REFERENCE_RUN",
                    help="the run(s) to compare with; with two (one before RUN_DIR, one after), their "
                         "run-to-run spread counts as noise")
    ap.add_argument("--floor", type=float, default=FLOOR,
                    help=f"the smallest difference counted as noise, as a fraction (default {FLOOR})")
    args = ap.parse_args(argv)
    pair = args.run_dir is not None and args.against is not None
    if args.series is not None and (args.run_dir is not None or args.against is not None) or \
            args.series is None and not pair:
        ap.error("give RUN_DIR --against REFERENCE_RUN [...], or --series RUN RUN RUN [...]")
    try:
        print(series_markdown(args.series, args.floor) if args.series else
              compare_markdown(args.run_dir, args.against, args.floor))
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
