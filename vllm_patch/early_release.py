"""A step that gives requests their first token reaches the client before the next step is launched (knob
``early_release``).

With async scheduling vLLM 0.27.1's engine core keeps a queue of two steps
(``EngineCore.step_with_batch_queue``): it schedules and launches step N, returns nothing, schedules and
launches step N+1, and only then waits for step N's output and hands it to the client. Launching a step
is host work that, in a spec engine, includes the drafter's passes and a wait for the GPU at the next
step's input preparation. Measured with ``benchmarks/ttft_probe.py`` at the 8B shape on an H100
(``results/ttft-probe/``): from a request's arrival to its first token's release the host spent 52 ms in
a spec engine against 10.5 ms in a vanilla one, of which 21 ms was launching step N+1 and 11 ms of it a
wait at ``synchronize_input_prep``. ``early_output`` had already copied the token early; the host still
held it until the next step was out.

Here, before a new step is scheduled, the oldest step in the queue is looked at: where it is the step
that gives some request its first token (a request with no output token yet whose prompt the step
completes), the engine waits for that step's output and returns it first, as vLLM does when the queue
is full; the next step is scheduled on the following call. vLLM's own code does the waiting (its
``has_requests`` reads false for that one call, so it takes its "nothing new to schedule" path).

It acts only where step N queued a draft pass (the twin proposer says so for the latest
``sample_tokens``: ``EngineState.draft_pass_queued``): the next step is then launched a few milliseconds
later while the GPU is still busy with step N's drafter work, so no decode step waits for it. Where no
draft pass was queued (γ 0 under a schedule with ``draft_idle=skip``/``skip_all``) the GPU would idle
during that launch, so vLLM's order stays; so it does for every step that gives no first token, in a
vanilla engine, and where the engine core and the worker are different processes (tensor parallelism:
the flag is not there). The engine report counts the steps handed over early (``early_release_steps``).
Not measured on a GPU yet.
"""

from __future__ import annotations

from .engine_state import EngineState


def gives_first_tokens(scheduler, scheduler_output) -> bool:
    """Whether the scheduled step completes the prompt of a request that has no output token yet."""
    requests = scheduler.requests
    for req_id in scheduler_output.num_scheduled_tokens:
        req = requests.get(req_id)
        if req is not None and req.num_output_tokens == 0 and req.num_computed_tokens >= req.num_prompt_tokens:
            return True
    return False


def _no_requests() -> bool:
    return False


def install(state: EngineState, core_cls=None, runner_cls=None) -> None:
    """Wrap ``EngineCore.step_with_batch_queue`` and ``GPUModelRunner.sample_tokens`` (once per process:
    ``engine_patches.apply``); a no-op when the knob is off. ``core_cls``, ``runner_cls``: vLLM's classes
    unless given (a test hands in the real engine core with stand-in parts)."""
    if not getattr(state.knobs, "early_release", False):
        return
    if core_cls is None:
        from vllm.v1.engine.core import EngineCore as core_cls
    if runner_cls is None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as runner_cls
    orig = core_cls.step_with_batch_queue
    orig_sample_tokens = runner_cls.sample_tokens

    def sample_tokens(self, *args, **kwargs):
        state.draft_pass_queued = None  # the proposer sets it if it is called for this step
        return orig_sample_tokens(self, *args, **kwargs)

    def step_with_batch_queue(self):
        queue = self.batch_queue
        if (queue and state.draft_pass_queued and getattr(self.vllm_config, "speculative_config", None) is not None
                and gives_first_tokens(self.scheduler, queue[-1][1])):
            # vLLM's "no new batch" path: wait for the oldest step, update the scheduler, return its outputs
            self.scheduler.has_requests = _no_requests
            try:
                outputs, _ = orig(self)
            finally:
                del self.scheduler.has_requests
            state.bump("early_release_steps")
            # a model did run for this output (in the earlier call): no idle pause in the busy loop
            return outputs, True
        return orig(self)

    core_cls.step_with_batch_queue = step_with_batch_queue
    runner_cls.sample_tokens = sample_tokens
