"""One vocabulary for the knobs, from notebook slider to engine environment.

``Knobs`` is what a researcher sets; :meth:`Knobs.to_env` is what the leg's
process gets; the engine reads it back through ``vllm_patch.knobs`` and each
leg record states the values the engine reported, not these.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from vllm_patch.knobs import ENV_BLIND, ENV_NO_GRAPH, ENV_RELAX, ENV_REPORT_DIR, ENV_TRACE

TAU_LADDER = {0.9: 0.105, 0.75: 0.288, 0.5: 0.693, 0.25: 1.386}


def logtau_from_tau(tau: float) -> float:
    """x = ln(1/tau): a drafted token is accepted when its target logit >= max - x."""
    if not 0 < tau <= 1:
        raise ValueError(f"tau must be in (0, 1], got {tau}")
    return math.log(1.0 / tau)


def tau_from_logtau(x: float) -> float:
    return math.exp(-x)


@dataclass(frozen=True)
class Knobs:
    gamma: int | None = None          # draft length; None = vanilla leg
    relax_logtau: float = 0.0         # 0 = strict tier
    blind_mm: bool = False            # draft decodes without image embeddings
    draft_cudagraph: bool = True      # capture the drafter's CUDA graphs (CUDA only)
    trace: bool = True                # per-request, per-step acceptance trace

    def __post_init__(self):
        if self.gamma is not None and (not isinstance(self.gamma, int) or self.gamma < 1):
            raise ValueError(f"gamma must be a positive integer or None, got {self.gamma!r}")
        if not isinstance(self.relax_logtau, (int, float)) or not math.isfinite(self.relax_logtau) \
                or self.relax_logtau < 0:
            raise ValueError(f"relax_logtau must be a finite number >= 0, got {self.relax_logtau!r}")
        if self.gamma is None and (self.relax_logtau > 0 or self.blind_mm):
            raise ValueError("relax_logtau and blind_mm need a draft (gamma is None: vanilla leg)")

    @property
    def tier(self) -> str:
        if self.gamma is None:
            return "vanilla"
        return "relaxed" if self.relax_logtau > 0 else "strict"

    def to_env(self, report_dir: str | None = None) -> dict[str, str]:
        env = {
            ENV_RELAX: repr(float(self.relax_logtau)),
            ENV_BLIND: "1" if self.blind_mm else "0",
            ENV_NO_GRAPH: "0" if self.draft_cudagraph else "1",
            ENV_TRACE: "1" if self.trace else "0",
        }
        if report_dir is not None:
            env[ENV_REPORT_DIR] = str(report_dir)
        return env

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
