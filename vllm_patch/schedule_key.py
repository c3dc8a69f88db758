"""Knob ``gamma_schedule_key``: what vLLM's batch-size γ schedule is looked up by.

vLLM 0.27.1's scheduler picks the next step's γ from ``num_speculative_tokens_per_batch_size`` by the number
of requests it scheduled in this step (``len(num_scheduled_tokens)``, ``Scheduler.schedule``). While prompts
wait for their prefill that number is small although the batch is about to be large: the step that admits a
wave of requests, or the last steps of a wave whose successors are already waiting. There the schedule turns
speculation on, and with ``draft_idle=skip_all`` the draft first catches up on every running request's context.
Measured on one H100 (8B, E18 ``results/E18/20261207T235605Z-869510a1``, ``twin_a0.9_auto_lean`` at
concurrency 32, 64 fresh requests): the first wave's requests ended with inter-token gaps of 23-66 ms
where vanilla's were at most 15, their TPOT 8.3-9.2 ms against vanilla's 7.0-7.6; the second wave's, with
nobody waiting behind it, equalled vanilla's. TPOT 0.856x vanilla's.

``load`` looks the schedule up by the requests running plus those waiting (at least the scheduled ones, at
most ``max_num_seqs``, past which the batch cannot grow): a step is priced at the batch it is about to have.
``batch`` is vLLM's rule. The engine report counts the steps whose γ the key changed (``schedule_key_changes``).
"""

from __future__ import annotations

from .engine_state import EngineState


def load_of(scheduler) -> int:
    """Requests the scheduler holds: running, waiting and skipped-waiting."""
    return len(scheduler.running) + len(scheduler.waiting) + len(getattr(scheduler, "skipped_waiting", ()))


def keyed_gamma(scheduler, scheduler_output) -> int | None:
    """The γ the schedule gives at the scheduler's load, or None where no schedule is on or nothing ran."""
    lookup = getattr(scheduler, "dynamic_sd_lookup", None)
    scheduled = len(scheduler_output.num_scheduled_tokens)
    if lookup is None or scheduled == 0:
        return None
    return lookup[min(max(load_of(scheduler), scheduled), len(lookup) - 1)]


def install(state: EngineState, scheduler_cls=None) -> None:
    """Wrap ``Scheduler._update_after_schedule`` (the async scheduler's override calls it first, then reads
    the γ for its placeholders); a no-op unless the knob is ``load``."""
    if getattr(state.knobs, "gamma_schedule_key", "batch") != "load":
        return
    if scheduler_cls is None:
        from vllm.v1.core.sched.scheduler import Scheduler as scheduler_cls
    orig = scheduler_cls._update_after_schedule
    if getattr(orig, "_twin_schedule_key", False):
        return

    def _update_after_schedule(self, scheduler_output):
        gamma = keyed_gamma(self, scheduler_output)
        if gamma is not None and gamma != scheduler_output.num_spec_tokens_to_schedule:
            scheduler_output.num_spec_tokens_to_schedule = gamma
            state.bump("schedule_key_changes")
        return orig(self, scheduler_output)

    _update_after_schedule._twin_schedule_key = True
    scheduler_cls._update_after_schedule = _update_after_schedule
