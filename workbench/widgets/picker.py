"""The run picker's labels: what each run is, from its folder's files (``results.list_runs``)."""

from __future__ import annotations

import math
import re
from typing import Any

import pandas as pd


def _known(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def run_when(run_id: str) -> str:
    """``20261203T083606Z-40a8cb70`` -> ``2026-12-03 08:36`` (the run id's UTC stamp); otherwise ''."""
    m = re.match(r"(\d{4})(\d{2})(\d{2})T(\d{2})(\d{2})", str(run_id))
    return f"{m[1]}-{m[2]}-{m[3]} {m[4]}:{m[5]}" if m else ""


def run_state(row: Any) -> str:
    """complete / partial (legs failed, unfinished or not run) / damaged (a leg's records disagree with it)."""
    if int(row.get("n_damaged") or 0):
        return "damaged"
    if int(row["n_complete"]) == int(row["n_legs"]) and int(row["n_legs"]):
        return "complete"
    missing = [f"{int(row[f'n_{k}'])} {k}" for k in ("failed", "incomplete", "pending") if int(row[f"n_{k}"] or 0)]
    return "partial (" + ", ".join(missing) + ")" if missing else "partial"


def run_label(row: Any) -> str:
    """One line of the run picker: date, profile, smoke or full, prompts, legs, device, state, run id."""
    parts = [run_when(row["run_id"]) or None,
             str(row["profile"]) if _known(row.get("profile")) else None,
             None if not _known(row.get("smoke")) else ("smoke" if bool(row["smoke"]) else "full"),
             f"{int(row['n_prompts'])} prompts" if _known(row.get("n_prompts")) else None,
             f"{int(row['n_legs'])} legs" + (f" ({int(row['n_spec'])} spec)" if _known(row.get("n_spec")) else ""),
             str(row["device"]) if _known(row.get("device")) else None,
             run_state(row)]
    return " · ".join(p for p in parts if p) + f"  [{row['run_id']}]"


def picker_options(runs: pd.DataFrame) -> list[tuple[str, str]]:
    """(label, path) of each run of one experiment, oldest first."""
    return [(run_label(r), str(r["path"])) for r in runs.to_dict("records")]


def experiment_key(name: Any) -> tuple:
    """Natural order of experiment folders: the catalogue's E1, E2, ..., E18 by number, then the other folders
    (``cost-ladder``, ``cuda-verify``, ...) by name; numbers inside a name compare as numbers."""
    s = str(name)
    parts = tuple((0, int(p), "") if p.isdigit() else (1, 0, p.lower()) for p in re.split(r"(\d+)", s) if p)
    return (re.fullmatch(r"E\d+", s) is None, parts)


def sorted_experiments(runs: pd.DataFrame) -> list[str]:
    """The experiments with runs, in natural order (``experiment_key``)."""
    return sorted((str(e) for e in runs["experiment"].unique()), key=experiment_key)


def default_experiment(runs: pd.DataFrame) -> str:
    """The experiment the explorer opens on: the one with the newest run (run ids start with their UTC
    stamp), so a researcher who has just made a run sees it; the last in natural order where no run id says
    when it was made."""
    exps = sorted_experiments(runs)
    stamped = [(run_when(r), str(r), str(e)) for e, r in zip(runs["experiment"], runs["run_id"]) if run_when(r)]
    if not stamped:
        return exps[-1]
    newest = max(w for w, _, _ in stamped)
    return max((e for w, _, e in stamped if w == newest), key=experiment_key)


def experiment_options(runs: pd.DataFrame) -> list[tuple[str, str]]:
    """(label, experiment) of each experiment with runs, in natural order (E1, E2, ..., E18, then other
    folders): ``"E6: Drafter families"`` where its newest run names a title."""
    out = []
    for exp in sorted_experiments(runs):
        titles = [t for t in runs.loc[runs["experiment"] == exp, "title"] if _known(t)] if "title" in runs else []
        out.append((f"{exp}: {titles[-1]}" if titles else str(exp), str(exp)))
    return out
