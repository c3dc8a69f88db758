"""Figure export: PNG / SVG / PDF through kaleido, HTML self-contained.

Static export uses kaleido >= 1, which drives a headless Chromium-family
browser. It never downloads one: the browser is taken from ``BROWSER_PATH``
or found on ``PATH`` (Debian: ``apt-get install chromium``). MathJax is
switched off so nothing is fetched from a CDN; plotly.js comes from the
installed plotly package, so export works offline.

Files are written into a hidden staging folder and moved into place only
when every requested file exists, so an interrupted export never leaves a
set of figures that looks complete. Without a browser, static formats are
skipped with a warning and HTML is still written. ``export_run`` removes
derived tables and figures the run's records can no longer make.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

import plotly.graph_objects as go

from typing import Any

from . import analyses
from .results import Run, load_run
from .runfolder import RUN_JSON, disturbed_state, partial_state, read_json, write_json_atomic

STATIC_FORMATS = ("png", "svg", "pdf")
FORMATS = STATIC_FORMATS + ("html",)
BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
_FIG_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class BrowserError(RuntimeError):
    """Static export was asked for and the browser it needs is not usable (a bad BROWSER_PATH, none found)."""


class MissingBrowserWarning(UserWarning):
    """Static figures (png/svg/pdf) were skipped: no Chromium-family browser; HTML was written."""


INSTALL_BROWSER = ("install a Chromium-family browser for kaleido (Debian/Ubuntu: `apt-get install -y chromium`) "
                   "or set BROWSER_PATH to its executable")


def find_browser() -> str:
    """Path of the browser kaleido will drive; clear error when there is none."""
    env = os.environ.get("BROWSER_PATH")
    if env:
        if not (os.path.isfile(env) and os.access(env, os.X_OK)):
            raise BrowserError(f"BROWSER_PATH={env!r} is not an executable file; png/svg/pdf export needs it to "
                               f"point at a Chromium-family browser (or unset it to write html only)")
        why = browser_problem(env)
        if why:
            raise BrowserError(f"BROWSER_PATH={env!r} {why}; png/svg/pdf export needs a Chromium-family browser "
                               f"that runs headless (or unset it to write html only)")
        return env
    for name in BROWSER_NAMES:
        path = shutil.which(name)
        if path:
            why = browser_problem(path)
            if why:
                raise BrowserError(f"{path} {why}, so static figure export (png/svg/pdf) cannot use it: "
                                   + INSTALL_BROWSER)
            return path
    raise BrowserError("static figure export (png/svg/pdf) needs a Chromium-family browser and none was found: "
                       + INSTALL_BROWSER)


@functools.lru_cache(maxsize=None)
def browser_problem(path: str) -> str | None:
    """Why ``path`` cannot render a page headless (it is started once, on an empty page), or None.

    An executable that is not a browser (``/bin/false``) or a browser that cannot start here is found
    before a run's legs, not by kaleido after them."""
    cmd = [path, "--headless", "--disable-gpu", "--no-sandbox", "--dump-dom", "about:blank"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"did not render an empty page headless ({type(exc).__name__}: {exc})"
    if proc.returncode != 0 or "<html" not in proc.stdout:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][-200:]
        return f"did not render an empty page headless (exit status {proc.returncode}: {tail})"
    return None


def parse_formats(formats: Iterable[str] | str) -> tuple[str, ...]:
    """``"png,html"`` or ``["png", "html"]`` -> ``("png", "html")``; unknown formats are refused."""
    if isinstance(formats, str):
        formats = formats.split(",")
    out = tuple(dict.fromkeys(f.strip().lower().lstrip(".") for f in formats if f.strip()))
    bad = [f for f in out if f not in FORMATS]
    if bad or not out:
        raise ValueError(f"unknown export format(s) {bad or list(out)}; choose from {', '.join(FORMATS)}")
    return out


def usable_formats(formats: Iterable[str] | str) -> tuple[tuple[str, ...], str | None]:
    """The requested formats this host can write, and a warning when static ones must be skipped.

    HTML needs no browser. Without one (and without BROWSER_PATH), png/svg/pdf are dropped and the
    warning says what to install; a BROWSER_PATH that points nowhere stays an error.
    """
    fmts = parse_formats(formats)
    static = [f for f in fmts if f in STATIC_FORMATS]
    if not static:
        return fmts, None
    if os.environ.get("BROWSER_PATH"):
        find_browser()  # set but wrong is an error now, not after hours of legs
        return fmts, None
    try:
        find_browser()
    except BrowserError:
        kept = tuple(f for f in fmts if f not in STATIC_FORMATS)
        return kept, (f"{'/'.join(static)} figures skipped (no Chromium-family browser found); "
                      f"{'/'.join(kept) or 'no other'} figures written. To get them: {INSTALL_BROWSER}")
    return fmts, None


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
    Without a Chromium-family browser, png/svg/pdf are skipped with one
    ``MissingBrowserWarning`` naming what to install; HTML is still written.
    """
    # no format at all: what is left of png-only on a host without a browser; nothing to write
    formats = parse_formats(formats) if (isinstance(formats, str) or tuple(formats)) else ()
    for name, fig in figs.items():
        if not isinstance(name, str) or not _FIG_NAME.match(name):
            raise ValueError(f"figure name {name!r} is not a plain file name")
        if not isinstance(fig, go.Figure):
            raise TypeError(f"figure {name!r} is a {type(fig).__name__}, not a plotly Figure")
    if int(width) <= 0 or int(height) <= 0 or scale <= 0:
        raise ValueError(f"width, height and scale must be positive (got {width}, {height}, {scale})")
    if figs and formats:
        formats, skipped = usable_formats(formats)
        if skipped:
            warnings.warn(skipped, MissingBrowserWarning, stacklevel=2)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    static = [f for f in formats if f in STATIC_FORMATS]
    browser = find_browser() if static and figs else None

    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out))
    written: dict[str, list[Path]] = {name: [] for name in figs}
    try:
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
                try:
                    fig.write_html(staging / f"{name}.html", include_plotlyjs=True, full_html=True,
                                   include_mathjax=False, default_width=f"{int(width)}px",
                                   default_height=f"{int(height)}px", config={"displaylogo": False})
                except OSError as exc:  # a full disk: name the figure's file, not its staging copy
                    raise OSError(exc.errno, exc.strerror or str(exc), str(out / f"{name}.html")) from exc
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
        # <run>/figures of a run folder: its summary lists what this export wrote, not what was drawn
        if (out.parent / RUN_JSON).is_file() and out.name == "figures":
            record_figures(out.parent, written)


def record_figures(run_dir: str | Path, written: Mapping[str, list[Path]]) -> None:
    """``tables/summary.json`` ``figures``: the figures written (with their files), and whether the
    run was still going or lacked legs when its tables were made (``partial``)."""
    path = Path(run_dir) / "tables" / analyses.SUMMARY_JSON
    if not path.is_file():
        return
    try:
        summary = read_json(path)
    except (OSError, ValueError):
        return
    if not isinstance(summary, dict):
        return
    summary["figures"] = [name for name, files in written.items() if files]
    summary["figure_files"] = {name: [p.name for p in files] for name, files in written.items() if files}
    not_written = sorted(name for name, files in written.items() if not files)
    if not_written:
        summary["figures_not_written"] = not_written
    else:
        summary.pop("figures_not_written", None)
    summary.update(partial_state(run_dir, summary.get("legs") or {}))
    summary.update(disturbed_state(run_dir))
    write_json_atomic(path, summary)


# --------------------------------------------------------------------------- a run's standard set


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
    ``tables/summary.json`` (``workbench.analyses``), and removes the derived
    files whose inputs are gone (``written["removed"]``). Raises if the run has
    no finished leg.
    """
    # a leg whose records are damaged is left out and named (not a reason to export nothing)
    run = load_run(run_dir, damaged="mark")
    t = analyses.RunTables(run)
    if run.records.empty and not t.available():  # a cost-ladder run has tables without prompt records
        removed = remove_stale(run.path, set(), set()) if tables else []
        raise ValueError(f"run {run.path} has no finished leg with records; nothing to export"
                         + (f" (removed {len(removed)} derived file(s) left from earlier: "
                            f"{', '.join(p.name for p in removed)})" if removed else ""))
    figs = standard_figures(run, t)
    written = export_figures(figs, run.path / "figures", formats, width, height)
    if tables:
        for name, path in analyses.write_tables(t).items():
            written[f"table:{name}"] = [path]
        analyses.write_summary(t, list(figs))
        damaged = {r.leg: r.error for r in run.legs.itertuples() if r.status == "damaged"}
        record_figures(run.path, {name: written.get(name, []) for name in figs})
        if damaged:  # the summary names which file and line kept a leg out
            spath = run.path / "tables" / analyses.SUMMARY_JSON
            write_json_atomic(spath, dict(read_json(spath), damaged=damaged))
        written["table:summary"] = [run.path / "tables" / analyses.SUMMARY_JSON]
        removed = remove_stale(run.path, set(t.available()), set(figs))
        if removed:
            written["removed"] = removed
    return written


def remove_stale(run_dir: str | Path, tables: set[str], figures: set[str]) -> list[Path]:
    """Delete derived files the run's records can no longer make (a leg's records gone, say).

    Only files named after a registered table (``tables/<name>.csv``) or analysis
    (``figures/<name>.<fmt>``) are considered; anything else in those folders is left alone.
    Returns the files removed.
    """
    rdir = Path(run_dir)
    removed: list[Path] = []
    for path in sorted((rdir / "tables").glob("*.csv")):
        if path.stem in analyses.TABLES and path.stem not in tables:
            path.unlink()
            removed.append(path)
    for path in sorted((rdir / "figures").glob("*.*")):
        if path.suffix.lstrip(".") in FORMATS and path.stem in analyses.ANALYSES and path.stem not in figures:
            path.unlink()
            removed.append(path)
    return removed
