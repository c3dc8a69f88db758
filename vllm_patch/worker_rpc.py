"""Methods of vLLM's workers that the workbench calls by name through ``collective_rpc``.

``llm.collective_rpc("twin_spec_flush_trace")`` (and the others) runs the method in every worker
process, each on its own engine state; the names are the contract with ``workbench.leg``, the cost
ladder and the trace-cost benchmark:

* ``twin_spec_flush_trace()``: write out every traced step; the number of steps traced.
* ``twin_spec_set_trace(on)``: switch tracing off/on in a running engine; whether it is on.
* ``twin_spec_trace_stats()``: steps traced and the host time the trace took on the decode path.
* ``twin_spec_flush_steps()``: write out the step timer's rows; its file (None: no step timer).
* ``twin_spec_set_draft_graphs(mode)``: how the twin drafter dispatches from now on although its
  graphs exist: ``True`` / ``"built"`` (what was built), ``"piecewise"`` (an engine with FULL graphs
  runs its single-token steps piecewise), ``False`` / ``"none"`` (eager); the cost ladder measures
  them side by side in one engine. Returns the mode set.
* ``twin_spec_draft_graph_stats()``: single-token draft steps by graph mode, and the mode built.
"""

from __future__ import annotations

from .engine_state import EngineState


def _twin_drafter(worker):
    runner = getattr(worker, "model_runner", None)
    drafter = getattr(runner, "drafter", None)
    return drafter if getattr(drafter, "_twin", None) is not None else None


def install(state: EngineState) -> None:
    """Add the methods to vLLM's ``WorkerBase``, bound to this process's engine state."""
    from vllm.v1.worker.worker_base import WorkerBase

    def twin_spec_flush_trace(self) -> int:
        return state.flush_trace()

    def twin_spec_set_trace(self, on: bool) -> bool:
        return state.set_trace(on)

    def twin_spec_trace_stats(self) -> dict:
        return state.trace_stats()

    def twin_spec_flush_steps(self) -> str | None:
        return state.flush_steps()

    def twin_spec_set_draft_graphs(self, mode) -> str | None:
        drafter = _twin_drafter(self)
        return drafter.set_dispatch(mode) if drafter is not None else None

    def twin_spec_draft_graph_stats(self) -> dict | None:
        drafter = _twin_drafter(self)
        if drafter is None:
            return None
        return {"built": drafter.built_graph_mode(), "dispatched": dict(drafter._twin_dispatched)}

    for method in (twin_spec_flush_trace, twin_spec_set_trace, twin_spec_trace_stats, twin_spec_flush_steps,
                   twin_spec_set_draft_graphs, twin_spec_draft_graph_stats):
        setattr(WorkerBase, method.__name__, method)
