"""The registry's vocabulary and value checks: files, roles, tiers, data sets, runners, field sets, and the
checks of one knob, ladder field, role reference or name template."""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Any

from workbench.knobs import KNOBS, Knob, KnobError


PACKAGE_DIR = Path(__file__).resolve().parents[1]  # workbench/: the YAML files sit beside the package
EXPERIMENTS_FILE = PACKAGE_DIR / "experiments.yaml"
PROFILES_FILE = PACKAGE_DIR / "profiles.yaml"


class RegistryError(ValueError):
    """experiments.yaml / profiles.yaml / an override is invalid; the message names the item and field."""


# --- knobs ---------------------------------------------------------------------------------------
# The table lives in workbench.knobs (one entry per knob: type, check, variable, option, ...).

KnobSpec = Knob


# Roles an experiment may name; a profile binds each to a checkpoint.
ROLES = ("target", "twin", "small-vlm", "text-draft")
# Roles workbench.tiny.ensure_tiny_models() builds.
TINY_ROLES = ("target", "twin-int4", "twin-dequant", "random-draft", "small-vlm", "text-draft")
LEG_KINDS = ("vanilla", "spec", "score")
TIERS = ("strict", "relaxed")
DATASETS = ("mathvista", "mmvet", "tiny", "organism")
SWEEPABLE = tuple(KNOBS) + ("draft", "model")
# How an experiment's legs run: `legs` (workbench.leg, one process per leg, per-prompt records) or
# `ladder` (workbench.ladder_engine: one engine per leg timed step by step; the cost ladder, E16).
# `serve` (workbench.serve_leg: each leg behind vLLM's OpenAI server, driven by `vllm bench serve`).
RUNNERS = ("legs", "ladder", "serve")
# A ladder experiment's own settings (`ladder:` in experiments.yaml, `-p batches=1,4` on the command line).
# ``eager``: spec engines also time the drafter forced to eager (off: graphs-on cells only).
LADDER_FIELDS = ("batches", "repeats", "prompt_len", "eager")
LADDER_DEFAULTS = {"prompt_len": 128, "eager": True}
# Roles a shape-only profile (`shapes: true`, workbench.shapes) binds, and the folders it can bind them to.
SHAPE_ROLES = ("target", "twin", "small-vlm", "text-draft")
# Roles workbench.organism.models.ensure_organism_models() builds (`organism: <variant>` profiles). An
# organism profile must bind target and twin and may leave the others unbound: a run with a leg that needs
# an unbound one is refused at its preflight, naming the role.
ORGANISM_ROLES = ("target", "twin-int4", "twin-dequant", "random-draft", "small-vlm", "text-draft")
ORGANISM_VARIANTS = ("instruct", "thinking")
LOAD_FORMATS = ("auto", "dummy")

_EXPERIMENT_FIELDS = {"title", "question", "dataset", "legs", "sweep", "defaults", "analyses", "smoke",
                      "bracket", "profiles", "result_prefix", "notes", "runner", "ladder"}
_LEG_FIELDS = {"name", "kind", "model", "draft", "tier", "reference", "named_only"} | set(KNOBS)
_SMOKE_FIELDS = {"sweep", "legs", "dataset", "bracket", "ladder"} | set(KNOBS)
_PROFILE_FIELDS = {"description", "device", "tiny", "stand_in", "default_smoke", "roles", "engine", "shapes",
                   "load_format", "organism", "stand_ins"}
_ENGINE_KNOBS = {"dtype", "max_model_len", "gpu_memory_utilization", "max_num_seqs", "tensor_parallel_size"}
_ID_RE = re.compile(r"^E[1-9][0-9]*$")
_LEG_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


def check_knob(name: str, value: Any, where: str) -> Any:
    """Return `value` (ints widened to float where a float is expected) or raise naming `where`."""
    spec = KNOBS.get(name)
    if spec is None:
        raise RegistryError(f"{where}: unknown knob {name!r}; known knobs: {', '.join(KNOBS)}")
    try:
        return spec.validate(value, where)
    except KnobError as exc:
        raise RegistryError(str(exc)) from None


def check_ladder(name: str, value: Any, where: str) -> Any:
    """A ladder setting (``batches``: a non-empty list of distinct integers >= 1; ``repeats``, ``prompt_len``:
    an integer >= 1; ``eager``: a boolean), or raise naming ``where``."""
    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    if name not in LADDER_FIELDS:
        raise RegistryError(f"{where}: unknown ladder setting {name!r}; settings: {', '.join(LADDER_FIELDS)}")
    if name == "batches":
        vals = value if isinstance(value, list) else [value]
        if not vals or not all(whole(v) for v in vals) or len(set(vals)) != len(vals):
            raise RegistryError(f"{where}: batches must be a list of distinct integers >= 1, got {value!r}")
        return list(vals)
    if name == "eager":
        if not isinstance(value, bool):
            raise RegistryError(f"{where}: eager must be true or false, got {value!r}")
        return value
    if not whole(value):
        raise RegistryError(f"{where}: {name} must be an integer >= 1, got {value!r}")
    return value


def parse_knob_text(name: str, text: str, where: str = "override") -> Any:
    """Typed value of a command-line string (`-p gamma=4`, `-p blind_mm=true`)."""
    spec = KNOBS.get(name)
    if spec is None:
        raise RegistryError(f"{where}: unknown knob {name!r}; known knobs: {', '.join(KNOBS)}")
    try:
        return spec.parse(text, where)
    except KnobError as exc:
        raise RegistryError(str(exc)) from None


def split_role(ref: str) -> tuple[str, str | None]:
    role, _, prof = ref.partition("@")
    return role, (prof or None)


def template_fields(template: str) -> list[str]:
    """Placeholder names in a leg name template ("strict_g{gamma}" -> ["gamma"])."""
    try:
        return [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise RegistryError(f"bad leg name template {template!r}: {exc}") from None
