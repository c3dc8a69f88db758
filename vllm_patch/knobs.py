"""The knob table, and the engine switches parsed and validated once per process.

``Knob`` describes one knob: name, type, check, environment variable, leg
option, whether it only means something with a draft, whether it acts on a
CPU host. ``SWITCHES`` are the knobs the engine reads from its environment;
``workbench.knobs`` adds the workload knobs (gamma, concurrency, ...) to make
the one table the workbench validates, builds leg options and environments
from. The plugin imports nothing from the workbench, so the table starts here.

The variable names are the ones researchers' scripts already use (see the
README): ``VLLM_SPEC_RELAX_LOGTAU``, ``VLLM_SPEC_DRAFT_BLIND_MM``,
``VLLM_SPEC_DISABLE_DRAFT_CUDAGRAPH``, ``VLLM_SPEC_TRACE``; issue 18 added
``VLLM_SPEC_DRAFT_CUDAGRAPH_MODE``, ``VLLM_SPEC_DRAFT_LINEAR_KERNEL`` and ``VLLM_SPEC_ASYNC_SCHEDULING``
(the last one only tells the engine's report what the leg asked: vLLM's own ``async_scheduling``
engine argument is what switches it). ``VLLM_SPEC_REPORT_DIR``
is where every engine process reports the knobs it actually read, and where
the trace goes. Whatever the workbench checked before, the engine checks its
environment again here: a script may set these variables by hand.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Callable

ENV_RELAX = "VLLM_SPEC_RELAX_LOGTAU"
ENV_BLIND = "VLLM_SPEC_DRAFT_BLIND_MM"
ENV_NO_GRAPH = "VLLM_SPEC_DISABLE_DRAFT_CUDAGRAPH"
ENV_TRACE = "VLLM_SPEC_TRACE"
ENV_GRAPH_MODE = "VLLM_SPEC_DRAFT_CUDAGRAPH_MODE"
ENV_LINEAR_KERNEL = "VLLM_SPEC_DRAFT_LINEAR_KERNEL"
ENV_ASYNC = "VLLM_SPEC_ASYNC_SCHEDULING"
ENV_REPORT_DIR = "VLLM_SPEC_REPORT_DIR"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class KnobError(ValueError):
    """A knob has a value that is refused; the message names the knob (or variable) and the rule."""


@dataclass(frozen=True)
class Knob:
    name: str
    type: type                       # bool | int | float | str
    default: Any
    check: Callable[[Any], bool]
    rule: str                        # the check in words: "a float >= 0"
    help: str
    env: str | None = None           # engine environment variable
    env_inverted: bool = False       # the variable holds the negation (VLLM_SPEC_DISABLE_...)
    flag: str | None = None          # leg command-line option
    spec_only: bool = False          # means something only with a draft
    applies_on_cpu: bool = True      # False: accepted on CPU, recorded as having no effect

    def validate(self, value: Any, where: str = "") -> Any:
        """``value`` if it has the knob's type and passes its check (ints widen to float); else KnobError."""
        if self.type is bool:
            ok = isinstance(value, bool)
        elif self.type is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.type is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ok:
                value = float(value)
        else:
            ok = isinstance(value, self.type)
        if not ok or not self.check(value):
            raise KnobError(f"{where + ': ' if where else ''}knob {self.name!r} must be {self.rule}, got {value!r}")
        return value

    def parse(self, text: str, where: str = "") -> Any:
        """Typed value of a string (command line, environment)."""
        raw = str(text).strip()
        try:
            if self.type is bool:
                low = raw.lower()
                if low not in _TRUE | _FALSE:
                    raise ValueError
                value: Any = low in _TRUE
            elif self.type is int:
                value = int(raw)
            elif self.type is float:
                value = float(raw)
            else:
                value = raw
        except ValueError:
            raise KnobError(f"{where + ': ' if where else ''}knob {self.name!r} must be {self.rule}, "
                            f"got {text!r}") from None
        return self.validate(value, where)

    def env_value(self, value: Any) -> str:
        """The string the engine's environment gets for ``value``."""
        if self.type is bool:
            return "1" if bool(value) != self.env_inverted else "0"
        return repr(float(value)) if self.type is float else str(value)

    def read_env(self, env: Mapping[str, str]) -> Any:
        """The knob's value from the engine's environment (unset or empty: the default)."""
        raw = env.get(self.env or "")
        if raw is None or raw.strip() == "":
            return self.default
        if self.type is bool:
            low = raw.strip().lower()
            if low not in _TRUE | _FALSE:
                raise KnobError(f"{self.env}={raw!r} is not a boolean (use 1/0, true/false)")
            return (low in _TRUE) != self.env_inverted
        try:
            return self.validate(self.type(raw.strip()))
        except (ValueError, KnobError):
            raise KnobError(f"{self.env}={raw!r} must be {self.rule} ({self.help})") from None


def _finite_nonneg(v: float) -> bool:
    return math.isfinite(v) and v >= 0


def _any(_: Any) -> bool:
    return True


DRAFT_CUDAGRAPH_MODES = ("auto", "none", "piecewise", "full")
DRAFT_LINEAR_KERNELS = ("auto", "machete", "marlin", "humming", "exllama", "own")


def own_kernel_available() -> bool:
    """Whether the project's own int4 GEMV module (``vllm_patch.twin_gemv``) exists in this install."""
    import importlib.util

    return importlib.util.find_spec(f"{__package__}.twin_gemv") is not None


def check_combination(values: Mapping[str, Any], where: str = "") -> None:
    """Rules across knobs, the same in the workbench and in the engine; KnobError names the knobs."""
    pre = f"{where}: " if where else ""
    mode = values.get("draft_cudagraph_mode", "auto")
    if values.get("draft_cudagraph") is False and mode in ("piecewise", "full"):
        raise KnobError(f"{pre}knob 'draft_cudagraph_mode' is {mode!r} but knob 'draft_cudagraph' is off; "
                        "turn draft_cudagraph on or use draft_cudagraph_mode 'none' / 'auto'")


SWITCHES: dict[str, Knob] = {k.name: k for k in [
    Knob("relax_logtau", float, 0.0, _finite_nonneg, "a finite number >= 0",
         "relaxed gate x = ln(1/tau); 0 = strict (e.g. 0.693 for tau=0.5)",
         env=ENV_RELAX, flag="--relax-logtau", spec_only=True),
    Knob("blind_mm", bool, False, _any, "true or false", "draft decodes without image embeddings",
         env=ENV_BLIND, flag="--blind-mm", spec_only=True),
    Knob("draft_cudagraph", bool, True, _any, "true or false", "capture the drafter's CUDA graphs",
         env=ENV_NO_GRAPH, env_inverted=True, flag="--draft-cudagraph", spec_only=True, applies_on_cpu=False),
    Knob("trace", bool, False, _any, "true or false", "record the per-step acceptance trace",
         env=ENV_TRACE, flag="--trace", spec_only=True),
    Knob("draft_cudagraph_mode", str, "auto", lambda v: v in DRAFT_CUDAGRAPH_MODES,
         "one of " + ", ".join(DRAFT_CUDAGRAPH_MODES),
         "drafter CUDA graphs: none, piecewise (vLLM's), full (FULL graph per single-token step), "
         "auto (the best verified on the platform; none on CPU)",
         env=ENV_GRAPH_MODE, flag="--draft-cudagraph-mode", spec_only=True, applies_on_cpu=False),
    # 'own' is refused (naming the knob) where the module with TwinGemvLinearKernel is absent
    Knob("draft_linear_kernel", str, "auto",
         lambda v: v in DRAFT_LINEAR_KERNELS and (v != "own" or own_kernel_available()),
         "one of " + ", ".join(DRAFT_LINEAR_KERNELS) + " ('own' needs vllm_patch.twin_gemv with "
         "TwinGemvLinearKernel; this install must have it)",
         "W4A16 kernel of the draft's linear layers (the target's are vLLM's choice); auto: Marlin "
         "first on CUDA, vLLM's CPU kernels on CPU; own: vllm_patch.twin_gemv",
         env=ENV_LINEAR_KERNEL, flag="--draft-linear-kernel", spec_only=True, applies_on_cpu=False),
    Knob("async_scheduling", bool, False, _any, "true or false",
         "vLLM's async scheduling for the draft_model leg (asked explicitly; the padded drafter batch "
         "stays on); vLLM's CPU platform always turns it off",
         env=ENV_ASYNC, flag="--async-scheduling", spec_only=True, applies_on_cpu=False),
]}


def parse_relax_logtau(raw: str | None) -> float:
    """``x`` of the relaxed gate; unset or 0 is the strict tier."""
    return SWITCHES["relax_logtau"].read_env({ENV_RELAX: raw} if raw is not None else {})


@dataclass(frozen=True)
class EngineKnobs:
    relax_logtau: float = 0.0
    blind_mm: bool = False
    draft_cudagraph: bool = True
    trace: bool = False
    draft_cudagraph_mode: str = "auto"
    draft_linear_kernel: str = "auto"
    async_scheduling: bool = False
    report_dir: str | None = None

    @property
    def tier(self) -> str:
        return "relaxed" if self.relax_logtau > 0 else "strict"

    def as_dict(self) -> dict:
        return asdict(self)


def read_knobs(env: Mapping[str, str] | None = None) -> EngineKnobs:
    env = os.environ if env is None else env
    knobs = EngineKnobs(**{name: k.read_env(env) for name, k in SWITCHES.items()},
                        report_dir=env.get(ENV_REPORT_DIR) or None)
    if knobs.trace and not knobs.report_dir:
        raise KnobError(f"{ENV_TRACE}=1 needs {ENV_REPORT_DIR}: the folder the trace is written to")
    check_combination(knobs.as_dict(), where="engine environment")
    return knobs
