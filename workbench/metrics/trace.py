"""Acceptance from the trace: the per-step margins of every traced record (``TraceIndex``), counterfactual
acceptance at any relax x, acceptance over output position."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import NamedTuple

import numpy as np
import pandas as pd

from .common import LEG_KEYS, _require, acceptance_length, acceptance_rate, position_acceptance


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
