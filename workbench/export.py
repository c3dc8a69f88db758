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

import pandas as pd
import plotly.graph_objects as go

from . import analyses
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
    """Every table of ``workbench.analyses`` that the run can make, from its records alone."""
    return analyses.RunTables(run).available()


def standard_figures(run: Run, tables: analyses.RunTables | None = None) -> dict[str, go.Figure]:
    """Every figure of ``workbench.analyses`` that the run's legs support, named by its analysis."""
    return analyses.draw(tables if tables is not None else analyses.RunTables(run))


def export_run(
    run_dir: str | Path,
    formats: Iterable[str] = FORMATS,
    width: int = 1000,
    height: int = 600,
    tables: bool = True,
) -> dict[str, list[Path]]:
    """Regenerate a run's figures (and tables) from its raw records alone.

    Writes ``run_dir/figures/<analysis>.<fmt>`` for every analysis the run
    supports and, with ``tables``, ``run_dir/tables/<table>.csv`` and
    ``tables/summary.json`` (``workbench.analyses``). Raises if the run has
    no finished leg.
    """
    run = load_run(run_dir)
    if run.records.empty:
        raise ValueError(f"run {run.path} has no finished leg with records; nothing to export")
    t = analyses.RunTables(run)
    figs = standard_figures(run, t)
    written = export_figures(figs, run.path / "figures", formats, width, height)
    if tables:
        for name, path in analyses.write_tables(t).items():
            written[f"table:{name}"] = [path]
        analyses.write_summary(t, list(figs))
        written["table:summary"] = [run.path / "tables" / analyses.SUMMARY_JSON]
    return written
