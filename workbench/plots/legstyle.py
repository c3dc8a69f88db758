"""How a leg looks in every figure: one place that maps a leg to (label, colour, dash).

A leg is a drafter, a tier (strict, or relaxed at some x), a gamma and a knob
setting (blind-MM). Legs that differ only in gamma are one *series* (a line of
Speedup vs γ): they share a hue, lighter for a smaller gamma. Every other
difference gets its own hue. Measured and predicted of one leg share its colour;
predicted is drawn dotted (``PREDICTED_DASH``).

Labels name what varies across the run's spec legs, as a reader says it:
``"int4 twin"``, ``"small VLM"``, ``"text draft"``, ``"relaxed x = 0.69"``,
with ``"γ = 4"`` where the run has several gammas. Legs that nothing in the
table tells apart (same tier, gamma and knobs, no drafter named) keep their leg names.

``LegStyles.from_frame(df)`` styles the legs of any table with a ``leg`` column
(and ``tier``, ``gamma``, ``relax_logtau``, ``blind_mm``, ``draft`` where it has
them); ``RunTables.leg_styles`` styles a run's legs once, so that a leg has
the same colour in every view of the run.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from ._base import TIER_COLORS, _gamma, _num

# Drafter names of the catalogue (workbench/profiles.yaml ``drafts``) as a reader says them.
DRAFTER_LABELS = {"twin": "int4 twin", "twin-int4": "int4 twin", "small-vlm": "small VLM",
                  "text-draft": "text draft", "random": "random draft"}
# Strict series take these in turn (the first is the strict tier's colour), relaxed ones the warm ramp.
STRICT_PALETTE = ["#1f77b4", "#2ca02c", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#bcbd22", "#d62728"]
RELAXED_PALETTE = ["#ff7f0e", "#d62728", "#8c564b", "#e377c2", "#bcbd22"]
RELAXED_RAMP = ["#fdae6b", "#fd8d3c", "#f16913", "#d94801", "#a63603", "#7f2704"]
PREDICTED_DASH = "dot"
BLIND_DASH = "dashdot"


@dataclass(frozen=True)
class LegStyle:
    label: str            # the leg as a reader names it (with gamma where the run has several)
    color: str            # its own colour; legs of one series share the hue
    dash: str = "solid"   # measured lines; predicted ones are PREDICTED_DASH
    series: str = ""      # the label without gamma: what Speedup vs γ draws as one line
    gamma: int | None = None
    tier: str | None = None


def drafter_label(draft: Any) -> str | None:
    """``"small-vlm"`` -> ``"small VLM"``; a path -> its last part, so named; None for none."""
    if draft is None or (isinstance(draft, float) and math.isnan(draft)) or str(draft) in ("", "None"):
        return None
    name = str(draft).rstrip("/").rsplit("/", 1)[-1]
    base, at, of = name.partition("@")      # "twin@8b-thinking": the twin of that target
    label = DRAFTER_LABELS.get(base, base.replace("_", " "))
    return f"{label} of {of}" if at else label


def _key(row: Mapping[str, Any]) -> tuple:
    """What makes a series: drafter, tier, x (relaxed only), blind-MM, a drawn acceptance (E18's synthetic α)."""
    tier = str(row.get("tier"))
    x = (_num(row.get("relax_logtau")) or 0.0) if tier == "relaxed" else 0.0
    return (drafter_label(row.get("draft")), tier, round(x, 4), bool(_num(row.get("blind_mm")) or False),
            drawn_alpha(row.get("acceptance")))


def drawn_alpha(acceptance: Any) -> float | None:
    """The drawn acceptance α of a leg: a number, or the ``acceptance`` knob ``alpha:A`` (as run.json and the
    serving table state it: ``"alpha:0.9"``, ``"synthetic α (alpha:0.9)"``); None for real acceptance."""
    f = _num(acceptance)
    if f is not None or not isinstance(acceptance, str):
        return f
    m = re.search(r"alpha:\s*([0-9.eE+-]+)", acceptance)
    return _num(m[1]) if m else None


def _keys(spec: list[dict[str, Any]]) -> dict[str, tuple]:
    """Each spec leg's series key; legs that nothing in the table tells apart (same key, gamma and
    concurrency: drafters of a table without a ``draft`` column) each get a series of their own, by name."""
    keys = {str(r["leg"]): (*_key(r), None) for r in spec}
    groups: dict[tuple, list[str]] = {}
    for r in spec:
        groups.setdefault((keys[str(r["leg"])], _gamma(r.get("gamma")), r.get("concurrency")), []).append(str(r["leg"]))
    for legs in groups.values():
        if len(legs) > 1:
            keys.update({leg: (*keys[leg][:5], leg) for leg in legs})
    return keys


def _shade(color: str, t: float) -> str:
    """``color`` mixed with white by ``t`` (0: itself)."""
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    mix = lambda c: round(c + (255 - c) * t)  # noqa: E731
    return f"#{mix(r):02x}{mix(g):02x}{mix(b):02x}"


def _series_label(key: tuple, vary: set[str]) -> str:
    draft, tier, x, blind, alpha, name = key
    if name is not None:
        return name
    parts = []
    if draft and "draft" in vary:
        parts.append(draft)
    if tier == "relaxed":
        parts.append(f"relaxed x = {x:.2g}" if x else "relaxed")
    elif "tier" in vary or not (parts or (tier == "synthetic" and alpha is not None)):
        parts.append(tier)   # (a drawn α says "synthetic" itself)
    if blind:
        parts.append("blind-MM")
    if alpha is not None:
        parts.append(f"synthetic α = {alpha:.2g}")
    return ", ".join(parts)


class LegStyles(Mapping):
    """Leg name -> ``LegStyle``, for the legs of one run (or one table)."""

    def __init__(self, styles: Mapping[str, LegStyle]):
        self._styles = dict(styles)

    def __getitem__(self, leg: str) -> LegStyle:
        return self._styles[str(leg)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._styles)

    def __len__(self) -> int:
        return len(self._styles)

    @classmethod
    def from_frame(cls, df: pd.DataFrame) -> "LegStyles":
        """Styles of the legs in ``df`` (one row per leg is enough; repeats are ignored)."""
        if df is None or not len(df) or "leg" not in df.columns:
            return cls({})
        rows = [r for r in df.drop_duplicates("leg").to_dict("records")]
        if "tier" not in df.columns:   # nothing to name them by: their leg names, a colour each
            return cls({str(r["leg"]): LegStyle(str(r["leg"]), STRICT_PALETTE[i % len(STRICT_PALETTE)],
                                                series=str(r["leg"]), gamma=_gamma(r.get("gamma")))
                        for i, r in enumerate(rows)})
        spec = [r for r in rows if str(r.get("tier")) != "vanilla"]
        keys = _keys(spec)
        vary = {name for i, name in enumerate(("draft", "tier", "x", "blind", "alpha"))
                if len({k[i] for k in keys.values()}) > 1}
        gammas = {_gamma(r.get("gamma")) for r in spec} - {None}
        order = {k: i for i, k in enumerate(keys.values())}
        series = sorted(set(keys.values()), key=lambda k: (k[1] != "strict", k[1], k[2], k[3], order[k]))
        colors = _series_colors(series)
        gamma_rank = {k: sorted({_gamma(r.get("gamma")) for r in spec if keys[str(r["leg"])] == k} - {None})
                      for k in series}
        out: dict[str, LegStyle] = {}
        for r in rows:
            leg, tier, g = str(r["leg"]), str(r.get("tier")), _gamma(r.get("gamma"))
            if tier == "vanilla":
                out[leg] = LegStyle(leg, TIER_COLORS["vanilla"], "dash", leg, g, tier)
                continue
            k = keys[leg]
            ranks = gamma_rank[k]
            t = 0.5 * (len(ranks) - 1 - ranks.index(g)) / (len(ranks) - 1) if g in ranks and len(ranks) > 1 else 0.0
            label = _series_label(k, vary)
            full = label + (f", γ = {g}" if len(gammas) > 1 and g is not None else "")
            out[leg] = LegStyle(full, _shade(colors[k], t), BLIND_DASH if k[3] else "solid", label, g, tier)
        return cls(out)

    def of(self, leg: Any, row: Mapping[str, Any] | None = None) -> LegStyle:
        """The style of ``leg``; a leg these styles do not know is styled alone from ``row``."""
        if str(leg) in self._styles:
            return self._styles[str(leg)]
        return LegStyles.from_frame(pd.DataFrame([{**(row or {}), "leg": leg}]))[str(leg)]


def _series_colors(series: list[tuple]) -> dict[tuple, str]:
    strict = [k for k in series if k[1] != "relaxed"]
    relaxed = [k for k in series if k[1] == "relaxed"]
    colors = {k: STRICT_PALETTE[i % len(STRICT_PALETTE)] for i, k in enumerate(strict)}
    drafters = {k[0] for k in relaxed}
    if len(relaxed) > 1 and len(drafters) == 1 and not any(k[3] for k in relaxed):
        # One drafter's τ ladder: light to dark as the gate loosens.
        step = max(1, (len(RELAXED_RAMP) - 1) // max(1, len(relaxed) - 1)) if len(relaxed) <= len(RELAXED_RAMP) else 1
        colors.update({k: RELAXED_RAMP[min(i * step, len(RELAXED_RAMP) - 1)] if len(relaxed) <= len(RELAXED_RAMP)
                       else RELAXED_PALETTE[i % len(RELAXED_PALETTE)] for i, k in enumerate(relaxed)})
    else:
        colors.update({k: RELAXED_PALETTE[i % len(RELAXED_PALETTE)] for i, k in enumerate(relaxed)})
    return colors


def styles_for(df: pd.DataFrame, styles: Mapping[str, LegStyle] | None) -> LegStyles:
    """``styles`` where they know every leg of ``df``; else the legs of ``df`` styled from ``df``."""
    legs = set(df["leg"].astype(str)) if df is not None and len(df) and "leg" in df.columns else set()
    if styles is not None and legs <= set(styles):
        return styles if isinstance(styles, LegStyles) else LegStyles(styles)
    return LegStyles.from_frame(df)


def run_leg_frame(legs: pd.DataFrame, config: Mapping[str, Any]) -> pd.DataFrame:
    """One row per leg of a run (``Run.legs``), with what ``LegStyles.from_frame`` reads: the leg table's
    tier, gamma and knobs, and the drafter as the run's plan names it (``run.json`` ``legs``), else as the
    leg's summary names it. Legs of no known tier (pending ones the plan does not describe) are left out."""
    planned = {p.get("name"): p for p in (config.get("legs") or []) if isinstance(p, Mapping)}
    rows = []
    for r in legs.to_dict("records"):
        p = planned.get(r["leg"], {})
        knobs = p.get("knobs") if isinstance(p.get("knobs"), Mapping) else {}
        pick = lambda *vs: next((v for v in vs if v is not None and not (isinstance(v, float) and math.isnan(v))),  # noqa: E731
                                None)
        row = {"leg": r["leg"], "leg_index": r.get("leg_index"), "tier": pick(r.get("tier"), p.get("tier")),
               "gamma": pick(r.get("gamma"), knobs.get("gamma"), p.get("gamma")),
               "relax_logtau": pick(r.get("relax_logtau"), knobs.get("relax_logtau"), p.get("relax_logtau")),
               "blind_mm": pick(r.get("blind_mm"), knobs.get("blind_mm"), p.get("blind_mm")),
               "draft": pick(p.get("draft"), r.get("draft")),
               "acceptance": pick(r.get("acceptance"), knobs.get("acceptance"))}
        if row["tier"] is not None:
            rows.append(row)
    return pd.DataFrame(rows, columns=["leg", "leg_index", "tier", "gamma", "relax_logtau", "blind_mm", "draft",
                                       "acceptance"])
