"""Planning: an experiment + profile + overrides -> the ordered, bracketed legs. Pure: no files, no processes.

Spec legs are bracketed by vanilla legs of the same engine shape (vanilla,
spec…, vanilla, spec…, vanilla): machine drift then shows up in the vanilla
legs and is divided out of each spec leg's speedup.

    parse_overrides(["gamma=4", "relax_logtau=0.288,0.693"]) -> dict
    plan(experiment, profile=None, overrides=None, smoke=None) -> Plan
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from workbench.knobs import NOT_ON_CPU, SPEC_ONLY, tier_of
from workbench.registry import (DATASETS, KNOBS, LADDER_FIELDS, ROLES, Experiment, Profile, Registry,
                                RegistryError, check_knob, check_ladder, load_registry, parse_knob_text, split_role,
                                template_fields)

__all__ = ["PlannedLeg", "Plan", "parse_overrides", "plan", "ENGINE_SHAPE", "SPEC_ONLY", "template_fields"]

# Knobs that shape the engine: a spec leg is compared only with vanilla legs that share them.
ENGINE_SHAPE = ("max_num_seqs", "max_tokens", "max_model_len", "n", "dtype", "gpu_memory_utilization",
                "tensor_parallel_size")


# --- planning ----------------------------------------------------------------------------------


def _server_seqs(knobs: dict[str, Any]):
    """A serving leg's server takes the largest client concurrency as its ``max_num_seqs`` (runners.leg_config)."""
    from workbench.knobs import parse_concurrencies

    concs = parse_concurrencies(knobs.get("concurrencies"))
    return max(concs) if concs else knobs.get("max_num_seqs")

@dataclass
class PlannedLeg:
    index: int
    name: str
    kind: str                       # vanilla | spec | score
    tier: str                       # vanilla | strict | relaxed | score
    model: str                      # role reference ("target", "target@8b-instruct")
    draft: str | None = None
    reference: str | None = None    # score legs: the vanilla leg whose output is scored
    template: str | None = None
    knobs: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PlannedLeg":
        return cls(**{k: d.get(k) for k in ("index", "name", "kind", "tier", "model", "draft", "reference",
                                             "template")}, knobs=dict(d.get("knobs") or {}),
                   notes=dict(d.get("notes") or {}))

    def describe(self) -> str:
        k = self.knobs
        if self.kind == "vanilla":
            return f"vanilla {self.model}"
        if self.kind == "score":
            return f"score {self.model} on {self.reference}"
        extra = f" x={k['relax_logtau']}" if self.tier == "relaxed" else ""
        extra += " blind-mm" if k.get("blind_mm") else ""
        return f"{self.tier} {self.model}<-{self.draft} g={k.get('gamma')}{extra}"


@dataclass
class Plan:
    experiment: Experiment
    profile: Profile
    overrides: dict[str, Any]
    smoke: bool
    datasets: list[str]             # candidates in order; the first one that loads is used
    legs: list[PlannedLeg]
    ladder: dict[str, Any] = field(default_factory=dict)   # runner ladder: batches, repeats, prompt_len, size
    own_brackets: bool = False      # each bracket group has its own vanilla legs (``_bracket``)

    @property
    def n(self) -> int:
        return max(int(l.knobs["n"]) for l in self.legs)

    def table(self) -> list[dict[str, Any]]:
        rows = []
        for l in self.legs:
            rows.append({"#": l.index, "leg": l.name, "kind": l.kind, "tier": l.tier, "model": l.model,
                         "draft": l.draft or "", "gamma": l.knobs.get("gamma"),
                         "relax_logtau": l.knobs.get("relax_logtau"), "blind_mm": l.knobs.get("blind_mm"),
                         "draft_cudagraph": l.knobs.get("draft_cudagraph"),
                         "max_num_seqs": _server_seqs(l.knobs), "max_tokens": l.knobs.get("max_tokens"),
                         "n": l.knobs.get("n"), "notes": "; ".join(f"{k}: {v}" for k, v in l.notes.items())})
        return rows

    def config(self) -> dict[str, Any]:
        return {"experiment": self.experiment.id, "title": self.experiment.title,
                "question": self.experiment.question, "profile": self.profile.name,
                "device": self.profile.device, "smoke": self.smoke, "overrides": self.overrides,
                "dataset_candidates": self.datasets, "analyses": self.experiment.analyses,
                "result_prefix": self.experiment.result_prefix, "runner": self.experiment.runner,
                **({"ladder": self.ladder} if self.experiment.runner == "ladder" else {}),
                "load_format": self.profile.load_format or "auto",
                "brackets": "own" if self.own_brackets else "shared",
                "definition": self.experiment.to_dict(),
                "legs": [l.to_dict() for l in self.legs]}


def parse_overrides(items: Iterable[str] | dict[str, Any] | None, experiment: Experiment | None = None
                    ) -> dict[str, Any]:
    """`["gamma=4", "relax_logtau=0.288,0.693"]` -> {"gamma": 4, "relax_logtau": [0.288, 0.693]}.

    A comma list is allowed only for a parameter the experiment sweeps (it replaces the sweep).
    """
    if items is None:
        return {}
    pairs: list[tuple[str, Any]] = []
    if isinstance(items, dict):
        pairs = list(items.items())
    else:
        for item in items:
            if "=" not in item:
                raise RegistryError(f"bad override {item!r}: expected name=value (e.g. gamma=4)")
            k, v = item.split("=", 1)
            pairs.append((k.strip(), v))
    out: dict[str, Any] = {}
    swept = set(experiment.sweep) if experiment else set()
    ladder = experiment is not None and experiment.runner == "ladder"
    for key, value in pairs:
        where = f"override {key}={value}"
        if key in out:
            raise RegistryError(f"{where}: {key!r} given twice")
        if key == "eager" and ladder:
            if isinstance(value, str):
                low = value.strip().lower()
                if low not in ("true", "false"):
                    raise RegistryError(f"{where}: eager takes true or false")
                value = low == "true"
            out[key] = check_ladder(key, value, where)
            continue
        if key in LADDER_FIELDS and ladder:
            if isinstance(value, str):
                try:
                    vals = [int(v) for v in value.split(",")]
                except ValueError:
                    raise RegistryError(f"{where}: {key} takes integers (e.g. batches=1,4,16)") from None
            else:
                vals = value if isinstance(value, list) else [value]
            out[key] = check_ladder(key, vals if key == "batches" else (vals[0] if len(vals) == 1 else vals), where)
            continue
        if key == "legs":  # a subset of the experiment's leg templates, by template name
            names = value.split(",") if isinstance(value, str) else list(value)
            known = [t.name for t in experiment.legs] if experiment else names
            bad = [n for n in names if n not in known]
            if bad:
                raise RegistryError(f"{where}: unknown leg template(s) {bad}; {experiment.id} has {known}")
            out[key] = names
            continue
        if key == "dataset":
            if value not in DATASETS:
                raise RegistryError(f"{where}: unknown dataset {value!r}; datasets: {', '.join(DATASETS)}")
            out[key] = value
            continue
        if key in ("draft", "model"):
            vals = value.split(",") if isinstance(value, str) else (value if isinstance(value, list) else [value])
            for v in vals:
                if split_role(v)[0] not in ROLES:
                    raise RegistryError(f"{where}: unknown role {v!r}; roles: {', '.join(ROLES)}")
            out[key] = vals if len(vals) > 1 else vals[0]
            continue
        if key not in KNOBS:
            raise RegistryError(f"{where}: unknown parameter {key!r}; known: dataset, draft, model, "
                                f"{', '.join(KNOBS)}"
                                + (f", and for the cost ladder {', '.join(LADDER_FIELDS)}" if ladder else ""))
        if isinstance(value, str):
            parts = [p for p in value.split(",")]
            vals = [parse_knob_text(key, p, where) for p in parts]
        elif isinstance(value, list):
            vals = [check_knob(key, v, where) for v in value]
        else:
            vals = [check_knob(key, value, where)]
        if len(vals) > 1 and experiment is not None and key not in swept:
            raise RegistryError(f"{where}: a list of values needs a swept parameter; "
                                f"{experiment.id} sweeps {sorted(swept) or 'nothing'}")
        out[key] = vals if len(vals) > 1 else vals[0]
    return out


def _render(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _check_profile(reg: Registry, exp: Experiment, prof: Profile) -> None:
    """Refuse a profile the experiment does not run under."""
    if exp.profiles and not prof.stand_in and prof.name not in exp.profiles:
        raise RegistryError(f"{exp.id} runs under profile(s) {', '.join(exp.profiles)} (or a stand-in such as "
                            f"tiny), not {prof.name!r}")
    if prof.organism and prof.stand_in:
        # an organism variant stands in for the profiles its `stand_ins` does not map: an experiment that
        # compares two profiles (E14: thinking vs instruct) must find a different organism for each, or it
        # would compare the organism with itself
        others = sorted({split_role(r)[1] for leg in exp.legs for r in (leg.model, leg.draft)
                         if r and split_role(r)[1]})
        by = {o: reg.role_profile(prof, f"target@{o}") for o in others}
        if len(others) > 1 and len({p.organism for p in by.values()}) < len(others):
            said = ", ".join(f"{o} -> {p.name} ({p.organism})" for o, p in by.items())
            raise RegistryError(f"{exp.id} compares profiles {', '.join(others)}; under the organism profile "
                                f"{prof.name!r} they resolve to {said}, so it would compare an organism with "
                                f"itself (map each to its own organism profile in stand_ins)")
    if prof.shapes and exp.runner not in ("ladder", "serve"):
        raise RegistryError(f"profile {prof.name!r} binds shape-only stand-ins with random weights "
                            f"(load_format {prof.load_format or 'auto'}): only the cost ladder and the serving "
                            f"experiment run under it, not {exp.id}")


def _base_knobs(reg: Registry, exp: Experiment, prof: Profile, smoke: bool) -> dict[str, Any]:
    """Every leg's knobs before its template: the registry's defaults, the experiment's, the profile's engine
    settings, then the smoke settings."""
    base = {k: v for k, v in reg.defaults.items() if k != "dataset"}
    base.update(exp.defaults)
    base.update(prof.engine)
    if smoke:
        base.update(reg.smoke_defaults)
        base.update(exp.smoke.knobs)
    base.setdefault("dtype", "auto")
    return base


def _sweep(exp: Experiment, ov: dict[str, Any], smoke: bool) -> tuple[dict[str, list], dict[str, Any]]:
    """The swept values (an override of a swept key replaces its list) and the plain overrides (every other
    knob the overrides set)."""
    sweep = dict(exp.sweep)
    if smoke:
        sweep.update(exp.smoke.sweep)
    for key, val in ov.items():
        if key in sweep:
            sweep[key] = val if isinstance(val, list) else [val]
    plain_ov = {k: v for k, v in ov.items()
                if k not in sweep and k not in ("dataset", "legs") and k not in LADDER_FIELDS}
    return sweep, plain_ov


def _ladder(exp: Experiment, prof: Profile, ov: dict[str, Any], smoke: bool) -> dict[str, Any]:
    """The cost ladder's settings (batches, repeats, prompt_len, size); empty for any other runner."""
    ladder: dict[str, Any] = {}
    if exp.runner == "ladder":
        ladder = dict(exp.ladder)
        if smoke:
            ladder.update(exp.smoke.ladder)
        ladder.update({k: v for k, v in ov.items() if k in LADDER_FIELDS})
        ladder["size"] = ladder_size(prof)
    return ladder


def _templates(exp: Experiment, ov: dict[str, Any], smoke: bool) -> list:
    templates = [t for t in exp.legs if not t.named_only]  # a named_only leg runs when -p legs= names it
    if smoke and exp.smoke.legs and "legs" not in ov:
        templates = [t for t in exp.legs if t.name in exp.smoke.legs]
    if "legs" in ov:
        templates = [t for t in exp.legs if t.name in ov["legs"]]
    return templates


def _leg(t, values: dict[str, Any], base: dict[str, Any], plain_ov: dict[str, Any], where: str) -> PlannedLeg:
    """One leg of template ``t`` at one combination of swept ``values``."""
    used = {k: values[k] for k in template_fields(t.name) if k in values}
    knobs = dict(base)
    knobs.update(t.knobs)
    model, draft = t.model, t.draft
    for k, v in list(used.items()) + list(plain_ov.items()):
        if k == "model":
            model = v
        elif k == "draft":
            draft = v if t.kind == "spec" else draft
        else:
            knobs[k] = v
    lw = f"{where}, leg {t.name}"
    if t.kind == "spec":
        if t.tier == "strict":
            knobs["relax_logtau"] = 0.0
        elif tier_of({"relax_logtau": knobs.get("relax_logtau")}) != "relaxed":
            raise RegistryError(f"{lw}: a relaxed leg needs relax_logtau > 0 (set it on the leg, "
                                f"sweep it, or pass -p relax_logtau=X)")
    else:
        for k in SPEC_ONLY:
            knobs[k] = None
    fmt = dict(knobs)
    fmt.update(model=model, draft=draft)
    name = t.name.format(**{k: _render(v) for k, v in fmt.items()})
    return PlannedLeg(index=-1, name=name, kind=t.kind, tier=tier_of(knobs) if t.kind == "spec" else t.kind,
                      model=model, draft=draft if t.kind == "spec" else None, reference=t.reference,
                      template=t.name, knobs=knobs)


def _expand(templates: list, sweep: dict[str, list], base: dict[str, Any], plain_ov: dict[str, Any],
            where: str) -> list[PlannedLeg]:
    """Every template at every combination of the swept values it uses, each such leg once, in order."""
    expanded: list[PlannedLeg] = []
    seen: set = set()
    keys = list(sweep)
    for combo in itertools.product(*(sweep[k] for k in keys)) if keys else [()]:
        values = dict(zip(keys, combo))
        for t in templates:
            used = {k: values[k] for k in template_fields(t.name) if k in values}
            ident = (t.name, tuple(sorted((k, repr(v)) for k, v in used.items())))
            if ident in seen:
                continue
            seen.add(ident)
            expanded.append(_leg(t, values, base, plain_ov, where))
    return expanded


def _number(legs: list[PlannedLeg], prof: Profile, ladder: dict[str, Any], where: str) -> None:
    """Index the legs in order, note the knobs that do not apply on a CPU, give a ladder engine the largest
    batch; refuse repeated leg names."""
    for i, leg in enumerate(legs):
        leg.index = i
        if prof.device == "cpu" and leg.kind == "spec":
            for k in NOT_ON_CPU:
                leg.notes[k] = f"not applicable on CPU (requested: {_render(leg.knobs[k])})"
        if ladder:  # one engine per leg takes every batch of the ladder
            leg.knobs["max_num_seqs"] = max(ladder["batches"])
    names = [l.name for l in legs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise RegistryError(f"{where}: planned leg names repeat: {dup}")


def _datasets(exp: Experiment, prof: Profile, ov: dict[str, Any]) -> list[str]:
    """The data set candidates, in order (none for the cost ladder, which decodes random token ids)."""
    if exp.runner == "ladder":
        if "dataset" in ov:
            raise RegistryError(f"{exp.id}: the cost ladder decodes random prompt token ids; it takes no dataset")
        return []
    if "dataset" in ov:
        return [ov["dataset"]]
    if prof.tiny:
        return list(exp.smoke.datasets or ["tiny"])
    if prof.organism:
        # the organism answers its own corpus's questions (held-out test split), whatever the experiment's set
        return ["organism"]
    return [exp.dataset]


def plan(experiment: str | Experiment, profile: str | None = None, overrides: Any = None,
         smoke: bool | None = None, registry: Registry | None = None, own_brackets: bool = False) -> Plan:
    """Expand an experiment into its ordered, bracketed legs (no side effects).

    ``own_brackets``: no vanilla leg is shared by two brackets (V s s V V s s V instead of V s s V s s V),
    so that each bracket group can run on a GPU of its own (``workbench.groups``; the Ray executor)."""
    reg = registry or load_registry()
    exp = experiment if isinstance(experiment, Experiment) else reg.experiment(experiment)
    if profile is None:
        profile = exp.profiles[0] if exp.profiles else "8b-thinking"
    prof = reg.profile(profile)
    _check_profile(reg, exp, prof)
    if smoke is None:
        smoke = prof.default_smoke
    ov = parse_overrides(overrides, exp)

    base = _base_knobs(reg, exp, prof, smoke)
    sweep, plain_ov = _sweep(exp, ov, smoke)
    ladder = _ladder(exp, prof, ov, smoke)
    where = f"experiment {exp.id}"
    expanded = _expand(_templates(exp, ov, smoke), sweep, base, plain_ov, where)
    legs = _bracket(expanded, exp.bracket_every if not (smoke and exp.smoke.bracket_every is not True)
                    else exp.smoke.bracket_every, own_brackets)
    _number(legs, prof, ladder, where)
    return Plan(experiment=exp, profile=prof, overrides=ov, smoke=bool(smoke), datasets=_datasets(exp, prof, ov),
                legs=legs, ladder=ladder, own_brackets=bool(own_brackets))


def ladder_size(prof: Profile) -> str:
    """The model size a cost-ladder run measures under a profile: ``8b`` for the 8b-target stand-in, ``tiny``."""
    if prof.shapes:
        return prof.roles["target"].rsplit("-", 1)[0]
    return "tiny" if prof.tiny else prof.name


def _shape(leg: PlannedLeg) -> tuple:
    return (leg.model,) + tuple(repr(leg.knobs.get(k)) for k in ENGINE_SHAPE)


def _vanilla_like(leg: PlannedLeg, number: int) -> PlannedLeg:
    knobs = dict(leg.knobs)
    for k in SPEC_ONLY:
        knobs[k] = None
    return PlannedLeg(index=-1, name=f"vanilla_{number}", kind="vanilla", tier="vanilla", model=leg.model,
                      knobs=knobs)


def _bracket(expanded: list[PlannedLeg], every: int | None, own: bool = False) -> list[PlannedLeg]:
    """Insert vanilla legs: V spec.. V spec.. V, at most `every` spec legs between two vanilla legs.

    ``own``: a full bracket is closed and the next one opened by a vanilla leg of its own
    (V spec.. V V spec.. V): one vanilla leg more per bracket, and no vanilla leg belongs to two
    brackets, so each bracket can run on another GPU with both its vanilla legs on its own.

    A spec leg's two neighbouring vanilla legs always share its engine shape (target, concurrency,
    max_tokens, ...), so the paired ratio compares like with like. Score legs go last because they read
    a vanilla leg's output.
    """
    spec = [l for l in expanded if l.kind == "spec"]
    score = [l for l in expanded if l.kind == "score"]
    explicit_vanilla = [l for l in expanded if l.kind == "vanilla"]
    if every is None:
        out = [l for l in expanded if l.kind != "score"]
    else:
        out = list(explicit_vanilla)
        n_van = 0
        prev_shape = None
        chunk: list[PlannedLeg] = []

        def flush():
            nonlocal n_van
            if chunk:
                out.extend(chunk)
                n_van += 1
                out.append(_vanilla_like(chunk[0], n_van))
                chunk.clear()

        for leg in spec:
            shape = _shape(leg)
            if shape != prev_shape:
                flush()
                n_van += 1
                out.append(_vanilla_like(leg, n_van))
                prev_shape = shape
            elif len(chunk) >= every:
                flush()
                if own:
                    n_van += 1
                    out.append(_vanilla_like(leg, n_van))
            chunk.append(leg)
        flush()
        if not spec and score:
            # A scoring-only plan still needs the reference output.
            n_van += 1
            out.append(_vanilla_like(score[0], n_van))
            out[-1].model = score[0].reference or "target"
    for s in score:
        ref = next((l for l in out if l.kind == "vanilla" and l.model == s.reference), None)
        if ref is None:
            raise RegistryError(f"score leg {s.name}: no vanilla leg of {s.reference!r} to score against")
        s.reference = ref.name
        s.tier = "score"
        out.append(s)
    return out
