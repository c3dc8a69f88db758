"""The target's sampled tokens leave the GPU before the drafter's work, not behind it (knob ``early_output``).

With async scheduling, vLLM 0.27.1's ``GPUModelRunner.sample_tokens`` samples, queues the drafter's
passes (``propose_draft_token_ids``: for a new request the draft's prefill and its γ draft steps), and
only then builds ``AsyncGPUModelRunnerOutput``, whose copy stream waits for the whole default stream
before it copies the sampled tokens to the host. Every step's tokens therefore reach the client after
the draft has proposed; for a new request that puts the draft's prefill and all γ draft steps into its
time to first token (at the 32B shape about 70 ms of the twin's ~110 ms extra TTFT,
``results/E16/README.md``).

The tokens and log-probabilities that copy carries are final once the target has sampled: the drafter
reads them and never writes them. So the copy only has to wait for the sampling:

* ``propose_draft_token_ids`` (wrapped) records a CUDA event on the current stream before the drafter
  queues anything, when the runner has async scheduling, a CUDA device and the twin's drafter;
* ``AsyncGPUModelRunnerOutput.__init__`` (wrapped) makes its copy stream wait for that event instead
  of the whole default stream. The device tensors stay referenced by the output until its copy has
  completed (vLLM's own rule), so the allocator cannot hand them out meanwhile;
* ``sample_tokens`` (wrapped) clears the event at its entry and exit, so an event never outlives the
  step it was recorded in (a drafter that runs after the output is built, vLLM's CPU-token path, leaves
  the copy as vLLM orders it).

What changes for a request: TTFT loses the first step's drafting; each later step's tokens leave one
draft earlier, so TPOT (the mean over a request's tokens) is the same within noise. Off (``0``), the
copy waits as in stock vLLM. The engine report counts the steps whose copy went early
(``early_output_steps``, written at the first and every 100th, and whole at the leg's end).
"""

from __future__ import annotations

import torch

from .engine_state import EngineState


def _eligible(runner) -> bool:
    drafter = getattr(runner, "drafter", None)
    return (getattr(drafter, "_twin", None) is not None and bool(getattr(runner, "use_async_scheduling", False))
            and getattr(getattr(runner, "device", None), "type", None) == "cuda")


def install(state: EngineState, runner_cls=None, out_cls=None, event_cls=None) -> None:
    """Wrap the three methods (once per process: ``engine_patches.apply``); a no-op when the knob is off.

    ``runner_cls``, ``out_cls``, ``event_cls``: vLLM's ``GPUModelRunner``, ``AsyncGPUModelRunnerOutput``
    and ``torch.cuda.Event`` unless given (a test hands in stand-ins to check the ordering on a CPU host).
    """
    if not getattr(state.knobs, "early_output", False):
        return
    if runner_cls is None or out_cls is None:
        from vllm.v1.worker import gpu_model_runner as gmr

        runner_cls, out_cls = gmr.GPUModelRunner, gmr.AsyncGPUModelRunnerOutput
    new_event = event_cls or torch.cuda.Event
    orig_propose = runner_cls.propose_draft_token_ids
    orig_sample_tokens = runner_cls.sample_tokens
    orig_out_init = out_cls.__init__
    pending: list = [None]  # the current step's "sampled" event

    def propose_draft_token_ids(self, *args, **kwargs):
        if _eligible(self):
            event = new_event()
            event.record()  # the current stream: sampling is queued, drafting is not yet
            pending[0] = event
        return orig_propose(self, *args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        pending[0] = None
        try:
            return orig_sample_tokens(self, *args, **kwargs)
        finally:
            pending[0] = None

    def __init__(self, *args, **kwargs):
        event, pending[0] = pending[0], None
        stream = kwargs.get("async_output_copy_stream")
        if event is None or stream is None:
            return orig_out_init(self, *args, **kwargs)
        # vLLM's __init__ calls ``stream.wait_stream(default_stream)``; for this one call the copy stream
        # waits for the sampling event instead (an instance attribute shadows the method, then goes)
        stream.wait_stream = lambda _default_stream: stream.wait_event(event)
        try:
            orig_out_init(self, *args, **kwargs)
        finally:
            del stream.wait_stream
        state.bump("early_output_steps")

    runner_cls.propose_draft_token_ids = propose_draft_token_ids
    runner_cls.sample_tokens = sample_tokens
    out_cls.__init__ = __init__
