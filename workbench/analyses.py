"""The analysis registry: every table a run folder holds and every figure drawn from them, named once.

A **table** is computed from a run's raw records by a ``workbench.metrics``
function and written as ``<run>/tables/<name>.csv``. An **analysis** is a
figure: the ``workbench.plots`` function that draws it and the tables it reads;
``experiments.yaml`` names analyses, and the registry refuses an unknown name
when it loads. The executed notebook, ``workbench export`` and the explorer
all read tables and figures from here, so a number has one name and one
recipe wherever it appears.

    tables = RunTables(load_run(run_dir))       # computed on demand, each once
    tables.get("speedup")                       # DataFrame, or None where the run lacks what it needs
    draw(tables, ["speedup_distribution"])      # {analysis name: figure}
    analyze_run(run_dir)                        # every table -> tables/*.csv + tables/summary.json

An analysis with a ``view`` (``View``) is also a figure of the run explorer
(``workbench.widgets.Explorer``), which loops over this table: the view says
which runs show it, which sliders drive it and how a slider move updates it.
Adding a figure to the explorer is one ``Analysis(...)`` entry here (and its
``workbench.plots`` function).
"""

from __future__ import annotations

import inspect
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from . import exactness, metrics, plots
from .results import Run, load_run
from .runfolder import write_text_atomic

SUMMARY_JSON = "summary.json"
# The relax x grid of counterfactual acceptance (table and explorer curves): x up to 3 (τ = 0.05)
# covers the τ ladders of E4/E13.
# x = 0+ (metrics.ZERO_PLUS) is on the grid so that the jump of the tie rule is drawn as a jump.
RELAX_GRID = np.unique(np.concatenate([np.round(np.linspace(0.0, 3.0, 151), 4), [metrics.ZERO_PLUS]]))
OVER_POSITION_BINS = 10


class NotApplicable(LookupError):
    """The run lacks what a table or figure needs (no spec leg, no trace, no score leg, ...)."""


@dataclass(frozen=True)
class Table:
    name: str
    compute: Callable[["RunTables"], pd.DataFrame]
    doc: str
    in_summary: bool = True       # also in tables/summary.json (the key numbers), not only as csv


SLIDERS = ("gamma", "relax_logtau")
VIEW_GROUPS = ("legs", "ladder", "serving")


@dataclass(frozen=True)
class View:
    """How the run explorer shows an analysis: one figure, in a box of CSS class ``wb-fig-<box>``.

    Functions of a view take ``(tables, gamma, x)``: the run's ``RunTables``,
    the gamma slider's value (an int, or None where the run has no gamma)
    and the relax_logtau slider's x; they raise ``NotApplicable`` where the
    run lacks what they need.

    - ``empty``: title of the placeholder shown where the run cannot draw it.
    - ``group``: which runs show it: ``"legs"`` (a run of prompt legs) or
      ``"ladder"`` (a cost-ladder run, E16) or ``"serving"`` (a run of serving legs,
      E17); the explorer shows one group.
    - ``sliders``: the sliders that drive it (of ``SLIDERS``); none: drawn
      once per run.
    - ``args``: draw keyword -> slider: the figure is the analysis's own draw
      (as exported) called with these slider values, e.g.
      ``{"marker_x": "relax_logtau"}``.
    - ``figure``: ``figure(tables, gamma, x) -> Figure``, where the figure
      needs more than ``args`` (default: the analysis's draw with ``args``).
    - ``update``: ``update(tables, gamma, x) -> traces`` (plotly traces or
      dicts, or a figure), what a move of one of its sliders changes: each
      carries a ``meta``, and every shown trace whose meta contains it takes
      its other properties, in place. Without one, a view with ``args`` or
      ``figure`` is redrawn at the new slider values and the shown figure is
      edited to match ("redraw with these arguments").
    - ``by_gamma``: traces whose meta has a gamma are shown only at the gamma
      slider's value, except those of the roles in ``always_shown``.
    """
    box: str
    empty: str
    group: str = "legs"
    sliders: tuple[str, ...] = ()
    args: Mapping[str, str] = field(default_factory=dict)
    figure: Callable[..., Any] | None = None
    update: Callable[..., Any] | None = None
    by_gamma: bool = False
    always_shown: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.group not in VIEW_GROUPS:
            raise ValueError(f"view {self.box!r}: group must be one of {VIEW_GROUPS}, got {self.group!r}")
        unknown = [s for s in (*self.sliders, *self.args.values()) if s not in SLIDERS]
        if unknown:
            raise ValueError(f"view {self.box!r}: unknown slider {unknown[0]!r}; sliders: {', '.join(SLIDERS)}")
        missing = [s for s in self.args.values() if s not in self.sliders]
        if self.by_gamma and "gamma" not in self.sliders:
            missing.append("gamma")
        if missing:
            raise ValueError(f"view {self.box!r}: depends on slider {missing[0]!r}; list it in sliders")

    @property
    def redraws(self) -> bool:
        """A slider move redraws the figure (no ``update`` of its own, and the figure depends on a slider)."""
        return self.update is None and bool(self.sliders) and (self.figure is not None or bool(self.args))


@dataclass(frozen=True)
class Analysis:
    name: str
    tables: tuple[str, ...]       # what it reads; the first one is required, the others optional
    draw: Callable[..., Any]      # workbench.plots function: draw(*tables) -> Figure
    doc: str
    view: View | None = None      # its figure in the run explorer (None: exported only)


class RunTables:
    """The tables of one run, computed from its records on demand, each once.

    ``tables[name]`` raises ``NotApplicable`` (or the metrics function's
    ValueError) where the table cannot be made; ``get`` returns None then.
    """

    def __init__(self, run: Run, bins: int = OVER_POSITION_BINS, teacher: bool = True):
        self.run = run
        self.bins = bins
        # False: classify divergences from the run's gap cache only (never load a model; the explorer)
        self.teacher = teacher
        self._cache: dict[str, pd.DataFrame] = {}
        self.errors: dict[str, str] = {}

    # what the table recipes read
    @cached_property
    def records(self) -> pd.DataFrame:
        """Records of engine legs (vanilla and spec; not score legs)."""
        r = self.run.records
        return r[r["mode"].isin(["vanilla", "spec"])] if len(r) else r

    @cached_property
    def has_spec(self) -> bool:
        return bool(len(self.records)) and self.records["tier"].isin(metrics.SPEC_TIERS).any()

    @cached_property
    def has_vanilla(self) -> bool:
        return bool(len(self.records)) and self.records["tier"].eq("vanilla").any()

    @cached_property
    def trace(self) -> metrics.TraceIndex | None:
        """The acceptance trace of every traced spec record, or None where no leg ran with the trace."""
        if not self.has_spec:
            return None
        index = metrics.TraceIndex(self.records)
        return None if index.empty else index

    @cached_property
    def ladder(self) -> tuple[pd.DataFrame, pd.DataFrame] | None:
        """The cost ladder's raw (steps, walls) rows (E16: ``workbench.ladder``), or None where the run has none."""
        from . import ladder
        return ladder.load(self.run.path) if ladder.has_rows(self.run.path) else None

    @cached_property
    def serving(self) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame] | None:
        """The serving legs' (leg table, paired speedups, per-request rows) (E17: ``workbench.serving``), or
        None where the run has no complete serving leg."""
        from . import serving
        return serving.load(self.run.path) if serving.has_serving(self.run.path) else None

    @cached_property
    def leg_styles(self) -> plots.LegStyles:
        """Every leg's label, colour and dash (``workbench.plots.legstyle``), the same in every figure of the run.
        Serving legs are styled from their table (one leg per server and concurrency, E18's drawn acceptance)."""
        if self.serving is not None:
            return plots.LegStyles.from_frame(self.serving[0])
        return plots.LegStyles.from_frame(plots.run_leg_frame(self.run.legs, self.run.config))

    @cached_property
    def leg_targets(self) -> dict[str, str]:
        """Leg -> its target checkpoint as the run wrote it (legs without one are absent)."""
        legs = self.run.legs
        if "target" not in legs.columns:
            return {}
        return {r.leg: r.target for r in legs.itertuples(index=False) if isinstance(r.target, str)}

    @cached_property
    def _legs_with_records(self) -> list[str]:
        """The legs that have records, in run order."""
        have = set(self.records["leg"])
        return [l for l in self.run.legs_order if l in have]

    def _legs_of_tier(self, tier: str) -> list[str]:
        """The legs with records, in run order, whose every record has ``tier``."""
        recs = self.records
        return [l for l in self._legs_with_records if (recs.loc[recs["leg"] == l, "tier"] == tier).all()]

    @cached_property
    def references(self) -> dict[str, str]:
        """Spec leg -> the vanilla leg its output is compared with: the first of its own target (E14 runs
        two targets), else the run's first vanilla leg."""
        vans = self._legs_of_tier("vanilla")
        if not vans:
            return {}
        target_of = self.leg_targets.get
        return {leg: next((v for v in vans if target_of(v) == target_of(leg)), vans[0])
                for leg in self._legs_with_records if leg not in vans}

    @cached_property
    def verdicts(self) -> dict[str, "exactness.Verdict"]:
        """Strict leg -> the exactness rule's verdict against the first vanilla leg of its target.

        Divergences are classified with the float32 target's top-2 gap,
        teacher-forced (``exactness.TeacherGaps``), cached in the run folder's
        ``top2_gaps.json`` (a second target's in ``top2_gaps-2.json``) so a
        copied run opens without the model; where
        neither the cache nor the model has it, a bf16 divergence stays
        unclassified (and fails the rule). ``WORKBENCH_NO_TEACHER=1`` uses the
        cache only.
        """
        recs, legs = self.records, self.run.legs.set_index("leg")
        strict = self._legs_of_tier("strict")
        if not self._legs_of_tier("vanilla") or not strict:
            return {}
        by_pid = lambda leg: dict(zip(recs.loc[recs["leg"] == leg, "pid"], recs.loc[recs["leg"] == leg, "gen_ids"]))
        target_of = self.leg_targets.get
        order_targets = _targets_in_order(self)
        prompts = lambda: {p.pid: p for p in _prompts(self)}  # noqa: E731 (read only if a gap is computed)
        gaps_by_target: dict = {}
        out = {}
        for leg in strict:
            ref = self.references[leg]  # a vanilla leg of the strict leg's own target (E14 runs two)
            target = target_of(ref)
            gaps = None
            if target:
                if target not in gaps_by_target:
                    gaps_by_target[target] = exactness.TeacherGaps(
                        _model_dir(target), prompts,
                        cache=self.run.path / _per_target(exactness.GAPS_CACHE, order_targets, target),
                        cache_only=not self.teacher or os.environ.get("WORKBENCH_NO_TEACHER") == "1")
                gaps = gaps_by_target[target]
            dtype = legs.loc[leg, "dtype"] if "dtype" in legs.columns else None
            # "auto" (or a leg summary without it) is Qwen3-VL's checkpoint dtype, bf16: the lenient rule
            dtype = dtype if isinstance(dtype, str) and dtype != "auto" else "bfloat16"
            out[leg] = exactness.classify(by_pid(ref), by_pid(leg), dtype, gaps)
        return out

    @property
    def dataset(self) -> str | None:
        return (self.run.config.get("dataset") or {}).get("resolved")

    def need(self, ok: bool, what: str) -> None:
        if not ok:
            raise NotApplicable(f"no {what} in this run")

    # access
    def __getitem__(self, name: str) -> pd.DataFrame:
        if name not in self._cache:
            self._cache[name] = TABLES[name].compute(self)
        return self._cache[name]

    def get(self, name: str) -> pd.DataFrame | None:
        """The table, or None where the run cannot make it (a reason other than
        ``NotApplicable`` is kept in ``errors``)."""
        if name not in TABLES:
            raise KeyError(f"unknown table {name!r}; tables: {', '.join(TABLES)}")
        try:
            return self[name]
        except NotApplicable:
            return None
        except (LookupError, ValueError) as exc:
            self.errors[name] = f"{type(exc).__name__}: {exc}"
            return None

    def available(self) -> dict[str, pd.DataFrame]:
        """Every table this run can make, in registry order."""
        return {name: df for name in TABLES if (df := self.get(name)) is not None}


# --------------------------------------------------------------------------- table recipes


def _speedup(t: RunTables) -> pd.DataFrame:
    t.need(t.has_spec and t.has_vanilla, "vanilla and spec legs")
    return metrics.bracketed_speedup(t.records, t.run.legs_order)


def _prompt_speedups(t: RunTables) -> pd.DataFrame:
    t.need(t.has_spec and t.has_vanilla, "vanilla and spec legs")
    return metrics.prompt_speedups(t.records, t.run.legs_order)


def _exactness(t: RunTables) -> pd.DataFrame:
    """Exact-match statistics, and each strict leg judged by the one exactness rule (``workbench.exactness``)."""
    t.need(t.has_spec and t.has_vanilla, "vanilla and spec legs")
    out = metrics.exactness_summary(t.records, refs=t.references)
    verdicts = t.verdicts
    out["dtype"] = [v.dtype if (v := verdicts.get(leg)) else None for leg in out["leg"]]
    for col in ("n_near_tie", "n_error", "n_unclassified"):
        out[col] = [v.as_dict()[col] if (v := verdicts.get(leg)) else None for leg in out["leg"]]
    out["rule_ok"] = [v.ok if (v := verdicts.get(leg)) else None for leg in out["leg"]]
    out["classification"] = [v.describe() if (v := verdicts.get(leg)) else "relaxed tier: may differ by design"
                             for leg in out["leg"]]
    return out


def _divergences(t: RunTables) -> pd.DataFrame:
    """Per strict leg and diverging prompt: first differing token, the fp32 target's top-2 gap there, class."""
    t.need(t.has_spec and t.has_vanilla, "vanilla and spec legs")
    rows = [{"leg": leg, "dtype": v.dtype, "threshold": exactness.threshold(v.dtype), "pid": d.pid,
             "position": d.position, "top2_gap": d.top2_gap, "class": d.kind}
            for leg, v in t.verdicts.items() for d in v.divergences]
    return pd.DataFrame(rows, columns=["leg", "dtype", "threshold", "pid", "position", "top2_gap", "class"])


def _acceptance(t: RunTables) -> pd.DataFrame:
    t.need(t.has_spec, "spec leg")
    return metrics.acceptance(t.records)


def _per_position(t: RunTables) -> pd.DataFrame:
    t.need(t.has_spec, "spec leg")
    return metrics.per_position_acceptance(t.records)


def _over_position(t: RunTables) -> pd.DataFrame:
    t.need(t.trace is not None, "acceptance trace (trace knob off)")
    return t.trace.over_position(t.bins)


def _counterfactual(t: RunTables) -> pd.DataFrame:
    t.need(t.trace is not None, "acceptance trace (trace knob off)")
    return t.trace.curves(RELAX_GRID)


GROUNDED_AUTO_BYTES = 2 << 30


def _token_classes(t: RunTables) -> pd.DataFrame:
    """Per traced spec leg and token class: evaluated draft positions, accepted, rate.

    Classes by the grounded definition (``workbench.grounding``: the float32 target's greedy choice there
    changes with a blank picture, teacher-forced on the leg's output by the leg's own target, cached in
    ``grounded.json``, a second target's in ``grounded-2.json``) where the target can be loaded
    (automatically up to ``GROUNDED_AUTO_BYTES`` of weights, at any size with ``WORKBENCH_GROUNDED=1``)
    or the cache has every output; else by the vocabulary proxy
    (``metrics.image_word_token_ids`` with the target's tokenizer). Column ``definition`` says which.
    """
    from . import grounding

    t.need(t.trace is not None and t.has_spec, "acceptance trace of a spec leg")
    recs = t.records
    traced = recs[recs["trace"].map(lambda x: isinstance(x, dict) and bool(x.get("steps")))]
    t.need(len(traced) > 0, "traced spec output")
    target_of = {leg: t.leg_targets[leg] for leg in traced["leg"].unique() if leg in t.leg_targets}
    t.need(bool(target_of), "target model of the spec legs")
    # each leg's tokens are classed by its own target (E14 runs two), with a cache file per target
    order = _targets_in_order(t)
    parts = [_token_classes_of(t, traced[traced["leg"].map(target_of.get) == target], target,
                               _per_target(grounding.CACHE, order, target))
             for target in dict.fromkeys(target_of.values())]
    out = pd.concat(parts, ignore_index=True)
    tiers = traced.drop_duplicates("leg").set_index("leg")
    for k in ("tier", "blind_mm"):
        if k in tiers.columns:
            out.insert(1, k, out["leg"].map(tiers[k]))
    return out


def _token_classes_of(t: RunTables, traced: pd.DataFrame, target: str, cache: str) -> pd.DataFrame:
    from . import grounding

    model_dir = _model_dir(target)
    # One float32 teacher pass per traced output: automatic for checkpoints up to GROUNDED_AUTO_BYTES on disk
    # (the tiny models, the organism); WORKBENCH_GROUNDED=1 asks for it at any size, 0 never.
    ask = os.environ.get("WORKBENCH_GROUNDED")
    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else 0
    cache_only = (not t.teacher or os.environ.get("WORKBENCH_NO_TEACHER") == "1" or ask == "0"
                  or (ask != "1" and weights > GROUNDED_AUTO_BYTES))
    finder = grounding.GroundedPositions(model_dir, lambda: {p.pid: p for p in _prompts(t)},
                                         cache=t.run.path / cache, cache_only=cache_only)
    rows = list(traced[["pid", "gen_ids"]].itertuples(index=False))
    if finder.available() or all(finder.cached(r.pid, r.gen_ids) for r in rows):
        labels = [finder.labels(r.pid, r.gen_ids) for r in rows]
        out = metrics.token_class_acceptance(traced, set(), position_labels=labels)
        out["definition"] = "grounded: target's greedy choice changes with a blank picture"
    else:
        from transformers import AutoTokenizer

        t.need((Path(model_dir) / "tokenizer_config.json").is_file(), "target model or tokenizer for the token classes")
        ids = metrics.image_word_token_ids(AutoTokenizer.from_pretrained(model_dir))
        out = metrics.token_class_acceptance(traced, ids)
        out["definition"] = "vocabulary proxy (metrics.IMAGE_WORDS)"
    return out


def alpha_from_length(acceptance_length: float, gamma: int) -> float:
    """The per-token acceptance probability alpha whose expected tokens per step, (1 - alpha^(gamma+1)) /
    (1 - alpha), equal the measured acceptance length (bisection; the sum is increasing in alpha)."""
    target = min(max(float(acceptance_length), 1.0), gamma + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(gamma + 1)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _speedup_model(t: RunTables) -> pd.DataFrame:
    """Per spec leg: the measured step costs, the acceptance, the speedup they predict and the measured one.

    c = draft_step_ms / verify_ms (the drafter's propose / gamma over the target's verification step, both
    from the engine's step timer); predicted S = (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)) with
    alpha from the measured acceptance length (so the numerator is that length); measured S = the median
    bracketed speedup (``speedup`` table). ``verify_over_decode``: the verification step over the bracketing
    vanilla legs' decode step (the formula takes it as 1).

    The formula counts decode steps only. ``predicted_with_prefill`` adds what a request of the leg's mean
    output length also pays, from the same step timer: vanilla ``prefill + (n - 1) decode``, spec
    ``prefill + prefill propose + (n - 1) / acceptance length x (verify + propose)``; with short outputs the
    prefill's share is what moves the measured speedup away from the formula.
    """
    t.need(t.has_spec and t.has_vanilla, "vanilla and spec legs")
    legs = t.run.legs.set_index("leg")
    t.need(legs["step_costs"].map(lambda x: isinstance(x, dict) and "verify_ms" in x).any(),
           "step timings (legs run before the step timer was recorded per leg)")
    acc = _acceptance(t).set_index("leg")
    speed = t.get("speedup")
    speed = speed.set_index("leg") if speed is not None else None

    def med(leg, key):
        sc = legs.loc[leg, "step_costs"] if leg in legs.index else None
        v = (sc or {}).get(key) if isinstance(sc, dict) else None
        return v["median"] if isinstance(v, dict) else None

    vanilla = [l for l in legs.index if legs.loc[l, "tier"] == "vanilla" and med(l, "decode_ms") is not None]
    decode = float(np.mean([med(l, "decode_ms") for l in vanilla])) if vanilla else None
    van_prefill = [med(l, "prefill_ms") for l in vanilla if med(l, "prefill_ms") is not None]
    van_prefill = float(np.mean(van_prefill)) if van_prefill else None
    gen_len = t.records.groupby("leg")["gen_len"].mean()
    rows = []
    for leg in acc.index:
        gamma = int(acc.loc[leg, "gamma"])
        verify, draft = med(leg, "verify_ms"), med(leg, "draft_step_ms")
        length = float(acc.loc[leg, "acceptance_length"])
        c = draft / verify if verify and draft is not None else None
        predicted = length / (gamma * c + 1) if c is not None else None
        measured = float(speed.loc[leg, "speedup"]) if speed is not None and leg in speed.index else None
        n, pf, ppf, propose = float(gen_len.get(leg, 0.0)), med(leg, "prefill_ms"), med(leg, "prefill_propose_ms"), \
            med(leg, "propose_ms")
        with_prefill = None
        if None not in (decode, van_prefill, verify, propose, pf, ppf) and n >= 1:
            t_vanilla = van_prefill + (n - 1) * decode
            t_spec = pf + ppf + (n - 1) / length * (verify + propose)
            with_prefill = t_vanilla / t_spec if t_spec > 0 else None
        rows.append({"leg": leg, "tier": acc.loc[leg, "tier"], "gamma": gamma,
                     "acceptance_rate": float(acc.loc[leg, "acceptance_rate"]), "acceptance_length": length,
                     "alpha": alpha_from_length(length, gamma), "decode_ms": decode, "verify_ms": verify,
                     "draft_step_ms": draft, "propose_ms": propose, "c": c,
                     "verify_over_decode": verify / decode if verify and decode else None,
                     "predicted_speedup": predicted, "mean_output_tokens": n,
                     "prefill_ms": pf, "prefill_propose_ms": ppf, "vanilla_prefill_ms": van_prefill,
                     "predicted_with_prefill": with_prefill, "measured_speedup": measured,
                     "measured_over_predicted": measured / predicted if measured and predicted else None})
    return pd.DataFrame(rows)


def _agreement(t: RunTables) -> pd.DataFrame:
    """Per prompt: teacher-forced agreement (score leg) beside realised acceptance (first strict leg)."""
    recs = t.run.records
    score = recs[recs["mode"] == "score"] if len(recs) else recs
    t.need(len(score) > 0, "score leg")
    acc = metrics.prompt_acceptance(t.records)
    strict = acc[acc["tier"] == "strict"]
    t.need(len(strict) > 0, "strict leg to compare the score leg with")
    first = strict[strict["leg"] == strict["leg"].iloc[0]]
    return score[["pid", "agreement", "n_scored"]].merge(
        first[["pid", "leg", "acceptance_rate", "acceptance_length"]], on="pid")


def _legs_throughput(t: RunTables) -> pd.DataFrame:
    recs = t.records
    t.need(len(recs) > 0, "finished engine leg")
    vt = recs.groupby("leg", sort=False).agg(tier=("tier", "first"), n=("pid", "size"),
                                             median_tok_s=("tok_s", "median"),
                                             total_tokens=("gen_len", "sum"), t_max=("t", "max"))
    # total throughput of a leg: all tokens over the time the slowest prompt finished
    vt["throughput_tok_s"] = vt["total_tokens"] / vt["t_max"]
    return vt.reset_index()


def _targets_in_order(t: "RunTables") -> list[str]:
    """The run's target checkpoints in the order its legs first use them (most runs have one; E14 two)."""
    legs = t.run.legs
    if "target" not in legs.columns:
        return []
    order = {leg: i for i, leg in enumerate(t.run.legs_order)}
    rows = sorted(legs.itertuples(index=False), key=lambda r: order.get(r.leg, len(order)))
    return list(dict.fromkeys(r.target for r in rows if isinstance(r.target, str)))


def _per_target(name: str, targets: list[str], target: str) -> str:
    """A teacher cache's file in the run folder for ``target``: ``name`` for the run's first target (so a run
    of one target keeps its one file), ``<stem>-<k>.json`` for the k-th other (a cache belongs to one target)."""
    k = targets.index(target) if target in targets else 0
    return name if k == 0 else f"{Path(name).stem}-{k + 1}{Path(name).suffix}"


def _model_dir(path: str) -> str:
    """A leg's model path as written (relative to where the run was made, the repository root) -> a folder."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return str(p)
    from .envcapture import REPO_ROOT
    return str(REPO_ROOT / p)


def _prompts(t: RunTables) -> list:
    from .prompts import load_prompts
    return load_prompts(t.run.path / t.run.config.get("prompts_file", "prompts.jsonl"), check_images=False)


def _mathvista_accuracy(t: RunTables) -> pd.DataFrame:
    from .datasets.scoring import score_mathvista
    t.need(t.dataset == "mathvista" and len(t.records) > 0, "MathVista prompts")
    prompts = {p.pid: p for p in _prompts(t)}
    rows = []
    for r in t.records.itertuples():
        res = score_mathvista(r.text or "", prompts[r.pid].meta)
        rows.append({"leg": r.leg, "tier": r.tier, "pid": r.pid, "correct": bool(res.get("correct"))})
    return pd.DataFrame(rows).groupby("leg", sort=False).agg(
        tier=("tier", "first"), n=("pid", "size"), accuracy=("correct", "mean")).reset_index()


def _organism_accuracy(t: RunTables) -> pd.DataFrame:
    """Per leg: the organism's rule-scored accuracy on its held-out questions, beside ``chance``: guessing
    uniformly among each question's possible answers (``organism.corpus.chance_level`` over these prompts'
    templates), what a model that does not look at the picture reaches."""
    from .organism.corpus import TEMPLATES, chance_level, score_output
    from .registry import load_registry
    t.need(t.dataset == "organism" and len(t.records) > 0, "organism prompts")
    try:
        style = load_registry().profile(t.run.config.get("profile")).organism
    except Exception:  # noqa: BLE001 - a run folder from elsewhere: judge by what the outputs look like
        style = None
    # a leg's style is its target's variant (E14 under the organism runs both), read from the organism's
    # manifest where the checkpoint is here, else the profile's
    leg_style = {}
    for leg in t.records["leg"].unique():
        target = t.leg_targets.get(leg)
        try:
            leg_style[leg] = json.loads((Path(_model_dir(target)) / "manifest.json").read_text())["variant"]
        except (TypeError, OSError, ValueError, KeyError):
            leg_style[leg] = style
    prompts = {p.pid: p for p in _prompts(t)}
    templates = [p.meta.get("template") for p in prompts.values()]
    chance = chance_level(templates) if templates and all(n in TEMPLATES for n in templates) else float("nan")
    rows = []
    for r in t.records.itertuples():
        meta = prompts[r.pid].meta
        s = leg_style.get(r.leg) or ("thinking" if "<think>" in (r.text or "") else "instruct")
        res = score_output(r.text or "", meta, style=s)
        rows.append({"leg": r.leg, "tier": r.tier, "pid": r.pid, "correct": bool(res["correct"])})
    out = pd.DataFrame(rows).groupby("leg", sort=False).agg(
        tier=("tier", "first"), n=("pid", "size"), accuracy=("correct", "mean")).reset_index()
    out["chance"] = chance
    return out


def _mmvet_capability(t: RunTables) -> pd.DataFrame:
    """Per MM-Vet capability and leg: prompts, tok/s and acceptance length (no grader needed)."""
    from .datasets.scoring import mmvet_capability_table
    t.need(t.dataset == "mmvet" and len(t.records) > 0, "MM-Vet prompts")
    prompts = _prompts(t)
    acc = metrics.prompt_acceptance(t.records)[["leg", "pid", "acceptance_length"]]
    merged = t.records[["leg", "tier", "pid", "tok_s"]].merge(acc, on=["leg", "pid"], how="left")
    parts = []
    for leg, grp in merged.groupby("leg", sort=False):
        part = mmvet_capability_table(grp, prompts=prompts, values=("tok_s", "acceptance_length"))
        part.insert(0, "leg", leg)
        parts.append(part)
    return pd.concat(parts, ignore_index=True)


def _step_costs(t: RunTables) -> pd.DataFrame:
    from . import ladder
    t.need(t.ladder is not None, "cost-ladder leg (steps.jsonl)")
    return ladder.step_costs(t.ladder[0])


def _cost_ratio(t: RunTables) -> pd.DataFrame:
    from . import ladder
    t.need(t.ladder is not None, "cost-ladder leg (steps.jsonl)")
    return ladder.cost_ratio(t["step_costs"], t.ladder[1])


def _first_token_costs(t: RunTables) -> pd.DataFrame:
    from . import ladder
    t.need(t.ladder is not None, "cost-ladder leg (steps.jsonl)")
    return ladder.first_token_costs(t.ladder[0])


def _speedup_curve(t: RunTables) -> pd.DataFrame:
    from . import ladder
    ratios = t["cost_ratio"]
    t.need(len(ratios) > 0, "complete cost-ladder spec leg")
    return ladder.speedup_curve(ratios)


def _serving(t: RunTables, i: int) -> pd.DataFrame:
    t.need(t.serving is not None, "complete serving leg (runner serve)")
    return t.serving[i]


def _serving_legs(t: RunTables) -> pd.DataFrame:
    return _serving(t, 0)


def _serving_speedup(t: RunTables) -> pd.DataFrame:
    t.need(t.serving is not None and (t.serving[0]["tier"] == "vanilla").any()
           and t.serving[0]["tier"].isin(metrics.SPEC_TIERS).any(), "vanilla and spec serving legs")
    return _serving(t, 1)


def _serving_requests(t: RunTables) -> pd.DataFrame:
    return _serving(t, 2)


TABLES: dict[str, Table] = {t.name: t for t in [
    Table("speedup", _speedup, "per spec leg: median bracketed speedup over prompts, IQR (metrics.bracketed_speedup)"),
    Table("prompt_speedups", _prompt_speedups, "per prompt and spec leg: tok/s over the bracketing vanilla legs'"),
    Table("acceptance", _acceptance, "per spec leg: acceptance rate and length from the per-prompt counters"),
    Table("exactness", _exactness, "per spec leg: exact-match rate and first divergence vs the first vanilla leg; "
          "strict legs judged by the exactness rule (workbench.exactness: equal, or bf16 near-ties only)"),
    Table("divergences", _divergences, "per strict leg and diverging prompt: first differing token, float32 "
          "target's top-2 gap there, near-tie / error / unclassified"),
    Table("per_position_acceptance", _per_position, "per spec leg and draft position: accepted at i / drafts"),
    Table("acceptance_over_position", _over_position, "per traced leg: acceptance vs output token position",
          in_summary=False),
    Table("counterfactual_acceptance", _counterfactual,
          "per traced leg: acceptance predicted at each relax x on RELAX_GRID from the recorded margins",
          in_summary=False),
    Table("speedup_model", _speedup_model, "per spec leg: measured step costs (target verification, draft step "
          "= propose / gamma, from the engine's step timer), c, acceptance, the speedup they predict "
          "((1 - a^(g+1)) / ((1 - a)(g c + 1))) beside the measured one"),
    Table("token_classes", _token_classes, "per traced spec leg and token class: acceptance of image-grounded "
          "tokens (the target's greedy choice changes with a blank picture, workbench.grounding) vs the others, "
          "or the vocabulary proxy where the target cannot be loaded"),
    Table("agreement", _agreement, "per prompt (E7): teacher-forced agreement beside realised acceptance"),
    Table("legs_throughput", _legs_throughput, "per engine leg: median tok/s and total throughput"),
    Table("mathvista_accuracy", _mathvista_accuracy, "per leg: rule-scored MathVista accuracy"),
    Table("organism_accuracy", _organism_accuracy, "per leg: the organism's rule-scored accuracy on its held-out "
          "questions (MathVista scorer), beside the mean chance level of their formats"),
    Table("mmvet_capability", _mmvet_capability, "per leg and MM-Vet capability: tok/s, acceptance length"),
    Table("step_costs", _step_costs, "cost ladder (E16): median and IQR ms of the target's decode step, its "
          "verification step (gamma + 1 tokens per request) and the drafter's propose, per size, batch, gamma, "
          "drafter graphs (ladder.step_costs)"),
    Table("cost_ratio", _cost_ratio, "cost ladder (E16): c = (propose / gamma) / verification step per cell, "
          "S(1, gamma, c) = (gamma + 1) / (gamma c + 1), and the measured forced-acceptance speedup, end to end "
          "and decode only (the first token, timed apart, taken off), with the time to the first token"),
    Table("first_token_costs", _first_token_costs, "cost ladder (E16): where the spec engine's first token goes: "
          "the target's prefill (vanilla and spec engine), the draft's first propose, its prefill alone (first "
          "propose - (gamma-1) single-token steps), and (target + draft) / vanilla prefill (ladder.first_token_costs)"),
    Table("speedup_curve", _speedup_curve, "cost ladder (E16): S(alpha, gamma, c) for alpha in [0.5, 0.98] at "
          "each cell's c", in_summary=False),
    Table("serving_legs", _serving_legs, "serving legs (E17): TTFT/TPOT/ITL/E2EL mean, median, p90, p99 ms, output "
          "and request throughput, acceptance from the server counters and the per-request sums (serving.leg_table)"),
    Table("serving_speedup", _serving_speedup, "serving legs (E17): per spec leg, median over the bracketing "
          "vanilla legs of its concurrency of the TPOT speedup and throughput ratio, IQR (serving.paired_speedups)"),
    Table("serving_requests", _serving_requests, "serving legs (E17): one row per request (serving.request_table)",
          in_summary=False),
]}


# --------------------------------------------------------------------------- figures


def _speedup_vs_gamma(speedup: pd.DataFrame, styles: plots.LegStyles | None = None):
    if not speedup["gamma"].notna().any():
        raise NotApplicable("no spec leg with a gamma in this run")
    return plots.speedup_vs_gamma(speedup, styles=styles)


# explorer views: what a slider move computes (View.figure / View.update)


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


ANALYSES: dict[str, Analysis] = {a.name: a for a in [
    Analysis("exactness_table", ("exactness",), plots.exactness_table,
             "exact-match rate and first divergence of each spec leg vs vanilla"),
    Analysis("speedup_vs_gamma", ("speedup",), _speedup_vs_gamma, "median speedup vs gamma with IQR bars",
             view=View("speedup", "Speedup vs γ: needs a vanilla and a spec leg", sliders=("gamma",),
                       update=_speedup_selection)),
    Analysis("speedup_distribution", ("prompt_speedups",), plots.speedup_distribution,
             "per-prompt bracketed speedup, one box per spec leg",
             view=View("distribution", "Per-prompt speedup: needs a vanilla and a spec leg", sliders=("gamma",),
                       by_gamma=True)),
    Analysis("per_position_acceptance", ("per_position_acceptance",), plots.per_position_acceptance,
             "accepted at draft position i / drafts, per spec leg",
             view=View("per-position", "Per-position acceptance: no spec leg", sliders=("gamma", "relax_logtau"),
                       figure=_per_position_view, update=_per_position_predicted, by_gamma=True)),
    Analysis("acceptance_vs_tau", ("acceptance", "counterfactual_acceptance"), plots.acceptance_vs_tau,
             "measured acceptance vs relax x, with the counterfactual curve from the trace",
             view=View("tau", "Acceptance vs τ: no spec leg", sliders=("gamma", "relax_logtau"),
                       args={"marker_x": "relax_logtau"}, update=_tau_markers, by_gamma=True,
                       always_shown=("measured_points",))),
    Analysis("acceptance_over_position", ("acceptance_over_position",), plots.acceptance_over_position,
             "acceptance vs output token position (needs the trace)",
             view=View("over-position", "Acceptance over output position: no trace (run legs with --trace)",
                       sliders=("gamma", "relax_logtau"), figure=_over_position_view, update=_over_position_predicted,
                       by_gamma=True)),
    Analysis("agreement_vs_acceptance", ("agreement",), plots.agreement_vs_acceptance,
             "E7: teacher-forced agreement vs realised acceptance per prompt, Pearson r"),
    Analysis("step_cost_vs_batch", ("step_costs",), plots.step_cost_vs_batch,
             "cost ladder: engine-side step cost vs batch per role (decode, verification, draft step), IQR bars",
             view=View("ladder-steps", "Step cost vs batch: no complete ladder leg", group="ladder")),
    Analysis("c_by_graphs", ("cost_ratio",), plots.cost_ratio_by_graphs,
             "cost ladder: c = draft step / verification step, drafter CUDA graphs on vs off",
             view=View("ladder-c", "c = draft step / verification step: needs a complete spec and vanilla leg",
                       group="ladder")),
    Analysis("speedup_curves", ("speedup_curve", "cost_ratio"), plots.speedup_curves,
             "cost ladder: predicted S(alpha) at the measured c, measured S at alpha = 1, the seed PR's and "
             "QuantSpec's operating points",
             view=View("ladder-speedup", "S(α): needs a complete spec leg", group="ladder", sliders=("gamma",),
                       by_gamma=True)),
    Analysis("serving_summary", ("serving_legs", "serving_speedup"), plots.serving_summary,
             "serving legs: latency percentiles, throughput, acceptance, bracketed TPOT speedup and throughput ratio",
             view=View("serving-summary", "Serving legs: no complete serving leg", group="serving")),
    Analysis("serving_latency", ("serving_requests",), plots.serving_latency,
             "serving legs: per-request TPOT and TTFT, one box per tier at each max concurrency",
             view=View("serving-latency", "Serving latency: no complete serving leg", group="serving")),
    Analysis("serving_throughput", ("serving_legs",), plots.serving_throughput,
             "serving legs: output throughput vs max concurrency per tier",
             view=View("serving-throughput", "Serving throughput: no complete serving leg", group="serving")),
    Analysis("serving_acceptance", ("serving_legs",), plots.serving_acceptance,
             "serving legs: acceptance rate vs max concurrency per spec tier (server counters, per-request sums)",
             view=View("serving-acceptance", "Serving acceptance: no spec serving leg", group="serving")),
]}


def views(group: str | None = None) -> dict[str, View]:
    """Analysis name -> its explorer view, in registry order (of one group, or all)."""
    return {name: a.view for name, a in ANALYSES.items()
            if a.view is not None and (group is None or a.view.group == group)}


def check_names(names: Iterable[str], where: str) -> list[str]:
    """The analysis names of an experiment, refused with a message naming ``where`` if one is unknown."""
    names = list(names)
    unknown = [n for n in names if n not in ANALYSES]
    if unknown:
        raise ValueError(f"{where}: unknown analysis {unknown[0]!r}; analyses: {', '.join(ANALYSES)}")
    return names


def draw_one(tables: RunTables, name: str, **kwargs: Any):
    """The figure of one analysis (``kwargs`` go to its draw function); raises NotApplicable where its
    first table cannot be made or is empty."""
    a = ANALYSES[name]
    first, *optional = a.tables
    if "styles" in inspect.signature(a.draw).parameters:
        kwargs.setdefault("styles", tables.leg_styles)
    return a.draw(_rows(tables, first), *(tables.get(o) for o in optional), **kwargs)


def view_figure(tables: RunTables, name: str, gamma: int | None, x: float):
    """The explorer's figure of analysis ``name`` at slider values (gamma, x): its view's ``figure``, or its
    draw with the view's ``args``."""
    view = ANALYSES[name].view
    if view is None:
        raise KeyError(f"analysis {name!r} has no explorer view")
    if view.figure is not None:
        return view.figure(tables, gamma, x)
    values = {"gamma": gamma, "relax_logtau": x}
    return draw_one(tables, name, **{kw: values[slider] for kw, slider in view.args.items()})


def draw(tables: RunTables, names: Iterable[str] | None = None) -> dict[str, Any]:
    """Figures of the named analyses (default: every registered one) that the run supports.

    Where a named one cannot be drawn (or any one fails), the reason goes to
    ``tables.errors["figure:<name>"]``.
    """
    figs = {}
    for name in (ANALYSES if names is None else check_names(names, "draw")):
        try:
            figs[name] = draw_one(tables, name)
        except NotApplicable as exc:
            if names is not None:  # asked for by name: say why it is missing
                tables.errors[f"figure:{name}"] = f"{type(exc).__name__}: {exc}"
        except (LookupError, ValueError) as exc:
            tables.errors[f"figure:{name}"] = f"{type(exc).__name__}: {exc}"
    return figs


# --------------------------------------------------------------------------- writing a run's tables


def _json_rows(df: pd.DataFrame) -> list[dict[str, Any]]:
    out = []
    for row in df.to_dict(orient="records"):
        clean = {}
        for k, v in row.items():
            if hasattr(v, "item"):
                v = v.item()
            if isinstance(v, float) and math.isnan(v):
                v = None
            if v is pd.NA:
                v = None
            if isinstance(v, (list, dict)):
                continue
            clean[k] = v
        out.append(clean)
    return out


def write_tables(tables: RunTables) -> dict[str, Path]:
    """Every table the run can make -> ``<run>/tables/<name>.csv`` (written whole, then renamed)."""
    tdir = tables.run.path / "tables"
    tdir.mkdir(exist_ok=True)
    written = {}
    for name, df in tables.available().items():
        write_text_atomic(tdir / f"{name}.csv", df.to_csv(index=False))
        written[name] = tdir / f"{name}.csv"
    return written


def summary(tables: RunTables, figures: Iterable[str] = ()) -> dict[str, Any]:
    """The key numbers of a run (what ``tables/summary.json`` holds)."""
    run, cfg = tables.run, tables.run.config
    out: dict[str, Any] = {
        "experiment": cfg.get("experiment"), "run_id": cfg.get("run_id"), "profile": cfg.get("profile"),
        "smoke": cfg.get("smoke"), "dataset": tables.dataset,
        "legs": dict(zip(run.legs["leg"], run.legs["status"])),
    }
    out["n_complete"] = sum(s == "complete" for s in out["legs"].values())
    out["n_failed"] = sum(s == "failed" for s in out["legs"].values())
    for name, df in tables.available().items():
        if TABLES[name].in_summary:
            out[name] = _json_rows(df)
    agreement = tables.get("agreement")
    if agreement is not None and len(agreement) >= 2:
        a = agreement[["agreement", "acceptance_rate"]].astype(float).dropna()
        out["agreement_acceptance_pearson"] = (float(a.corr().iloc[0, 1]) if len(a) >= 2 and a.std().min() > 0
                                               else None)
    out["figures"] = list(figures)
    out["not_computed"] = dict(tables.errors)
    return out


def write_summary(tables: RunTables, figures: Iterable[str] = ()) -> dict[str, Any]:
    """``summary(...)`` -> ``<run>/tables/summary.json`` (written whole, then renamed); returns it."""
    out = summary(tables, figures)
    path = tables.run.path / "tables" / SUMMARY_JSON
    path.parent.mkdir(exist_ok=True)
    write_text_atomic(path, json.dumps(out, indent=2, default=str) + "\n")
    return out


def analyze_run(run_dir: str | Path, figures: bool = True) -> dict[str, Any]:
    """Every table of a run -> ``<run>/tables/*.csv``, its key numbers -> ``tables/summary.json``.

    Figures: the experiment's own analyses (``run.json`` ``analyses``), returned
    under ``_figures`` (``workbench.export`` writes figure files). Everything
    is recomputed from ``legs/*/records.jsonl``, so this can be rerun at any time.
    """
    tables = RunTables(load_run(run_dir))
    write_tables(tables)
    figs = draw(tables, tables.run.config.get("analyses", [])) if figures else {}
    out = write_summary(tables, list(figs))
    out["_figures"] = figs
    return out
