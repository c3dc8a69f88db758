"""Explorer views: what a slider move computes (``View.figure`` / ``View.update``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from .. import metrics, plots
from .base import NotApplicable
from .runtables import RunTables


def _rows(t: RunTables, name: str) -> pd.DataFrame:
    df = t[name]
    if df is None or len(df) == 0:
        raise NotApplicable(f"no rows in table {name!r}")
    return df


def _traced(t: RunTables) -> metrics.TraceIndex:
    t.need(t.trace is not None, "acceptance trace (trace knob off)")
    return t.trace


def _speedup_selection(t: RunTables, gamma: int | None, x: float) -> list[dict[str, Any]]:
    """The speedup figure's selection marker on the legs of the slider's gamma."""
    sp = t["speedup"]
    sel = sp[sp["gamma"].map(plots._gamma) == gamma]
    return [{"meta": {"role": "selection"}, "x": [gamma] * len(sel), "y": sel["speedup"].to_numpy(float)}]


def _predicted_per_position(t: RunTables, x: float) -> pd.DataFrame | None:
    """Per traced leg and draft position: acceptance predicted at relax x (None: no trace)."""
    if t.trace is None:
        return None
    rows = []
    for leg in t.trace.legs:
        rate = t.trace.per_position_at(leg, x)
        meta = t.trace.prompts[t.trace.prompts["leg"] == leg].iloc[0]
        rows.append(pd.DataFrame({"leg": leg, "tier": meta["tier"], "gamma": meta["gamma"],
                                  "relax_logtau": meta.get("relax_logtau"),
                                  "position": np.arange(rate.size), "rate": rate}))
    return pd.concat(rows, ignore_index=True)


def _per_position_view(t: RunTables, gamma: int | None, x: float):
    return plots.per_position_acceptance(_rows(t, "per_position_acceptance"), _predicted_per_position(t, x),
                                         styles=t.leg_styles)


def _per_position_predicted(t: RunTables, gamma: int | None, x: float) -> list[dict[str, Any]]:
    trace = _traced(t)
    return [{"meta": {"role": "predicted", "leg": leg}, "y": trace.per_position_at(leg, x)} for leg in trace.legs]


def _tau_markers(t: RunTables, gamma: int | None, x: float) -> list[dict[str, Any]]:
    """The slider's marker on each counterfactual curve, at the trace's prediction for x."""
    trace = _traced(t)
    return [{"meta": {"role": "marker", "leg": leg}, "x": [x],
             "y": [float(trace.curve(leg, [x])["acceptance_length"].iloc[0])]} for leg in trace.legs]


def _over_position_view(t: RunTables, gamma: int | None, x: float):
    over = _rows(t, "acceptance_over_position")
    return plots.acceptance_over_position(over, predicted=_traced(t).over_position(t.bins, relax_logtau=x),
                                          styles=t.leg_styles)


def _over_position_predicted(t: RunTables, gamma: int | None, x: float) -> list[dict[str, Any]]:
    pred = _traced(t).over_position(t.bins, relax_logtau=x)
    return [{"meta": {"role": "predicted", "leg": leg}, "y": d["acceptance_rate"].to_numpy(float)}
            for leg, d in pred.groupby("leg", sort=False)]
