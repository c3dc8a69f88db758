"""Figures of the cost ladder (E16): step cost vs batch, c with and without drafter graphs, S(α)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ._base import GAMMA_SYMBOLS, TEMPLATE, _layout, _num


LADDER_ROLE_COLORS = {"target decode": "#7f7f7f", "target verify": "#1f77b4", "draft step": "#ff7f0e"}
BATCH_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def _graphs_label(v: Any) -> str:
    return "drafter graphs" if bool(v) else "drafter eager"


def step_cost_vs_batch(costs: pd.DataFrame) -> go.Figure:
    """Engine-side step cost vs batch per role (``ladder.step_costs``): median with IQR bars, one panel per size.

    Roles: the target's decode step (vanilla engine), its verification step of gamma + 1 tokens per
    request, and one draft step (the drafter's ``propose`` / gamma); spec roles per gamma, drafter
    graphs on (solid) and off (dashed).
    """
    from plotly.subplots import make_subplots

    sizes = list(dict.fromkeys(costs["size"].astype(str)))
    fig = make_subplots(rows=1, cols=len(sizes), subplot_titles=[f"size {s}" for s in sizes], shared_yaxes=True)
    gammas = sorted({int(g) for g in costs["gamma"].dropna()})
    in_legend: set[str] = set()  # each role/gamma/graphs once, from whichever panel has it first
    for col, size in enumerate(sizes, start=1):
        d = costs[costs["size"].astype(str) == size]
        groups = []
        dec = d[d["role"] == "target decode"]
        if len(dec):
            groups.append(("target decode", None, None, dec, 1.0))
        for g in gammas:
            for graphs in (True, False):
                sel = d[(d["gamma"] == g) & (d["draft_graphs"].astype(bool) == graphs)]
                if len(sel):
                    groups.append(("target verify", g, graphs, sel[sel["role"] == "target verify"], 1.0))
                    groups.append(("draft step", g, graphs, sel[sel["role"] == "draft propose"], float(g)))
        for role, g, graphs, part, div in groups:
            if part.empty:
                continue
            part = part.sort_values("batch")
            med = part["median_ms"].to_numpy(float) / div
            q1, q3 = part["q1_ms"].to_numpy(float) / div, part["q3_ms"].to_numpy(float) / div
            name = role if g is None else f"{role} γ={g}, {_graphs_label(graphs)}"
            symbol = GAMMA_SYMBOLS[gammas.index(g) % len(GAMMA_SYMBOLS)] if g is not None else "circle"
            fig.add_trace(go.Scatter(
                x=part["batch"].to_numpy(int), y=med, mode="lines+markers", name=name, legendgroup=name,
                showlegend=name not in in_legend,
                line=dict(color=LADDER_ROLE_COLORS[role], dash="solid" if graphs in (None, True) else "dash"),
                marker=dict(symbol=symbol, size=8),
                error_y=dict(type="data", symmetric=False, array=q3 - med, arrayminus=med - q1),
                customdata=np.stack([q1, q3, part["n"].to_numpy(float)], axis=1),
                hovertemplate=(f"{size}, {name}<br>batch %{{x}}: %{{y:.3f}} ms"
                               "<br>IQR %{customdata[0]:.3f}–%{customdata[1]:.3f} ms, %{customdata[2]:.0f} steps"
                               + ("<br>(propose / γ)" if role == "draft step" else "") + "<extra></extra>"),
                meta={"role": role, "gamma": g, "draft_graphs": graphs, "size": size}), row=1, col=col)
            in_legend.add(name)
        fig.update_xaxes(type="log", title_text="batch (requests per step)", tickvals=sorted(d["batch"].unique()),
                         row=1, col=col)
    fig.update_yaxes(title_text="ms per step (median, IQR bars)", row=1, col=1)
    fig.update_layout(title="Engine-side step cost vs batch: target decode, verification (γ+1 tokens), draft step",
                      template=TEMPLATE, legend=dict(font=dict(size=10)))
    return fig


def _size_and_setup(label: str) -> tuple[str, str | None]:
    """``"32b [marlin full async]"`` -> ``("32b", "marlin full async")``; a plain size has no setup."""
    if label.endswith("]") and " [" in label:
        size, setup = label[:-1].split(" [", 1)
        return size, setup
    return label, None


SETUP_COLORS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def cost_ratio_by_graphs(ratios: pd.DataFrame) -> go.Figure:
    """c = draft step / verification step per batch (``ladder.cost_ratio``), drafter graphs on and off side by side;
    one panel per size and gamma. Drafter setups of one size measured together (``32b [marlin full async]``
    beside ``32b [marlin piecewise async]``) share that size's panels, one bar colour per setup."""
    from plotly.subplots import make_subplots

    split = ratios["size"].astype(str).map(_size_and_setup)
    ratios = ratios.assign(_base=split.map(lambda t: t[0]), _setup=split.map(lambda t: t[1]))
    panels = list(dict.fromkeys(zip(ratios["_base"], ratios["gamma"].astype(int))))
    setups = list(dict.fromkeys(ratios["_setup"]))
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[f"{s}, γ={g}" for s, g in panels],
                        shared_yaxes=True)
    shown: set[str] = set()
    for col, (size, g) in enumerate(panels, start=1):
        d = ratios[(ratios["_base"] == size) & (ratios["gamma"].astype(int) == g)]
        for i, setup in enumerate(setups):
            for graphs in (True, False):
                part = d[(d["_setup"].map(lambda v: v == setup)) & (d["draft_graphs"].astype(bool) == graphs)]
                part = part.sort_values("batch")
                if part.empty:
                    continue
                name = _graphs_label(graphs) if setup is None else f"{setup}, {_graphs_label(graphs)}"
                color = (SETUP_COLORS[i % len(SETUP_COLORS)] if graphs else "#ff7f0e") if setup is not None else (
                    "#1f77b4" if graphs else "#ff7f0e")
                fig.add_trace(go.Bar(
                    x=part["batch"].astype(str), y=part["c"].to_numpy(float), name=name, legendgroup=name,
                    showlegend=name not in shown, marker_color=color,
                    marker_pattern_shape="" if graphs or setup is None or i == 0 else "/",
                    customdata=np.stack([part["propose_per_token_ms"].to_numpy(float),
                                         part["verify_ms"].to_numpy(float),
                                         part["S_pred_alpha1"].to_numpy(float)], axis=1),
                    hovertemplate=(f"{size}, γ={g}, {name}<br>batch %{{x}}: c = %{{y:.3f}}"
                                   "<br>propose/γ %{customdata[0]:.3f} ms / verification %{customdata[1]:.3f} ms"
                                   "<br>S(1, γ, c) = %{customdata[2]:.2f}<extra></extra>"),
                    meta={"role": "c", "gamma": g, "draft_graphs": graphs, "size": size, "setup": setup}),
                    row=1, col=col)
                shown.add(name)
        fig.update_xaxes(title_text="batch", row=1, col=col)
    fig.add_hline(y=1.0, line_dash="dot", line_color="#888888")
    fig.update_yaxes(title_text="c = draft step / verification step", row=1, col=1)
    fig.update_layout(title="Cost ratio c = draft step / verification step, by drafter setup and CUDA graphs",
                      template=TEMPLATE, barmode="group", legend=dict(orientation="h", y=-0.15))
    return fig


def _alpha1_markers(fig: go.Figure, r, name: str, g: int, color: str, symbol: str) -> None:
    """A cell's markers at α = 1: S(1, γ, c) predicted (open), measured end to end (filled) and, where the rows
    time the first token apart, decode only (open with a dot)."""
    fig.add_trace(go.Scatter(x=[1.0], y=[float(r.S_pred_alpha1)], mode="markers", name=f"{name}: S(1,γ,c)",
                             legendgroup=name, showlegend=False,
                             marker=dict(symbol=symbol + "-open", size=10, color=color),
                             hovertemplate=name + "<br>predicted at α = 1: S(1,γ,c) = %{y:.2f}<extra></extra>",
                             meta={"role": "predicted_alpha1", "gamma": int(g)}))
    measured = _num(getattr(r, "S_measured_alpha1", None))
    if measured is not None:
        fig.add_trace(go.Scatter(
            x=[1.0], y=[measured], mode="markers", name=f"{name}: measured", legendgroup=name,
            showlegend=False, marker=dict(symbol=symbol, size=10, color=color),
            hovertemplate=(name + "<br>measured at α = 1 (forced acceptance, vanilla wall / spec wall): "
                           "%{y:.2f}<extra></extra>"),
            meta={"role": "measured_alpha1", "gamma": int(g)}))
    decode = _num(getattr(r, "S_measured_decode_alpha1", None))
    if decode is not None:
        fig.add_trace(go.Scatter(
            x=[1.0], y=[decode], mode="markers", name=f"{name}: measured, decode only", legendgroup=name,
            showlegend=False, marker=dict(symbol=symbol + "-open-dot", size=10, color=color),
            hovertemplate=(name + "<br>measured at α = 1, decode only (first token timed apart and "
                           "taken off): %{y:.2f}<extra></extra>"),
            meta={"role": "measured_decode_alpha1", "gamma": int(g)}))


def _alpha1_legend(fig: go.Figure, c_of: dict) -> None:
    """What the markers at α = 1 mean, once in the legend."""
    keys = [("at α=1, open: predicted S(1,γ,c)", "circle-open"),
            ("at α=1, filled: measured, forced acceptance", "circle")]
    if any(_num(getattr(r, "S_measured_decode_alpha1", None)) is not None for r in c_of.values()):
        keys.append(("at α=1, open with a dot: measured, decode only", "circle-open-dot"))
    for label, symbol in keys:
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=label,
                                 marker=dict(symbol=symbol, size=10, color="#555555"), meta={"role": "legend"}))


def _operating_points(fig: go.Figure, gammas: list[int]) -> None:
    """The seed PR's point per gamma (at the α of its acceptance length) and QuantSpec's at α = 0.9."""
    from .. import ladder

    seed = ladder.SEED_POINT
    for g in gammas:
        a = ladder.alpha_for_length(seed["acceptance_length"], g)
        fig.add_trace(go.Scatter(
            x=[a], y=[seed["speedup"]], mode="markers", name=f"seed PR 1.28x at L=1.49 (α={a:.2f} at γ={g})",
            marker=dict(symbol="x", size=13, color="#000000"),
            hovertemplate=(f"{seed['label']}<br>placed at α = {a:.3f}: the α whose expected acceptance length L = "
                           f"(1 − α^(γ+1)) / (1 − α) at γ = {g} is {seed['acceptance_length']}<extra></extra>"),
            meta={"role": "seed_point", "gamma": g}))
    q = ladder.QUANTSPEC_POINT
    fig.add_trace(go.Scatter(
        x=[q["alpha"]], y=[q["speedup"]], mode="markers", name="QuantSpec ≈2.5x at >90% acceptance (α=0.9)",
        marker=dict(symbol="triangle-right", size=14, color="#9467bd"),
        hovertemplate=(f"{q['label']}<br>drawn at α = {q['alpha']}, the lower end of the acceptance it reports"
                       "<extra></extra>"), meta={"role": "quantspec_point"}))


def speedup_curves(curve: pd.DataFrame, ratios: pd.DataFrame | None = None) -> go.Figure:
    """Predicted S(α, γ, c) at each cell's measured c (``ladder.speedup_curve``), with the published operating points.

    One line per size, batch, gamma and drafter mode (graphs solid, eager dashed). At α = 1: S(1, γ, c)
    (open marker) and the measured forced-acceptance speedup, end to end (filled) and, where the rows time
    the first token apart, decode only (open with a dot: the one S(1, γ, c) models), from ``ratios``. The seed PR's
    point (1.28x at acceptance length 1.49) is placed per gamma at the α whose expected acceptance
    length is 1.49; QuantSpec's (≈2.5x at > 90 % acceptance) at α = 0.9 (``ladder.OPERATING_POINTS_NOTE``).
    Every trace's meta carries its gamma, so a γ slider can show one gamma at a time.
    """
    from .. import ladder

    fig = go.Figure()
    cells = list(curve.groupby(["size", "batch", "gamma", "draft_graphs"], sort=True))
    batches = sorted({int(b) for b in curve["batch"]})
    gammas = sorted({int(g) for g in curve["gamma"]})
    c_of = {}
    if ratios is not None and len(ratios):
        for r in ratios.itertuples():
            c_of[(str(r.size), int(r.batch), int(r.gamma), bool(r.draft_graphs))] = r
    for (size, batch, g, graphs), d in cells:
        key = (str(size), int(batch), int(g), bool(graphs))
        r = c_of.get(key)
        c_text = f", c={r.c:.2f}" if r is not None else ""
        name = f"{size} b={batch} γ={g} {'graphs' if graphs else 'eager'}{c_text}"
        color = BATCH_COLORS[batches.index(int(batch)) % len(BATCH_COLORS)]
        dash = "solid" if graphs else "dash"
        fig.add_trace(go.Scatter(x=d["alpha"].to_numpy(float), y=d["S"].to_numpy(float), mode="lines", name=name,
                                 legendgroup=name, line=dict(color=color, dash=dash),
                                 hovertemplate=name + "<br>α %{x:.2f}: S %{y:.2f}<extra></extra>",
                                 meta={"role": "curve", "gamma": int(g), "size": str(size), "batch": int(batch),
                                       "draft_graphs": bool(graphs)}))
        if r is not None:
            _alpha1_markers(fig, r, name, g, color, GAMMA_SYMBOLS[gammas.index(int(g)) % len(GAMMA_SYMBOLS)])
    if c_of:
        _alpha1_legend(fig, c_of)
    _operating_points(fig, gammas)
    fig.add_hline(y=1.0, line_dash="dot", line_color="#888888")
    seed = ladder.SEED_POINT
    lo = min([0.5] + [ladder.alpha_for_length(seed["acceptance_length"], g) for g in gammas]) - 0.03
    fig.update_xaxes(range=[lo, 1.03])
    _layout(fig, "Predicted speedup S(α, γ, c) = (1 − α^(γ+1)) / ((1 − α)(γc + 1)) at the measured c",
            "α (per-token acceptance)", "speedup over the target alone")
    fig.add_annotation(text=_wrap(ladder.OPERATING_POINTS_NOTE, 150), xref="paper", yref="paper", x=0, y=0,
                       yshift=-60,  # in pixels below the axis: stays inside the bottom margin at any figure height
                       showarrow=False, align="left", xanchor="left", yanchor="top", font=dict(size=10))
    fig.update_layout(margin=dict(b=150))
    return fig


def _wrap(text: str, width: int) -> str:
    import textwrap

    return "<br>".join(textwrap.wrap(text, width))

