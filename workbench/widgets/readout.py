"""The explorer's readout: a compact table of every spec leg at the sliders' values, or the cost ladder's line."""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from .. import plots


def _fmt(v: Any, spec: str = ".2f") -> str:
    f = plots._num(v)
    return "–" if f is None else format(f, spec)


def _ladder_readout_html(ratios: pd.DataFrame | None, gamma: int | None) -> str:
    """One line per batch at ``gamma``: c with drafter graphs on / off, S(1,γ,c), measured S at α = 1
    (end to end, and decode only where the rows time the first token apart)."""
    if ratios is None or not len(ratios) or gamma is None:
        return "cost ladder: no complete spec leg yet"
    sel = ratios[ratios["gamma"].astype(int) == gamma]
    parts = []
    for (size, batch), d in sel.groupby(["size", "batch"], sort=True):
        on = d[d["draft_graphs"].astype(bool)]
        off = d[~d["draft_graphs"].astype(bool)]
        get = lambda part, col: part[col].iloc[0] if len(part) and col in part else None  # noqa: E731
        decode = plots._num(get(on, "S_measured_decode_alpha1"))  # rows that time the first token apart
        parts.append(f"{html.escape(str(size))} b={int(batch)}: c = <b>{_fmt(get(on, 'c'))}</b> graphs / "
                     f"{_fmt(get(off, 'c'))} eager, S(1,γ,c) = {_fmt(get(on, 'S_pred_alpha1'))}, "
                     f"measured at α=1 {_fmt(get(on, 'S_measured_alpha1'))}"
                     + (f" (decode only {_fmt(decode)})" if decode is not None else ""))
    return f"γ = {gamma}: " + "; ".join(parts)


def legs_readout_table(tables: Any, styles: plots.LegStyles) -> pd.DataFrame:
    """Per spec leg of the run, once per run: its label, colour, gamma, measured acceptance and speedup."""
    acc = tables.get("acceptance")
    if acc is None or not len(acc):
        return pd.DataFrame(columns=["leg", "label", "color", "gamma", "acceptance_length", "acceptance_rate",
                                     "speedup"])
    out = acc[["leg", "gamma", "acceptance_length", "acceptance_rate"]].copy()
    sp = tables.get("speedup")
    speed = dict(zip(sp["leg"], sp["speedup"])) if sp is not None and len(sp) else {}
    out["speedup"] = out["leg"].map(speed)
    out["gamma"] = out["gamma"].map(plots._gamma)
    out["label"] = [styles.of(leg, r).label for leg, r in zip(out["leg"], acc.to_dict("records"))]
    out["color"] = [styles.of(leg, r).color for leg, r in zip(out["leg"], acc.to_dict("records"))]
    return out.reset_index(drop=True)


def legs_readout_html(table: pd.DataFrame, predicted: dict[str, tuple[float, float]], x: float,
                      gamma: int | None) -> str:
    """Every spec leg in one compact table: measured acceptance length and rate, speedup, and the acceptance
    its own trace predicts at relax x. Legs of another gamma than the slider's are greyed."""
    import math

    tau = math.exp(-x)
    head = (f"<div class='wb-readout-head'>x = {x:.2f} (τ = {tau:.3f}): predicted from each leg's own trace "
            "<i>(first-order: replays recorded steps)</i></div>")
    if not len(table):
        return head + "<i>no spec leg with acceptance counters in this run</i>"
    several = table["gamma"].nunique() > 1
    rows = []
    for r in table.itertuples(index=False):
        pred = predicted.get(r.leg)
        dim = several and gamma is not None and r.gamma != gamma
        rows.append(
            f"<tr data-leg='{html.escape(str(r.leg))}' style='opacity:{0.45 if dim else 1}'>"
            f"<td style='white-space:nowrap'><span style='display:inline-block;width:10px;height:10px;background:{r.color};"
            f"margin-right:4px'></span><span style='color:{r.color}'>{html.escape(str(r.label))}</span></td>"
            f"<td>{'' if r.gamma is None else r.gamma}</td><td>{_fmt(r.acceptance_length, '.3f')}</td>"
            f"<td>{_fmt(r.acceptance_rate, '.3f')}</td><td>{_fmt(r.speedup, '.3f')}</td>"
            f"<td><b>{_fmt(pred[0] if pred else None, '.3f')}</b></td><td>{_fmt(pred[1] if pred else None, '.3f')}</td></tr>")
    th = "".join(f"<th style='text-align:left;padding-right:10px'>{h}</th>" for h in (
        "leg", "γ", "acc. length", "acc. rate", "speedup", "predicted length at x", "predicted rate at x"))
    return (head + "<table class='wb-readout-table' style='border-collapse:collapse;font-size:12px'>"
            f"<tr>{th}</tr>" + "".join(rows) + "</table>")
