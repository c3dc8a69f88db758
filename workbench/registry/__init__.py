"""E1–E18 declared as data (experiments.yaml) and the model profiles (profiles.yaml).

Both files are validated when loaded: a typo in a knob name, a role that no
profile binds, or a value of the wrong type is an error naming the experiment
(or profile) and the field, not something discovered half-way through a run.

Public API:
    load_registry(experiments_path=None, profiles_path=None) -> Registry
    Registry.experiment(id) / Registry.profile(name) / Registry.ids()
    check_knob(name, value, where) -> value       (type + range check)
    parse_knob_text(name, text, where) -> value   (CLI `-p name=value` strings)
    split_role(ref) -> (role, profile or None)    ("twin@8b-instruct")

The package: ``checks`` (vocabulary, value checks), ``entries`` (the data classes), ``loading`` (reading and
validating the YAML files, ``load_registry``). Every name is importable from ``workbench.registry``.
"""

from workbench.knobs import KNOBS, SPEC_ONLY, Knob, KnobError, tier_of  # noqa: F401  (re-exported)

from .checks import (DATASETS, EXPERIMENTS_FILE, KnobSpec, LADDER_DEFAULTS, LADDER_FIELDS, LEG_KINDS, LOAD_FORMATS,
                     ORGANISM_ROLES, ORGANISM_VARIANTS, PACKAGE_DIR, PROFILES_FILE, ROLES, RUNNERS, RegistryError,
                     SHAPE_ROLES, SWEEPABLE, TIERS, TINY_ROLES, _ENGINE_KNOBS, _EXPERIMENT_FIELDS, _ID_RE,
                     _LEG_FIELDS, _LEG_NAME_RE, _PROFILE_FIELDS, _SMOKE_FIELDS, check_knob, check_ladder,
                     parse_knob_text, split_role, template_fields)
from .entries import Experiment, LegTemplate, Profile, Registry, Smoke
from .loading import (_ANALYSES_PY, _check_knobs, _check_role_ref, _check_sweep_value, _load_bracket,
                      _load_dataset, _load_experiment, _load_ladder, _load_leg, _load_profiles, _load_smoke,
                      _load_sweep, _need_mapping, _need_str, _read_yaml, _shape_folders, _unknown, analysis_names,
                      load_registry)

__all__ = [
    "RegistryError", "KnobSpec", "KNOBS", "ROLES", "TINY_ROLES", "ORGANISM_ROLES", "LEG_KINDS", "TIERS", "DATASETS",
    "LegTemplate", "Smoke", "Experiment", "Profile", "Registry", "RUNNERS", "LADDER_FIELDS",
    "load_registry", "check_knob", "check_ladder", "parse_knob_text", "split_role", "template_fields",
]
