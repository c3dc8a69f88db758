"""Run-time changes to vLLM 0.27.1 that make a Qwen3-VL twin a working draft.

Everything here wraps or replaces methods on vLLM's own classes; no vLLM file
is copied or edited. Each wrapper is narrow: it acts only for the
``draft_model`` method and otherwise defers to the original. The drafting loop
itself (the first five points below) is ``twin_proposer.TwinDraftProposer``, a
subclass of vLLM's ``DraftModelProposer`` that the runner constructs in its
place; :func:`apply` installs it and the rest, one module per concern:

* ``twin_proposer``   the drafting loop (M-RoPE positions, the draft's images, drafter CUDA graphs)
* ``runner_hooks``    the model runner: the draft's multimodal inputs and encoder cache, the
                      batch's request ids for the gate, report facts, step-timer spans
* ``relaxed_gate``    the rejection-sampler wrapper: relaxed gate, trace margins, the tie rule
* ``request_checks``  the relaxed tier refuses sampled requests (offline and HTTP 400)
* ``quant_ignore``    a draft's compressed-tensors ignore list reaches its layers
* ``worker_rpc``      ``twin_spec_*`` methods the workbench calls through ``collective_rpc``
* ``cpu_int4``        the CPU W4A16 fallback
* ``early_output``    with async scheduling, a step's sampled tokens go to the host before the drafter's work
* ``early_release``   with async scheduling, a step that gives a first token is handed over before the next launch
* ``target_graphs``   the target's FULL decode graphs under vLLM's batch-size γ schedule (knob ``target_graphs``)
* ``schedule_key``    that schedule looked up by running + waiting requests (knob ``gamma_schedule_key=load``)
* ``engine_state``    the per-engine state those share (knobs, report, trace, step timer)
* ``engine_report``, ``telemetry``  the report, the trace writer and the step timer

:func:`apply` creates the one ``EngineState`` of the process and hands it to each installer; no
module keeps engine state in a global. That the plugin is installed, and with which state, is the
one process-wide fact (``engine_state.current()``; why it has to be, see ``engine_state``).

What stock 0.27.1 gets wrong for an M-RoPE draft, and what is done here:

* ``_raise_if_mrope`` refuses the draft outright -> allowed for ``draft_model``.
* ``self.positions`` is never allocated for an M-RoPE draft, but the
  copy/expand kernel of the first draft pass writes 1-D positions into it
  -> allocated as a scratch buffer of sequence positions.
* The first pass is fed the target's M-RoPE positions where 1-D sequence
  positions are expected (the kernel reads row 0, the temporal row). After an
  image the temporal row is compressed, so the KV-cache slot mapping of the
  draft pointed at the wrong slots -> the kernel is fed the runner's sequence
  positions, and the draft's 3-D positions are rebuilt afterwards: every target
  token keeps its exact (t, h, w) triple, every appended token is a text token
  at ``seq + delta`` where ``delta`` is that request's M-RoPE offset.
* Later draft steps advanced M-RoPE row 0 as if it were the sequence position
  -> the sequence position and the M-RoPE offset are carried separately.
* The multimodal mask is gathered with EAGLE's one-token shift and for the
  target's token layout, while the draft's first pass inserts one slot per
  request (the off-by-one reported upstream) -> gathered without shift and
  scattered into the draft's layout.
* The draft runs its own vision tower on the request's images (its encoder
  outputs are cached beside the target's), unless its tower's weights equal
  the target's (a twin's do: ``draft_vision``, knob ``draft_vision_share``),
  when it reads the target's encoder outputs, or ``blind_mm`` is on: then
  the image placeholder positions keep the draft's embedding of the
  ``<|image_pad|>`` token and their (t, h, w) positions, and no vision tower
  of the draft runs.
"""

from __future__ import annotations

from .engine_state import EngineState, current, publish
from .knobs import EngineKnobs
from .telemetry import StepTimer, TraceWriter  # noqa: F401  (the trace's line format is documented there)


def apply(knobs: EngineKnobs) -> EngineState:
    """Install every change once per process (plugins load more than once); the engine state.

    A second call, in any process where the plugin is installed, changes nothing and returns the
    state of the first.
    """
    installed = current()
    if installed is not None:
        return installed
    state = EngineState.create(knobs)
    from . import cpu_int4, early_output, early_release, quant_ignore, relaxed_gate, request_checks
    from . import runner_hooks, schedule_key, target_graphs, twin_proposer, worker_rpc

    twin_proposer.install()  # the twin's drafting loop: vllm_patch/twin_proposer.py
    runner_hooks.install(state)
    relaxed_gate.install(state)
    request_checks.install(knobs)
    quant_ignore.install()
    worker_rpc.install(state)
    cpu_int4.install()
    early_output.install(state)  # after runner_hooks: its wrappers are the outer ones
    early_release.install(state)
    target_graphs.install(knobs)  # knob target_graphs=full only
    schedule_key.install(state)  # knob gamma_schedule_key=load only
    publish(state)
    return state


def __getattr__(name: str):
    # ``engine_patches.G``: read-only name of this process's engine state, for callers in the
    # engine's process that read it (the cost ladder's in-process engine: ``G.steps``, ``G.report``).
    # Not installed: an empty state (no report, no trace, no step timer).
    if name == "G":
        return current() or EngineState()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
