"""workbench.export: real PNG/SVG/PDF files of the requested size, self-contained HTML."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from synthetic_runs import LADDER_LEGS, write_run  # noqa: E402

from workbench.export import export_figures, export_run, find_browser  # noqa: E402
from workbench.results import load_run  # noqa: E402


def need_browser():
    try:
        return find_browser()
    except RuntimeError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run static export: {exc}")
        pytest.skip(f"no browser for kaleido: {exc}")


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def pdf_pages(path: Path) -> list[tuple[float, float]]:
    data = path.read_bytes()
    assert data.startswith(b"%PDF-")
    assert len(re.findall(rb"/Type\s*/Page\b", data)) == 1
    boxes = re.findall(rb"/MediaBox\s*\[\s*([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*\]", data)
    return [(float(b[2]) - float(b[0]), float(b[3]) - float(b[1])) for b in boxes]


def test_export_figures_sizes_and_formats(tmp_path):
    need_browser()
    figs = {"line": go.Figure(go.Scatter(x=[1, 2, 3], y=[2, 1, 3], name="a")),
            "bars": go.Figure(go.Bar(x=["a", "b"], y=[1, 2]))}
    written = export_figures(figs, tmp_path / "fig", width=640, height=480)
    assert {p.name for ps in written.values() for p in ps} == {
        f"{n}.{f}" for n in figs for f in ("png", "svg", "pdf", "html")}
    for name in figs:
        assert png_size(tmp_path / "fig" / f"{name}.png") == (640, 480)
        svg = ET.parse(tmp_path / "fig" / f"{name}.svg").getroot()
        assert svg.tag.endswith("svg") and (svg.get("width"), svg.get("height")) == ("640", "480")
        # kaleido lays the page out at 96 px per inch: 640 x 480 px = 480 x 360 pt.
        assert pdf_pages(tmp_path / "fig" / f"{name}.pdf") == [(480.0, 360.0)]
        html = (tmp_path / "fig" / f"{name}.html").read_text()
        assert not re.search(r"<script[^>]*\ssrc=", html)  # nothing loaded from elsewhere
        assert len(html) > 1_000_000  # plotly.js is inline
    # No staging leftovers next to the figures.
    assert sorted(p.name for p in (tmp_path / "fig").iterdir() if p.name.startswith(".")) == []


def test_export_scale_and_html_only(tmp_path):
    fig = {"f": go.Figure(go.Scatter(y=[1, 3, 2]))}
    written = export_figures(fig, tmp_path, formats=["html"], width=300, height=200)
    assert [p.name for p in written["f"]] == ["f.html"]
    assert "Plotly.newPlot" in (tmp_path / "f.html").read_text()


def test_export_bad_inputs(tmp_path, monkeypatch):
    fig = go.Figure()
    with pytest.raises(ValueError, match="unknown export format"):
        export_figures({"f": fig}, tmp_path, formats=["jpg"])
    with pytest.raises(ValueError, match="not a plain file name"):
        export_figures({"../f": fig}, tmp_path, formats=["html"])
    with pytest.raises(TypeError, match="not a plotly Figure"):
        export_figures({"f": {"data": []}}, tmp_path, formats=["html"])
    monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "no-such-browser"))
    with pytest.raises(RuntimeError, match="BROWSER_PATH"):
        export_figures({"f": fig}, tmp_path / "out", formats=["png", "html"])
    # Nothing that looks like a finished export is left behind.
    assert not list((tmp_path / "out").glob("f.*"))


def test_export_run_regenerates_from_records(tmp_path):
    need_browser()
    rdir = write_run(tmp_path, legs=LADDER_LEGS, n_prompts=6, failed=("vanilla_1",))
    written = export_run(rdir, formats=("png", "html"), width=500, height=300)
    names = {k for k in written if not k.startswith("table:")}
    assert names == {"speedup_vs_gamma", "speedup_distribution", "exactness_table", "per_position_acceptance",
                     "acceptance_over_position", "acceptance_vs_tau"}
    for n in names:
        assert png_size(rdir / "figures" / f"{n}.png") == (500, 300)
    assert (rdir / "tables" / "speedup.csv").read_text().count("\n") == 1 + 4  # header + 4 spec legs
    # Regenerable from raw records alone: drop the derived folders and export again.
    shutil.rmtree(rdir / "figures")
    shutil.rmtree(rdir / "tables")
    export_run(rdir, formats=("html",))
    assert (rdir / "figures" / "speedup_vs_gamma.html").stat().st_size > 0


def test_export_run_without_finished_legs(tmp_path):
    rdir = write_run(tmp_path, n_prompts=2, failed=("vanilla_0", "strict_g6", "vanilla_1"))
    with pytest.raises(ValueError, match="no finished leg"):
        export_run(rdir, formats=("html",))


def test_notebook_and_export_write_one_file_per_table(tmp_path):
    from workbench import analyses

    rdir = write_run(tmp_path, legs=LADDER_LEGS, n_prompts=6)
    cfg_path = rdir / "run.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["analyses"] = ["exactness_table", "speedup_vs_gamma"]
    cfg_path.write_text(json.dumps(cfg))
    # what the experiment notebook writes, then what `workbench export` writes, into one folder
    res = analyses.analyze_run(rdir)
    assert list(res["_figures"]) == ["exactness_table", "speedup_vs_gamma"]
    export_run(rdir, formats=("html",))
    tables = sorted(p.name for p in (rdir / "tables").iterdir())
    assert tables == sorted(["speedup.csv", "prompt_speedups.csv", "acceptance.csv", "exactness.csv", "divergences.csv",
                             "per_position_acceptance.csv", "acceptance_over_position.csv",
                             "counterfactual_acceptance.csv", "legs_throughput.csv", "summary.json"])
    figures = sorted(p.stem for p in (rdir / "figures").glob("*.html"))
    # every figure its records support: not E7's agreement, nor the cost ladder's (E16), nor the serving ones (E17)
    assert figures == sorted(set(analyses.ANALYSES) - {"agreement_vs_acceptance", "step_cost_vs_batch",
                                                       "c_by_graphs", "speedup_curves", "serving_summary",
                                                       "serving_speedup",
                                                       "serving_latency", "serving_throughput",
                                                       "serving_acceptance"})
    summary = json.loads((rdir / "tables" / "summary.json").read_text())
    assert {r["leg"] for r in summary["speedup"]} == {"strict_g2", "strict_g4", "strict_g6", "relaxed_g6_x0.693"}
    assert summary["not_computed"] == {}
    # the csv holds what the registry computes from the records
    run_tables = analyses.RunTables(load_run(rdir))
    speedup = pd.read_csv(rdir / "tables" / "speedup.csv")
    assert speedup["speedup"].tolist() == pytest.approx(run_tables["speedup"]["speedup"].tolist())


def test_workbench_export_png_svg_as_documented(tmp_path, capsys):
    """docs/experiments.md: `workbench export results/E1/<run id> --formats png,svg`, as written."""
    need_browser()
    from workbench import cli

    rdir = write_run(tmp_path, legs=LADDER_LEGS[:3], n_prompts=3)
    assert cli.main(["export", str(rdir), "--formats", "png,svg"]) == 0, capsys.readouterr().err
    figs = rdir / "figures"
    assert png_size(figs / "speedup_distribution.png")[0] > 0
    ET.parse(figs / "speedup_distribution.svg")  # a whole SVG document
    assert not list(figs.glob("*.html"))  # only the formats asked for
