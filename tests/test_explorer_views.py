"""The explorer's figures are the views declared in the analysis registry (no browser)."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import pytest

from synthetic_runs import LADDER_LEGS, write_run
from workbench import analyses, metrics

BOXES = {"speedup_vs_gamma": "speedup", "speedup_distribution": "distribution",
         "per_position_acceptance": "per-position", "acceptance_vs_tau": "tau",
         "acceptance_over_position": "over-position", "step_cost_vs_batch": "ladder-steps",
         "c_by_graphs": "ladder-c", "speedup_curves": "ladder-speedup",
         "serving_summary": "serving-summary", "serving_speedup": "serving-speedup", "serving_latency": "serving-latency",
         "serving_throughput": "serving-throughput", "serving_acceptance": "serving-acceptance"}


def _tree(widget) -> list:
    """Every widget under ``widget`` (itself included)."""
    out = [widget]
    for child in getattr(widget, "children", ()):
        out += _tree(child)
    return out


def test_the_explorer_shows_every_declared_view_in_its_box(tmp_path):
    from workbench.widgets import Explorer

    write_run(tmp_path, legs=LADDER_LEGS, n_prompts=4)
    ex = Explorer(tmp_path, "E1")
    assert {name: v.box for name, v in analyses.views().items()} == BOXES
    assert list(ex.figs) == list(analyses.views())
    for name, box in BOXES.items():
        assert f"wb-fig-{box}" in ex.boxes[name]._dom_classes
        assert ex.boxes[name].children == (ex.figs[name],)
        assert ex.boxes[name] in _tree(ex.widget)
        # a per-prompt run shows the "legs" views, the ladder and serving ones are hidden
        assert ex.boxes[name].layout.display == (None if analyses.ANALYSES[name].view.group == "legs" else "none")
    assert ex.fig_pos is ex.figs["per_position_acceptance"]


def test_a_view_added_through_the_registry_alone(tmp_path, monkeypatch):
    """A throwaway analysis entry and its plots function: it appears in the explorer, in its own box,
    redrawn by the relax slider (and only by it), with no other edit."""
    from workbench.widgets import Explorer

    calls = []

    def probe(acceptance, x: float = 0.0) -> go.Figure:   # the "plots function"
        calls.append(x)
        fig = go.Figure(go.Scatter(x=list(acceptance["leg"]), y=[x] * len(acceptance), meta={"role": "probe"}))
        fig.update_layout(title=f"probe at x = {x:.2f}")
        return fig

    monkeypatch.setitem(analyses.ANALYSES, "probe", analyses.Analysis(
        "probe", ("acceptance",), probe, "a throwaway view",
        view=analyses.View("probe", "probe: no spec leg", sliders=("relax_logtau",), args={"x": "relax_logtau"})))
    write_run(tmp_path, legs=LADDER_LEGS, n_prompts=4)
    ex = Explorer(tmp_path, "E1")
    fw = ex.figs["probe"]
    assert "wb-fig-probe" in ex.boxes["probe"]._dom_classes and ex.boxes["probe"] in _tree(ex.widget)
    assert ex.boxes["probe"].layout.display is None
    (trace,) = fw.data
    assert set(trace.y) == {0.0} and fw.layout.title.text == "probe at x = 0.00"

    ex.relax_slider.value = 0.8
    assert fw.data[0] is trace                      # edited in place, not rebuilt
    assert set(trace.y) == {0.8} and fw.layout.title.text == "probe at x = 0.80"
    n = len(calls)
    ex.gamma_slider.value = 2                       # not a slider of this view: not redrawn
    assert len(calls) == n and set(trace.y) == {0.8}
    # the other views still follow the slider as before
    predicted = next(t for t in ex.fig_pos.data if t.meta["role"] == "predicted" and t.meta["leg"] == "strict_g6")
    assert np.allclose(predicted.y, ex.pre.trace.per_position_at("strict_g6", 0.8))

    # and the exported figures include it (the same registry)
    tables = analyses.RunTables(ex.pre.run, teacher=False)
    assert set(analyses.draw(tables, ["probe"])["probe"].data[0].y) == {0.0}


def test_a_view_where_the_run_lacks_its_table_shows_its_placeholder(tmp_path, monkeypatch):
    from workbench.widgets import Explorer

    monkeypatch.setitem(analyses.ANALYSES, "probe", analyses.Analysis(
        "probe", ("agreement",), lambda t: go.Figure(go.Scatter(y=[1])), "needs a score leg",
        view=analyses.View("probe", "probe: needs a score leg", sliders=("relax_logtau",), args={})))
    write_run(tmp_path, legs=LADDER_LEGS, n_prompts=4)
    ex = Explorer(tmp_path, "E1")
    assert not ex.figs["probe"].data and ex.figs["probe"].layout.title.text == "probe: needs a score leg"
    ex.relax_slider.value = 0.5   # no update to apply to a placeholder
    assert not ex.figs["probe"].data


def test_views_refuse_an_unknown_slider_or_group():
    with pytest.raises(ValueError, match="unknown slider 'tau'"):
        analyses.View("x", "x", sliders=("tau",))
    with pytest.raises(ValueError, match="list it in sliders"):
        analyses.View("x", "x", args={"marker_x": "relax_logtau"})
    with pytest.raises(ValueError, match="group"):
        analyses.View("x", "x", group="bogus")


def test_over_position_follows_the_relax_slider_from_the_trace_index(tmp_path):
    from workbench.widgets import Explorer

    write_run(tmp_path, legs=LADDER_LEGS, n_prompts=6)
    ex = Explorer(tmp_path, "E1")
    ex.relax_slider.value = 0.42
    pred = ex.pre.trace.over_position(ex.bins, relax_logtau=0.42)
    fig = ex.figs["acceptance_over_position"]
    for leg, d in pred.groupby("leg", sort=False):
        (t,) = [t for t in fig.data if (t.meta["leg"], t.meta["role"]) == (leg, "predicted")]
        assert np.allclose(t.y, d["acceptance_rate"], equal_nan=True)
        assert np.allclose(t.x, d["bin_mid"])


@pytest.mark.parametrize("bins", [10, 3, [0, 5, 17, 40], [2.5, 9.0]])
def test_over_position_fast_path_equals_counting_every_step(tmp_path, bins):
    """Predicted at x, TraceIndex.over_position counts on presorted running maxima; the counts are those
    of ``step_accepted`` (every step's running maxima <= x) binned by position."""
    from synthetic_runs import bulk_records
    import pandas as pd

    idx = metrics.TraceIndex(pd.DataFrame(bulk_records(LADDER_LEGS, 40, steps=9)))
    edges = (np.linspace(0, idx.position.max() + 1, bins + 1) if isinstance(bins, int)
             else np.asarray(bins, float))
    b = np.searchsorted(edges, idx.position, side="right") - 1
    inside = (b >= 0) & (b < edges.size - 1)
    nb = edges.size - 1
    key = idx.step_leg[inside] * nb + b[inside]
    for x in (0.0, metrics.ZERO_PLUS, 0.3, 1.0, 2.999, 50.0, np.inf):
        want = np.bincount(key, weights=idx.step_accepted(x)[inside], minlength=len(idx.legs) * nb)
        got = idx.over_position(bins, relax_logtau=x)
        assert np.array_equal(got["accepted"].to_numpy(), want), x
        assert got.drop(columns=["accepted", "acceptance_rate", "acceptance_length"]).equals(
            idx.over_position(bins).drop(columns=["accepted", "acceptance_rate", "acceptance_length"]))
