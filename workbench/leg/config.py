"""The leg's configuration: ``LegConfig`` (one leg.json) and its errors."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..knobs import KNOBS, Knobs
from ..runfolder import read_json, run_dir_of_leg


# Set by the protocol for the legs it starts: the leg stops when that process dies.
PARENT_ENV = "WORKBENCH_PARENT_PID"


# Knobs of the table that are LegConfig fields of the same name (the speculative ones live in Knobs).
WORKLOAD_KNOBS = ("n", "max_tokens", "max_model_len", "max_num_seqs", "dtype", "gpu_memory_utilization",
                  "tensor_parallel_size")


class LegError(ValueError):
    """Bad input to a leg, found before an engine starts."""


@dataclass
class LegConfig:
    target: str
    prompts: str
    out: str
    max_tokens: int
    draft: str | None = None
    knobs: Knobs = field(default_factory=Knobs)
    pids: list[str] | None = None
    n: int | None = None
    max_model_len: int = 4096
    max_num_seqs: int = 1
    # a serving leg's client concurrencies against its one server (max_num_seqs = the largest); None: one
    # cell at max_num_seqs
    concurrencies: list[int] | None = None
    # what a serving leg's cells send (workbench.serve_requests): "fresh" (no request repeats another, none is
    # cached) or "repeat" (the prompt set cycled: cached prompts)
    serve_requests: str = "fresh"
    # vLLM's tensor parallelism: target and draft sharded over this many worker processes (one per rank)
    tensor_parallel_size: int = 1
    max_num_batched_tokens: int | None = None
    dtype: str = "auto"
    gpu_memory_utilization: float | None = None
    enforce_eager: bool | None = None
    # vLLM's attention backend by name (e.g. TRITON_ATTN, FLASH_ATTN); None: vLLM's choice
    attention_backend: str | None = None
    # KV cache size in bytes on a GPU (vLLM's kv_cache_memory_bytes): skips vLLM's start-up memory
    # profile, which refuses to start while another process on the same GPU frees memory.
    kv_cache_memory_bytes: int | None = None
    # vLLM's load_format: "dummy" (random weights) under the shape profiles (cost ladder, serving ladder)
    load_format: str = "auto"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    limit_images: int = 4
    in_process: bool | None = None  # None: in-process engine on CPU, vLLM's default elsewhere
    cpu_threads: int = 1
    seed: int = 0
    experiment: str | None = None
    leg: str | None = None
    run_id: str | None = None
    ignore_eos: bool = False
    force: bool = False
    # a failed earlier attempt of this leg: its finished prompts are reused when the engine settings match
    resume_from: str | None = None

    # Fields that do not change what the engine computes or how fast: identity and bookkeeping.
    _NOT_ENGINE = ("out", "pids", "n", "experiment", "leg", "run_id", "force", "resume_from")

    def __post_init__(self):
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise LegError(f"kv_cache_memory_bytes must be a positive number of bytes, got {self.kv_cache_memory_bytes}")
        # the knob table's checks (serve_requests too: a serving leg's, no offline option); None: the default
        for name in (*WORKLOAD_KNOBS, "serve_requests"):
            value = getattr(self, name)
            if value is not None:
                try:
                    KNOBS[name].validate(value)
                except ValueError as exc:
                    raise LegError(str(exc)) from None

    @property
    def mode(self) -> str:
        return "vanilla" if self.draft is None else "spec"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["knobs"] = self.knobs.as_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "leg config") -> "LegConfig":
        if not isinstance(d, dict):
            raise LegError(f"{where}: expected a JSON object, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise LegError(f"{where}: unknown field(s) {unknown}; fields: {sorted(names)}")
        missing = [k for k in ("target", "prompts", "out", "max_tokens") if d.get(k) is None]
        if missing:
            raise LegError(f"{where}: missing field(s) {missing}")
        kw = dict(d)
        knobs = kw.pop("knobs", None) or {}
        if not isinstance(knobs, dict):
            raise LegError(f"{where}: 'knobs' must be an object")
        try:
            kw["knobs"] = Knobs(**knobs)
        except TypeError as exc:
            raise LegError(f"{where}: knobs: {exc}") from None
        return cls(**kw)

    # Paths that leg.json stores relative to its own folder when they lie in the same run folder, so a
    # copied or moved run folder still names its own prompts and attempts (and can reuse them).
    _RUN_PATHS = ("prompts", "out", "resume_from")

    def to_file_dict(self, folder: str | Path) -> dict[str, Any]:
        """``to_dict`` as leg.json in ``folder`` stores it: paths inside the run folder made relative."""
        d = self.to_dict()
        folder = Path(folder).resolve()
        rdir = run_dir_of_leg(folder)
        if rdir is None:
            return d
        for key in self._RUN_PATHS:
            value = d.get(key)
            if value:
                p = Path(value).resolve()
                if p == rdir or rdir in p.parents:
                    d[key] = os.path.relpath(p, folder)
        return d

    def engine_settings(self) -> dict[str, Any]:
        """What must match for records of two attempts to belong in one leg."""
        return {k: v for k, v in self.to_dict().items() if k not in self._NOT_ENGINE}


def load_leg_config(path: str | Path) -> LegConfig:
    """A leg.json: relative paths in it are relative to its own folder (see ``LegConfig.to_file_dict``)."""
    path = Path(path)
    d = read_json(path)
    if isinstance(d, dict):
        d = dict(d)
        for key in LegConfig._RUN_PATHS:
            value = d.get(key)
            if isinstance(value, str) and value and not os.path.isabs(value):
                d[key] = os.path.normpath(path.parent.resolve() / value)
    return LegConfig.from_dict(d, str(path))


# --------------------------------------------------------------------------- #
# Checks that need no engine                                                   #
