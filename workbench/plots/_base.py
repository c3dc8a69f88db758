"""What every figure module shares: number parsing, trace meta, the layout, the house colours and marks."""

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

