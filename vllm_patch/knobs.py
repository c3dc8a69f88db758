"""The engine switches, parsed and validated once per process.

The names are the ones researchers' scripts already use (see the README):
``VLLM_SPEC_RELAX_LOGTAU``, ``VLLM_SPEC_DRAFT_BLIND_MM``,
``VLLM_SPEC_DISABLE_DRAFT_CUDAGRAPH``. Two more belong to the workbench:
``VLLM_SPEC_TRACE`` (per-request acceptance trace) and ``VLLM_SPEC_REPORT_DIR``
(where every engine process reports the knobs it actually read, and where the
trace goes).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass

ENV_RELAX = "VLLM_SPEC_RELAX_LOGTAU"
ENV_BLIND = "VLLM_SPEC_DRAFT_BLIND_MM"
ENV_NO_GRAPH = "VLLM_SPEC_DISABLE_DRAFT_CUDAGRAPH"
ENV_TRACE = "VLLM_SPEC_TRACE"
ENV_REPORT_DIR = "VLLM_SPEC_REPORT_DIR"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


class KnobError(ValueError):
    """An engine switch has a value the patched engine refuses."""


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise KnobError(f"{name}={env.get(name)!r} is not a boolean (use 1/0, true/false)")


def parse_relax_logtau(raw: str | None) -> float:
    """``x`` of the relaxed gate; unset or 0 is the strict tier."""
    if raw is None or raw.strip() == "":
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise KnobError(
            f"{ENV_RELAX}={raw!r} is not a number; expected x >= 0 (e.g. 0.693 for tau=0.5)"
        ) from None
    if not math.isfinite(value) or value < 0:
        raise KnobError(f"{ENV_RELAX}={raw!r} must be a finite number >= 0 (0 = strict)")
    return value


@dataclass(frozen=True)
class EngineKnobs:
    relax_logtau: float = 0.0
    blind_mm: bool = False
    draft_cudagraph: bool = True
    trace: bool = False
    report_dir: str | None = None

    @property
    def tier(self) -> str:
        return "relaxed" if self.relax_logtau > 0 else "strict"

    def as_dict(self) -> dict:
        return asdict(self)


def read_knobs(env: Mapping[str, str] | None = None) -> EngineKnobs:
    env = os.environ if env is None else env
    knobs = EngineKnobs(
        relax_logtau=parse_relax_logtau(env.get(ENV_RELAX)),
        blind_mm=_flag(env, ENV_BLIND),
        draft_cudagraph=not _flag(env, ENV_NO_GRAPH),
        trace=_flag(env, ENV_TRACE),
        report_dir=env.get(ENV_REPORT_DIR) or None,
    )
    if knobs.trace and not knobs.report_dir:
        raise KnobError(f"{ENV_TRACE}=1 needs {ENV_REPORT_DIR}: the folder the trace is written to")
    return knobs
