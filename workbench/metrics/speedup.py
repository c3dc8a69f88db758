"""Speedup: per-prompt ratios over the bracketing vanilla legs, their median and quartiles."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from .common import LEG_KEYS, _is_spec, _is_vanilla, _leg_meta, _leg_order, _require


def bracketing_vanilla(legs_order: Sequence[str], vanilla_legs: Iterable[str]) -> dict[str, tuple[str | None, str | None]]:
    """For each non-vanilla leg: the nearest vanilla leg before and after it in run order."""
    vanilla = set(vanilla_legs)
    out: dict[str, tuple[str | None, str | None]] = {}
    for i, leg in enumerate(legs_order):
        if leg in vanilla:
            continue
        before = next((l for l in reversed(legs_order[:i]) if l in vanilla), None)
        after = next((l for l in legs_order[i + 1:] if l in vanilla), None)
        out[leg] = (before, after)
    return out


class PlacementError(ValueError):
    """A bracket's legs ran on different devices: their ratio would measure the devices, not the drafter."""


def _check_placements(records: pd.DataFrame, brackets: Mapping[str, tuple[str | None, str | None]]) -> None:
    if "placement" in records.columns:
        check_placements(records.groupby("leg", sort=False)["placement"].first().to_dict(), brackets)


def check_placements(where: Mapping[str, Any], brackets: Mapping[str, tuple[str | None, str | None]]) -> None:
    """Refuse a bracket whose legs ran on different placements (``where``: leg -> placement key; legs that
    recorded none, as in runs made before placements were recorded, are not checked)."""
    for leg, sides in brackets.items():
        named = {l: where.get(l) for l in (leg, *sides) if l is not None}
        known = {p for p in named.values() if isinstance(p, str)}
        if len(known) > 1:
            said = ", ".join(f"{l} on {p}" for l, p in named.items())
            raise PlacementError(f"leg {leg} and its bracketing legs ran on different devices ({said}); a bracket's "
                                 "legs must run on one GPU, in order (docs/ray.md, placement)")


def prompt_ratios(records: pd.DataFrame, reference_legs: Iterable[str], legs_order: Sequence[str] | None = None,
                  value: str = "tok_s", legs: Iterable[str] | None = None) -> pd.DataFrame:
    """Per prompt of each compared leg: its ``value`` over the mean of that prompt's ``value`` in the
    nearest reference leg before and after it in run order (one side if only one exists).

    Compared legs: ``legs``, or every leg that is not a reference leg. Only
    reference legs that have records can bracket (a failed one is skipped
    over to the next one). Prompts without a positive reference value on
    either side are dropped: a ratio to nothing is not a ratio. Columns:
    ``LEG_KEYS``, ``pid``, ``value``, ``baseline``, ``ratio``, ``ref_before``, ``ref_after``.
    """
    _require(records, ["leg", "pid", value], "prompt_ratios")
    order = _leg_order(records, legs_order)
    present = set(records["leg"])
    refs = [leg for leg in dict.fromkeys(reference_legs) if leg in present]
    compared = set(legs) if legs is not None else present - set(refs)
    rows = records[records["leg"].isin(compared)]
    cols = LEG_KEYS + ["pid", "value", "baseline", "ratio", "ref_before", "ref_after"]
    if rows.empty:
        return pd.DataFrame(columns=cols)
    if not refs:
        raise ValueError("a bracketed ratio needs at least one finished reference leg; the records have none")
    ref = records[records["leg"].isin(refs)].pivot(index="pid", columns="leg", values=value).astype(float)
    ref = ref.where(ref > 0)
    brackets = bracketing_vanilla(order, refs)
    _check_placements(records, {leg: brackets[leg] for leg in rows["leg"].unique()})
    parts = []
    for leg, grp in rows.groupby("leg", sort=False):
        before, after = brackets[leg]
        sides = [s for s in (before, after) if s is not None]
        part = grp.copy()
        part["value"] = part[value].astype(float)
        part["baseline"] = part["pid"].map(ref[sides].mean(axis=1, skipna=True)).astype(float)
        part["ref_before"], part["ref_after"] = before, after
        parts.append(part)
    out = pd.concat(parts, ignore_index=True)
    out["ratio"] = out["value"] / out["baseline"]
    out = out[np.isfinite(out["ratio"])]
    for c in cols:
        if c not in out.columns:
            out[c] = None
    return out[cols].reset_index(drop=True)


def ratio_summary(per_prompt: pd.DataFrame, column: str = "ratio") -> pd.DataFrame:
    """One row per leg of a per-prompt table: median of ``column`` over prompts, q25, q75, IQR and n."""
    cols = LEG_KEYS + [column, "q25", "q75", "iqr", "n"]
    if per_prompt.empty:
        return pd.DataFrame(columns=cols)
    g = per_prompt.groupby("leg", sort=False)[column]
    agg = pd.DataFrame({column: g.median(), "q25": g.quantile(0.25), "q75": g.quantile(0.75), "n": g.size()})
    agg["iqr"] = agg["q75"] - agg["q25"]
    out = _leg_meta(per_prompt).join(agg).reset_index()
    return out.sort_values("leg_index", kind="stable")[cols].reset_index(drop=True)


def median_iqr(values: Iterable[float]) -> dict[str, float]:
    """Median, quartiles, IQR and count of some values (NaN left out), e.g. per-prompt ratios pooled over legs."""
    v = pd.Series(list(values), dtype=float).dropna()
    q25, q75 = (float(v.quantile(q)) for q in (0.25, 0.75)) if len(v) else (np.nan, np.nan)
    return {"median": float(v.median()) if len(v) else np.nan, "q25": q25, "q75": q75, "iqr": q75 - q25,
            "n": int(len(v))}


def median_ratio_draws(spec: Sequence[float], sides: Sequence[Sequence[float]], spec_over_side: bool = False,
                       draws: int = 2000, seed: int = 0) -> np.ndarray | None:
    """Bootstrap draws of a bracketed median ratio over requests (``median_ratio_ci``'s statistic); None where a
    group has fewer than 2 finite values."""
    groups = [np.asarray(spec, dtype=float)] + [np.asarray(s, dtype=float) for s in sides]
    groups = [g[np.isfinite(g)] for g in groups]
    if len(groups) < 2 or any(len(g) < 2 for g in groups):
        return None
    rng = np.random.default_rng(seed)

    def medians(g: np.ndarray) -> np.ndarray:
        return np.median(g[rng.integers(0, len(g), size=(draws, len(g)))], axis=1)

    s = medians(groups[0])
    ratios = np.stack([(s / medians(g)) if spec_over_side else (medians(g) / s) for g in groups[1:]])
    return np.median(ratios, axis=0)


def median_ratio_ci(spec: Sequence[float], sides: Sequence[Sequence[float]], spec_over_side: bool = False,
                    level: float = 0.95, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of a bracketed median ratio over requests.

    The statistic is the one a serving table shows: per side (a bracketing vanilla leg), median(side) /
    median(spec) (``spec_over_side``: median(spec) / median(side)), then the median over the sides. Each draw
    resamples the spec leg's requests once and each side's independently (with replacement), so the interval
    holds what the requests themselves vary by: at a synthetic α each request draws its own acceptance, and
    13 requests of 128 tokens move a median TPOT by several per cent, far more than the bracket's IQR says.
    Seeded: the same requests give the same interval. NaN, NaN where a group has fewer than 2 finite values."""
    stat = median_ratio_draws(spec, sides, spec_over_side, draws, seed)
    if stat is None:
        return np.nan, np.nan
    tail = (1.0 - level) / 2.0
    return float(np.quantile(stat, tail)), float(np.quantile(stat, 1.0 - tail))


def prompt_speedups(records: pd.DataFrame, legs_order: Sequence[str] | None = None) -> pd.DataFrame:
    """Per prompt and spec leg: tok/s, bracketing vanilla tok/s and their ratio (``prompt_ratios``)."""
    _require(records, ["leg", "pid", "tier", "tok_s"], "prompt_speedups")
    cols = LEG_KEYS + ["pid", "tok_s", "baseline_tok_s", "speedup", "vanilla_before", "vanilla_after"]
    spec_legs = records.loc[_is_spec(records), "leg"].unique()
    if not len(spec_legs):
        return pd.DataFrame(columns=cols)
    if not _is_vanilla(records).any():
        raise ValueError("bracketed speedup needs at least one finished vanilla leg; the records have none")
    per = prompt_ratios(records, records.loc[_is_vanilla(records), "leg"], legs_order, "tok_s", spec_legs)
    per = per.rename(columns={"value": "tok_s", "baseline": "baseline_tok_s", "ratio": "speedup",
                              "ref_before": "vanilla_before", "ref_after": "vanilla_after"})
    return per[cols]


def bracketed_speedup(records: pd.DataFrame, legs_order: Sequence[str] | None = None) -> pd.DataFrame:
    """One row per spec leg: median speedup over prompts with q25/q75/IQR and n."""
    per = prompt_speedups(records, legs_order)
    cols = LEG_KEYS + ["speedup", "q25", "q75", "iqr", "n", "vanilla_before", "vanilla_after"]
    if per.empty:
        return pd.DataFrame(columns=cols)
    sides = per.groupby("leg", sort=False)[["vanilla_before", "vanilla_after"]].first()
    return ratio_summary(per, "speedup").join(sides, on="leg")[cols]
