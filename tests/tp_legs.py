"""What the tensor-parallel test modules share: the leg sizes, the host check, a module-scoped cache of leg
processes, and the checks every TP 2 leg gets (tests/test_tensor_parallel*.py)."""

from __future__ import annotations

import os

import pytest

from conftest import TINY_PROMPTS, run_leg_process

FP32 = ["--max-tokens", "32", "--ignore-eos", "--dtype", "float32", "--max-model-len", "1024", "--n", "4"]
BF16 = ["--max-tokens", "32", "--ignore-eos", "--dtype", "bfloat16", "--max-model-len", "1024", "--n", "4"]


def _cores() -> int:
    return len(os.sched_getaffinity(0))


needs_two_cores = pytest.mark.skipif(_cores() < 2, reason="tensor_parallel_size 2 needs 2 CPU cores")


@pytest.fixture(scope="module")
def tp_legs(tmp_path_factory, tiny_models):
    """``get(name, *leg args)``: the leg of the tiny target on the tiny prompts, run once per module."""
    cache = {}

    def get(name, *args):
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            cache[name] = run_leg_process(out, "--target", tiny_models["target"], "--prompts", TINY_PROMPTS,
                                          *args, timeout=900).ok()
        return cache[name]

    return get


def gen(leg) -> dict[str, list[int]]:
    return {pid: r["gen_ids"] for pid, r in leg.by_pid().items()}


def trace_equals_counters(leg) -> None:
    recs = leg.by_pid().values()
    spec = leg.summary["spec"]
    assert sum(r["spec"]["accepted"] for r in recs) == spec["num_accepted_tokens"]
    assert sum(r["spec"]["draft_tokens"] for r in recs) == spec["num_draft_tokens"]
    assert sum(r["spec"]["drafts"] for r in recs) == spec["num_drafts"]


def tp2_report(leg) -> dict:
    report = leg.summary["engine_report"]
    assert report["tensor_parallel_size"] == 2 and report["tp_ranks"] == 2, report
    assert len(set(report["rank_pids"])) == 2
    assert all(r["knobs"]["tensor_parallel_size"] == 2 for r in leg.by_pid().values())  # every record states it
    return report
