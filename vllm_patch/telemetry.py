"""The plugin's telemetry: the acceptance trace and the step timer, each a JSONL file per engine process.

Both write off the decode path: the engine's thread keeps references (device tensors, CUDA events)
and hands batches to a daemon thread of :class:`_JsonlWriter`, which resolves them and appends
lines. An engine's writers live on its :class:`~vllm_patch.engine_state.EngineState`; the relaxed
gate (``relaxed_gate``) records the trace, the runner hooks (``runner_hooks``) and the twin
proposer stamp the step timer, and the worker RPC (``worker_rpc``) flushes both.
"""

from __future__ import annotations

import functools
import json
import os
import threading

import torch

from .jit_count import JitCounter
from .knobs import ENV_STEP_TIMING, Knob


class _JsonlWriter:
    """A daemon thread that turns queued batches into lines of one JSONL file.

    The engine's thread only puts batches on a queue; ``lines(batch)`` runs
    in the writer thread. :meth:`flush_queue` waits until everything queued so
    far is on disk and re-raises a writer failure.
    """

    def __init__(self, path: str, name: str):
        import queue

        self.path = path
        self._name = name
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.muted = False  # a tensor-parallel rank other than 0: nothing is written (EngineState.set_parallel)

    def lines(self, batch) -> list[str]:
        raise NotImplementedError

    def put(self, batch) -> None:
        if self.muted:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put(batch)

    def _run(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a") as f:
            while True:
                item = self._queue.get()
                try:
                    if isinstance(item, threading.Event):
                        f.flush()
                        item.set()
                    else:
                        f.writelines(self.lines(item))
                except BaseException as exc:  # surfaced by flush_queue()
                    self._error = exc
                finally:
                    self._queue.task_done()

    def flush_queue(self, timeout: float = 60.0) -> None:
        if self._thread is not None:
            done = threading.Event()
            self._queue.put(done)
            if not done.wait(timeout):
                raise TimeoutError(f"{self.path} not written within {timeout}s")
        if self._error is not None:
            raise RuntimeError(f"writing {self.path} failed: {self._error!r}") from self._error


class TraceWriter(_JsonlWriter):
    """Per verification step and request: drafted, accepted, target margins.

    The verification step only keeps what it traced: two small tensors that
    stay on the device, plus the request ids and draft counts it already has on
    the host. Nothing on the decode path synchronises with the device, copies,
    allocates pinned memory or formats JSON. Every ``batch_steps`` steps (and at
    :meth:`flush`) the kept tensors are concatenated on the device and copied
    off it in one non-blocking copy behind an event; a background thread waits
    for that copy, turns the steps into JSON lines and appends them to
    ``trace-<pid>.jsonl``. :meth:`flush` (called by the leg through
    ``collective_rpc`` once ``generate`` returns) hands over the rest and waits
    until the file holds every step.

    Line format: ``{"s": step, "r": [[req_id, drafted, accepted, margins], ...]}``
    plus ``"invalid": {req_id: n}`` when vLLM passed ``n`` placeholder ids for a
    request; ``drafted`` counts valid drafted tokens only (as vLLM's counters
    do) and ``margins`` has one entry per valid drafted token, rounded to 4
    decimals. ``"ties": {req_id: [i, ...]}`` lists drafted positions written as
    margin 0 that the target's argmax did not pick (tied in the logits' dtype,
    or closer than the rounding): strict verification rejected them, and a
    relaxed gate at any x > 0 accepts them (margin <= x).
    """

    ZERO = 5e-5   # margins below this are written as 0.0
    TIE = -1.0    # device-side mark of a tied, not-picked draft (never a real margin)

    def __init__(self, report_dir: str, batch_steps: int = 512):
        super().__init__(os.path.join(report_dir, f"trace-{os.getpid()}.jsonl"), "twin-spec-trace")
        self.batch_steps = batch_steps
        self.step = 0
        self.host_ns = 0  # host time the trace spent on the decode path (counted by the sampler's wrapper)
        self._pending: list[tuple] = []

    # -- decode path: keep references, nothing else ------------------------ #
    def record(self, req_ids, num_draft_tokens, accepted, margins) -> None:
        self.step += 1
        self._pending.append((self.step, list(req_ids), list(num_draft_tokens), accepted, margins))
        if len(self._pending) >= self.batch_steps:
            self._hand_over()

    def _hand_over(self) -> None:
        if not self._pending:
            return
        steps, self._pending = self._pending, []
        # One concatenation and one copy off the device for the whole batch.
        acc = torch.cat([s[3].reshape(-1).to(torch.int32) for s in steps])
        mar = torch.cat([s[4].reshape(-1).float() for s in steps])
        event = None
        if acc.device.type == "cuda":
            host_acc = torch.empty(acc.shape, dtype=acc.dtype, pin_memory=True)
            host_mar = torch.empty(mar.shape, dtype=mar.dtype, pin_memory=True)
            host_acc.copy_(acc, non_blocking=True)
            host_mar.copy_(mar, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            acc, mar = host_acc, host_mar
        meta = [(st, rids, k, int(a.numel()), int(m.numel())) for st, rids, k, a, m in steps]
        self.put((meta, acc, mar, event))

    # -- writer thread ---------------------------------------------------- #
    def lines(self, batch) -> list[str]:
        meta, acc, mar, event = batch
        if event is not None:
            event.synchronize()
        acc, mar = acc.tolist(), mar.tolist()
        out, ia, im = [], 0, 0
        for step, req_ids, ks, n_acc, n_mar in meta:
            line = self._format(step, req_ids, ks, acc[ia : ia + n_acc], mar[im : im + n_mar])
            ia, im = ia + n_acc, im + n_mar
            if line:
                out.append(line)
        return out

    @staticmethod
    def _format(step, req_ids, num_draft_tokens, acc: list, m: list) -> str:
        rows, invalid, ties, off = [], {}, {}, 0
        for i, (rid, k) in enumerate(zip(req_ids, num_draft_tokens)):
            if k > 0:
                # NaN marks a placeholder / out-of-range id: never an index,
                # never accepted, no margin; vLLM's counters skip it too.
                valid = [v for v in m[off : off + k] if v == v]
                tied = [j for j, v in enumerate(valid) if v < 0]
                rows.append([rid, len(valid), max(int(acc[i]), 0), [0.0 if v < 0 else round(v, 4) for v in valid]])
                if len(valid) < k:
                    invalid[rid] = k - len(valid)
                if tied:
                    ties[rid] = tied
            off += k
        if not rows:
            return ""
        line = {"s": step, "r": rows}
        if invalid:
            line["invalid"] = invalid
        if ties:
            line["ties"] = ties
        return json.dumps(line) + "\n"

    def flush(self, timeout: float = 60.0) -> int:
        """Write every traced step; returns the number of steps traced so far."""
        self._hand_over()
        self.flush_queue(timeout)
        return self.step


@functools.cache
def _cuda_present() -> bool:
    """torch.cuda.is_available(), asked once a process: on a host without CUDA each call opens the NVML library
    again (0.1-0.2 ms), four times a step on the drafter's path when the steps are timed."""
    return torch.cuda.is_available()


class StepTimer(_JsonlWriter):
    """Engine-side time of every model step: the target's forward and the drafting.

    ``VLLM_SPEC_STEP_TIMING=1`` (with ``VLLM_SPEC_REPORT_DIR``): for each
    ``execute_model`` step the target's forward pass and the drafter's
    ``propose`` are bracketed by CUDA events (wall clock on CPU, where the
    work is synchronous). Nothing waits on the device on the decode path; a
    background thread resolves the events and appends one JSON line per step
    to ``steps-<pid>.jsonl``: ``{"reqs", "tokens", "spec_tokens", "prefill",
    "target_ms", "draft_ms", "draft_loop_ms", "jit_compiles", "jit_ms"}`` (``draft_loop_ms``: the propose's
    gamma-1 single-token steps, from the first position update to the last sample; ``jit_compiles`` /
    ``jit_ms``: Triton kernels compiled inside the step and their host time, ``jit_count.JitCounter``).
    Written for the GPU cost ladder: a verification step is one with ``tokens == reqs * (1 + gamma)``.
    """

    # a measurement switch, not an experiment knob: parsed like the table's booleans
    SWITCH = Knob("step_timing", bool, False, lambda v: True, "true or false",
                  "engine-side step timings", env=ENV_STEP_TIMING)

    def __init__(self, report_dir: str, batch_steps: int = 128):
        super().__init__(os.path.join(report_dir, f"steps-{os.getpid()}.jsonl"), "twin-spec-steps")
        self.batch_steps = batch_steps
        self.current: dict | None = None
        self.jit = JitCounter()
        self.jit.install()
        self._done: list[dict] = []

    @staticmethod
    def _mark():
        if _cuda_present() and torch.cuda.is_initialized():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        import time

        return time.perf_counter()

    def begin(self, scheduler_output) -> None:
        spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", {}) or {}
        new = getattr(scheduler_output, "scheduled_new_reqs", []) or []
        self.current = {
            "reqs": len(getattr(scheduler_output, "num_scheduled_tokens", {}) or {}),
            "tokens": int(getattr(scheduler_output, "total_num_scheduled_tokens", 0)),
            "spec_tokens": int(sum(len(v) for v in spec.values())),
            "prefill": bool(new),
            "jit0": self.jit.snapshot(),
        }

    def span(self, key: str):
        cur = self.current
        timer = self

        class _Span:
            def __enter__(self_inner):
                if cur is not None:
                    cur[key + "_t0"] = timer._mark()

            def __exit__(self_inner, *exc):
                if cur is not None and key + "_t0" in cur:
                    cur[key + "_t1"] = timer._mark()

        return _Span()

    def stamp(self, name: str) -> None:
        """One time mark of the current step (the twin proposer marks its single-token steps)."""
        if self.current is not None:
            self.current[name] = self._mark()

    def end(self) -> None:
        cur, self.current = self.current, None
        if cur is None or "target_t0" not in cur:
            return
        cur["jit1"] = self.jit.snapshot()
        self._done.append(cur)
        if len(self._done) >= self.batch_steps:
            self._hand_over()

    def _hand_over(self) -> None:
        if self._done:
            self.put(self._done)
            self._done = []

    @staticmethod
    def _ms(t0, t1):
        if t0 is None or t1 is None:
            return None
        if isinstance(t0, float):
            return round((t1 - t0) * 1e3, 4)
        t1.synchronize()
        return round(t0.elapsed_time(t1), 4)

    def lines(self, batch) -> list[str]:
        out = []
        for cur in batch:
            row = {k: cur[k] for k in ("reqs", "tokens", "spec_tokens", "prefill")}
            row["target_ms"] = self._ms(cur.get("target_t0"), cur.get("target_t1"))
            row["draft_ms"] = self._ms(cur.get("draft_t0"), cur.get("draft_t1"))
            # the gamma-1 single-token draft steps of the propose (absent for gamma 1)
            row["draft_loop_ms"] = self._ms(cur.get("draft_loop_t0"), cur.get("draft_loop_t1"))
            (n0, ms0), (n1, ms1) = cur.get("jit0", (0, 0.0)), cur.get("jit1", (0, 0.0))
            row["jit_compiles"], row["jit_ms"] = n1 - n0, round(ms1 - ms0, 3)
            out.append(json.dumps(row) + "\n")
        return out

    def flush(self, timeout: float = 60.0) -> None:
        self._hand_over()
        self.flush_queue(timeout)
