"""workbench.plots: figures have the traces, data and colours the tables say."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from synthetic_runs import LADDER_LEGS, write_run  # noqa: E402

from workbench import metrics as M  # noqa: E402
from workbench import plots as P  # noqa: E402
from workbench.results import load_run  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return load_run(write_run(tmp_path_factory.mktemp("runs"), legs=LADDER_LEGS, n_prompts=10))


def test_speedup_vs_gamma_series_and_iqr():
    sp = pd.DataFrame({
        "leg": ["s2", "s4", "r4"], "leg_index": [1, 2, 3], "tier": ["strict", "strict", "relaxed"],
        "gamma": [2.0, 4.0, 4.0], "relax_logtau": [0.0, 0.0, 0.693], "blind_mm": [False] * 3,
        "speedup": [1.2, 1.5, 1.9], "q25": [1.1, 1.3, 1.6], "q75": [1.4, 1.6, 2.0], "n": [10] * 3,
    })
    fig = P.speedup_vs_gamma(sp)
    series = [t for t in fig.data if t.meta.get("role") == "speedup"]
    assert [t.name for t in series] == ["strict", "relaxed x = 0.69"]
    strict = series[0]
    assert list(strict.x) == [2, 4] and np.allclose(strict.y, [1.2, 1.5])
    assert np.allclose(strict.error_y.array, [0.2, 0.1]) and np.allclose(strict.error_y.arrayminus, [0.1, 0.2])
    assert strict.line.color == P.TIER_COLORS["strict"] and series[1].line.color == P.TIER_COLORS["relaxed"]
    assert any(t.meta.get("role") == "selection" for t in fig.data)


def test_speedup_distribution_box_violin(run):
    per = M.prompt_speedups(run.records, run.legs_order)
    box = P.speedup_distribution(per)
    assert [t.type for t in box.data] == ["box"] * 4
    assert [t.name for t in box.data] == ["strict, γ = 2", "strict, γ = 4", "strict, γ = 6", "relaxed x = 0.69, γ = 6"]
    assert np.allclose(sorted(box.data[0].y), sorted(per.loc[per["leg"] == "strict_g2", "speedup"]))
    assert box.data[2].marker.color == P.TIER_COLORS["strict"]   # the largest gamma in the series' own hue
    assert len({t.marker.color for t in box.data}) == 4           # each leg its own colour
    assert [t.type for t in P.speedup_distribution(per, "violin").data] == ["violin"] * 4
    with pytest.raises(ValueError, match="kind"):
        P.speedup_distribution(per, "bars")


def test_large_distribution_uses_precomputed_quartiles():
    n = P.BOX_MAX_POINTS + 1
    y = np.linspace(0.5, 2.5, n)
    per = pd.DataFrame({"leg": "s", "leg_index": 1, "tier": "strict", "gamma": 6, "relax_logtau": 0.0,
                        "blind_mm": False, "pid": [f"p{i}" for i in range(n)], "speedup": y})
    t = P.speedup_distribution(per).data[0]
    assert t.y is None and t.median[0] == pytest.approx(np.median(y)) and t.q1[0] == pytest.approx(np.quantile(y, 0.25))


def test_per_position_acceptance_bars_and_prediction(run):
    pos = M.per_position_acceptance(run.records)
    pred = pd.DataFrame({"leg": "strict_g6", "gamma": 6, "tier": "strict", "relax_logtau": 0.0,
                         "position": range(6), "rate": np.linspace(1, 0.5, 6)})
    fig = P.per_position_acceptance(pos, pred)
    bars = [t for t in fig.data if t.type == "bar"]
    assert [len(b.x) for b in bars] == [2, 4, 6, 6]
    g6 = pos[pos["leg"] == "strict_g6"].sort_values("position")
    assert np.allclose(bars[2].y, g6["rate"]) and list(bars[2].x) == [1, 2, 3, 4, 5, 6]
    predicted = [t for t in fig.data if t.meta.get("role") == "predicted"]
    assert len(predicted) == 1 and np.allclose(predicted[0].y, np.linspace(1, 0.5, 6))


def test_acceptance_over_position_lines(run):
    over = M.acceptance_over_position(run.records, 4)
    fig = P.acceptance_over_position(over, "acceptance_length")
    assert [t.name for t in fig.data] == ["strict_g2", "strict_g4", "strict_g6", "relaxed_g6_x0.693"]
    assert np.allclose(fig.data[2].y, over.loc[over["leg"] == "strict_g6", "acceptance_length"])
    with pytest.raises(ValueError, match="metric"):
        P.acceptance_over_position(over, "speed")


def test_acceptance_vs_tau_points_curves_marker(run):
    measured = M.acceptance(run.records)
    curve = M.predict_acceptance(run.records, np.linspace(0, 2, 21)).aggregate
    fig = P.acceptance_vs_tau(measured, curve, marker_x=0.5)
    roles = [t.meta["role"] for t in fig.data]
    assert roles.count("measured_points") == 4  # one per leg
    assert roles.count("counterfactual") == 4 and roles.count("marker") == 4
    g6 = [t for t in fig.data if t.meta["role"] == "measured_points" and t.meta["gamma"] == 6]
    assert sorted(x for t in g6 for x in t.x) == [0.0, 0.693]
    strict_curve = next(t for t in fig.data if t.meta["role"] == "counterfactual" and t.meta["leg"] == "strict_g6")
    assert strict_curve.line.color == P.TIER_COLORS["strict"]
    assert np.all(np.diff(strict_curve.y) >= 0)  # looser gate never accepts less


def test_exactness_table_cells(run):
    summ = M.exactness_summary(run.records)
    fig = P.exactness_table(summ)
    table = fig.data[0]
    assert isinstance(table, go.Table)
    assert list(table.cells.values[0]) == list(summ["leg"])
    assert list(table.cells.values[4]) == [f"{r:.3f}" for r in summ["match_rate"]]


def test_token_class_bars(run):
    classes = M.token_class_acceptance(run.records, set(range(10, 500)))
    fig = P.token_class_bars(classes)
    assert sorted(t.name for t in fig.data) == ["image-word", "other"]


# --------------------------------------------------------------------------- widgets (no browser)


def test_explorer_callbacks_update_in_place(tmp_path):
    from workbench.widgets import Explorer

    write_run(tmp_path, legs=LADDER_LEGS, n_prompts=6)
    write_run(tmp_path, experiment="E4", run_id="20260105T000000Z-eeee", n_prompts=3)
    ex = Explorer(tmp_path, "E1")
    assert ex.gamma_slider.options == (2, 4, 6) and ex.gamma_slider.value == 6
    assert ex.gamma_slider.index == 2  # the value the page shows is the one the callbacks use
    pos_traces = list(ex.fig_pos.data)
    predicted = next(t for t in ex.fig_pos.data if t.meta["role"] == "predicted" and t.meta["leg"] == "strict_g6")
    ex.relax_slider.value = 1.0
    assert list(ex.fig_pos.data) == pos_traces  # same trace objects: edited, not rebuilt
    expected = ex.pre.trace.per_position_at("strict_g6", 1.0)
    assert np.allclose(predicted.y, expected)
    assert "x = 1.00" in ex.readout.value and "strict_g6" in ex.readout.value
    marker = next(t for t in ex.fig_tau.data if t.meta["role"] == "marker" and t.meta["leg"] == "strict_g6")
    assert marker.x == (1.0,)
    ex.gamma_slider.value = 2
    visible = {t.meta["leg"]: t.visible for t in ex.fig_dist.data}
    assert visible["strict_g2"] is True and visible["strict_g6"] is False
    sel = next(t for t in ex.fig_speedup.data if t.meta.get("role") == "selection")
    assert list(sel.x) == [2]
    ex.experiment_dd.value = "E4"
    assert "E4" in ex.status.value and ex.gamma_slider.value == 6
    with pytest.raises(ValueError, match="experiment 'E9' has no runs"):
        Explorer(tmp_path, "E9")


def test_divergence_html_split_points():
    from workbench.widgets import divergence_html

    ref = pd.Series({"leg": "vanilla_0", "pid": "p1", "gen_ids": [1, 2, 3, 4], "text": "the red ball"})
    oth = pd.Series({"leg": "relaxed", "pid": "p1", "gen_ids": [1, 2, 9, 4], "text": "the red cube"})
    html = divergence_html(ref, oth)
    assert "index <b>2</b> (id 3 vs 9)" in html
    assert ">the red </span><span style='background:#ffe0b2'>ball<" in html  # cut at the word
    decoded = divergence_html(ref, oth, decode=lambda ids: "".join(chr(96 + i) for i in ids))
    assert ">ab</span><span style='background:#ffe0b2'>cd<" in decoded
    no_text = divergence_html(ref.drop("text"), oth.drop("text"))
    assert ">1 2 </span><span style='background:#ffe0b2'>3 4<" in no_text
    assert "identical" in divergence_html(ref, ref)


def test_agreement_vs_acceptance_scatter_and_correlation():
    import numpy as np
    import pandas as pd

    from workbench.plots import agreement_vs_acceptance

    table = pd.DataFrame({"pid": ["a", "b", "c", "d"], "agreement": [0.2, 0.4, 0.6, 0.8],
                          "acceptance_rate": [0.25, 0.35, 0.7, 0.75], "leg": "strict_g6"})
    fig = agreement_vs_acceptance(table)
    pts = fig.data[0]
    assert list(pts.x) == [0.2, 0.4, 0.6, 0.8] and list(pts.text) == ["a", "b", "c", "d"]
    r = np.corrcoef(table["agreement"], table["acceptance_rate"])[0, 1]
    assert f"Pearson r = {r:.3f}" in fig.layout.title.text
    small = agreement_vs_acceptance(table.iloc[:2])
    assert "undefined" in small.layout.title.text
    with pytest.raises(ValueError, match="agreement"):
        agreement_vs_acceptance(table.drop(columns=["agreement"]))


def test_run_switch_clears_the_previous_figures_annotations_on_the_page():
    """The page applies relayout messages; a key the new figure lacks must be sent as null."""
    from workbench.widgets import Explorer

    fw = go.FigureWidget()
    sent = []
    send = fw._send_relayout_msg
    fw._send_relayout_msg = lambda d, **k: (sent.append(d), send(d, **k))
    first = go.Figure(go.Scatter(y=[1]))
    first.add_annotation(x=0, y=1, text="x = 0+: ties accepted")
    Explorer._replace(fw, first)
    Explorer._replace(fw, go.Figure(go.Scatter(y=[2])))
    page: dict = {}
    for msg in sent:
        for k, v in msg.items():
            if v is None:
                page.pop(k, None)
            else:
                page[k] = v
    assert "annotations" not in page and not fw.layout.annotations


def test_divergence_text_follows_the_leg_dropdown(tmp_path):
    from workbench.widgets import divergence_viewer

    legs = [{"name": "vanilla_0", "tier": "vanilla"}, {"name": "strict_a", "tier": "strict", "gamma": 4},
            {"name": "strict_b", "tier": "strict", "gamma": 2},
            {"name": "vanilla_1", "tier": "vanilla"}]
    run = load_run(write_run(tmp_path, legs=legs, n_prompts=4))
    box = divergence_viewer(run)
    leg_dd, pid_dd, _ = box.children[0].children
    out = box.children[1]
    for leg in ("strict_b", "strict_a", "strict_b"):
        leg_dd.value = leg
        assert f"<b>{leg}</b> vs <b>vanilla_0</b>" in out.value
