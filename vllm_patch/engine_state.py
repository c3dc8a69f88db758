"""Per-engine state: the knobs read, the report, the trace and step timer, the batch being verified.

One :class:`EngineState` per engine process, created by ``engine_patches.apply`` and handed to
every installer there; the hooks close over it (``runner_hooks``, ``relaxed_gate``,
``worker_rpc``) or keep it on the object vLLM builds (the twin proposer keeps it as
``self._twin_engine``). No plugin module holds it in a global of its own.

The one process-wide fact is *that* the plugin is installed and with which state: vLLM loads its
general plugins more than once per process (front end, engine core, workers, each ``LLM``), the
patches must go in once, and the front end of an in-process engine (the cost ladder's step rows)
has no other handle on the state than the process. It is kept in one place, set once at install:
an attribute of the ``vllm`` module, the object the patches change, so it also survives a
re-import of this package (:func:`current`, :func:`publish`).
"""

from __future__ import annotations

import os

from .engine_report import EngineReport
from .knobs import EngineKnobs, KnobError
from .telemetry import StepTimer, TraceWriter

STATE_ATTR = "_twin_spec_state"  # on the vllm module: the installed EngineState


class EngineState:
    """What one engine's patches share.

    ``batch_req_ids`` is set by the runner's ``_sample`` hook around the rejection sampler call and
    read by the relaxed gate (vLLM calls the sampler without the runner): which requests the rows
    of the batch being verified belong to. ``trace_parked`` keeps the trace writer while tracing is
    switched off at run time (trace-cost benchmark: on and off side by side in one engine).
    """

    # step counters the report carries (each written by ``bump``, whole by ``report_counts``)
    COUNTERS = ("draft_idle_skips", "draft_idle_prompt_skips", "early_output_steps", "early_release_steps",
                "schedule_key_changes")

    def __init__(self, knobs: EngineKnobs | None = None, report: EngineReport | None = None,
                 trace: TraceWriter | None = None, steps: StepTimer | None = None):
        self.knobs = knobs
        self.report = report
        self.trace = trace
        self.trace_parked: TraceWriter | None = None
        self.steps = steps
        self.batch_req_ids: list[str] | None = None
        self.draft_vision_calls = 0
        self.draft_idle_skips = 0  # steps at γ 0 that ran no draft pass (knob draft_idle=skip / skip_all)
        self.draft_idle_prompt_skips = 0  # of them, steps with prompt tokens (draft_idle=skip_all)
        self.early_output_steps = 0  # steps whose sampled tokens were copied before the drafter's work
        self.early_release_steps = 0  # steps handed to the client before the next step's launch (early_release)
        self.schedule_key_changes = 0  # steps whose γ the schedule gave by load, not batch (gamma_schedule_key)
        self.draft_pass_queued: bool | None = None  # whether the latest sample_tokens queued a draft pass

    @classmethod
    def create(cls, knobs: EngineKnobs, env=None) -> EngineState:
        """The state of an engine started with ``knobs``; writes the first engine report."""
        env = os.environ if env is None else env
        report = EngineReport(knobs)
        report.update()
        trace = TraceWriter(knobs.report_dir) if knobs.trace and knobs.report_dir else None
        steps = None
        if StepTimer.SWITCH.read_env(env):
            if not knobs.report_dir:
                raise KnobError(f"{StepTimer.SWITCH.env}=1 needs VLLM_SPEC_REPORT_DIR: the folder step timings go to")
            steps = StepTimer(knobs.report_dir)
        return cls(knobs, report, trace, steps)

    def set_parallel(self, tp_rank: int, tp_size: int) -> None:
        """This worker's place in the tensor-parallel group (the runner hooks call it once the group exists).

        Every rank verifies the same drafts from the same gathered logits, so one trace and one set of
        step times describe the engine: rank 0 writes them, the other ranks write none (a trace file per
        rank would count every step once per rank). Each rank still writes its engine report, naming
        its rank: the workbench merges them and refuses ranks that disagree.
        """
        if self.report is not None:
            self.report.update(tp_rank=int(tp_rank), tensor_parallel_size=int(tp_size))
        if tp_rank != 0:
            self.trace, self.trace_parked = None, None
            if self.steps is not None:
                self.steps.muted = True

    def bump(self, name: str, **also: int) -> None:
        """One more step on counter ``name`` (and ``also`` added to others); the report has them at the first
        and every 100th (``report_counts`` writes the whole count at a leg's end)."""
        value = getattr(self, name) + 1
        setattr(self, name, value)
        for k, v in also.items():
            setattr(self, k, getattr(self, k) + v)
        if self.report is not None and (value == 1 or value % 100 == 0):
            self.report.update(**{name: value}, **{k: getattr(self, k) for k in also})

    # -- what the worker RPC asks (see worker_rpc) ----------------------------------------------- #
    def report_counts(self) -> None:
        """The step counters as they stand (the report otherwise has them at their first and every 100th
        step); a leg's end calls this through its flushes, so its summary holds the whole count."""
        counts = {k: getattr(self, k) for k in self.COUNTERS}
        counts = {k: v for k, v in counts.items() if v}
        compiled = self.steps.jit.kernels() if self.steps is not None else {}
        if compiled:  # the Triton kernels compiled in this process while it served (step timer on)
            counts["jit_compiles"] = compiled
        if self.report is not None and counts:
            self.report.update(**counts)

    def flush_trace(self) -> int:
        """Write out every traced step of this process; the number of steps traced."""
        self.report_counts()
        return self.trace.flush() if self.trace is not None else 0

    def set_trace(self, on: bool) -> bool:
        """Switch tracing off/on in a running engine; whether it is on."""
        if on and self.trace is None and self.trace_parked is not None:
            self.trace, self.trace_parked = self.trace_parked, None
        elif not on and self.trace is not None:
            self.trace.flush()
            self.trace, self.trace_parked = None, self.trace
        return self.trace is not None

    def trace_stats(self) -> dict:
        """Steps traced and the host time the trace spent on the decode path, this process."""
        t = self.trace or self.trace_parked
        return {"steps": t.step, "host_ms": t.host_ns / 1e6} if t is not None else {"steps": 0, "host_ms": 0.0}

    def flush_steps(self) -> str | None:
        """Write out the step timer's rows; its file (None: no step timer)."""
        self.report_counts()
        if self.steps is None or self.steps.muted:
            return None
        self.steps.flush()
        return self.steps.path


def current() -> EngineState | None:
    """The state the plugin was installed with in this process (None: not installed)."""
    import vllm

    return getattr(vllm, STATE_ATTR, None)


def publish(state: EngineState) -> None:
    """Record ``state`` as this process's installed state: once, at the end of the install."""
    import vllm

    if getattr(vllm, STATE_ATTR, None) is not None:
        raise RuntimeError("the twin-spec plugin is already installed in this process")
    setattr(vllm, STATE_ATTR, state)
