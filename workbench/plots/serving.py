"""Figures of a run of serving legs (E17): the legs table, latency boxes, throughput and acceptance vs concurrency."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from ._base import TEMPLATE, TIER_COLORS, _gamma, _layout, _num, _one_of
from .legstyle import LegStyle, styles_for


# --------------------------------------------------------------------------- serving legs (E17)


def _serving_series(df: pd.DataFrame, styles: Mapping[str, LegStyle] | None = None) -> pd.Series:
    """The series of each serving leg: its label (``LegStyles``: drafter, tier, x, gamma where the spec legs
    have several); vanilla legs are one series, "vanilla"."""
    st = styles_for(df, styles)
    return df.apply(lambda r: "vanilla" if r["tier"] == "vanilla" else st.of(r["leg"], r).label, axis=1)


def _series_colors(df: pd.DataFrame, styles: Mapping[str, LegStyle] | None) -> dict[str, str]:
    st = styles_for(df, styles)
    return {label: (TIER_COLORS["vanilla"] if r["tier"] == "vanilla" else st.of(r["leg"], r).color)
            for label, (_, r) in zip(df["series"], df.iterrows())}


def _tier_order(series: pd.Series, tiers: pd.Series) -> list[str]:
    rank = {"vanilla": 0, "strict": 1, "relaxed": 2}
    pairs = dict(zip(series, tiers))
    first = {s: i for i, s in reversed(list(enumerate(series)))}
    return sorted(pairs, key=lambda s: (rank.get(pairs[s], 3), first[s]))


def _int(v: Any) -> str:
    f = _num(v)
    return "—" if f is None else f"{f:.0f}"


def _share(v: Any) -> str:
    f = _num(v)
    return "—" if f is None else f"{f:.2g}"


def _interval(lo: Any, hi: Any) -> str:
    a, b = _num(lo), _num(hi)
    return "—" if a is None or b is None else f"{a:.3f}–{b:.3f}"


def serving_summary(legs: pd.DataFrame, speedups: pd.DataFrame | None = None) -> go.Figure:
    """Serving legs (``serving.leg_table``) with their bracketed speedups (``serving.paired_speedups``), a table."""
    df = legs.sort_values("leg_index", kind="stable")
    if speedups is not None and len(speedups):
        # one row per leg and concurrency: a server swept over concurrencies is one leg with a row per cell
        keep = ["leg", "concurrency", "tpot_speedup", "tpot_speedup_iqr", "throughput_ratio", "throughput_ratio_iqr",
                "n_pairs"] + [c for c in ("tpot_speedup_ci_lo", "tpot_speedup_ci_hi") if c in speedups.columns]
        df = df.merge(speedups[keep], on=["leg", "concurrency"], how="left")
        if "tpot_speedup_ci_lo" in df.columns:
            # how far the cell's own requests move the ratio (at a synthetic α each request draws its acceptance)
            df = df.assign(tpot_ci=[_interval(lo, hi) for lo, hi in zip(df["tpot_speedup_ci_lo"],
                                                                       df["tpot_speedup_ci_hi"])])
    df = df.assign(ok_n=[f"{_int(c)}/{_int(n)}" for c, n in zip(df["completed"], df["n"])])
    cols = [("leg", "leg"), ("concurrency", "conc."), ("ok_n", "ok/n"),
            ("ttft_ms_median", "TTFT ms p50"), ("ttft_ms_p99", "TTFT p99"), ("tpot_ms_median", "TPOT ms p50"),
            ("tpot_ms_p99", "TPOT p99"), ("itl_ms_median", "ITL ms p50"), ("e2el_ms_median", "E2EL ms p50"),
            ("output_throughput", "out tok/s"), ("acceptance_rate", "acc. rate"),
            ("trace_acceptance_rate", "acc. rate (trace)")]
    # what the cells sent, and what vLLM's caches served of it (fresh requests: nothing; repeated: cached prompts)
    if "serve_requests" in df.columns:
        df = df.assign(cached=[f"{_share(p)} / {_share(m)}" for p, m in zip(df["prefix_cache_hit_rate"],
                                                                           df["mm_cache_hit_rate"])])
        cols += [("serve_requests", "sent"), ("cached", "cached: prefix / image")]
    if "tpot_speedup" in df.columns:
        cols += [("tpot_speedup", "TPOT ×"), ("tpot_speedup_iqr", "IQR")]
        cols += [("tpot_ci", "95 % (requests)")] if "tpot_ci" in df.columns else []
        cols += [("throughput_ratio", "thr. ×"), ("throughput_ratio_iqr", "IQR"), ("n_pairs", "pairs")]

    def fmt(v: Any, name: str) -> str:
        if isinstance(v, str):
            return v
        f = _num(v)
        if f is None:
            return "—"
        if name.endswith("_iqr"):
            return f"{f:.3f}"
        return f"{f:.0f}" if abs(f) >= 100 or (float(f).is_integer() and abs(f) >= 1) else f"{f:.3g}"

    values = [[fmt(v, c) for v in df[c]] for c, _ in cols]
    fill = [[("#f5f5f5" if t == "vanilla" else "#ffffff") for t in df["tier"]]] * len(cols)
    fig = go.Figure(go.Table(columnwidth=[3.2] + [1.3 if c in ("cached", "tpot_ci") else 1 for c, _ in cols[1:]],
                             header=dict(values=[h for _, h in cols], fill_color="#eeeeee", align="left"),
                             cells=dict(values=values, fill_color=fill, align="left"),
                             meta={"role": "serving_summary"}))
    fig.update_layout(title="Serving legs per concurrency; speedup: median of the pairs with the bracketing vanilla "
                            "legs", template=TEMPLATE,
                      margin=dict(l=20, r=20, t=60, b=20))
    return fig


def serving_latency(requests: pd.DataFrame, kind: str = "box",
                    styles: Mapping[str, LegStyle] | None = None) -> go.Figure:
    """TPOT and TTFT of every successful request (``serving.request_table``), one box (or violin) per tier at
    each concurrency; the legs of one tier and concurrency pooled."""
    from plotly.subplots import make_subplots

    _one_of("kind", kind, ("box", "violin"))
    df = requests[requests["ok"].astype(bool)].copy()
    df["series"] = _serving_series(df, styles) if len(df) else pd.Series(dtype=str)
    colors = _series_colors(df, styles) if len(df) else {}
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=["TPOT (ms per output token after the first)", "TTFT (ms)"])
    for row, metric in ((1, "tpot_ms"), (2, "ttft_ms")):
        for series in _tier_order(df["series"], df["tier"]):
            d = df[(df["series"] == series) & df[metric].notna()].sort_values("concurrency", kind="stable")
            first = d.iloc[0] if len(d) else None
            if first is None:
                continue
            common = dict(x=d["concurrency"].astype(str).to_numpy(), y=d[metric].to_numpy(float), name=series,
                          legendgroup=series, showlegend=row == 1, marker_color=colors[series],
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


def _per_concurrency(legs: pd.DataFrame, column: str, role: str,
                     styles: Mapping[str, LegStyle] | None = None) -> list[go.Scatter]:
    """One line per series: median over its legs at each concurrency, bars to the legs' min and max."""
    df = legs[legs[column].notna()].copy()
    if not len(df):
        return []
    df["series"] = _serving_series(df, styles)
    colors = _series_colors(df, styles)
    traces = []
    for series in _tier_order(df["series"], df["tier"]):
        d = df[df["series"] == series]
        g = d.groupby("concurrency", sort=True)[column]
        med, lo, hi = g.median(), g.min(), g.max()
        names = d.groupby("concurrency", sort=True)["leg"].agg(lambda s: ", ".join(map(str, s)))
        tier = d["tier"].iloc[0]
        traces.append(go.Scatter(
            x=med.index.to_numpy(), y=med.to_numpy(float), mode="lines+markers", name=series,
            marker_color=colors[series], line_color=colors[series], text=names.to_numpy(),
            error_y=dict(type="data", symmetric=False, array=(hi - med).to_numpy(float),
                         arrayminus=(med - lo).to_numpy(float)),
            hovertemplate="c=%{x}: %{y:.3g}<br>%{text}<extra></extra>",
            meta={"tier": tier, "series": series, "role": role, "gamma": _gamma(d["gamma"].iloc[0])}))
    return traces


def serving_throughput(legs: pd.DataFrame, styles: Mapping[str, LegStyle] | None = None) -> go.Figure:
    """Output throughput (tokens/s, the client's) vs max concurrency per tier (``serving.leg_table``): median over
    the tier's legs at each concurrency, bars to their min and max."""
    fig = go.Figure(_per_concurrency(legs, "output_throughput", "throughput", styles))
    _layout(fig, "Serving output throughput vs max concurrency (median over legs, bars min–max)",
            "max concurrency", "output tokens/s")
    fig.update_xaxes(type="log" if legs["concurrency"].nunique() > 2 else "linear",
                     tickvals=sorted(legs["concurrency"].unique()))
    return fig


def serving_acceptance(legs: pd.DataFrame, styles: Mapping[str, LegStyle] | None = None) -> go.Figure:
    """Acceptance rate vs max concurrency per spec tier (``serving.leg_table``): the server's counters (lines), the
    per-request trace sums (open markers)."""
    spec = legs[legs["tier"] != "vanilla"]
    fig = go.Figure(_per_concurrency(spec, "acceptance_rate", "server", styles))
    for t in _per_concurrency(spec, "trace_acceptance_rate", "trace", styles):
        t.update(mode="markers", marker_symbol="circle-open", marker_size=11, showlegend=True,
                 name=f"{t.name} (per-request sum)", error_y=None)
        fig.add_trace(t)
    _layout(fig, "Acceptance rate vs max concurrency (server counters; open: sum of per-request counters)",
            "max concurrency", "acceptance rate (accepted / draft tokens)")
    fig.update_xaxes(type="log" if legs["concurrency"].nunique() > 2 else "linear",
                     tickvals=sorted(legs["concurrency"].unique()))
    fig.update_yaxes(range=[0, 1.02])
    return fig


def _interval_bars(d: pd.DataFrame, value: str) -> dict | None:
    """Error bars from ``<value>_ci_lo`` / ``_hi`` (the request interval) where the table has them."""
    lo, hi = f"{value}_ci_lo", f"{value}_ci_hi"
    if lo not in d.columns or d[lo].isna().all():
        return None
    y = d[value].astype(float)
    return dict(type="data", symmetric=False, array=(d[hi].astype(float) - y).clip(lower=0).to_numpy(),
                arrayminus=(y - d[lo].astype(float)).clip(lower=0).to_numpy())


def serving_speedup(speedups: pd.DataFrame) -> go.Figure:
    """The headline of a serving run (``serving.paired_speedups``), per spec leg against max concurrency: left,
    the TPOT speedup (vanilla / spec TPOT, median of the bracket's pairs), bars to its 95 % interval over the
    cell's requests, open diamonds the cost model's S at the acceptance the cell drew (``S_realised``, else
    ``S_predicted``); right, the TTFT ratio (spec / vanilla) with its interval. The dashed line is vanilla. A
    synthetic leg's name carries its acceptance ("synthetic α"): a cost measurement, not a user's speedup."""
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("TPOT × vanilla (above 1: faster)", "TTFT, spec / vanilla (below 1: sooner)"))
    palette = qualitative.Plotly
    order = speedups.sort_values(["leg_index", "concurrency"], kind="stable")
    for i, (leg, d) in enumerate(order.groupby("leg", sort=False)):
        color, acc = palette[i % len(palette)], str(d["acceptance"].iloc[0] or "")
        name = f"{leg}, {acc}" if acc and acc != "nan" else str(leg)
        x = d["concurrency"].to_numpy()
        meta = {"leg": leg, "tier": d["tier"].iloc[0], "gamma": _gamma(d["gamma"].iloc[0])}
        fig.add_trace(go.Scatter(x=x, y=d["tpot_speedup"].to_numpy(float), mode="lines+markers", name=name,
                                 legendgroup=str(leg), line_color=color, marker_color=color,
                                 error_y=_interval_bars(d, "tpot_speedup"),
                                 hovertemplate="c=%{x}: %{y:.3f}×<extra>" + str(leg) + "</extra>",
                                 meta={**meta, "role": "tpot_speedup"}), row=1, col=1)
        model = d["S_realised"] if "S_realised" in d.columns else pd.Series(index=d.index, dtype=float)
        model = model.where(model.notna(), d.get("S_predicted"))
        if model.notna().any():
            fig.add_trace(go.Scatter(x=x, y=model.to_numpy(float), mode="markers", name=f"{leg}: S from c",
                                     legendgroup=str(leg), marker=dict(symbol="diamond-open", size=11, color=color),
                                     hovertemplate="c=%{x}: S %{y:.3f}<extra>" + str(leg) + "</extra>",
                                     meta={**meta, "role": "predicted"}), row=1, col=1)
        fig.add_trace(go.Scatter(x=x, y=d["ttft_ratio"].to_numpy(float), mode="lines+markers", name=name,
                                 legendgroup=str(leg), showlegend=False, line_color=color, marker_color=color,
                                 error_y=_interval_bars(d, "ttft_ratio"),
                                 meta={**meta, "role": "ttft_ratio"}), row=1, col=2)
    for col in (1, 2):
        fig.add_hline(y=1.0, line_dash="dash", line_color=TIER_COLORS["vanilla"], row=1, col=col)
        fig.update_xaxes(title_text="max concurrency", row=1, col=col,
                         type="log" if speedups["concurrency"].nunique() > 2 else "linear",
                         tickvals=sorted(speedups["concurrency"].unique()))
    fig.update_layout(title="Serving speedup vs max concurrency (bars: 95 % interval over the cell's requests; "
                            "◇: S from the cost table at the acceptance drawn)", template=TEMPLATE,
                      legend_title_text="", margin=dict(l=60, r=20, t=80, b=50))
    return fig
