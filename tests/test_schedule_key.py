"""#36: knob ``gamma_schedule_key`` (``vllm_patch.schedule_key``): vLLM's batch-size γ schedule looked up by the
requests scheduled (``batch``, vLLM's) or by running plus waiting (``load``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conftest import TINY_PROMPTS, run_leg_process
from vllm_patch import schedule_key
from vllm_patch.knobs import SWITCHES, KnobError


def _scheduler(running, waiting, lookup):
    return SimpleNamespace(running=[0] * running, waiting=[0] * waiting, skipped_waiting=[], dynamic_sd_lookup=lookup)


def _out(scheduled):
    return SimpleNamespace(num_scheduled_tokens={f"r{i}": 1 for i in range(scheduled)}, num_spec_tokens_to_schedule=0)


def test_load_is_running_plus_waiting_clamped_to_the_schedule():
    lookup = [4, 4, 4, 0, 0, 0]  # γ 4 at batch 1-2, 0 at 3-5 (vLLM's dense lookup, index = batch size)
    assert schedule_key.keyed_gamma(_scheduler(2, 0, lookup), _out(2)) == 4
    assert schedule_key.keyed_gamma(_scheduler(2, 3, lookup), _out(2)) == 0  # prompts wait: the batch to come
    assert schedule_key.keyed_gamma(_scheduler(2, 40, lookup), _out(2)) == 0  # past the largest size: its γ
    assert schedule_key.keyed_gamma(_scheduler(2, 0, None), _out(2)) is None  # no schedule
    assert schedule_key.keyed_gamma(_scheduler(2, 3, lookup), _out(0)) is None  # an empty step
    with pytest.raises(KnobError, match="gamma_schedule_key"):
        SWITCHES["gamma_schedule_key"].parse("queue")


@pytest.mark.vllm
def test_a_request_admitted_while_others_wait_does_not_draft_under_load(tmp_path, tiny_models):
    """Four requests at once, a step's token budget (32) admitting their prompts a chunk at a time, γ 4 up to
    batch 2 and off from 3. vLLM's key sees one or two requests scheduled while the others' prompts wait and
    lets the first draft; ``load`` sees the four and does not. The output is the same."""
    common = ["--target", str(tiny_models["target"]), "--draft", str(tiny_models["twin-dequant"]), "--gamma", "4",
              "--gamma-schedule", "1-2:4/3-64:0", "--max-tokens", "16", "--ignore-eos", "--dtype", "float32",
              "--max-model-len", "1024", "--prompts", str(TINY_PROMPTS), "--n", "4", "--max-num-seqs", "4",
              "--max-num-batched-tokens", "32"]
    batch = run_leg_process(tmp_path / "batch", *common, "--leg", "batch").ok()
    load = run_leg_process(tmp_path / "load", *common, "--leg", "load", "--gamma-schedule-key", "load").ok()
    first = batch.records[0]["pid"]
    assert batch.by_pid()[first]["spec"]["drafts"] > 0  # drafted while three prompts waited for their prefill
    assert load.by_pid()[first]["spec"]["drafts"] == 0
    assert load.summary["engine_report"]["schedule_key_changes"] >= 1
    assert not batch.summary["engine_report"].get("schedule_key_changes")
    assert load.records[0]["knobs"]["gamma_schedule_key"] == "load"
    assert {p: r["gen_ids"] for p, r in load.by_pid().items()} == {p: r["gen_ids"] for p, r in batch.by_pid().items()}
