"""One knob table, from notebook slider to engine environment.

``KNOBS`` is the table: the engine switches of ``vllm_patch.knobs.SWITCHES``
(the plugin cannot import the workbench, so they are defined there) plus the
workload knobs a leg or an experiment sets. The registry validates
experiments.yaml and ``-p`` overrides with it, the leg builds its command-line
options from it, :meth:`Knobs.to_env` builds the engine's environment from it,
and the plugin parses that environment with the same entries. Each leg record
states the values the engine reported back, not the ones asked for.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from vllm_patch.knobs import ENV_REPORT_DIR, SWITCHES, Knob, KnobError, KnobValues, check_combination, tier_of

from workbench.acceptance import AcceptanceError, check_acceptance, check_schedule

__all__ = ["KNOBS", "Knob", "KnobError", "Knobs", "LEG_KNOBS", "SPEC_ONLY", "NOT_ON_CPU", "tier_of",
           "leg_knob_names", "column_knobs"]


def _int_range(lo: int, hi: int | None = None):
    return lambda v: v >= lo and (hi is None or v <= hi)


def _passes(check):
    def ok(v: Any) -> bool:
        try:
            return bool(check(v))
        except AcceptanceError:
            return False
    return ok


# Knobs a leg carries beside the engine switches that reach vLLM through its speculative_config
# (workbench.acceptance), not through the plugin's environment.
SPEC_CONFIG_KNOBS: dict[str, Knob] = {k.name: k for k in [
    Knob("gamma", int, None, _int_range(1, 32), "an integer 1..32", "draft length (tokens proposed per step)",
         flag="--gamma", spec_only=True, column="record"),
    Knob("acceptance", str, "real", _passes(check_acceptance),
         "real, alpha:A, rates:R1/R2/..., length:L or from:RUN_DIR[:LEG]",
         "acceptance the leg is measured at: real (the target judges) or synthetic through vLLM's synthetic "
         "rejection sampler (a cost measurement, never judged for exactness)",
         flag="--acceptance", spec_only=True, column="record"),
    Knob("gamma_schedule", str, "none", _passes(check_schedule), "none, auto, auto:RUN_DIR or LO-HI:G/LO-HI:G/...",
         "gamma by batch size (vLLM's num_speculative_tokens_per_batch_size); auto: chosen from an E16 cost "
         "table and the leg's acceptance", flag="--gamma-schedule", spec_only=True, column="leg"),
]}

KNOBS: dict[str, Knob] = {k.name: k for k in [
    *SPEC_CONFIG_KNOBS.values(),
    *SWITCHES.values(),
    Knob("max_num_seqs", int, 1, _int_range(1, 4096), "an integer >= 1", "max concurrent sequences",
         flag="--max-num-seqs"),
    Knob("concurrencies", str, "", lambda v: v == "" or all(x.isdigit() and int(x) >= 1 for x in v.split("/")),
         "empty or integers >= 1 separated by '/' (e.g. 1/4/16/32)",
         "a serving leg's client concurrencies against its one server (its max_num_seqs the largest), "
         "swept as `vllm bench sweep serve` does; empty: one cell at max_num_seqs", flag="--concurrencies"),
    Knob("serve_requests", str, "fresh", lambda v: v in ("fresh", "repeat"), "fresh or repeat",
         "what a serving leg's cells send: fresh (each request its own: a nonce first, each image its first "
         "pixels stamped, so neither vLLM's prefix cache nor its multimodal cache holds it) or repeat (the prompt "
         "set cycled, as warmed: cached prompts)", flag="--serve-requests"),
    Knob("tensor_parallel_size", int, 1, _int_range(1, 64), "an integer 1..64",
         "tensor-parallel ranks of the target and its draft (vLLM's draft_model shards the draft like the "
         "target); more than 1 runs vLLM's multiprocess executor, one worker per rank",
         flag="--tensor-parallel-size", column="leg"),
    Knob("max_tokens", int, None, _int_range(1), "an integer >= 1", "tokens generated per prompt",
         flag="--max-tokens"),
    Knob("max_model_len", int, 4096, _int_range(32), "an integer >= 32", "engine context length",
         flag="--max-model-len"),
    Knob("n", int, None, _int_range(1), "an integer >= 1", "number of prompts", flag="--n"),
    Knob("gpu_memory_utilization", float, None, lambda v: 0 < v <= 1, "a float in (0, 1]",
         "share of accelerator (on CPU: host) memory the engine may take", flag="--gpu-memory-utilization"),
    Knob("dtype", str, "auto", lambda v: v in ("auto", "bfloat16", "float16", "float32"),
         "one of auto, bfloat16, float16, float32", "model dtype", flag="--dtype"),
]}


def parse_concurrencies(value: str | None) -> list[int] | None:
    """The ``concurrencies`` knob as a list (None when empty)."""
    text = str(value or "").strip()
    return sorted({int(x) for x in text.split("/")}) if text else None


def leg_knob_names() -> tuple[str, ...]:
    """The per-leg speculative knobs ``Knobs`` holds: gamma, acceptance, gamma_schedule and the engine
    switches, in table order."""
    return tuple(SPEC_CONFIG_KNOBS) + tuple(SWITCHES)


def column_knobs(where: str) -> list[str]:
    """Knobs that are columns: ``"record"`` (records and LEG_KEYS), ``"leg"`` (the leg table: these and the
    record ones, each followed by its ``leg_extra`` columns), in table order."""
    if where == "record":
        return [n for n, k in KNOBS.items() if k.column == "record"]
    if where == "leg":
        return [c for n, k in KNOBS.items() if k.column in ("record", "leg") for c in (n, *k.leg_extra)]
    raise ValueError(f"column_knobs: where must be 'record' or 'leg', got {where!r}")


# Knobs without meaning for a vanilla leg (no draft).
SPEC_ONLY = tuple(name for name, k in KNOBS.items() if k.spec_only)
# Knobs that accept a value on CPU but act only on an accelerator.
NOT_ON_CPU = tuple(name for name, k in KNOBS.items() if not k.applies_on_cpu)
# The per-leg speculative knobs held by ``Knobs``.
LEG_KNOBS = leg_knob_names()


class Knobs(KnobValues):
    """A leg's speculative knobs (gamma and the engine switches), built from the table.

    Each field defaults to the knob's leg default (gamma None: a vanilla leg; trace on). Validated with
    the table's checks and ``check_combination``; ``ValueError`` names the knob.
    """

    _leg_defaults = True

    @classmethod
    def _table(cls) -> Mapping[str, Knob]:
        return {name: KNOBS[name] for name in leg_knob_names()}

    def _check(self) -> None:
        for name in leg_knob_names():
            value = getattr(self, name)
            if name == "gamma" and value is None:
                continue
            try:
                KNOBS[name].validate(value)
            except KnobError as exc:
                raise ValueError(str(exc)) from None
        if self.gamma is None and (self.relax_logtau > 0 or self.blind_mm or self.acceptance != "real"
                                   or self.gamma_schedule != "none"):
            raise ValueError("relax_logtau, blind_mm, acceptance and gamma_schedule need a draft "
                             "(gamma is None: vanilla leg)")
        if self.acceptance != "real" and self.relax_logtau > 0:
            raise ValueError(f"knob 'acceptance' is {self.acceptance!r} (synthetic: vLLM's sampler draws which "
                             f"drafted tokens are kept) and knob 'relax_logtau' is {self.relax_logtau}: the "
                             f"relaxed gate would judge nothing; set one of them")
        try:
            check_combination(self.as_dict())
        except KnobError as exc:
            raise ValueError(str(exc)) from None

    @classmethod
    def from_planned(cls, knobs: Mapping[str, Any], where: str = "") -> "Knobs":
        """A planned spec leg's knobs: every leg knob of the table must be there (None: the table's default)."""
        missing = [name for name in leg_knob_names() if name not in knobs]
        if missing:
            raise KeyError(f"{where + ': ' if where else ''}planned knobs lack {missing}; "
                           "a planned leg carries every knob of the table")
        values = {}
        for name in leg_knob_names():
            value = knobs[name]
            k = KNOBS[name]
            if value is None:
                value = k.default
            elif k.type is float:
                value = float(value)
            values[name] = value
        return cls(**values)

    def engine_args(self, on_cuda: bool) -> dict:
        """vLLM engine arguments these knobs set (beside the environment): async scheduling on CUDA.

        vLLM's CPU platform turns async scheduling off whatever is asked, so a CPU leg does not ask.
        """
        return {"async_scheduling": True} if (self.gamma is not None and self.async_scheduling and on_cuda) else {}

    def to_env(self, report_dir: str | None = None) -> dict[str, str]:
        env = {k.env: k.env_value(getattr(self, name)) for name, k in SWITCHES.items()}
        if report_dir is not None:
            env[ENV_REPORT_DIR] = str(report_dir)
        return env

    def spec_config_extra(self, max_batch: int, target: str | None = None) -> tuple[dict, dict]:
        """The ``speculative_config`` fields of acceptance and gamma_schedule, and what they resolved to
        (``target``: the target's folder, whose size ``gamma_schedule=auto`` looks up)."""
        from workbench.acceptance import spec_config_extra

        if self.gamma is None:
            return {}, {}
        return spec_config_extra(self.gamma, self.acceptance, self.gamma_schedule, max_batch, target,
                                 self.draft_idle, self.draft_linear_kernel)

    @staticmethod
    def add_leg_options(ap: argparse.ArgumentParser) -> None:
        """The leg's options for these knobs, from the table (``--no-draft-cudagraph``, ``--no-trace``)."""
        defaults = Knobs.defaults()
        for name in leg_knob_names():
            k = KNOBS[name]
            if k.type is bool and defaults[name]:
                ap.add_argument(k.flag, dest=name, action=argparse.BooleanOptionalAction, default=True,
                                help=f"{k.help} (default on)")
            elif k.type is bool:
                ap.add_argument(k.flag, dest=name, action="store_true", help=k.help)
            else:
                ap.add_argument(k.flag, dest=name, type=k.type, default=defaults[name], help=k.help)

    @classmethod
    def from_leg_args(cls, args: argparse.Namespace) -> "Knobs":
        return cls(**{name: getattr(args, name) for name in leg_knob_names()})
