"""What every figure module shares: number parsing, trace meta, the layout, the house colours and marks."""

from __future__ import annotations

import math
from typing import Any

import plotly.graph_objects as go

# The tiers' colours (vanilla, and the first strict and relaxed series of legstyle.py).
TIER_COLORS = {"vanilla": "#7f7f7f", "strict": "#1f77b4", "relaxed": "#ff7f0e"}
# Measured points of one gamma share a symbol.
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

