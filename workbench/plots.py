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


def acceptance_over_position(over: pd.DataFrame, metric: str = "acceptance_rate") -> go.Figure:
    """Acceptance vs output token position, one line per traced leg.

    ``over`` is ``metrics.acceptance_over_position(...)``.
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
    """Exact-match and first-divergence table (``metrics.exactness_summary(...)``)."""
    cols = ["leg", "ref_leg", "n", "n_exact", "match_rate", "median_first_divergence", "min_first_divergence",
            "mean_prefix_match_frac"]
    heads = ["leg", "vs", "prompts", "exact", "match rate", "median 1st div.", "min 1st div.", "prefix kept"]

    def fmt(c: str, v: Any) -> str:
        if c in ("match_rate", "mean_prefix_match_frac"):
            return f"{float(v):.3f}"
        if c in ("median_first_divergence", "min_first_divergence"):
            return "—" if _num(v) is None else f"{float(v):g}"
        return str(v)

    values = [[fmt(c, v) for v in summary[c]] for c in cols]
    fill = [["#e8f5e9" if r == 1.0 else "#fff3e0" for r in summary["match_rate"]]] * len(cols)
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
