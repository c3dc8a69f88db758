"""DataFrame -> plotly Figure. The same functions feed the notebook widgets and the exported figures.

Every trace carries ``meta = {"leg": ..., "tier": ..., "gamma": ..., "role": ...}``
so that widgets can find a trace and update it in place instead of
rebuilding the figure. Colours are fixed per tier (relaxed legs get darker
shades as x grows) so that a tier looks the same in every figure.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

TIER_COLORS = {"vanilla": "#7f7f7f", "strict": "#1f77b4", "relaxed": "#ff7f0e"}
# Relaxed legs: light to dark as the gate loosens.
RELAXED_SHADES = ["#fdae6b", "#fd8d3c", "#f16913", "#d94801", "#a63603", "#7f2704"]
BLIND_DASH = "dot"
# Counterfactual curves and measured points of one gamma share a dash/symbol.
CURVE_DASH = ["dash", "longdash", "dashdot", "longdashdot", "dot", "solid", "5px,2px", "2px,6px"]
GAMMA_SYMBOLS = ["circle", "square", "diamond", "triangle-up", "star", "hexagon", "cross", "pentagon"]
# Above this many prompts a box is drawn from precomputed quartiles instead of raw points.
BOX_MAX_POINTS = 5000
TEMPLATE = "plotly_white"


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def series_key(row: Any) -> tuple[str, float, bool]:
    """What makes two legs the same series across gamma: tier, x and blind-MM."""
    tier = str(row.get("tier"))
    x = _num(row.get("relax_logtau")) or 0.0
    return tier, (x if tier == "relaxed" else 0.0), bool(row.get("blind_mm") or False)


def series_label(row: Any) -> str:
    tier, x, blind = series_key(row)
    label = tier
    if tier == "relaxed":
        label += f" x={x:.3g} (τ={math.exp(-x):.2f})"
    if blind:
        label += ", blind-MM"
    return label


def series_color(row: Any, relaxed_xs: list[float] | None = None) -> str:
    tier, x, _ = series_key(row)
    if tier == "relaxed" and relaxed_xs and len(relaxed_xs) > 1:
        i = sorted(relaxed_xs).index(x) if x in relaxed_xs else 0
        return RELAXED_SHADES[min(i, len(RELAXED_SHADES) - 1)]
    return TIER_COLORS.get(tier, "#2ca02c")


def _relaxed_xs(df: pd.DataFrame) -> list[float]:
    if "tier" not in df.columns:
        return []
    xs = df.loc[df["tier"] == "relaxed", "relax_logtau"] if "relax_logtau" in df.columns else []
    return sorted({_num(x) or 0.0 for x in xs})


def _gamma(v: Any) -> int | None:
    f = _num(v)
    return None if f is None else int(round(f))


def _meta(row: Any, role: str, **extra: Any) -> dict[str, Any]:
    return {"leg": row.get("leg"), "tier": row.get("tier"), "gamma": _gamma(row.get("gamma")),
            "relax_logtau": _num(row.get("relax_logtau")), "role": role, **extra}


ACCEPTANCE_METRICS = ("acceptance_rate", "acceptance_length")


def _one_of(what: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{what} must be {' or '.join(repr(c) for c in choices)}, got {value!r}")


def _layout(fig: go.Figure, title: str, x: str, y: str) -> go.Figure:
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, template=TEMPLATE,
                      legend_title_text="", margin=dict(l=60, r=20, t=60, b=50))
    return fig


# --------------------------------------------------------------------------- speedup


def speedup_vs_gamma(speedup: pd.DataFrame) -> go.Figure:
    """Median bracketed speedup vs gamma, one line per tier/series, IQR as error bars.

    ``speedup`` is ``metrics.bracketed_speedup(...)``.
    """
    fig = go.Figure()
    df = speedup[speedup["gamma"].map(_num).notna()] if len(speedup) else speedup
    xs_relaxed = _relaxed_xs(df)
    groups: dict[tuple, list] = {}
    for _, row in df.iterrows():
        groups.setdefault(series_key(row), []).append(row)
    for key, rows in groups.items():
        rows = sorted(rows, key=lambda r: _num(r["gamma"]))
        first = rows[0]
        med = np.array([r["speedup"] for r in rows], dtype=float)
        fig.add_trace(go.Scatter(
            x=[_gamma(r["gamma"]) for r in rows], y=med, mode="lines+markers",
            name=series_label(first),
            line=dict(color=series_color(first, xs_relaxed), dash=BLIND_DASH if key[2] else None),
            error_y=dict(type="data", symmetric=False,
                         array=np.array([r["q75"] for r in rows], dtype=float) - med,
                         arrayminus=med - np.array([r["q25"] for r in rows], dtype=float)),
            customdata=np.array([[r["leg"], r["n"], r["q25"], r["q75"]] for r in rows], dtype=object),
            hovertemplate="γ=%{x}<br>speedup %{y:.3f} (IQR %{customdata[2]:.3f}–%{customdata[3]:.3f})"
                          "<br>n=%{customdata[1]}<br>%{customdata[0]}<extra></extra>",
            meta={**_meta(first, "speedup"), "legs": [r["leg"] for r in rows]},
        ))
    fig.add_hline(y=1.0, line=dict(color=TIER_COLORS["vanilla"], dash="dash", width=1))
    # Highlight for a selected gamma (moved by the explorer's gamma slider).
    fig.add_trace(go.Scatter(x=[], y=[], mode="markers", name="selected γ", showlegend=False,
                             marker=dict(size=16, symbol="circle-open", color="black", line=dict(width=2)),
                             hoverinfo="skip", meta={"role": "selection"}))
    _layout(fig, "Speedup vs γ (median over prompts, IQR bars; bracketed by vanilla legs)", "γ (draft length)",
            "speedup vs vanilla")
    fig.update_xaxes(dtick=1)
    return fig


def speedup_distribution(per_prompt: pd.DataFrame, kind: str = "box") -> go.Figure:
    """Per-prompt speedup distribution, one box (or violin) per spec leg.

    ``per_prompt`` is ``metrics.prompt_speedups(...)``.
    """
    _one_of("kind", kind, ("box", "violin"))
    fig = go.Figure()
    xs_relaxed = _relaxed_xs(per_prompt)
    order = per_prompt.drop_duplicates("leg").sort_values("leg_index", kind="stable") if len(per_prompt) else per_prompt
    for _, first in order.iterrows():
        vals = per_prompt.loc[per_prompt["leg"] == first["leg"]]
        common = dict(y=vals["speedup"].to_numpy(float), name=str(first["leg"]),
                      text=vals["pid"].astype(str).to_numpy(), marker_color=series_color(first, xs_relaxed),
                      legendgroup=series_label(first), meta=_meta(first, "distribution"))
        if kind == "box" and len(vals) > BOX_MAX_POINTS:
            y = common.pop("y")
            common.pop("text")
            q1, med, q3 = np.quantile(y, [0.25, 0.5, 0.75])
            lo = y[y >= q1 - 1.5 * (q3 - q1)].min()
            hi = y[y <= q3 + 1.5 * (q3 - q1)].max()
            fig.add_trace(go.Box(x=[common["name"]], q1=[q1], median=[med], q3=[q3], lowerfence=[lo],
                                 upperfence=[hi], mean=[float(y.mean())], boxpoints=False, **common))
        elif kind == "box":
            fig.add_trace(go.Box(boxpoints="outliers", hovertemplate="%{text}: %{y:.3f}<extra></extra>", **common))
        else:
            fig.add_trace(go.Violin(box_visible=True, points="outliers", **common))
    fig.add_hline(y=1.0, line=dict(color=TIER_COLORS["vanilla"], dash="dash", width=1))
    _layout(fig, "Per-prompt speedup vs bracketing vanilla legs", "leg", "speedup")
    fig.update_layout(showlegend=False)
    return fig


# --------------------------------------------------------------------------- acceptance


def per_position_acceptance(per_pos: pd.DataFrame, predicted: pd.DataFrame | None = None) -> go.Figure:
    """Per-position acceptance (accepted at draft position i / drafts), grouped bars per leg.

    ``per_pos`` is ``metrics.per_position_acceptance(...)``; ``predicted``
    (optional, same columns ``leg, position, rate``) adds the counterfactual
    at some relax x as open markers.
    """
    fig = go.Figure()
    xs_relaxed = _relaxed_xs(per_pos)
    legs = per_pos.drop_duplicates("leg").sort_values("leg_index", kind="stable") if len(per_pos) else per_pos
    for _, first in legs.iterrows():
        d = per_pos[per_pos["leg"] == first["leg"]].sort_values("position")
        fig.add_trace(go.Bar(
            x=d["position"].to_numpy() + 1, y=d["rate"].to_numpy(float), name=str(first["leg"]),
            marker_color=series_color(first, xs_relaxed), meta=_meta(first, "measured"),
            hovertemplate="position %{x}: %{y:.3f}<extra>" + str(first["leg"]) + "</extra>",
        ))
    if predicted is not None:
        for leg, d in predicted.groupby("leg", sort=False):
            first = d.iloc[0]
            d = d.sort_values("position")
            fig.add_trace(go.Scatter(
                x=d["position"].to_numpy() + 1, y=d["rate"].to_numpy(float), mode="markers+lines",
                name=f"{leg} predicted", line=dict(dash="dot", color="black"),
                marker=dict(symbol="diamond-open", size=9, color="black"),
                meta=_meta(first, "predicted"),
            ))
    _layout(fig, "Per-position acceptance (accepted at position i / drafts)", "draft position", "acceptance")
    fig.update_layout(barmode="group")
    fig.update_xaxes(dtick=1)
    fig.update_yaxes(range=[0, 1.02])
    return fig


def acceptance_over_position(over: pd.DataFrame, metric: str = "acceptance_rate",
                             predicted: pd.DataFrame | None = None) -> go.Figure:
    """Acceptance vs output token position, one line per traced leg.

    ``over`` is ``metrics.acceptance_over_position(...)``; ``predicted``
    (optional, the same table predicted at some relax x) adds it as dotted lines.
    """
    _one_of("metric", metric, ACCEPTANCE_METRICS)
    fig = go.Figure()
    for leg, d in over.groupby("leg", sort=False):
        first = d.iloc[0]
        fig.add_trace(go.Scatter(
            x=d["bin_mid"].to_numpy(float), y=d[metric].to_numpy(float), mode="lines+markers", name=str(leg),
            customdata=d[["bin_left", "bin_right", "n_steps"]].to_numpy(float),
            hovertemplate="tokens %{customdata[0]:.0f}–%{customdata[1]:.0f}: %{y:.3f}"
                          "<br>%{customdata[2]:.0f} steps<extra>" + str(leg) + "</extra>",
            meta={"leg": leg, "role": "over_position"},
        ))
    if predicted is not None:
        for leg, d in predicted.groupby("leg", sort=False):
            fig.add_trace(go.Scatter(x=d["bin_mid"].to_numpy(float), y=d[metric].to_numpy(float), mode="lines",
                                     line=dict(dash="dot", color="black"), name=f"{leg} predicted at x",
                                     meta={"leg": leg, "role": "predicted"}))
    _layout(fig, "Acceptance over output position", "output token position",
            metric.replace("_", " "))
    return fig


def acceptance_vs_tau(measured: pd.DataFrame, curve: pd.DataFrame | None = None,
                      metric: str = "acceptance_length", marker_x: float | None = None) -> go.Figure:
    """Measured acceptance of strict/relaxed legs vs relax x, plus counterfactual curves from traces.

    ``measured`` is ``metrics.acceptance(...)``; ``curve`` is
    ``Prediction.aggregate`` (or ``TraceIndex.curve`` rows): one line per
    traced leg. ``marker_x`` places a marker on each curve (the slider).
    """
    _one_of("metric", metric, ACCEPTANCE_METRICS)
    fig = go.Figure()
    xs_relaxed = _relaxed_xs(measured)
    m = measured.copy()
    if len(m):
        m["_x"] = [(_num(x) or 0.0) for x in m["relax_logtau"]]
        for gamma, d in m.groupby(m["gamma"].map(_gamma), sort=True):
            fig.add_trace(go.Scatter(
                x=d["_x"].to_numpy(float), y=d[metric].to_numpy(float), mode="markers",
                name=f"measured γ={gamma}", text=d["leg"].astype(str).to_numpy(),
                marker=dict(size=11, color=[series_color(r, xs_relaxed) for _, r in d.iterrows()],
                            symbol=GAMMA_SYMBOLS[(gamma or 0) % len(GAMMA_SYMBOLS)],
                            line=dict(color="black", width=1)),
                hovertemplate="%{text}<br>x=%{x:.3f}: %{y:.3f}<extra></extra>",
                meta={"role": "measured_points", "gamma": gamma},
            ))
    if curve is not None and len(curve):
        xs_curve = _relaxed_xs(curve.assign(relax_logtau=curve["leg_relax_logtau"])) if "leg_relax_logtau" in curve.columns else []
        for leg, d in curve.groupby("leg", sort=False):
            d = d.sort_values("relax_logtau")
            first = d.iloc[0].to_dict()
            if "leg_relax_logtau" in first:
                first["relax_logtau"] = first["leg_relax_logtau"]
            g = _gamma(first.get("gamma"))
            fig.add_trace(go.Scatter(
                x=d["relax_logtau"].to_numpy(float), y=d[metric].to_numpy(float), mode="lines",
                name=f"predicted from {leg} trace" + (f" (γ={g})" if g is not None else ""),
                line=dict(color=series_color(first, xs_curve), dash=CURVE_DASH[(g or 0) % len(CURVE_DASH)]),
                customdata=np.exp(-d["relax_logtau"].to_numpy(float)),
                hovertemplate="x=%{x:.3f} (τ=%{customdata:.2f}): %{y:.3f}<extra>" + str(leg) + "</extra>",
                meta={"role": "counterfactual", "leg": leg, "gamma": g},
            ))
            x0, y0 = d["relax_logtau"].to_numpy(float), d[metric].to_numpy(float)
            if len(x0) > 1 and x0[0] == 0 and x0[1] <= 1e-3 and y0[1] > y0[0]:
                # The tie rule: strict (x = 0) takes only the target's argmax pick; any x > 0
                # also accepts drafts tied with it. The curve rises vertically there.
                fig.add_annotation(x=0, y=float(y0[1]), text=f"x = 0+: ties accepted (+{y0[1] - y0[0]:.3f})",
                                   showarrow=True, arrowhead=2, ax=60, ay=-20, font=dict(size=10),
                                   name=f"tie-jump:{leg}")
            if marker_x is not None:
                y = float(np.interp(marker_x, d["relax_logtau"].to_numpy(float), d[metric].to_numpy(float)))
                fig.add_trace(go.Scatter(
                    x=[marker_x], y=[y], mode="markers", name=f"x={marker_x:.3f}", showlegend=False,
                    marker=dict(symbol="x", size=12, color="black"), meta={"role": "marker", "leg": leg, "gamma": g},
                ))
    _layout(fig, "Acceptance vs relax x = ln(1/τ): measured legs and counterfactual from trace",
            "relax_logtau x (0 = strict)", metric.replace("_", " "))
    return fig


# --------------------------------------------------------------------------- exactness


def exactness_table(summary: pd.DataFrame) -> go.Figure:
    """Exact-match and first-divergence table (the ``exactness`` table of ``workbench.analyses``).

    Where the table carries the exactness rule's verdict (``classification``,
    ``rule_ok``), each strict leg shows it: green equal, yellow near-ties
    only (passes in bf16), red a divergence the rule does not excuse.
    """
    cols = ["leg", "ref_leg", "n", "n_exact", "match_rate", "median_first_divergence", "min_first_divergence",
            "mean_prefix_match_frac"]
    heads = ["leg", "vs", "prompts", "exact", "match rate", "median 1st div.", "min 1st div.", "prefix kept"]
    has_rule = "classification" in summary.columns
    if has_rule:
        cols, heads = cols + ["dtype", "classification"], heads + ["dtype", "exactness rule"]

    def fmt(c: str, v: Any) -> str:
        if c in ("match_rate", "mean_prefix_match_frac"):
            return f"{float(v):.3f}"
        if c in ("median_first_divergence", "min_first_divergence"):
            return "—" if _num(v) is None else f"{float(v):g}"
        return "—" if v is None or (isinstance(v, float) and np.isnan(v)) else str(v)

    values = [[fmt(c, v) for v in summary[c]] for c in cols]

    def colour(row) -> str:
        if row["match_rate"] == 1.0:
            return "#e8f5e9"
        ok = row.get("rule_ok") if has_rule else None
        return "#ffebee" if ok is False else "#fff3e0"

    fill = [[colour(r) for _, r in summary.iterrows()]] * len(cols)
    fig = go.Figure(go.Table(header=dict(values=heads, fill_color="#eeeeee", align="left"),
                             cells=dict(values=values, fill_color=fill, align="left"),
                             meta={"role": "exactness"}))
    fig.update_layout(title="Exactness vs vanilla (token ids)", template=TEMPLATE,
                      margin=dict(l=20, r=20, t=60, b=20))
    return fig


def token_class_bars(classes: pd.DataFrame) -> go.Figure:
    """Acceptance by token class (``metrics.token_class_acceptance(...)``), bars per leg."""
    fig = go.Figure()
    for cls, d in classes.groupby("token_class", sort=True):
        fig.add_trace(go.Bar(x=d["leg"].astype(str), y=d["rate"].to_numpy(float), name=str(cls),
                             customdata=d["evaluated"].to_numpy(),
                             hovertemplate="%{x}: %{y:.3f} of %{customdata} positions<extra>" + str(cls) + "</extra>",
                             meta={"role": "token_class", "token_class": cls}))
    _layout(fig, "Acceptance by output token class (proxy)", "leg", "acceptance (given reached)")
    fig.update_layout(barmode="group")
    return fig


def agreement_vs_acceptance(table: pd.DataFrame) -> go.Figure:
    """E7: teacher-forced top-1 agreement of the draft (x) vs realised acceptance rate (y), one point per prompt.

    ``table``: columns pid, agreement, acceptance_rate (and leg). The title
    carries Pearson's r over the prompts (undefined below 3 points or with no spread).
    """
    need = {"pid", "agreement", "acceptance_rate"}
    if not need <= set(table.columns):
        raise ValueError(f"agreement_vs_acceptance: missing columns {sorted(need - set(table.columns))}")
    df = table.dropna(subset=["agreement", "acceptance_rate"])
    x, y = df["agreement"].to_numpy(float), df["acceptance_rate"].to_numpy(float)
    r = float(np.corrcoef(x, y)[0, 1]) if len(df) >= 3 and x.std() > 0 and y.std() > 0 else None
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=y, mode="markers", name="prompt", text=df["pid"],
                             marker=dict(color=TIER_COLORS["strict"], size=9),
                             hovertemplate="%{text}<br>agreement %{x:.3f}<br>acceptance %{y:.3f}<extra></extra>",
                             meta={"role": "agreement", "tier": "strict"}))
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", name="y = x", line=dict(color="#bbbbbb", dash="dot"),
                             meta={"role": "diagonal"}))
    r_text = f"Pearson r = {r:.3f}" if r is not None else "Pearson r undefined (fewer than 3 prompts or no spread)"
    _layout(fig, f"Offline agreement vs realised acceptance ({r_text}, n = {len(df)})",
            "teacher-forced top-1 agreement with the target's output", "acceptance rate (strict leg)")
    fig.update_xaxes(range=[0, 1.02])
    fig.update_yaxes(range=[0, 1.02])
    return fig


# --------------------------------------------------------------------------- the cost ladder (E16)

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


def speedup_curves(curve: pd.DataFrame, ratios: pd.DataFrame | None = None) -> go.Figure:
    """Predicted S(α, γ, c) at each cell's measured c (``ladder.speedup_curve``), with the published operating points.

    One line per size, batch, gamma and drafter mode (graphs solid, eager dashed). At α = 1: S(1, γ, c)
    (open marker) and the measured forced-acceptance speedup, end to end (filled) and, where the rows time
    the first token apart, decode only (open with a dot: the one S(1, γ, c) models), from ``ratios``. The seed PR's
    point (1.28x at acceptance length 1.49) is placed per gamma at the α whose expected acceptance
    length is 1.49; QuantSpec's (≈2.5x at > 90 % acceptance) at α = 0.9 (``ladder.OPERATING_POINTS_NOTE``).
    Every trace's meta carries its gamma, so a γ slider can show one gamma at a time.
    """
    from . import ladder

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
            symbol = GAMMA_SYMBOLS[gammas.index(int(g)) % len(GAMMA_SYMBOLS)]
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
    if c_of:  # what the markers at alpha = 1 mean, once in the legend
        keys = [("at α=1, open: predicted S(1,γ,c)", "circle-open"),
                ("at α=1, filled: measured, forced acceptance", "circle")]
        if any(_num(getattr(r, "S_measured_decode_alpha1", None)) is not None for r in c_of.values()):
            keys.append(("at α=1, open with a dot: measured, decode only", "circle-open-dot"))
        for label, symbol in keys:
            fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=label,
                                     marker=dict(symbol=symbol, size=10, color="#555555"), meta={"role": "legend"}))
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
    fig.add_hline(y=1.0, line_dash="dot", line_color="#888888")
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


# --------------------------------------------------------------------------- serving legs (E17)


def _serving_series(df: pd.DataFrame) -> pd.Series:
    """The series of each serving leg: its tier (with gamma where the spec legs of the frame have several)."""
    spec = df["tier"] != "vanilla"
    several = df.loc[spec, "gamma"].map(_gamma).nunique() > 1
    return df.apply(lambda r: str(r["tier"]) + (f" γ={_gamma(r['gamma'])}" if several and r["tier"] != "vanilla"
                                                else ""), axis=1)


def _tier_order(series: pd.Series, tiers: pd.Series) -> list[str]:
    rank = {"vanilla": 0, "strict": 1, "relaxed": 2}
    pairs = dict(zip(series, tiers))
    return sorted(pairs, key=lambda s: (rank.get(pairs[s], 3), s))


def serving_summary(legs: pd.DataFrame, speedups: pd.DataFrame | None = None) -> go.Figure:
    """Serving legs (``serving.leg_table``) with their bracketed speedups (``serving.paired_speedups``), a table."""
    df = legs.sort_values("leg_index", kind="stable")
    if speedups is not None and len(speedups):
        df = df.merge(speedups[["leg", "tpot_speedup", "tpot_speedup_iqr", "throughput_ratio",
                                "throughput_ratio_iqr", "n_pairs"]], on="leg", how="left")
    cols = [("leg", "leg"), ("concurrency", "conc."), ("completed", "ok"), ("n", "n"),
            ("ttft_ms_median", "TTFT ms p50"), ("ttft_ms_p99", "TTFT p99"), ("tpot_ms_median", "TPOT ms p50"),
            ("tpot_ms_p99", "TPOT p99"), ("itl_ms_median", "ITL ms p50"), ("e2el_ms_median", "E2EL ms p50"),
            ("output_throughput", "out tok/s"), ("request_throughput", "req/s"),
            ("acceptance_rate", "acc. rate"), ("trace_acceptance_rate", "acc. rate (trace)")]
    if "tpot_speedup" in df.columns:
        cols += [("tpot_speedup", "TPOT speedup"), ("tpot_speedup_iqr", "IQR"),
                 ("throughput_ratio", "throughput ×"), ("throughput_ratio_iqr", "IQR"), ("n_pairs", "pairs")]

    def fmt(v: Any) -> str:
        if isinstance(v, str):
            return v
        f = _num(v)
        return "—" if f is None else (f"{f:.0f}" if float(f).is_integer() and abs(f) >= 1 else f"{f:.3g}")

    values = [[fmt(v) for v in df[c]] for c, _ in cols]
    fill = [[("#f5f5f5" if t == "vanilla" else "#ffffff") for t in df["tier"]]] * len(cols)
    fig = go.Figure(go.Table(header=dict(values=[h for _, h in cols], fill_color="#eeeeee", align="left"),
                             cells=dict(values=values, fill_color=fill, align="left"),
                             meta={"role": "serving_summary"}))
    fig.update_layout(title="Serving legs: latency percentiles, throughput, acceptance; speedup = median over the "
                            "bracketing vanilla legs of the same concurrency", template=TEMPLATE,
                      margin=dict(l=20, r=20, t=60, b=20))
    return fig


def serving_latency(requests: pd.DataFrame, kind: str = "box") -> go.Figure:
    """TPOT and TTFT of every successful request (``serving.request_table``), one box (or violin) per tier at
    each concurrency; the legs of one tier and concurrency pooled."""
    from plotly.subplots import make_subplots

    _one_of("kind", kind, ("box", "violin"))
    df = requests[requests["ok"].astype(bool)].copy()
    df["series"] = _serving_series(df) if len(df) else pd.Series(dtype=str)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=["TPOT (ms per output token after the first)", "TTFT (ms)"])
    for row, metric in ((1, "tpot_ms"), (2, "ttft_ms")):
        for series in _tier_order(df["series"], df["tier"]):
            d = df[(df["series"] == series) & df[metric].notna()].sort_values("concurrency", kind="stable")
            first = d.iloc[0] if len(d) else None
            if first is None:
                continue
            common = dict(x=d["concurrency"].astype(str).to_numpy(), y=d[metric].to_numpy(float), name=series,
                          legendgroup=series, showlegend=row == 1, marker_color=TIER_COLORS.get(first["tier"], "#2ca02c"),
                          offsetgroup=series, meta={"tier": first["tier"], "series": series, "role": metric,
                                                    "gamma": _gamma(first["gamma"])})
            if kind == "box":
                fig.add_trace(go.Box(boxpoints="outliers", **common), row=row, col=1)
            else:
                fig.add_trace(go.Violin(box_visible=True, points="outliers", **common), row=row, col=1)
    fig.update_layout(title="Serving latency per request: TPOT and TTFT by max concurrency and tier",
                      template=TEMPLATE, legend_title_text="", margin=dict(l=60, r=20, t=80, b=50),
                      boxmode="group", violinmode="group")
    fig.update_xaxes(title_text="max concurrency", type="category", row=2, col=1)
    fig.update_yaxes(title_text="ms", row=1, col=1)
    fig.update_yaxes(title_text="ms", row=2, col=1)
    return fig


def _per_concurrency(legs: pd.DataFrame, column: str, role: str) -> list[go.Scatter]:
    """One line per series: median over its legs at each concurrency, bars to the legs' min and max."""
    df = legs[legs[column].notna()].copy()
    if not len(df):
        return []
    df["series"] = _serving_series(df)
    traces = []
    for series in _tier_order(df["series"], df["tier"]):
        d = df[df["series"] == series]
        g = d.groupby("concurrency", sort=True)[column]
        med, lo, hi = g.median(), g.min(), g.max()
        names = d.groupby("concurrency", sort=True)["leg"].agg(lambda s: ", ".join(map(str, s)))
        tier = d["tier"].iloc[0]
        traces.append(go.Scatter(
            x=med.index.to_numpy(), y=med.to_numpy(float), mode="lines+markers", name=series,
            marker_color=TIER_COLORS.get(tier, "#2ca02c"), text=names.to_numpy(),
            error_y=dict(type="data", symmetric=False, array=(hi - med).to_numpy(float),
                         arrayminus=(med - lo).to_numpy(float)),
            hovertemplate="c=%{x}: %{y:.3g}<br>%{text}<extra></extra>",
            meta={"tier": tier, "series": series, "role": role, "gamma": _gamma(d["gamma"].iloc[0])}))
    return traces


def serving_throughput(legs: pd.DataFrame) -> go.Figure:
    """Output throughput (tokens/s, the client's) vs max concurrency per tier (``serving.leg_table``): median over
    the tier's legs at each concurrency, bars to their min and max."""
    fig = go.Figure(_per_concurrency(legs, "output_throughput", "throughput"))
    _layout(fig, "Serving output throughput vs max concurrency (median over legs, bars min–max)",
            "max concurrency", "output tokens/s")
    fig.update_xaxes(type="log" if legs["concurrency"].nunique() > 2 else "linear",
                     tickvals=sorted(legs["concurrency"].unique()))
    return fig


def serving_acceptance(legs: pd.DataFrame) -> go.Figure:
    """Acceptance rate vs max concurrency per spec tier (``serving.leg_table``): the server's counters (lines), the
    per-request trace sums (open markers)."""
    spec = legs[legs["tier"] != "vanilla"]
    fig = go.Figure(_per_concurrency(spec, "acceptance_rate", "server"))
    for t in _per_concurrency(spec, "trace_acceptance_rate", "trace"):
        t.update(mode="markers", marker_symbol="circle-open", marker_size=11, showlegend=True,
                 name=f"{t.name} (per-request sum)", error_y=None)
        fig.add_trace(t)
    _layout(fig, "Acceptance rate vs max concurrency (server counters; open: sum of per-request counters)",
            "max concurrency", "acceptance rate (accepted / draft tokens)")
    fig.update_xaxes(type="log" if legs["concurrency"].nunique() > 2 else "linear",
                     tickvals=sorted(legs["concurrency"].unique()))
    fig.update_yaxes(range=[0, 1.02])
    return fig
