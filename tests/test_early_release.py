"""The early release of a first token (``vllm_patch.early_release``, knob ``early_release``), on a CPU host.

vLLM's CPU platform has no async scheduling, so its engine never takes ``step_with_batch_queue``. The test
runs vLLM 0.27.1's own ``EngineCore.step_with_batch_queue`` on an engine core whose scheduler and executor
are stand-ins that log the order of calls: with the knob on, a step that gives a request its first token
(and queued a draft pass) is handed over before the next step is scheduled; in every other case the order is
vLLM's (schedule and launch the next step, then hand over the oldest). The GPU side is E18's `twin_a1_early`
leg (both output knobs on) against `twin_a1` (both off, the default).
"""

from __future__ import annotations

import queue
from collections import deque
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from vllm_patch import early_release
from vllm_patch.engine_state import EngineState
from vllm_patch.knobs import SWITCHES, EngineKnobs, read_knobs

PROMPT = 16


class Request:
    def __init__(self):
        self.num_prompt_tokens, self.num_computed_tokens, self._out = PROMPT, 0, []

    @property
    def num_output_tokens(self):  # as vLLM's Request has it
        return len(self._out)


class Scheduler:
    def __init__(self, log):
        self.log, self.requests, self.steps = log, {}, 0

    def add(self, rid):
        self.requests[rid] = Request()

    def has_requests(self):
        return any(len(r._out) < 4 for r in self.requests.values())

    def schedule(self, throttle=False):
        self.steps += 1
        sched = {}
        for rid, r in self.requests.items():
            n = PROMPT - r.num_computed_tokens if r.num_computed_tokens < PROMPT else 1
            r.num_computed_tokens += n
            sched[rid] = n
        self.log.append(("schedule", self.steps))
        return SimpleNamespace(num_scheduled_tokens=sched, total_num_scheduled_tokens=sum(sched.values()),
                               pending_structured_output_tokens=False, step=self.steps)

    def get_grammar_bitmask(self, so):
        return None

    def update_from_output(self, so, out):
        for rid in so.num_scheduled_tokens:
            self.requests[rid]._out.append(out)
        self.log.append(("output", so.step))
        return {0: out}


class Executor:
    def __init__(self, log):
        self.log = log

    def execute_model(self, so, non_block=False):
        self.log.append(("launch", so.step))
        self._so = so
        f = Future()
        f.set_result(None)
        return f

    def sample_tokens(self, grammar, non_block=False):
        f = Future()
        f.set_result(f"tokens of step {self._so.step}")
        return f


def _core(knob_on: bool, spec: bool = True):
    from vllm.v1.engine.core import EngineCore

    class Core(EngineCore):  # the patch goes onto this subclass; vLLM's class stays as it is
        pass

    class Runner:
        def sample_tokens(self, *a, **k):
            return "sampled"

    state = EngineState(EngineKnobs(early_release=knob_on))
    early_release.install(state, Core, Runner)
    core = object.__new__(Core)
    log: list = []
    core.scheduler, core.model_executor = Scheduler(log), Executor(log)
    core.batch_queue_size, core.batch_queue = 2, deque(maxlen=2)
    core.is_ec_consumer, core.is_pooling_model, core.log_stats, core.check_for_draft_tokens = True, False, False, False
    core.aborts_queue = queue.Queue()
    core._should_throttle_prefills = lambda: False
    core.vllm_config = SimpleNamespace(observability_config=SimpleNamespace(enable_logging_iteration_details=False),
                                       speculative_config=object() if spec else None)
    return core, state, log, Runner


def _first_token_step(core, state, drafted=True):
    """A new request's prefill scheduled and launched (the call returns nothing: vLLM fills its queue first)."""
    core.scheduler.add("r1")
    assert core.step_with_batch_queue() == (None, True)
    state.draft_pass_queued = drafted  # what the twin proposer says for that step's sample_tokens


def test_the_first_token_is_handed_over_before_the_next_step_is_scheduled():
    core, state, log, runner = _core(knob_on=True)
    _first_token_step(core, state)
    outputs, executed = core.step_with_batch_queue()
    assert outputs == {0: "tokens of step 1"} and executed is True
    assert log == [("schedule", 1), ("launch", 1), ("output", 1)]  # step 2 not scheduled yet
    assert "has_requests" not in vars(core.scheduler) and core.scheduler.has_requests()
    assert state.early_release_steps == 1 and not core.batch_queue
    # the next call schedules step 2 as vLLM does; a decode step gives no first token: vLLM's order again
    assert core.step_with_batch_queue() == (None, True)
    state.draft_pass_queued = True
    assert core.step_with_batch_queue()[0] == {0: "tokens of step 2"}
    assert log[3:] == [("schedule", 2), ("launch", 2), ("schedule", 3), ("launch", 3), ("output", 2)]
    assert state.early_release_steps == 1
    # the runner's sample_tokens forgets the flag of the step before (the proposer sets it again)
    assert runner().sample_tokens() == "sampled" and state.draft_pass_queued is None


@pytest.mark.parametrize("case", ["knob off", "no draft pass queued", "vanilla engine"])
def test_otherwise_vllms_order_stays(case):
    core, state, log, _ = _core(knob_on=case != "knob off", spec=case != "vanilla engine")
    _first_token_step(core, state, drafted=case != "no draft pass queued")
    assert core.step_with_batch_queue()[0] == {0: "tokens of step 1"}
    assert log == [("schedule", 1), ("launch", 1), ("schedule", 2), ("launch", 2), ("output", 1)]
    assert state.early_release_steps == 0


def test_the_knob_reads_from_the_environment():
    knob = SWITCHES["early_release"]
    assert knob.env == "VLLM_SPEC_EARLY_RELEASE" and knob.default is False and not knob.applies_on_cpu
    assert read_knobs({"VLLM_SPEC_EARLY_RELEASE": "1"}).early_release is True
    assert read_knobs({}).early_release is False
