"""``RunTables``: the tables of one run, computed from its records on demand, each once."""

from __future__ import annotations

import os
from functools import cached_property

import pandas as pd

from .. import exactness, metrics, plots
from ..results import Run
from .base import OVER_POSITION_BINS, NotApplicable
from .tables import TABLES, _model_dir, _per_target, _prompts, _targets_in_order


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
        from .. import ladder
        return ladder.load(self.run.path) if ladder.has_rows(self.run.path) else None

    @cached_property
    def serving(self) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame] | None:
        """The serving legs' (leg table, paired speedups, per-request rows) (E17: ``workbench.serving``), or
        None where the run has no complete serving leg."""
        from .. import serving
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
