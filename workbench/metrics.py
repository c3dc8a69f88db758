"""Speedup, exactness and acceptance from raw per-prompt records.

Pure pandas/numpy: every function takes ``Run.records`` (or ``Run.legs``) and
returns a DataFrame (or a small named tuple of DataFrames). Vocabulary, as in
vLLM's spec-decode metrics:

- acceptance rate = accepted / draft tokens                        (``acceptance_rate``)
- acceptance length = 1 + accepted / drafts, tokens per target step (``acceptance_length``)
- per-position acceptance = accepted at draft position i / drafts   (``position_acceptance``)

These three functions are the only place the formulas are written; the leg's
summaries and every table here use them.

Speedup of a spec leg is *bracketed*: for each prompt, its tok/s divided by
the mean of that prompt's tok/s in the nearest vanilla leg before and after
the spec leg in run order (one side if only one exists), so slow drift of
the machine over a run divides out; the leg's speedup is the median over
prompts, with its quartiles.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from .knobs import column_knobs

# A leg's identity columns; the knob part comes from the knob table (``Knob.column == "record"``).
LEG_KEYS = ["leg", "leg_index", "tier", *column_knobs("record")]


# --------------------------------------------------------------------------- helpers


def _require(records: pd.DataFrame, cols: Iterable[str], what: str) -> None:
    missing = [c for c in cols if c not in records.columns]
    if missing:
        raise ValueError(f"{what}: records lack column(s) {missing}")


def _leg_order(records: pd.DataFrame, legs_order: Sequence[str] | None) -> list[str]:
    present = list(dict.fromkeys(records["leg"]))
    if legs_order is None:
        if "leg_index" in records.columns:
            firsts = records.groupby("leg", sort=False)["leg_index"].first()
            return list(firsts.sort_values(kind="stable").index)
        return present
    order = list(legs_order)
    unknown = [leg for leg in present if leg not in order]
    if unknown:
        raise ValueError(f"legs {unknown} have records but are not in legs_order {order}")
    return order


def _leg_meta(records: pd.DataFrame) -> pd.DataFrame:
    cols = [c for c in LEG_KEYS if c in records.columns]
    return records[cols].drop_duplicates("leg").set_index("leg")


SPEC_TIERS = ("strict", "relaxed", "synthetic")


# --------------------------------------------------------------------------- acceptance vocabulary


def _per(num: Any, den: Any) -> Any:
    """num / den where den > 0: NaN elsewhere (arrays, Series), None for a scalar with den 0."""
    if np.ndim(num) == 0 and np.ndim(den) == 0 and not isinstance(num, pd.Series) and not isinstance(den, pd.Series):
        return float(num) / float(den) if den and float(den) > 0 else None
    n, d = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(d > 0, n / np.where(d > 0, d, 1.0), np.nan)
    index = next((x.index for x in (num, den) if isinstance(x, pd.Series)), None)
    return out if index is None else pd.Series(out, index=index)


def acceptance_rate(accepted: Any, draft_tokens: Any) -> Any:
    """Acceptance rate (vLLM's): accepted / draft tokens. Scalars, arrays or Series."""
    return _per(accepted, draft_tokens)


def position_acceptance(accepted_at_position: Any, drafts: Any) -> Any:
    """Per-position acceptance (vLLM's): accepted at draft position i / drafts."""
    return _per(accepted_at_position, drafts)


def acceptance_length(accepted: Any, drafts: Any) -> Any:
    """Acceptance length (vLLM's): 1 + accepted / drafts, tokens emitted per target step."""
    ratio = _per(accepted, drafts)
    return None if ratio is None else 1 + ratio


def _is_vanilla(records: pd.DataFrame) -> pd.Series:
    return records["tier"].eq("vanilla")


def _is_spec(records: pd.DataFrame) -> pd.Series:
    # Other record kinds (e.g. tier "score" from a teacher-forced scoring pass) are neither.
    return records["tier"].isin(SPEC_TIERS)


# --------------------------------------------------------------------------- speedup


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


# --------------------------------------------------------------------------- exactness


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


# --------------------------------------------------------------------------- acceptance (counters)


def _spec_rows(records: pd.DataFrame) -> pd.DataFrame:
    _require(records, ["leg", "pid", "spec"], "acceptance")
    return records[records["spec"].map(lambda s: isinstance(s, dict))]


def prompt_acceptance(records: pd.DataFrame) -> pd.DataFrame:
    """Per prompt of every spec leg, from its ``spec`` counters."""
    spec = _spec_rows(records)
    cols = LEG_KEYS + ["pid", "drafts", "draft_tokens", "accepted", "acceptance_rate", "acceptance_length"]
    if spec.empty:
        return pd.DataFrame(columns=cols)
    out = spec[[c for c in LEG_KEYS if c in spec.columns] + ["pid"]].copy()
    for k in ("drafts", "draft_tokens", "accepted"):
        out[k] = spec["spec"].map(lambda s, k=k: s.get(k)).astype(float)
    out["acceptance_rate"] = acceptance_rate(out["accepted"], out["draft_tokens"])
    out["acceptance_length"] = acceptance_length(out["accepted"], out["drafts"])
    return out.reindex(columns=cols).reset_index(drop=True)


def acceptance(records: pd.DataFrame) -> pd.DataFrame:
    """Per spec leg, pooled over prompts (sums of counters, then ratios, as vLLM does)."""
    per = prompt_acceptance(records)
    cols = LEG_KEYS + ["n_prompts", "drafts", "draft_tokens", "accepted", "acceptance_rate", "acceptance_length"]
    if per.empty:
        return pd.DataFrame(columns=cols)
    g = per.groupby("leg", sort=False)
    sums = g[["drafts", "draft_tokens", "accepted"]].sum()
    sums["n_prompts"] = g.size()
    out = _leg_meta(per).join(sums).reset_index()
    out["acceptance_rate"] = acceptance_rate(out["accepted"], out["draft_tokens"])
    out["acceptance_length"] = acceptance_length(out["accepted"], out["drafts"])
    return out.sort_values("leg_index", kind="stable")[cols].reset_index(drop=True)


def per_position_acceptance(records: pd.DataFrame) -> pd.DataFrame:
    """Long table: per spec leg and draft position i (0-based), accepted at i / drafts."""
    spec = _spec_rows(records)
    cols = LEG_KEYS + ["position", "accepted", "drafts", "rate"]
    rows = []
    for leg, grp in spec.groupby("leg", sort=False):
        per_pos = [np.asarray(s.get("accepted_per_pos") or [], dtype=float) for s in grp["spec"]]
        width = max((len(p) for p in per_pos), default=0)
        if width == 0:
            continue
        acc = np.zeros(width)
        for p in per_pos:
            acc[: len(p)] += p
        drafts = float(sum(s.get("drafts") or 0 for s in grp["spec"]))
        meta = grp.iloc[0]
        for i in range(width):
            rate = position_acceptance(acc[i], drafts)
            rows.append({**{k: meta.get(k) for k in LEG_KEYS}, "position": i, "accepted": acc[i],
                         "drafts": drafts, "rate": np.nan if rate is None else rate})
    return pd.DataFrame(rows, columns=cols)


def leg_summary_acceptance(legs: pd.DataFrame) -> pd.DataFrame:
    """Engine-wide counters from the leg summaries (``Run.legs``), same vocabulary."""
    done = legs[(legs["status"] == "complete") & legs["tier"].isin(SPEC_TIERS)].copy()
    drafts = done["spec_num_drafts"].astype(float)
    draft_tokens = done["spec_num_draft_tokens"].astype(float)
    accepted = done["spec_num_accepted_tokens"].astype(float)
    done["acceptance_rate"] = acceptance_rate(accepted, draft_tokens)
    done["acceptance_length"] = acceptance_length(accepted, drafts)
    done["per_position"] = [
        (np.asarray(p, dtype=float) / d).tolist() if isinstance(p, list) and d else None
        for p, d in zip(done["spec_accepted_per_pos"], drafts)
    ]
    return done[["leg", "leg_index", "tier", "gamma", "relax_logtau", "blind_mm", "spec_num_drafts",
                 "spec_num_draft_tokens", "spec_num_accepted_tokens", "acceptance_rate",
                 "acceptance_length", "per_position"]].reset_index(drop=True)


# --------------------------------------------------------------------------- acceptance (trace)


# The tie rule (one statement; the engine's relaxed gate and trace follow it,
# see ``vllm_patch.engine_patches.TraceWriter``): a drafted token is accepted at
# relax x when its margin m = max logit - its logit satisfies m <= x, except at
# x = 0 (strict), where only the token the target's argmax picks is accepted. A
# token tied with the argmax but not picked is recorded with margin 0 and a
# ``ties`` mark; it is counted at margin ZERO_PLUS, so the curve at x = 0
# reproduces the strict leg's counters and jumps at x = 0+ by the ties.
ZERO_PLUS = 1e-6  # below every recorded nonzero margin (4 decimals), above every tie


class TraceIndex:
    """The ``trace`` of every traced record, flattened once into numpy arrays.

    Per step: its leg, prompt, output position at which it starts, tokens
    drafted and accepted, and the running maximum of its margins. A step
    accepts at relax x the leading run of positions with margin <= x, which
    is the number of positions whose running maximum is <= x; so predicted
    acceptance for any x is a count over the running maxima, and aggregate
    curves reduce to ``searchsorted`` on presorted arrays (fast enough to
    follow a slider over a hundred thousand prompts).

    Output position: the first token comes from prefill; a step that accepts
    a tokens emits a + 1 (the accepted drafts plus the target's own token),
    so step s starts at 1 + sum over earlier steps of (accepted + 1).
    """

    def __init__(self, records: pd.DataFrame):
        _require(records, ["leg", "pid", "trace"], "trace analysis")
        traced = records[records["trace"].map(lambda t: isinstance(t, dict) and bool(t.get("steps")))]
        self.prompts = traced[[c for c in LEG_KEYS if c in traced.columns] + ["pid"]].reset_index(drop=True)
        self.legs = list(dict.fromkeys(self.prompts["leg"]))
        all_steps = list(traced["trace"].map(lambda t: t["steps"]))
        n_per_prompt = np.fromiter((len(s) for s in all_steps), dtype=np.int64, count=len(all_steps))
        flat = list(chain.from_iterable(all_steps))
        try:
            drafted = np.fromiter((s["drafted"] for s in flat), dtype=np.int64, count=len(flat))
            accepted = np.fromiter((s["accepted"] for s in flat), dtype=np.int64, count=len(flat))
            margin_lists = [s["margins"] for s in flat]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"trace step lacks drafted/accepted/margins ({exc!r})") from None
        n_margins = np.fromiter((len(m) for m in margin_lists), dtype=np.int64, count=len(flat))
        step_prompt = np.repeat(np.arange(len(all_steps)), n_per_prompt)
        bad = np.flatnonzero((n_margins != drafted) | (accepted > drafted) | (accepted < 0))
        if bad.size:
            i = int(bad[0])
            row = self.prompts.iloc[step_prompt[i]]
            raise ValueError(
                f"trace of leg {row['leg']!r} prompt {row['pid']!r}: step with drafted={drafted[i]}, "
                f"accepted={accepted[i]}, {n_margins[i]} margins (need len(margins) == drafted >= accepted)"
            )
        width = int(drafted.max()) if drafted.size else 0
        runmax = np.full((len(flat), width), np.inf)
        if flat:
            values = np.fromiter(chain.from_iterable(margin_lists), dtype=float, count=int(n_margins.sum()))
            starts = np.repeat(np.cumsum(n_margins) - n_margins, n_margins)
            col = np.arange(values.size) - starts
            tie_at = [(i, j) for i, st in enumerate(flat) for j in st.get("ties", ()) if j < n_margins[i]]
            if tie_at:
                ti, tj = np.array(tie_at, dtype=np.int64).T
                at = (np.cumsum(n_margins) - n_margins)[ti] + tj
                values[at] = np.maximum(values[at], ZERO_PLUS)
            runmax[np.repeat(np.arange(len(flat)), n_margins), col] = values
            runmax = np.maximum.accumulate(runmax, axis=1)
        # Output position of each step's first drafted token.
        emitted_before = np.cumsum(accepted + 1) - (accepted + 1)
        first_step = np.cumsum(n_per_prompt) - n_per_prompt
        self.position = 1 + emitted_before - np.repeat(emitted_before[first_step], n_per_prompt)
        self.drafted, self.accepted, self.runmax = drafted, accepted, runmax
        self.step_prompt = step_prompt
        leg_codes = pd.Categorical(self.prompts["leg"], categories=self.legs).codes
        self.step_leg = leg_codes[step_prompt] if flat else np.zeros(0, np.int64)
        # Per leg: presorted running maxima (all positions, and per position).
        self._sorted: dict[str, np.ndarray] = {}
        self._sorted_pos: dict[str, list[np.ndarray]] = {}
        self._n_steps: dict[str, int] = {}
        self._n_drafted: dict[str, int] = {}
        for code, leg in enumerate(self.legs):
            sel = self.step_leg == code
            rm = runmax[sel]
            finite = rm[np.isfinite(rm)]
            self._sorted[leg] = np.sort(finite)
            self._sorted_pos[leg] = [np.sort(rm[:, i]) for i in range(width)]
            self._n_steps[leg] = int(sel.sum())
            self._n_drafted[leg] = int(drafted[sel].sum())

    @property
    def empty(self) -> bool:
        return self.drafted.size == 0

    def _binned(self, edges: np.ndarray) -> dict[str, np.ndarray]:
        """Per set of bin edges (cached): the steps inside, their (leg, bin) key, steps and drafts per key."""
        cache = self.__dict__.setdefault("_bins_cache", {})
        ck = edges.tobytes()
        if ck not in cache:
            b = np.searchsorted(edges, self.position, side="right") - 1
            inside = (b >= 0) & (b < edges.size - 1)
            nb, nl = edges.size - 1, len(self.legs)
            key = self.step_leg[inside] * nb + b[inside]
            cache[ck] = {"inside": inside, "key": key,
                         "count": np.bincount(key, minlength=nl * nb).reshape(nl, nb),
                         "drafted": np.bincount(key, weights=self.drafted[inside], minlength=nl * nb).reshape(nl, nb)}
        return cache[ck]

    def _binned_sorted(self, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Running maxima below +inf of the steps of each (leg, bin) key, sorted within the key, and the
        keys' bounds in that array (cached per set of edges)."""
        binned = self._binned(edges)
        if "sorted" not in binned:
            n_keys = len(self.legs) * (edges.size - 1)
            rm = self.runmax[binned["inside"]]
            keys = np.broadcast_to(binned["key"][:, None], rm.shape)
            keep = rm < np.inf   # what ``runmax <= x`` can count at a finite x (padding is +inf)
            values, keys = rm[keep], keys[keep]
            order = np.lexsort((values, keys))
            bounds = np.concatenate([[0], np.cumsum(np.bincount(keys, minlength=n_keys))])
            binned["sorted"] = (values[order], bounds)
        return binned["sorted"]

    def _check_leg(self, leg: str) -> None:
        if leg not in self._sorted:
            raise ValueError(f"leg {leg!r} has no acceptance trace (traced legs: {self.legs})")

    def step_accepted(self, relax_logtau: float) -> np.ndarray:
        """Predicted accepted tokens per step at relax x."""
        return (self.runmax <= relax_logtau).sum(axis=1)

    def curve(self, leg: str, relax_logtau: Sequence[float] | np.ndarray) -> pd.DataFrame:
        """Predicted aggregate acceptance of one leg's steps at each x."""
        self._check_leg(leg)
        xs = np.atleast_1d(np.asarray(relax_logtau, dtype=float))
        acc = np.searchsorted(self._sorted[leg], xs, side="right").astype(float)
        steps, drafted = self._n_steps[leg], self._n_drafted[leg]
        return pd.DataFrame({
            "leg": leg, "relax_logtau": xs, "tau": np.exp(-xs), "accepted": acc,
            "drafts": steps, "draft_tokens": drafted,
            "acceptance_rate": acceptance_rate(acc, np.full_like(acc, drafted)),
            "acceptance_length": acceptance_length(acc, np.full_like(acc, steps)),
        })

    def curves(self, relax_logtau: float | Sequence[float] | np.ndarray) -> pd.DataFrame:
        """``curve`` of every traced leg, with the leg's own keys; the x each leg ran with is
        ``leg_relax_logtau`` (next to the x it is replayed at)."""
        xs = np.atleast_1d(np.asarray(relax_logtau, dtype=float))
        if np.any(xs < 0) or not np.all(np.isfinite(xs)):
            raise ValueError(f"relax_logtau must be finite and >= 0, got {xs.tolist()}")
        meta = (self.prompts.drop(columns="pid").drop_duplicates("leg").set_index("leg")
                .rename(columns={"relax_logtau": "leg_relax_logtau"}))
        return pd.concat([self.curve(leg, xs) for leg in self.legs], ignore_index=True).join(meta, on="leg")

    def per_position_at(self, leg: str, relax_logtau: float) -> np.ndarray:
        """Predicted per-position acceptance (accepted at position i / drafts) at x."""
        self._check_leg(leg)
        steps = self._n_steps[leg]
        accepted = np.array([np.searchsorted(col, relax_logtau, side="right") for col in self._sorted_pos[leg]])
        return position_acceptance(accepted, np.full(accepted.shape, steps)) if steps else np.zeros(0)

    def per_prompt_at(self, relax_logtau: float) -> pd.DataFrame:
        """Predicted counters per traced prompt at x."""
        n = len(self.prompts)
        acc = np.bincount(self.step_prompt, weights=self.step_accepted(relax_logtau), minlength=n)
        drafts = np.bincount(self.step_prompt, minlength=n).astype(float)
        drafted = np.bincount(self.step_prompt, weights=self.drafted, minlength=n)
        out = self.prompts.rename(columns={"relax_logtau": "leg_relax_logtau"})
        out["relax_logtau"] = relax_logtau
        out["drafts"], out["draft_tokens"], out["accepted"] = drafts, drafted, acc
        out["acceptance_rate"] = acceptance_rate(acc, drafted)
        out["acceptance_length"] = acceptance_length(acc, drafts)
        return out

    def over_position(self, bins: int | Sequence[float] = 10, relax_logtau: float | None = None) -> pd.DataFrame:
        """Acceptance vs output position of the step, per leg (measured, or predicted at x).

        Predicted at a finite x, the counts come from running maxima presorted per leg and bin
        (once per set of bins), so a call costs a ``searchsorted`` per bin (a slider can follow it).
        """
        if self.empty:
            return pd.DataFrame(columns=["leg", "bin_left", "bin_right", "bin_mid", "n_steps",
                                         "drafted", "accepted", "acceptance_rate", "acceptance_length"])
        if isinstance(bins, (int, np.integer)):
            if bins < 1:
                raise ValueError(f"bins must be >= 1, got {bins}")
            edges = np.linspace(0, self.position.max() + 1, int(bins) + 1)
        else:
            edges = np.asarray(bins, dtype=float)
            if edges.ndim != 1 or edges.size < 2 or np.any(np.diff(edges) <= 0):
                raise ValueError("bins must be an int or increasing bin edges (at least two)")
        nb, nl = edges.size - 1, len(self.legs)
        binned = self._binned(edges)
        key, count, dr = binned["key"], binned["count"], binned["drafted"]
        if relax_logtau is None:
            ac = np.bincount(key, weights=self.accepted[binned["inside"]], minlength=nl * nb).reshape(nl, nb)
        elif np.isfinite(relax_logtau):
            # accepted at x = running maxima <= x, counted per (leg, bin) on its presorted segment
            values, bounds = self._binned_sorted(edges)
            ac = np.array([np.searchsorted(values[lo:hi], relax_logtau, side="right")
                           for lo, hi in zip(bounds[:-1], bounds[1:])], dtype=float).reshape(nl, nb)
        else:
            ac = np.bincount(key, weights=self.step_accepted(relax_logtau)[binned["inside"]],
                             minlength=nl * nb).reshape(nl, nb)
        rate, length = acceptance_rate(ac, dr), acceptance_length(ac, count)
        return pd.DataFrame({
            "leg": np.repeat(self.legs, nb),
            "bin_left": np.tile(edges[:-1], nl), "bin_right": np.tile(edges[1:], nl),
            "bin_mid": np.tile((edges[:-1] + edges[1:]) / 2, nl),
            "n_steps": count.ravel(), "drafted": dr.ravel(), "accepted": ac.ravel(),
            "acceptance_rate": rate.ravel(), "acceptance_length": length.ravel(),
        })


def acceptance_over_position(records: pd.DataFrame, bins: int | Sequence[float] = 10,
                             relax_logtau: float | None = None) -> pd.DataFrame:
    """Acceptance vs output token position, per traced leg.

    ``bins``: number of equal-width bins over [0, longest output] or explicit
    edges. Each step counts in the bin of the output position where it starts.
    With ``relax_logtau`` the counts are predicted at that x (see
    ``predict_acceptance``), keeping the measured step positions.
    """
    return TraceIndex(records).over_position(bins, relax_logtau)


class Prediction(NamedTuple):
    per_prompt: pd.DataFrame
    aggregate: pd.DataFrame


def predict_acceptance(records: pd.DataFrame, relax_logtau: float | Sequence[float]) -> Prediction:
    """Counterfactual acceptance at relax x from recorded margins.

    For each traced step, predicted accepted = length of the leading run of
    margins <= x, capped at the tokens drafted; ties follow the tie rule
    above (strict at x = 0 exactly, ties accepted from x = 0+). This is a first-order
    prediction: it replays the recorded steps, but after a different
    acceptance the continuation (and so every later draft) would change, so
    it is exact only at the x the leg ran with (and for steps before the
    first difference). Returns per-prompt and per-leg aggregate acceptance
    length and rate, one row per x.
    """
    index = TraceIndex(records)
    if index.empty:
        raise ValueError("predict_acceptance: no record carries a trace (run the leg with --trace)")
    aggregate = index.curves(relax_logtau)
    xs = np.atleast_1d(np.asarray(relax_logtau, dtype=float))
    per_prompt = pd.concat([index.per_prompt_at(float(x)) for x in xs], ignore_index=True)
    return Prediction(per_prompt, aggregate)


# --------------------------------------------------------------------------- token classes

# Visual vocabulary used by the token-class proxy: words whose value has to be
# read off the image (colours, shapes, counts, positions, common objects).
IMAGE_WORDS = (
    "red orange yellow green blue purple pink brown black white gray grey color colour "
    "circle square triangle rectangle line bar dot shape left right top bottom above below "
    "behind front middle center corner image picture photo figure chart graph plot table "
    "axis label person man woman people dog cat car tree building sign text number "
    "one two three four five six seven eight nine ten 0 1 2 3 4 5 6 7 8 9"
).split()


def image_word_token_ids(tokenizer: Any, words: Iterable[str] = IMAGE_WORDS) -> set[int]:
    """Token ids that spell visual vocabulary, for ``token_class_acceptance``.

    ``tokenizer`` is anything with ``encode(text, add_special_tokens=False)``
    (a transformers tokenizer). Each word is encoded bare, with a leading
    space and capitalised, and every piece counts.
    """
    ids: set[int] = set()
    for w in words:
        for variant in {w, " " + w, w.capitalize(), " " + w.capitalize()}:
            ids.update(int(i) for i in tokenizer.encode(variant, add_special_tokens=False))
    return ids


def token_class_acceptance(
    records: pd.DataFrame,
    token_class: Mapping[int, str] | Callable[[np.ndarray], Sequence[str]] | set[int] | frozenset[int],
    *,
    in_class: str = "image-word",
    other: str = "other",
    position_labels: Sequence[Sequence[str]] | None = None,
) -> pd.DataFrame:
    """Acceptance by class of the output token at each evaluated draft position.

    Without labels for "image-grounded" tokens this uses a proxy: each draft
    position the target evaluated (every accepted position and the first
    rejected one) is attributed to the token that ended up in the output at
    that position (the accepted draft, or the target's own correction), and
    that token's class decides the bucket. ``token_class`` is a set of ids
    (e.g. ``image_word_token_ids(tokenizer)``: ``in_class`` vs ``other``), a
    mapping id -> label (unmapped ids are ``other``), or a function from an
    id array to labels. Rate = accepted / evaluated positions of the class,
    i.e. the acceptance of a drafted token given the draft got that far.

    ``position_labels`` (one sequence per traced record, in the records' order, one label per output
    position) labels positions instead of token ids, e.g. the grounded definition
    (``workbench.grounding``: the target's greedy choice there changes with a blank picture);
    ``token_class`` is then ignored.
    """
    index = TraceIndex(records)
    if index.empty:
        raise ValueError("token_class_acceptance: no record carries a trace (run the leg with --trace)")
    ids_by_prompt = records.loc[records["trace"].map(lambda t: isinstance(t, dict) and bool(t.get("steps"))), "gen_ids"]
    ids_by_prompt = [np.asarray(x, dtype=np.int64) for x in ids_by_prompt]
    # Evaluated positions: j = 0..min(accepted, drafted - 1) of every step.
    n_eval = np.minimum(index.accepted + 1, index.drafted)
    step_of = np.repeat(np.arange(n_eval.size), n_eval)
    j = np.arange(step_of.size) - np.repeat(np.cumsum(n_eval) - n_eval, n_eval)
    out_pos = index.position[step_of] + j
    prompt_of = index.step_prompt[step_of]
    lens = np.array([len(x) for x in ids_by_prompt], dtype=np.int64)
    keep = out_pos < lens[prompt_of]  # the last step may run past max_tokens/EOS
    offsets = np.cumsum(lens) - lens
    all_ids = np.concatenate(ids_by_prompt) if ids_by_prompt else np.zeros(0, np.int64)
    tok = all_ids[(offsets[prompt_of] + out_pos)[keep]]
    if position_labels is not None:
        if len(position_labels) != len(ids_by_prompt) or any(
                len(lab) != n for lab, n in zip(position_labels, lens)):
            raise ValueError("position_labels: one label per output token of every traced record")
        flat_labels = np.array([x for lab in position_labels for x in lab], dtype=object)
        labels = flat_labels[(offsets[prompt_of] + out_pos)[keep]] if flat_labels.size else flat_labels
    elif isinstance(token_class, (set, frozenset)):
        labels = np.where(np.isin(tok, np.fromiter(token_class, dtype=np.int64)), in_class, other)
    elif isinstance(token_class, Mapping):
        labels = np.array([token_class.get(int(t), other) for t in tok], dtype=object)
    elif callable(token_class):
        labels = np.asarray(token_class(tok), dtype=object)
        if labels.shape != tok.shape:
            raise ValueError("token_class function must return one label per token id")
    else:
        raise TypeError("token_class must be a set of ids, a mapping id -> label, or a function")
    df = pd.DataFrame({
        "leg": np.asarray(index.legs, dtype=object)[index.step_leg[step_of][keep]] if index.legs else [],
        "token_class": labels,
        "accepted": (j < index.accepted[step_of])[keep],
    })
    g = df.groupby(["leg", "token_class"], sort=False)["accepted"]
    out = pd.DataFrame({"evaluated": g.size(), "accepted": g.sum()}).reset_index()
    out["rate"] = out["accepted"] / out["evaluated"]
    return out
