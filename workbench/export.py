"""Figure export: PNG / SVG / PDF through kaleido, HTML self-contained.

Static export uses kaleido >= 1, which drives a headless Chromium-family
browser. It never downloads one: the browser is taken from ``BROWSER_PATH``
or found on ``PATH`` (Debian: ``apt-get install chromium``). MathJax is
switched off so nothing is fetched from a CDN; plotly.js comes from the
installed plotly package, so export works offline.

Files are written into a hidden staging folder and moved into place only
when every requested file exists, so an interrupted export never leaves a
set of figures that looks complete.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from . import metrics, plots
from .results import Run, load_run

STATIC_FORMATS = ("png", "svg", "pdf")
FORMATS = STATIC_FORMATS + ("html",)
BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
_FIG_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def find_browser() -> str:
    """Path of the browser kaleido will drive; clear error when there is none."""
    env = os.environ.get("BROWSER_PATH")
    if env:
        if not (os.path.isfile(env) and os.access(env, os.X_OK)):
            raise RuntimeError(f"BROWSER_PATH={env!r} is not an executable file")
        return env
    for name in BROWSER_NAMES:
        path = shutil.which(name)
        if path:
            return path
    raise RuntimeError(
        "static figure export (png/svg/pdf) needs a Chromium-family browser for kaleido and none was found: "
        "install one (Debian/Ubuntu: `apt-get install -y chromium`) or set BROWSER_PATH to its executable"
    )


def export_figures(
    figs: Mapping[str, go.Figure],
    out_dir: str | Path,
    formats: Iterable[str] = FORMATS,
    width: int = 1000,
    height: int = 600,
    scale: float = 1.0,
) -> dict[str, list[Path]]:
    """Write each figure as ``out_dir/<name>.<fmt>``; returns the paths per figure.

    PNG is ``width*scale`` x ``height*scale`` pixels; SVG and PDF have the
    same layout size. HTML embeds plotly.js (no network needed to view it).
    """
    formats = tuple(dict.fromkeys(f.lower().lstrip(".") for f in formats))
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise ValueError(f"unknown export format(s) {bad or formats}; choose from {FORMATS}")
    for name, fig in figs.items():
        if not isinstance(name, str) or not _FIG_NAME.match(name):
            raise ValueError(f"figure name {name!r} is not a plain file name")
        if not isinstance(fig, go.Figure):
            raise TypeError(f"figure {name!r} is a {type(fig).__name__}, not a plotly Figure")
    if int(width) <= 0 or int(height) <= 0 or scale <= 0:
        raise ValueError(f"width, height and scale must be positive (got {width}, {height}, {scale})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    static = [f for f in formats if f in STATIC_FORMATS]
    browser = find_browser() if static and figs else None

    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out))
    try:
        written: dict[str, list[Path]] = {name: [] for name in figs}
        if static and figs:
            import kaleido  # imported late: only static export needs it

            specs = [
                {"fig": fig.to_dict(), "path": staging / f"{name}.{fmt}",
                 "opts": {"format": fmt, "width": int(width), "height": int(height), "scale": scale}}
                for name, fig in figs.items() for fmt in static
            ]
            kaleido.write_fig_from_object_sync(specs, kopts={"mathjax": False, "path": browser})
        if "html" in formats:
            for name, fig in figs.items():
                fig.write_html(staging / f"{name}.html", include_plotlyjs=True, full_html=True,
                               include_mathjax=False, default_width=f"{int(width)}px",
                               default_height=f"{int(height)}px", config={"displaylogo": False})
        for name in figs:
            for fmt in formats:
                src = staging / f"{name}.{fmt}"
                if not src.is_file() or src.stat().st_size == 0:
                    raise RuntimeError(f"export of figure {name!r} as {fmt} produced no file")
        for name in figs:
            for fmt in formats:
                dst = out / f"{name}.{fmt}"
                os.replace(staging / f"{name}.{fmt}", dst)
                written[name].append(dst)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# --------------------------------------------------------------------------- a run's standard set


def standard_tables(run: Run) -> dict[str, pd.DataFrame]:
    """Derived tables of a run, from its records alone (those that apply)."""
    rec = run.records
    tables: dict[str, pd.DataFrame] = {}
    if rec.empty:
        return tables
    has_vanilla = rec["tier"].eq("vanilla").any()
    has_spec = rec["tier"].isin(metrics.SPEC_TIERS).any()
    if has_vanilla and has_spec:
        tables["speedup"] = metrics.bracketed_speedup(rec, run.legs_order)
        tables["speedup_per_prompt"] = metrics.prompt_speedups(rec, run.legs_order)
        tables["exactness"] = metrics.exactness_summary(rec)
    if has_spec:
        tables["acceptance"] = metrics.acceptance(rec)
        tables["acceptance_per_position"] = metrics.per_position_acceptance(rec)
    traced = rec["trace"].map(lambda t: isinstance(t, dict) and bool(t.get("steps")))
    if traced.any():
        tables["acceptance_over_position"] = metrics.acceptance_over_position(rec)
        grid = np.round(np.linspace(0.0, 3.0, 61), 4)
        tables["counterfactual_acceptance"] = metrics.predict_acceptance(rec, grid).aggregate
    return tables


def standard_figures(run: Run, tables: Mapping[str, pd.DataFrame] | None = None) -> dict[str, go.Figure]:
    """The run's standard figures (those its legs support), from ``standard_tables``."""
    t = standard_tables(run) if tables is None else tables
    figs: dict[str, go.Figure] = {}
    if "speedup" in t and t["speedup"]["gamma"].notna().any():
        figs["speedup_vs_gamma"] = plots.speedup_vs_gamma(t["speedup"])
    if "speedup_per_prompt" in t:
        figs["speedup_distribution"] = plots.speedup_distribution(t["speedup_per_prompt"])
    if "exactness" in t:
        figs["exactness"] = plots.exactness_table(t["exactness"])
    if "acceptance_per_position" in t and len(t["acceptance_per_position"]):
        figs["acceptance_per_position"] = plots.per_position_acceptance(t["acceptance_per_position"])
    if "acceptance_over_position" in t:
        figs["acceptance_over_position"] = plots.acceptance_over_position(t["acceptance_over_position"])
    if "acceptance" in t and len(t["acceptance"]):
        figs["acceptance_vs_tau"] = plots.acceptance_vs_tau(t["acceptance"], t.get("counterfactual_acceptance"))
    return figs


def export_run(
    run_dir: str | Path,
    formats: Iterable[str] = FORMATS,
    width: int = 1000,
    height: int = 600,
    tables: bool = True,
) -> dict[str, list[Path]]:
    """Regenerate a run's standard figures (and csv tables) from its raw records alone.

    Writes ``run_dir/figures/<name>.<fmt>`` and, with ``tables``,
    ``run_dir/tables/<name>.csv``. Raises if the run has no finished leg.
    """
    run = load_run(run_dir)
    if run.records.empty:
        raise ValueError(f"run {run.path} has no finished leg with records; nothing to export")
    t = standard_tables(run)
    figs = standard_figures(run, t)
    written = export_figures(figs, run.path / "figures", formats, width, height)
    if tables:
        tdir = run.path / "tables"
        tdir.mkdir(exist_ok=True)
        for name, df in t.items():
            tmp = tdir / f".{name}.csv.tmp"
            df.to_csv(tmp, index=False)
            os.replace(tmp, tdir / f"{name}.csv")
            written.setdefault(f"table:{name}", []).append(tdir / f"{name}.csv")
    return written
