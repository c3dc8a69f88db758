"""Loading ``experiments.yaml`` and ``profiles.yaml``: every error names the experiment or profile and field."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import yaml

from workbench.knobs import KNOBS, SPEC_ONLY, tier_of

from .checks import (DATASETS, EXPERIMENTS_FILE, LADDER_DEFAULTS, LADDER_FIELDS, LEG_KINDS, LOAD_FORMATS,
                     ORGANISM_ROLES, ORGANISM_VARIANTS, PROFILES_FILE, ROLES, RUNNERS, RegistryError, SHAPE_ROLES,
                     SWEEPABLE, TIERS, TINY_ROLES, _ENGINE_KNOBS, _EXPERIMENT_FIELDS, _ID_RE, _LEG_FIELDS,
                     _LEG_NAME_RE, _PROFILE_FIELDS, _SMOKE_FIELDS, check_knob, check_ladder, split_role,
                     template_fields)
from .entries import Experiment, LegTemplate, Profile, Registry, Smoke


# --- loading -----------------------------------------------------------------------------------

def _need_mapping(obj: Any, where: str) -> dict:
    if not isinstance(obj, dict):
        raise RegistryError(f"{where}: expected a mapping, got {type(obj).__name__}")
    return obj


def _need_str(obj: Any, where: str) -> str:
    if not isinstance(obj, str) or not obj.strip():
        raise RegistryError(f"{where}: expected a non-empty string, got {obj!r}")
    return obj


def _unknown(obj: dict, allowed: set, where: str) -> None:
    bad = sorted(set(obj) - allowed)
    if bad:
        raise RegistryError(f"{where}: unknown field(s) {bad}; allowed: {sorted(allowed)}")


def _check_knobs(obj: dict, where: str, allowed: set | None = None) -> dict[str, Any]:
    out = {}
    for k, v in obj.items():
        if allowed is not None and k not in allowed:
            raise RegistryError(f"{where}: field {k!r} not allowed here; allowed: {sorted(allowed)}")
        out[k] = check_knob(k, v, f"{where}.{k}")
    return out


def _load_profiles(raw: Any, where: str) -> dict[str, Profile]:
    raw = _need_mapping(raw, where)
    _unknown(raw, {"version", "profiles"}, where)
    profs = _need_mapping(raw.get("profiles"), f"{where}: profiles")
    out: dict[str, Profile] = {}
    for name, body in profs.items():
        w = f"profile {name}"
        body = _need_mapping(body, w)
        _unknown(body, _PROFILE_FIELDS, w)
        device = body.get("device", "gpu")
        if device not in ("cpu", "gpu"):
            raise RegistryError(f"{w}.device: must be cpu or gpu, got {device!r}")
        for flag in ("tiny", "stand_in", "default_smoke", "shapes"):
            if not isinstance(body.get(flag, False), bool):
                raise RegistryError(f"{w}.{flag}: must be true or false, got {body.get(flag)!r}")
        shapes = body.get("shapes", False)
        if shapes and (body.get("tiny") or body.get("stand_in")):
            raise RegistryError(f"{w}: a shapes profile is neither tiny nor a stand-in")
        organism = body.get("organism")
        if organism is not None and organism not in ORGANISM_VARIANTS:
            raise RegistryError(f"{w}.organism: must be one of {', '.join(ORGANISM_VARIANTS)}, got {organism!r}")
        if organism is not None and (shapes or body.get("tiny")):
            raise RegistryError(f"{w}: an organism profile is neither tiny nor a shapes profile")
        load_format = body.get("load_format")
        if load_format is not None and load_format not in LOAD_FORMATS:
            raise RegistryError(f"{w}.load_format: must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
        roles = _need_mapping(body.get("roles"), f"{w}.roles")
        shape_dirs = _shape_folders() if shapes else ()
        for role, target in roles.items():
            if role not in (SHAPE_ROLES if shapes else ROLES):
                raise RegistryError(f"{w}.roles: unknown role {role!r}"
                                    + (f"; a shapes profile binds {', '.join(SHAPE_ROLES)}" if shapes
                                       else f"; roles: {', '.join(ROLES)}"))
            _need_str(target, f"{w}.roles.{role}")
            if body.get("tiny") and target not in TINY_ROLES:
                raise RegistryError(f"{w}.roles.{role}: {target!r} is not a tiny model role "
                                    f"({', '.join(TINY_ROLES)})")
            if organism is not None and target not in ORGANISM_ROLES:
                raise RegistryError(f"{w}.roles.{role}: {target!r} is not an organism model role "
                                    f"({', '.join(ORGANISM_ROLES)})")
            if shapes and target not in shape_dirs:
                raise RegistryError(f"{w}.roles.{role}: {target!r} is not a workbench.shapes stand-in "
                                    f"({', '.join(shape_dirs)})")
        missing = [r for r in (SHAPE_ROLES if shapes else ROLES) if r not in roles]
        if organism is not None:  # these must exist; the others are refused per leg when unbound
            missing = [r for r in ("target", "twin") if r not in roles]
        if missing:
            raise RegistryError(f"{w}.roles: missing role(s) {missing}")
        engine = _check_knobs(_need_mapping(body.get("engine", {}), f"{w}.engine"), f"{w}.engine",
                              allowed=_ENGINE_KNOBS)
        stand_ins = _need_mapping(body.get("stand_ins", {}), f"{w}.stand_ins")
        if stand_ins and not body.get("stand_in"):
            raise RegistryError(f"{w}.stand_ins: only a stand-in profile (stand_in: true) maps other profiles")
        out[str(name)] = Profile(name=str(name), description=str(body.get("description", "")), device=device,
                                 roles=dict(roles), engine=engine, tiny=body.get("tiny", False),
                                 stand_in=body.get("stand_in", False),
                                 default_smoke=body.get("default_smoke", False), shapes=shapes,
                                 load_format=load_format, organism=organism,
                                 stand_ins={str(k): str(v) for k, v in stand_ins.items()})
    if not out:
        raise RegistryError(f"{where}: no profiles defined")
    for name, prof in out.items():
        for other, by in prof.stand_ins.items():
            w = f"profile {name}.stand_ins.{other}"
            if other not in out or out[other].stand_in:
                raise RegistryError(f"{w}: {other!r} is not a profile that a stand-in stands in for")
            if by not in out or not out[by].stand_in or by == name:
                raise RegistryError(f"{w}: {by!r} is not another stand-in profile")
            if bool(out[by].organism) != bool(prof.organism) or out[by].tiny != prof.tiny:
                raise RegistryError(f"{w}: {by!r} is not a stand-in of the same kind as {name!r} "
                                    f"(organism / tiny)")
    return out


def _shape_folders() -> tuple[str, ...]:
    from workbench.shapes import DRAFT_SHAPES, SHAPES
    return tuple(f"{size}-{role}" for size in SHAPES for role in ("target", "twin")) + tuple(DRAFT_SHAPES)


def _load_ladder(raw: Any, where: str, required: bool) -> dict[str, Any]:
    raw = _need_mapping(raw if raw is not None else {}, where)
    out = {k: check_ladder(k, v, f"{where}.{k}") for k, v in raw.items()}
    if required:
        missing = [k for k in LADDER_FIELDS if k not in out and k not in LADDER_DEFAULTS]
        if missing:
            raise RegistryError(f"{where}: missing setting(s) {missing}")
        out = {**LADDER_DEFAULTS, **out}
    return out


def _check_role_ref(ref: Any, where: str, profiles: dict[str, Profile]) -> str:
    _need_str(ref, where)
    role, prof = split_role(ref)
    if role not in ROLES:
        raise RegistryError(f"{where}: unknown role {role!r}; roles: {', '.join(ROLES)}")
    if prof is not None and prof not in profiles:
        raise RegistryError(f"{where}: unknown profile {prof!r} in role {ref!r}; profiles: {', '.join(profiles)}")
    return ref


def _check_sweep_value(key: str, value: Any, where: str, profiles: dict[str, Profile]) -> Any:
    if key in ("draft", "model"):
        return _check_role_ref(value, where, profiles)
    return check_knob(key, value, where)


def _load_sweep(raw: Any, where: str, profiles: dict[str, Profile]) -> dict[str, list]:
    raw = _need_mapping(raw if raw is not None else {}, where)
    out: dict[str, list] = {}
    for key, values in raw.items():
        if key not in SWEEPABLE:
            raise RegistryError(f"{where}: cannot sweep {key!r}; sweepable: {', '.join(SWEEPABLE)}")
        if not isinstance(values, list) or not values:
            raise RegistryError(f"{where}.{key}: expected a non-empty list of values, got {values!r}")
        checked = [_check_sweep_value(key, v, f"{where}.{key}[{i}]", profiles) for i, v in enumerate(values)]
        if len(set(map(repr, checked))) != len(checked):
            raise RegistryError(f"{where}.{key}: duplicate values in {values!r}")
        out[key] = checked
    return out


def _load_leg(raw: Any, where: str, profiles: dict[str, Profile]) -> LegTemplate:
    raw = _need_mapping(raw, where)
    name = _need_str(raw.get("name"), f"{where}.name")
    where = f"{where} ({name})"
    _unknown(raw, _LEG_FIELDS, where)
    for f in template_fields(name):
        if f not in SWEEPABLE:
            raise RegistryError(f"{where}.name: placeholder {{{f}}} is not a knob or role field; "
                                f"allowed: {', '.join(SWEEPABLE)}")
    if not _LEG_NAME_RE.match(re.sub(r"\{[^}]*\}", "x", name)):
        raise RegistryError(f"{where}.name: only letters, digits, '_', '.', '-' and {{placeholders}} allowed")
    kind = raw.get("kind")
    if kind not in LEG_KINDS:
        raise RegistryError(f"{where}.kind: must be one of {', '.join(LEG_KINDS)}, got {kind!r}")
    model = _check_role_ref(raw.get("model", "target"), f"{where}.model", profiles)
    draft = raw.get("draft")
    tier = raw.get("tier")
    reference = raw.get("reference")
    knobs = {k: check_knob(k, v, f"{where}.{k}") for k, v in raw.items() if k in KNOBS}
    if kind == "spec":
        draft = _check_role_ref(draft, f"{where}.draft", profiles) if draft is not None else None
        if draft is None:
            raise RegistryError(f"{where}: a spec leg needs a 'draft' role")
        if tier not in TIERS:
            raise RegistryError(f"{where}.tier: must be one of {', '.join(TIERS)}, got {tier!r}")
        # the tier a relax_logtau set on the leg gives (``tier_of``) must be the one declared
        if "relax_logtau" in knobs and tier_of({"relax_logtau": knobs["relax_logtau"]}) != tier:
            if tier == "strict":
                raise RegistryError(f"{where}: a strict leg cannot set relax_logtau (got {knobs['relax_logtau']})")
            raise RegistryError(f"{where}: a relaxed leg needs relax_logtau > 0")
    else:
        for fname, val in (("draft", draft), ("tier", tier)):
            if val is not None:
                raise RegistryError(f"{where}: a {kind} leg takes no {fname!r}")
        bad = sorted(set(knobs) & set(SPEC_ONLY) - {"trace"})
        if bad:
            raise RegistryError(f"{where}: knob(s) {bad} do not apply to a {kind} leg")
    if kind == "score":
        reference = _check_role_ref(reference or "target", f"{where}.reference", profiles)
    elif reference is not None:
        raise RegistryError(f"{where}: only a score leg takes 'reference'")
    named_only = raw.get("named_only", False)
    if not isinstance(named_only, bool):
        raise RegistryError(f"{where}.named_only: expected true or false, got {named_only!r}")
    return LegTemplate(name=name, kind=kind, model=model, draft=draft, tier=tier, reference=reference,
                       knobs=knobs, named_only=named_only)


def _load_bracket(raw: Any, where: str, default: int | None) -> int | None:
    if raw is None:
        return default
    if raw is False:
        return None
    raw = _need_mapping(raw, where)
    _unknown(raw, {"every"}, where)
    every = raw.get("every")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise RegistryError(f"{where}.every: must be an integer >= 1, got {every!r}")
    return every


def _load_dataset(raw: Any, where: str) -> str:
    if raw not in DATASETS:
        raise RegistryError(f"{where}: unknown dataset {raw!r}; datasets: {', '.join(DATASETS)}")
    return raw


def _load_experiment(exp_id: str, raw: Any, defaults: dict, profiles: dict[str, Profile]) -> Experiment:
    w = f"experiment {exp_id}"
    if not isinstance(exp_id, str) or not _ID_RE.match(exp_id):
        raise RegistryError(f"{w}: id must look like E<number>")
    raw = _need_mapping(raw, w)
    _unknown(raw, _EXPERIMENT_FIELDS, w)
    title = _need_str(raw.get("title"), f"{w}.title")
    question = _need_str(raw.get("question"), f"{w}.question")
    dataset = _load_dataset(raw.get("dataset", defaults.get("dataset", "mathvista")), f"{w}.dataset")
    exp_defaults = _check_knobs(_need_mapping(raw.get("defaults", {}), f"{w}.defaults"), f"{w}.defaults")
    legs_raw = raw.get("legs")
    if not isinstance(legs_raw, list) or not legs_raw:
        raise RegistryError(f"{w}.legs: expected a non-empty list of legs")
    legs = [_load_leg(l, f"{w}.legs[{i}]", profiles) for i, l in enumerate(legs_raw)]
    runner = raw.get("runner", "legs")
    if runner not in RUNNERS:
        raise RegistryError(f"{w}.runner: must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if runner == "ladder":
        # one engine per leg, timed step by step: no score legs, no vanilla legs added around spec legs
        for t in legs:
            if t.kind == "score":
                raise RegistryError(f"{w}: leg {t.name}: a ladder experiment has vanilla and spec legs only")
        if raw.get("bracket") not in (None, False):
            raise RegistryError(f"{w}.bracket: a ladder experiment runs its legs as listed (bracket: false)")
        if "ladder" not in raw:
            raise RegistryError(f"{w}: runner ladder needs a 'ladder' mapping ({', '.join(LADDER_FIELDS)})")
    elif "ladder" in raw:
        raise RegistryError(f"{w}.ladder: only an experiment with runner: ladder takes ladder settings")
    ladder = _load_ladder(raw.get("ladder"), f"{w}.ladder", required=True) if runner == "ladder" else {}
    names = [t.name for t in legs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise RegistryError(f"{w}.legs: duplicate leg name(s) {dup}")
    sweep = _load_sweep(raw.get("sweep"), f"{w}.sweep", profiles)
    for key in sweep:
        if not any(key in template_fields(t.name) for t in legs):
            raise RegistryError(f"{w}.sweep.{key}: no leg name template mentions {{{key}}}, "
                                f"so the sweep would produce identical leg names")
    bracket = _load_bracket(raw.get("bracket"), f"{w}.bracket", None if runner == "ladder" else 2)
    if bracket is None and not any(t.kind == "vanilla" for t in legs) and any(t.kind == "spec" for t in legs):
        raise RegistryError(f"{w}: bracket is false but no vanilla leg is listed; "
                            f"speedup needs vanilla legs")
    analyses = raw.get("analyses", [])
    if not isinstance(analyses, list) or not all(isinstance(a, str) and a for a in analyses):
        raise RegistryError(f"{w}.analyses: expected a list of analysis names, got {analyses!r}")
    known = analysis_names()
    unknown = [a for a in analyses if a not in known]
    if unknown:
        raise RegistryError(f"{w}.analyses: unknown analysis {unknown[0]!r}; analyses: {', '.join(known)}")
    profs = raw.get("profiles", [])
    if not isinstance(profs, list):
        raise RegistryError(f"{w}.profiles: expected a list of profile names, got {profs!r}")
    for p in profs:
        if p not in profiles:
            raise RegistryError(f"{w}.profiles: unknown profile {p!r}; profiles: {', '.join(profiles)}")
        if profiles[p].stand_in:
            raise RegistryError(f"{w}.profiles: {p!r} is a stand-in profile; it is always allowed")
    smoke = _load_smoke(raw.get("smoke", {}), f"{w}.smoke", legs, sweep, profiles)
    if smoke.ladder and runner != "ladder":
        raise RegistryError(f"{w}.smoke.ladder: only an experiment with runner: ladder takes ladder settings")
    prefix = raw.get("result_prefix")
    if prefix is not None:
        _need_str(prefix, f"{w}.result_prefix")
    return Experiment(id=exp_id, title=title, question=question, dataset=dataset, legs=legs, sweep=sweep,
                      defaults=exp_defaults, analyses=list(analyses), smoke=smoke, bracket_every=bracket,
                      profiles=list(profs), result_prefix=prefix, notes=raw.get("notes"), runner=runner,
                      ladder=ladder)


def _load_smoke(raw: Any, where: str, legs: list[LegTemplate], sweep: dict, profiles) -> Smoke:
    raw = _need_mapping(raw if raw is not None else {}, where)
    _unknown(raw, _SMOKE_FIELDS, where)
    knobs = {k: check_knob(k, v, f"{where}.{k}") for k, v in raw.items() if k in KNOBS}
    ssweep = _load_sweep(raw.get("sweep"), f"{where}.sweep", profiles)
    for key in ssweep:
        if key not in sweep:
            raise RegistryError(f"{where}.sweep.{key}: the experiment does not sweep {key!r}")
    leg_names = raw.get("legs")
    if leg_names is not None:
        if not isinstance(leg_names, list) or not leg_names:
            raise RegistryError(f"{where}.legs: expected a non-empty list of leg name templates")
        known = [t.name for t in legs]
        for n in leg_names:
            if n not in known:
                raise RegistryError(f"{where}.legs: unknown leg template {n!r}; legs: {', '.join(known)}")
    datasets = raw.get("dataset")
    if datasets is not None:
        if isinstance(datasets, str):
            datasets = [datasets]
        if not isinstance(datasets, list) or not datasets:
            raise RegistryError(f"{where}.dataset: expected a dataset name or a list of fallbacks")
        datasets = [_load_dataset(d, f"{where}.dataset") for d in datasets]
    bracket = raw.get("bracket")
    bracket_every = True if bracket is None else _load_bracket(bracket, f"{where}.bracket", None)
    ladder = _load_ladder(raw.get("ladder"), f"{where}.ladder", required=False)
    return Smoke(knobs=knobs, sweep=ssweep, legs=leg_names, datasets=datasets, bracket_every=bracket_every,
                 ladder=ladder)


def _read_yaml(path: Path) -> Any:
    try:
        with open(path, "r", encoding="utf-8") as fh:
            return yaml.safe_load(fh)
    except FileNotFoundError:
        raise RegistryError(f"registry file not found: {path}") from None
    except yaml.YAMLError as exc:
        raise RegistryError(f"{path}: not valid YAML ({exc})") from None


_ANALYSES_PY = Path(__file__).resolve().parents[1] / "analyses" / "figures.py"


@functools.lru_cache(maxsize=1)
def analysis_names() -> tuple[str, ...]:
    """The names of ``workbench.analyses.ANALYSES``, read from its source without importing it.

    The catalogue (``workbench list|show|legs``, ``doctor``) must load on a host without pandas and
    plotly, which importing the analysis registry needs; the names are the first argument of each
    ``Analysis(...)`` in the ``ANALYSES`` table. A test checks they equal the imported table's keys.
    """
    import ast

    tree = ast.parse(_ANALYSES_PY.read_text(encoding="utf-8"), str(_ANALYSES_PY))
    names: list[str] = []
    for node in ast.walk(tree):
        value = None
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ANALYSES" for t in node.targets):
            value = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "ANALYSES":
            value = node.value
        if value is None:
            continue
        for call in ast.walk(value):
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "Analysis":
                arg = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "name"), None)
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    names.append(arg.value)
    if not names:
        raise RegistryError(f"{_ANALYSES_PY}: no Analysis(...) entries found in ANALYSES")
    return tuple(names)


def load_registry(experiments_path: str | Path | None = None,
                  profiles_path: str | Path | None = None) -> Registry:
    """Load and validate experiments + profiles; every error names the experiment/profile and field."""
    ep = Path(experiments_path) if experiments_path else EXPERIMENTS_FILE
    pp = Path(profiles_path) if profiles_path else PROFILES_FILE
    profiles = _load_profiles(_read_yaml(pp), str(pp.name))
    raw = _need_mapping(_read_yaml(ep), ep.name)
    _unknown(raw, {"version", "defaults", "smoke_defaults", "experiments"}, ep.name)
    defaults_raw = dict(_need_mapping(raw.get("defaults", {}), f"{ep.name}: defaults"))
    dataset = _load_dataset(defaults_raw.pop("dataset", "mathvista"), f"{ep.name}: defaults.dataset")
    defaults = _check_knobs(defaults_raw, f"{ep.name}: defaults")
    missing = [k for k in KNOBS if k not in defaults and k != "dtype"]
    if missing:
        raise RegistryError(f"{ep.name}: defaults must set every knob; missing {missing}")
    defaults["dataset"] = dataset
    smoke_defaults = _check_knobs(_need_mapping(raw.get("smoke_defaults", {}), f"{ep.name}: smoke_defaults"),
                                  f"{ep.name}: smoke_defaults")
    exps_raw = _need_mapping(raw.get("experiments"), f"{ep.name}: experiments")
    experiments = {str(k): _load_experiment(k, v, defaults, profiles) for k, v in exps_raw.items()}
    return Registry(experiments=experiments, profiles=profiles, defaults=defaults,
                    smoke_defaults=smoke_defaults, source=str(ep))
