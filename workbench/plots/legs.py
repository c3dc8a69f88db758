"""Figures of a run of prompt legs: speedup, acceptance (per position, over output position, vs τ), exactness."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ._base import (ACCEPTANCE_METRICS, BOX_MAX_POINTS, GAMMA_SYMBOLS, TEMPLATE, TIER_COLORS, _gamma, _layout, _meta,
                    _num, _one_of)
from .legstyle import PREDICTED_DASH, LegStyle, LegStyles, styles_for


# --------------------------------------------------------------------------- speedup


def speedup_vs_gamma(speedup: pd.DataFrame, styles: Mapping[str, LegStyle] | None = None) -> go.Figure:
    """Median bracketed speedup vs gamma, one line per series (drafter, tier, x, blind-MM), IQR as error bars.

    ``speedup`` is ``metrics.bracketed_speedup(...)``; ``styles`` (``LegStyles``, default: styled from
    ``speedup``) name and colour the legs: a line in its series' hue, each gamma's marker in its leg's shade.
    """
    fig = go.Figure()
    df = speedup[speedup["gamma"].map(_num).notna()] if len(speedup) else speedup
    st = styles_for(df, styles)
    groups: dict[str, list] = {}
    for _, row in df.iterrows():
        groups.setdefault(st.of(row["leg"], row).series, []).append(row)
    for label, rows in groups.items():
        rows = sorted(rows, key=lambda r: _num(r["gamma"]))
        first, last = rows[0], st.of(rows[-1]["leg"], rows[-1])
        med = np.array([r["speedup"] for r in rows], dtype=float)
        fig.add_trace(go.Scatter(
            x=[_gamma(r["gamma"]) for r in rows], y=med, mode="lines+markers", name=label,
            line=dict(color=last.color, dash=last.dash),
            marker=dict(size=9, color=[st.of(r["leg"], r).color for r in rows], line=dict(color=last.color, width=1)),
            error_y=dict(type="data", symmetric=False, color=last.color,
                         array=np.array([r["q75"] for r in rows], dtype=float) - med,
                         arrayminus=med - np.array([r["q25"] for r in rows], dtype=float)),
            customdata=np.array([[r["leg"], r["n"], r["q25"], r["q75"]] for r in rows], dtype=object),
            hovertemplate="γ=%{x}<br>speedup %{y:.3f} (IQR %{customdata[2]:.3f}–%{customdata[3]:.3f})"
                          "<br>n=%{customdata[1]}<br>%{customdata[0]}<extra>" + label + "</extra>",
            meta={**_meta(first, "speedup"), "legs": [r["leg"] for r in rows], "series": label},
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


def speedup_distribution(per_prompt: pd.DataFrame, kind: str = "box",
                         styles: Mapping[str, LegStyle] | None = None) -> go.Figure:
    """Per-prompt speedup distribution, one box (or violin) per spec leg, named and coloured by ``styles``.

    ``per_prompt`` is ``metrics.prompt_speedups(...)``.
    """
    _one_of("kind", kind, ("box", "violin"))
    fig = go.Figure()
    st = styles_for(per_prompt, styles)
    order = per_prompt.drop_duplicates("leg").sort_values("leg_index", kind="stable") if len(per_prompt) else per_prompt
    for _, first in order.iterrows():
        vals = per_prompt.loc[per_prompt["leg"] == first["leg"]]
        s = st.of(first["leg"], first)
        common = dict(y=vals["speedup"].to_numpy(float), name=s.label,
                      text=vals["pid"].astype(str).to_numpy(), marker_color=s.color, line_color=s.color,
                      legendgroup=s.series, meta=_meta(first, "distribution"))
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


def per_position_acceptance(per_pos: pd.DataFrame, predicted: pd.DataFrame | None = None,
                            styles: Mapping[str, LegStyle] | None = None) -> go.Figure:
    """Per-position acceptance (accepted at draft position i / drafts), grouped bars per leg.

    ``per_pos`` is ``metrics.per_position_acceptance(...)``; ``predicted``
    (optional, same columns ``leg, position, rate``) adds the counterfactual
    at some relax x, dotted in its leg's colour.
    """
    fig = go.Figure()
    st = styles_for(pd.concat([per_pos, predicted]) if predicted is not None else per_pos, styles)
    legs = per_pos.drop_duplicates("leg").sort_values("leg_index", kind="stable") if len(per_pos) else per_pos
    for _, first in legs.iterrows():
        d = per_pos[per_pos["leg"] == first["leg"]].sort_values("position")
        s = st.of(first["leg"], first)
        fig.add_trace(go.Bar(
            x=d["position"].to_numpy() + 1, y=d["rate"].to_numpy(float), name=s.label, legendgroup=s.label,
            marker_color=s.color, meta=_meta(first, "measured"),
            hovertemplate="position %{x}: %{y:.3f}<extra>" + s.label + "</extra>",
        ))
    if predicted is not None:
        for leg, d in predicted.groupby("leg", sort=False):
            first = d.iloc[0]
            s = st.of(leg, first)
            d = d.sort_values("position")
            fig.add_trace(go.Scatter(
                x=d["position"].to_numpy() + 1, y=d["rate"].to_numpy(float), mode="markers+lines",
                name=f"{s.label}, predicted", legendgroup=s.label, line=dict(dash=PREDICTED_DASH, color=s.color),
                marker=dict(symbol="diamond-open", size=9, color=s.color),
                meta=_meta(first, "predicted"),
            ))
    _layout(fig, "Per-position acceptance (accepted at position i / drafts; dotted: predicted at x)",
            "draft position", "acceptance")
    fig.update_layout(barmode="group")
    fig.update_xaxes(dtick=1)
    fig.update_yaxes(range=[0, 1.02])
    return fig


def acceptance_over_position(over: pd.DataFrame, metric: str = "acceptance_rate",
                             predicted: pd.DataFrame | None = None,
                             styles: Mapping[str, LegStyle] | None = None) -> go.Figure:
    """Acceptance vs output token position, one line per traced leg.

    ``over`` is ``metrics.acceptance_over_position(...)``; ``predicted``
    (optional, the same table predicted at some relax x) adds it dotted in each leg's colour.
    """
    _one_of("metric", metric, ACCEPTANCE_METRICS)
    fig = go.Figure()
    st = styles_for(over, styles)
    for leg, d in over.groupby("leg", sort=False):
        s = st.of(leg, d.iloc[0])
        fig.add_trace(go.Scatter(
            x=d["bin_mid"].to_numpy(float), y=d[metric].to_numpy(float), mode="lines+markers", name=s.label,
            legendgroup=s.label, line=dict(color=s.color, dash=s.dash), marker=dict(color=s.color),
            customdata=d[["bin_left", "bin_right", "n_steps"]].to_numpy(float),
            hovertemplate="tokens %{customdata[0]:.0f}–%{customdata[1]:.0f}: %{y:.3f}"
                          "<br>%{customdata[2]:.0f} steps<extra>" + s.label + "</extra>",
            meta={"leg": leg, "role": "over_position", **({"gamma": s.gamma} if s.gamma is not None else {})},
        ))
    if predicted is not None:
        for leg, d in predicted.groupby("leg", sort=False):
            s = st.of(leg, d.iloc[0])
            fig.add_trace(go.Scatter(x=d["bin_mid"].to_numpy(float), y=d[metric].to_numpy(float), mode="lines",
                                     line=dict(dash=PREDICTED_DASH, color=s.color), name=f"{s.label}, predicted at x",
                                     legendgroup=s.label, meta={"leg": leg, "role": "predicted",
                                                                **({"gamma": s.gamma} if s.gamma is not None else {})}))
    _layout(fig, "Acceptance over output position (dotted: predicted at x)", "output token position",
            metric.replace("_", " "))
    return fig


def acceptance_vs_tau(measured: pd.DataFrame, curve: pd.DataFrame | None = None,
                      metric: str = "acceptance_length", marker_x: float | None = None,
                      styles: Mapping[str, LegStyle] | None = None) -> go.Figure:
    """Measured acceptance of strict/relaxed legs vs relax x, plus counterfactual curves from traces.

    ``measured`` is ``metrics.acceptance(...)``; ``curve`` is
    ``Prediction.aggregate`` (or ``TraceIndex.curve`` rows): one dotted line per
    traced leg, in the leg's colour. ``marker_x`` places a marker on each curve (the slider).
    """
    _one_of("metric", metric, ACCEPTANCE_METRICS)
    fig = go.Figure()
    legs = measured
    if curve is not None and len(curve):
        legs = pd.concat([measured, curve.assign(relax_logtau=curve.get("leg_relax_logtau", curve["relax_logtau"]))])
    st = styles_for(legs, styles)
    for _, r in measured.iterrows():
        s, g = st.of(r["leg"], r), _gamma(r["gamma"])
        fig.add_trace(go.Scatter(
            x=[_num(r["relax_logtau"]) or 0.0], y=[float(r[metric])], mode="markers", name=f"{s.label}, measured",
            legendgroup=s.label, text=[str(r["leg"])],
            marker=dict(size=11, color=s.color, symbol=GAMMA_SYMBOLS[(g or 0) % len(GAMMA_SYMBOLS)],
                        line=dict(color="black", width=1)),
            hovertemplate="%{text}<br>x=%{x:.3f}: %{y:.3f}<extra>" + s.label + "</extra>",
            meta={"role": "measured_points", "gamma": g, "leg": r["leg"]},
        ))
    if curve is not None and len(curve):
        for leg, d in curve.groupby("leg", sort=False):
            _tau_curve(fig, d.sort_values("relax_logtau"), leg, st, metric, marker_x)
    _layout(fig, "Acceptance vs relax x = ln(1/τ): measured legs (markers), predicted from a leg's trace (dotted)",
            "relax_logtau x (0 = strict)", metric.replace("_", " "))
    return fig


def _tau_curve(fig: go.Figure, d: pd.DataFrame, leg: str, st: LegStyles, metric: str,
               marker_x: float | None) -> None:
    """One traced leg's counterfactual curve, its tie-jump note and the slider's marker on it."""
    first = d.iloc[0].to_dict()
    if "leg_relax_logtau" in first:
        first["relax_logtau"] = first["leg_relax_logtau"]
    s = st.of(leg, first)
    g = _gamma(first.get("gamma"))
    fig.add_trace(go.Scatter(
        x=d["relax_logtau"].to_numpy(float), y=d[metric].to_numpy(float), mode="lines",
        name=f"{s.label}, predicted from its trace", legendgroup=s.label,
        line=dict(color=s.color, dash=PREDICTED_DASH, width=2.5),
        customdata=np.exp(-d["relax_logtau"].to_numpy(float)),
        hovertemplate="x=%{x:.3f} (τ=%{customdata:.2f}): %{y:.3f}<extra>" + s.label + "</extra>",
        meta={"role": "counterfactual", "leg": leg, "gamma": g},
    ))
    x0, y0 = d["relax_logtau"].to_numpy(float), d[metric].to_numpy(float)
    if len(x0) > 1 and x0[0] == 0 and x0[1] <= 1e-3 and y0[1] > y0[0]:
        # The tie rule: strict (x = 0) takes only the target's argmax pick; any x > 0
        # also accepts drafts tied with it. The curve rises vertically there.
        fig.add_annotation(x=0, y=float(y0[1]), text=f"x = 0+: ties accepted (+{y0[1] - y0[0]:.3f})",
                           showarrow=True, arrowhead=2, ax=60, ay=-20, font=dict(size=10, color=s.color),
                           name=f"tie-jump:{leg}")
    if marker_x is not None:
        y = float(np.interp(marker_x, x0, y0))
        fig.add_trace(go.Scatter(
            x=[marker_x], y=[y], mode="markers", name=f"x={marker_x:.3f}", showlegend=False, legendgroup=s.label,
            marker=dict(symbol="x", size=12, color=s.color, line=dict(color="black", width=1)),
            meta={"role": "marker", "leg": leg, "gamma": g},
        ))


# --------------------------------------------------------------------------- exactness


def exactness_table(summary: pd.DataFrame, styles: Mapping[str, LegStyle] | None = None) -> go.Figure:
    """Exact-match and first-divergence table (the ``exactness`` table of ``workbench.analyses``).

    Where the table carries the exactness rule's verdict (``classification``,
    ``rule_ok``), each strict leg shows it: green equal, yellow near-ties
    only (passes in bf16), red a divergence the rule does not excuse. Each leg's name is in its colour.
    """
    st = styles_for(summary, styles)
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
                             cells=dict(values=values, fill_color=fill, align="left",
                                        font=dict(color=[[st.of(l, r).color for l, r in zip(
                                            summary["leg"], summary.to_dict("records"))]] + ["#222222"] * (len(cols) - 1))),
                             meta={"role": "exactness"}))
    fig.update_layout(title="Exactness vs vanilla (token ids)", template=TEMPLATE,
                      margin=dict(l=20, r=20, t=60, b=20))
    return fig


def token_class_bars(classes: pd.DataFrame, styles: Mapping[str, LegStyle] | None = None) -> go.Figure:
    """Acceptance by token class (``metrics.token_class_acceptance(...)``), bars per leg (named by ``styles``)."""
    fig = go.Figure()
    st = styles_for(classes, styles)
    for cls, d in classes.groupby("token_class", sort=True):
        names = [st.of(leg, r).label for leg, r in zip(d["leg"], d.to_dict("records"))]
        fig.add_trace(go.Bar(x=names, y=d["rate"].to_numpy(float), name=str(cls),
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

