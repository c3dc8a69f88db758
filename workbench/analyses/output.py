"""Writing a run's tables: ``tables/*.csv`` and the key numbers in ``tables/summary.json``."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from ..results import load_run
from ..runfolder import disturbed_state, partial_state, write_text_atomic
from .base import SUMMARY_JSON
from .figures import draw
from .runtables import RunTables
from .tables import TABLES


def _json_rows(df: pd.DataFrame) -> list[dict[str, Any]]:
    out = []
    for row in df.to_dict(orient="records"):
        clean = {}
        for k, v in row.items():
            if hasattr(v, "item"):
                v = v.item()
            if isinstance(v, float) and math.isnan(v):
                v = None
            if v is pd.NA:
                v = None
            if isinstance(v, (list, dict)):
                continue
            clean[k] = v
        out.append(clean)
    return out


def write_tables(tables: RunTables) -> dict[str, Path]:
    """Every table the run can make -> ``<run>/tables/<name>.csv`` (written whole, then renamed)."""
    tdir = tables.run.path / "tables"
    tdir.mkdir(exist_ok=True)
    written = {}
    for name, df in tables.available().items():
        write_text_atomic(tdir / f"{name}.csv", df.to_csv(index=False))
        written[name] = tdir / f"{name}.csv"
    return written


def summary(tables: RunTables, figures: Iterable[str] = ()) -> dict[str, Any]:
    """The key numbers of a run (what ``tables/summary.json`` holds)."""
    run, cfg = tables.run, tables.run.config
    out: dict[str, Any] = {
        "experiment": cfg.get("experiment"), "run_id": cfg.get("run_id"), "profile": cfg.get("profile"),
        "smoke": cfg.get("smoke"), "dataset": tables.dataset,
        "legs": dict(zip(run.legs["leg"], run.legs["status"])),
    }
    out["n_complete"] = sum(s == "complete" for s in out["legs"].values())
    out["n_failed"] = sum(s == "failed" for s in out["legs"].values())
    # a run with a failed or missing leg says so whether or not a figure applies (record_figures repeats it)
    out.update(partial_state(run.path, out["legs"]))
    # another run on the host while legs ran: the timings are marked, not silently mixed with clean ones
    out.update(disturbed_state(run.path))
    for name, df in tables.available().items():
        if TABLES[name].in_summary:
            out[name] = _json_rows(df)
    agreement = tables.get("agreement")
    if agreement is not None and len(agreement) >= 2:
        a = agreement[["agreement", "acceptance_rate"]].astype(float).dropna()
        out["agreement_acceptance_pearson"] = (float(a.corr().iloc[0, 1]) if len(a) >= 2 and a.std().min() > 0
                                               else None)
    out["figures"] = list(figures)
    out["not_computed"] = dict(tables.errors)
    return out


def write_summary(tables: RunTables, figures: Iterable[str] = ()) -> dict[str, Any]:
    """``summary(...)`` -> ``<run>/tables/summary.json`` (written whole, then renamed); returns it."""
    out = summary(tables, figures)
    path = tables.run.path / "tables" / SUMMARY_JSON
    path.parent.mkdir(exist_ok=True)
    write_text_atomic(path, json.dumps(out, indent=2, default=str) + "\n")
    return out


def analyze_run(run_dir: str | Path, figures: bool = True) -> dict[str, Any]:
    """Every table of a run -> ``<run>/tables/*.csv``, its key numbers -> ``tables/summary.json``.

    Figures: the experiment's own analyses (``run.json`` ``analyses``), returned
    under ``_figures`` (``workbench.export`` writes figure files). Everything
    is recomputed from ``legs/*/records.jsonl``, so this can be rerun at any time.
    """
    tables = RunTables(load_run(run_dir))
    write_tables(tables)
    figs = draw(tables, tables.run.config.get("analyses", [])) if figures else {}
    out = write_summary(tables, list(figs))
    out["_figures"] = figs
    return out
