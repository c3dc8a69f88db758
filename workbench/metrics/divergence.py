"""Exactness: where a leg's output first differs from its reference leg's, per prompt and per leg."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from .common import LEG_KEYS, _is_spec, _is_vanilla, _leg_meta, _leg_order, _require


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where two outputs differ; the shorter length if one is a prefix of the other."""
    a_arr, b_arr = np.asarray(a), np.asarray(b)
    n = min(len(a_arr), len(b_arr))
    diff = np.flatnonzero(a_arr[:n] != b_arr[:n])
    if diff.size:
        return int(diff[0])
    return None if len(a_arr) == len(b_arr) else n


def exactness(records: pd.DataFrame, ref_leg: str, leg: str) -> pd.DataFrame:
    """Per prompt (present in both legs): exact match of gen_ids and the first differing index.

    ``first_divergence`` is <NA> for an exact match; when one output is a
    prefix of the other it is the shorter length.
    """
    _require(records, ["leg", "pid", "gen_ids"], "exactness")
    for name in (ref_leg, leg):
        if not records["leg"].eq(name).any():
            raise ValueError(f"exactness: leg {name!r} has no records")
    ref = records.loc[records["leg"] == ref_leg, ["pid", "gen_ids"]]
    oth = records.loc[records["leg"] == leg, ["pid", "gen_ids"]]
    both = ref.merge(oth, on="pid", suffixes=("_ref", ""))
    if both.empty:
        raise ValueError(f"exactness: legs {ref_leg!r} and {leg!r} share no prompt ids")
    div = [first_divergence(r, o) for r, o in zip(both["gen_ids_ref"], both["gen_ids"])]
    ref_len = both["gen_ids_ref"].map(len)
    out = pd.DataFrame({
        "pid": both["pid"],
        "ref_leg": ref_leg,
        "leg": leg,
        "exact": [d is None for d in div],
        "first_divergence": pd.array(div, dtype="Int64"),
        "ref_len": ref_len,
        "len": both["gen_ids"].map(len),
    })
    # Share of the reference output reproduced before the first difference.
    out["prefix_match_frac"] = (out["first_divergence"].fillna(out["ref_len"]) / out["ref_len"].where(out["ref_len"] > 0)).astype(float)
    return out.reset_index(drop=True)


def exactness_summary(records: pd.DataFrame, ref_leg: str | None = None, legs: Sequence[str] | None = None,
                      refs: Mapping[str, str] | None = None) -> pd.DataFrame:
    """One row per compared leg: exact-match rate and first-divergence statistics.

    Defaults: reference = the first vanilla leg in run order (``refs``: a reference per compared leg, e.g.
    a vanilla leg of its own target where a run has two); compared = every spec leg.
    """
    order = _leg_order(records, None)
    if ref_leg is None:
        vans = [l for l in order if l in set(records.loc[_is_vanilla(records), "leg"])]
        if not vans:
            raise ValueError("exactness_summary: no vanilla leg to compare against")
        ref_leg = vans[0]
    if legs is None:
        legs = [l for l in order if l in set(records.loc[_is_spec(records), "leg"])]
    meta = _leg_meta(records)
    rows = []
    for leg in legs:
        ref = (refs or {}).get(leg, ref_leg)
        ex = exactness(records, ref, leg)
        div = ex["first_divergence"].dropna().astype(float)
        rows.append({
            **{k: meta.loc[leg, k] for k in LEG_KEYS[1:] if k in meta.columns}, "leg": leg,
            "ref_leg": ref, "n": len(ex), "n_exact": int(ex["exact"].sum()),
            "match_rate": float(ex["exact"].mean()),
            "median_first_divergence": float(div.median()) if len(div) else np.nan,
            "min_first_divergence": float(div.min()) if len(div) else np.nan,
            "mean_prefix_match_frac": float(ex["prefix_match_frac"].mean()),
        })
    cols = LEG_KEYS + ["ref_leg", "n", "n_exact", "match_rate", "median_first_divergence",
                       "min_first_divergence", "mean_prefix_match_frac"]
    return pd.DataFrame(rows, columns=cols)
