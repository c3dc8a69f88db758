"""Engine setup: the engine's arguments and the process environment a leg sets before vLLM is imported."""

from __future__ import annotations

import glob
import os
from typing import Any

from .. import engine as engines  # "engine" is a local name in run_leg (the LLM's engine)
from .config import LegConfig, LegError


def engine_args(cfg: LegConfig) -> dict[str, Any]:
    """The leg's engine arguments (of ``vllm.LLM``, built by ``workbench.engine.build``; in its summary)."""
    import torch

    on_cuda = torch.cuda.is_available()
    kw: dict[str, Any] = dict(
        model=cfg.target,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        seed=cfg.seed,
        enable_prefix_caching=cfg.enable_prefix_caching,
        enable_chunked_prefill=cfg.enable_chunked_prefill,
        limit_mm_per_prompt={"image": cfg.limit_images, "video": 0},
        disable_log_stats=False,  # the spec-decode counters come from the stats
    )
    if cfg.tensor_parallel_size > 1:
        # one worker process per rank (vLLM's multiprocess executor; on CPU its shared-memory communicator)
        kw["tensor_parallel_size"] = cfg.tensor_parallel_size
        kw["distributed_executor_backend"] = "mp"
    elif _in_process(cfg):
        # Engine core and worker in the leg's own process: on CPU this cuts
        # engine start from ~30 s to ~6 s (no process spawns, no re-imports).
        kw["distributed_executor_backend"] = "uni"
    if cfg.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if cfg.load_format != "auto":
        kw["load_format"] = cfg.load_format
    if cfg.attention_backend:
        kw["attention_backend"] = cfg.attention_backend
    if cfg.kv_cache_memory_bytes is not None and on_cuda:
        kw["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
    elif on_cuda:
        from workbench.memory_plan import MemoryPlanError, plan_for_leg
        try:
            plan = plan_for_leg(cfg)
        except MemoryPlanError as exc:
            raise LegError(str(exc)) from None
        if plan is not None:  # the KV cache sized up front, and the share that covers it (workbench.memory_plan)
            kw["kv_cache_memory_bytes"] = plan.kv_cache_memory_bytes
            kw["gpu_memory_utilization"] = plan.gpu_memory_utilization
    if "gpu_memory_utilization" not in kw and cfg.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    elif "gpu_memory_utilization" not in kw and not on_cuda:
        # On CPU this is the share of host memory for the KV cache.
        kw["gpu_memory_utilization"] = 0.05
    # torch.compile on CPU costs far more start time than it saves on tiny models.
    kw["enforce_eager"] = (not on_cuda) if cfg.enforce_eager is None else cfg.enforce_eager
    if cfg.draft is not None:
        kw["speculative_config"] = engines.spec_config(cfg.draft, cfg.knobs.gamma,
                                                       cfg.knobs.spec_config_extra(cfg.max_num_seqs, cfg.target)[0])
        kw.update(cfg.knobs.engine_args(on_cuda))  # async scheduling, asked explicitly (CUDA only)
    return kw


def _cuda_present() -> bool:
    # Decided before torch is imported: thread settings must precede it. By the device nodes, not by
    # CUDA_VISIBLE_DEVICES: under Ray on a CPU host it names the logical GPU the leg's group holds, and a leg
    # that took it for CUDA ran its engine core in a process of its own with OpenMP bound by vLLM (~10x slower).
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def _in_process(cfg: LegConfig) -> bool:
    if cfg.in_process is not None:
        return cfg.in_process
    return not _cuda_present()


def prepare_process_env(cfg: LegConfig) -> None:
    """Environment of the leg process; must run before torch or vLLM is imported."""
    if _in_process(cfg):
        engines.in_process_env(cpu=not _cuda_present(), threads=cfg.cpu_threads)
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    # A forked engine core inherits whatever threads the leg started (tokenizer
    # pools): on CUDA it hung allocating pinned buffers. Spawn a clean process.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if os.environ.get("VLLM_SPEC_CPU_ISA"):
        # Before anything loads vLLM's CPU kernel library (the plugin repeats
        # this at engine start, where it is too late if a check imported it).
        from vllm_patch.cpu_int4 import apply_cpu_isa

        apply_cpu_isa()
