"""Triton kernels compiled while the engine serves: how many, how long, which.

A Triton kernel is compiled once per specialization (its constexprs, and each integer argument's class: equal
to 1, divisible by 16, other); vLLM's drafting kernels pick a constexpr block size from the step's longest
query (``copy_and_expand_eagle_inputs_kernel``: the next power of two, at most 256), so the first prompt of
a new length class, or the first step at a batch that divides by 16, compiles a kernel inside that step: on an
H100 at 8B the first speculative server of a run had prefill steps with 134-395 ms of draft work against 15-27
ms in the others, and the servers after it none (Triton's on-disk cache). ``JitCounter`` counts those
compiles through Triton's own hooks (``triton.knobs.runtime.jit_cache_hook`` before a compile,
``jit_post_compile_hook`` after; the hooks that were set are still called), so the step timer can say which
steps compiled (``jit_compiles``, ``jit_ms`` in ``steps-<pid>.jsonl``) and the engine report which kernels.

A compile that finds its binary in Triton's on-disk cache counts too (it is still a miss of the process's
cache); its time says which it was. Without Triton (CPU hosts) nothing is installed and every count is 0.
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["JitCounter"]


def _name(fn: Any) -> str:
    return str(getattr(fn, "name", None) or getattr(fn, "__name__", None) or fn)


class JitCounter:
    """Triton compiles in this process since ``install``: count, host ms, per kernel name."""

    def __init__(self):
        self._lock = threading.Lock()
        self.count, self.ms = 0, 0.0
        self.by_kernel: dict[str, int] = {}
        self._open: dict[int, float] = {}

    def install(self) -> bool:
        """Chain the counting hooks in front of any that were set; False where Triton has no such hooks."""
        try:
            from triton import knobs
            runtime = knobs.runtime
            previous_before, previous_after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        except Exception:  # noqa: BLE001 - no Triton, or one without knobs: nothing to count
            return False

        def before(*args, **kwargs):
            with self._lock:
                self._open[threading.get_ident()] = time.perf_counter()
            # a cache hook that returns True skips the compile (Triton's contract): the previous one decides
            return previous_before(*args, **kwargs) if previous_before else None

        def after(*args, **kwargs):
            self.compiled(_name(kwargs.get("fn")), time.perf_counter())
            return previous_after(*args, **kwargs) if previous_after else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
        return True

    def compiled(self, name: str, now: float) -> None:
        """One compile of kernel ``name`` ended at ``now`` (perf_counter): its time runs from this thread's
        last cache-miss hook."""
        with self._lock:
            t0 = self._open.pop(threading.get_ident(), None)
            self.count += 1
            self.ms += (now - t0) * 1e3 if t0 is not None else 0.0
            self.by_kernel[name] = self.by_kernel.get(name, 0) + 1

    def snapshot(self) -> tuple[int, float]:
        """(compiles so far, their ms so far)."""
        with self._lock:
            return self.count, self.ms

    def kernels(self) -> dict[str, int]:
        """Compiles so far per kernel name."""
        with self._lock:
            return dict(self.by_kernel)
