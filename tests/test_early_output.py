"""The early output copy (``vllm_patch.early_output``, knob ``early_output``): ordering, on a CPU host.

The wrappers are installed on stand-ins for vLLM's runner and output classes that keep vLLM 0.27.1's call
order (``sample_tokens`` samples, queues the drafter through ``propose_draft_token_ids``, then builds the
output, whose ``__init__`` makes the copy stream wait on the default stream). Timing on a GPU is the
serving legs' TTFT (E18) and ``tests/test_gpu.py``'s async legs (exact, ``early_output_steps`` counted).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_patch import early_output
from vllm_patch.engine_state import EngineState
from vllm_patch.knobs import SWITCHES, EngineKnobs, read_knobs


class Event:
    made: list = []

    def __init__(self):
        self.recorded = False
        Event.made.append(self)

    def record(self):
        self.recorded = True


class CopyStream:
    def __init__(self):
        self.waits: list = []

    def wait_stream(self, other):
        self.waits.append(("stream", other))

    def wait_event(self, event):
        self.waits.append(("event", event))


def _classes(draft_after_output: bool = False):
    class Output:
        def __init__(self, model_runner_output=None, async_output_copy_stream=None):
            async_output_copy_stream.wait_stream("default")  # vLLM: the copy waits for the default stream

    class Runner:
        def __init__(self, twin=True, use_async=True, device="cuda"):
            self.drafter = SimpleNamespace(_twin={} if twin else None)
            self.use_async_scheduling = use_async
            self.device = torch.device(device)
            self.stream = CopyStream()
            self.outputs = []

        def propose_draft_token_ids(self, *args):
            return "drafts"

        def sample_tokens(self, grammar_output=None):
            if not draft_after_output:
                self.propose_draft_token_ids()
            self.outputs.append(Output(async_output_copy_stream=self.stream))
            if draft_after_output:  # vLLM's CPU-token drafters run after the output is built
                self.propose_draft_token_ids()

    return Runner, Output


def _install(on: bool = True, **kw):
    state = EngineState(EngineKnobs(early_output=on))
    Runner, Output = _classes(**kw)
    early_output.install(state, Runner, Output, Event)
    return state, Runner


def test_the_copy_waits_for_the_sampling_event_not_for_the_drafter():
    state, Runner = _install()
    r = Runner()
    r.sample_tokens()
    r.sample_tokens()
    # each step's copy waited on that step's own event, recorded before the drafter queued anything
    assert [w[0] for w in r.stream.waits] == ["event", "event"]
    assert r.stream.waits[0][1] is not r.stream.waits[1][1] and all(w[1].recorded for w in r.stream.waits)
    assert state.early_output_steps == 2
    assert "wait_stream" not in vars(r.stream)  # the stream's own method is back


def test_an_event_never_reaches_a_later_step_and_other_runners_keep_vllms_order():
    # a drafter that runs after the output is built: its event must not serve the next step's copy
    _, Late = _install(draft_after_output=True)
    r = Late()
    r.sample_tokens()
    r.sample_tokens()
    assert [w[0] for w in r.stream.waits] == ["stream", "stream"]
    for kw in ({"twin": False}, {"use_async": False}, {"device": "cpu"}):
        _, Runner = _install()
        r = Runner(**kw)
        r.sample_tokens()
        assert r.stream.waits == [("stream", "default")], kw


def test_off_changes_nothing_and_the_knob_is_on_by_default():
    state, Runner = _install(on=False)
    r = Runner()
    r.sample_tokens()
    assert r.stream.waits == [("stream", "default")] and state.early_output_steps == 0
    knob = SWITCHES["early_output"]
    assert knob.default is False and knob.env == "VLLM_SPEC_EARLY_OUTPUT" and not knob.applies_on_cpu
    assert read_knobs({"VLLM_SPEC_EARLY_OUTPUT": "1"}).early_output is True
    assert read_knobs({}).early_output is False
