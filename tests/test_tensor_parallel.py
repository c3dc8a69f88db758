"""Issue 22: tensor parallelism. The target and its twin sharded over 2 ranks with vLLM's own TP (on CPU:
its multiprocess executor, one worker process per rank), every switch still exact.

The engine tests run the tiny models (4 attention heads, 2 key/value heads) at tensor_parallel_size 2 on
this 2-core host, beside the same legs at 1, in float32 with the dequantized twin where exactness is
asserted (vLLM's CPU int4 kernel has no float32 path on AVX-512 hosts), and in bfloat16 with the int4
twin for the int4 path (the plugin's fallback on AVX2 hosts, vLLM's kernel on AVX-512 ones). This module:
`workbench run E1` at TP 2 and 1 and the blind draft against that run's TP 2 vanilla leg, then the sizes a
host or model refuses; tests/test_tensor_parallel_legs.py: the relaxed gate and the int4 twin;
tests/test_tensor_parallel_ladder.py: the cost ladder. (Three modules, so that two test workers share them.)
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, TINY_PROMPTS, run_leg_process, workbench_cli
from tp_legs import FP32, gen, needs_two_cores, tp2_report, tp_legs, trace_equals_counters  # noqa: F401 (fixture)
from workbench.parallel import head_counts, tp_problems

# The E1 runs' workload: the blind legs' too, so that the E1 run's TP 2 vanilla leg is their reference.
E1_WORKLOAD = ["n=4", "max_tokens=32"]
FP32_RUN = [a for a in FP32 if a != "--ignore-eos"]  # a run's legs stop at EOS


# --------------------------------------------------------------------------- engines at TP 2 (CPU)


@pytest.fixture(scope="module")
def e1_runs(tmp_path_factory, tiny_models):
    """`workbench run E1 --profile tiny` in float32 with the dequantized twin, at tensor_parallel_size 2 and 1,
    4 prompts of 32 tokens (the blind legs' workload)."""
    from workbench.results import load_run

    runs = {}
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    for tp in (2, 1):
        root = tmp_path_factory.mktemp(f"e1_tp{tp}")
        res = subprocess.run(workbench_cli("run", "E1", "--profile", "tiny", "-p", f"tensor_parallel_size={tp}",
                                           "-p", "dtype=float32", *[a for p in E1_WORKLOAD for a in ("-p", p)],
                                           "--model-path", f"twin={tiny_models['twin-dequant']}", "--no-notebook",
                                           "--results", str(root)),
                             cwd=REPO, capture_output=True, text=True, timeout=1200)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        (rdir,) = list((root / "E1").iterdir())
        runs[tp] = load_run(rdir)
    # the TP 2 legs' communicator pairs (4 MiB each), which vLLM leaves even when a leg ends normally
    SHM_LEFT[:] = sorted(n for n in set(os.listdir("/dev/shm")) - shm_before if "cpushm" in n) if shm_before else []
    return runs


SHM_LEFT: list[str] = []


def _run_gen(run, leg: str) -> dict[str, list[int]]:
    return {r.pid: [int(t) for t in r.gen_ids] for r in run.leg_records(leg).itertuples()}


@needs_two_cores
@pytest.mark.vllm
def test_tp2_legs_leave_nothing_in_dev_shm(e1_runs):
    """#38: /dev/shm holds no more vLLM CPU communicator entries after the TP 2 run than before it."""
    assert SHM_LEFT == []


@needs_two_cores
@pytest.mark.vllm
def test_e1_at_tp2_is_exact_and_accepts_what_tp1_accepts(e1_runs):
    from workbench.exactness import classify

    two, one = e1_runs[2], e1_runs[1]
    assert json.loads((two.path / "env.json").read_text())["tensor_parallel_sizes"] == [2]
    gens = {tp: {leg: _run_gen(run, leg) for leg in run.legs_order} for tp, run in e1_runs.items()}
    spec = next(leg for leg in two.legs_order if leg.startswith("strict"))
    # strict, float32: equal token for token to the TP 2 vanilla legs and to the TP 1 vanilla leg
    for ref in [g for g in two.legs_order if g.startswith("vanilla")]:
        v = classify(gens[2][ref], gens[2][spec], "float32", None)
        assert v.ok and v.n_exact == v.n, f"TP 2 strict vs TP 2 {ref}: {v.describe()}"
    v = classify(gens[1]["vanilla_1"], gens[2][spec], "float32", None)
    assert v.ok and v.n_exact == v.n, f"TP 2 strict vs TP 1 vanilla: {v.describe()}"
    # acceptance: the same drafts accepted as at TP 1 (float32; reductions in another order)
    a2 = two.legs.set_index("leg").loc[spec, "spec_num_accepted_tokens"]
    a1 = one.legs.set_index("leg").loc[spec, "spec_num_accepted_tokens"]
    assert a2 == a1, (a2, a1)
    # one engine report, naming TP 2 and both workers; the leg table states it
    summary = json.loads((two.path / "legs" / spec / "summary.json").read_text())
    assert summary["engine_report"]["tensor_parallel_size"] == 2 and summary["engine_report"]["tp_ranks"] == 2
    assert summary["engine_args"]["tensor_parallel_size"] == 2
    assert set(two.legs["tensor_parallel_size"]) == {2} and set(one.legs["tensor_parallel_size"]) == {1}


@needs_two_cores
@pytest.mark.vllm
def test_blind_draft_at_tp2_is_exact_and_traced(tp_legs, tiny_models, e1_runs):
    args = [*FP32_RUN, "--draft", tiny_models["twin-dequant"], "--gamma", "3", "--blind-mm", "--max-num-seqs", "2"]
    two = tp_legs("blind_tp2", *args, "--tensor-parallel-size", "2")
    one = tp_legs("blind_tp1", *args)
    report = tp2_report(two)
    assert report["draft_vision"] == "blind"
    # strict: exact, blind or not (the reference: the E1 run's TP 2 vanilla leg, same prompts, tokens, dtype)
    van = e1_runs[2]
    assert van.legs.set_index("leg").loc["vanilla_1", "tensor_parallel_size"] == 2
    assert gen(two) == _run_gen(van, "vanilla_1")
    assert two.summary["spec"]["num_accepted_tokens"] == one.summary["spec"]["num_accepted_tokens"]
    trace_equals_counters(two)


# --------------------------------------------------------------------------- sizes a model and host allow


def _qwen3vl(heads=4, kv=2, vision=2):
    return {"text_config": {"num_attention_heads": heads, "num_key_value_heads": kv},
            "vision_config": {"num_heads": vision}}


def test_head_counts_read_the_language_model_and_the_vision_tower():
    assert head_counts(_qwen3vl(8, 4, 16)) == {"attention": 8, "kv": 4, "vision": 16}
    assert head_counts({"num_attention_heads": 6}) == {"attention": 6, "kv": 6}  # a text-only config


@pytest.mark.parametrize("tp,config,devices,message", [
    (3, _qwen3vl(), 8, "does not divide the target's 4 attention heads"),
    (4, _qwen3vl(8, 3, 16), 8, "the target's 3 key/value heads: neither divides the other"),
    (4, _qwen3vl(8, 8, 6), 8, "does not divide the target's vision tower's 6 heads"),
    (4, _qwen3vl(8, 8, 8), 2, "needs 4 CPU cores, one per rank; this host has 2"),
])
def test_sizes_the_heads_or_the_host_cannot_take_are_named(tp, config, devices, message):
    problems = tp_problems(tp, {"target": config}, devices, "CPU core")
    assert any(message in p for p in problems), problems


def test_sizes_that_shard_are_accepted():
    assert tp_problems(2, {"target": _qwen3vl(), "draft": _qwen3vl()}, 2, "CPU core") == []
    assert tp_problems(4, {"target": _qwen3vl(8, 2, 16)}, 4, "CUDA device") == []  # 2 KV heads replicated
    assert tp_problems(1, {"target": _qwen3vl(3, 3, 3)}, 1) == []
    assert tp_problems(2, {"target": None}, None) == []  # a hub id: vLLM checks it


def test_the_tiny_models_shard_at_2(tiny_models):
    for role in ("target", "twin-int4", "twin-dequant"):
        config = json.loads((Path(tiny_models[role]) / "config.json").read_text())
        assert tp_problems(2, {role: config}) == [], role


# --------------------------------------------------------------------------- the engine report over ranks


def _report(rank, **over):
    base = {"pid": 100 + rank, "tp_rank": rank, "tensor_parallel_size": 2, "drafter": "draft_model",
            "draft_linear_kernel": "CPUInt4", "weight_bytes": {"target": 10 + rank}, "knobs": {"trace": True}}
    return {**base, **over}


def test_rank_reports_merge_into_one_naming_tp_and_its_workers():
    from workbench.leg import merge_rank_reports

    merged = merge_rank_reports([_report(1), _report(0)])
    assert merged["tp_rank"] == 0 and merged["tensor_parallel_size"] == 2 and merged["tp_ranks"] == 2
    assert merged["rank_pids"] == [100, 101] and merged["weight_bytes"] == {"target": 10}  # rank 0's shard
    assert merge_rank_reports([_report(0, tensor_parallel_size=1)])["tensor_parallel_size"] == 1


@pytest.mark.parametrize("reports,message", [
    ([_report(0), _report(1, draft_linear_kernel="Other")], "ranks disagree on 'draft_linear_kernel'"),
    ([_report(0), _report(1, knobs={"trace": False})], "ranks disagree on 'knobs'"),
    ([_report(0), _report(0)], "a rank twice"),
])
def test_ranks_that_disagree_are_an_error(reports, message):
    from workbench.leg import RankDisagreement, merge_rank_reports

    with pytest.raises(RankDisagreement, match=message):
        merge_rank_reports(reports)


def test_only_rank_0_writes_the_trace_and_the_step_rows(tmp_path):
    from vllm_patch.engine_state import EngineState
    from vllm_patch.telemetry import StepTimer, TraceWriter

    for rank in (0, 1):
        d = tmp_path / f"r{rank}"
        state = EngineState(trace=TraceWriter(str(d)), steps=StepTimer(str(d)))
        state.set_parallel(rank, 2)
        if rank == 0:
            assert state.trace is not None and state.flush_steps() == state.steps.path
        else:
            assert state.trace is None and state.flush_trace() == 0 and state.flush_steps() is None
            state.steps.put({"never": "written"})
            assert not d.exists() or not list(d.iterdir())


# --------------------------------------------------------------------------- refused before an engine starts


def test_a_leg_refuses_a_size_its_models_cannot_take(tmp_path, tiny_models):
    res = run_leg_process(tmp_path / "leg", "--target", tiny_models["target"], "--prompts", TINY_PROMPTS,
                          "--max-tokens", "4", "--tensor-parallel-size", "3")
    assert res.returncode != 0
    assert "tensor_parallel_size 3 does not divide the target's 4 attention heads" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "leg" / "summary.json").exists()


@pytest.mark.parametrize("tp,message", [
    ("3", "tensor_parallel_size 3 does not divide the target (target)'s 4 attention heads"),
    ("64", "tensor_parallel_size 64 needs 64 CPU cores, one per rank"),
])
def test_a_run_refuses_a_bad_size_before_its_folder_exists(tmp_path, tp, message):
    root = tmp_path / "results"
    res = subprocess.run(workbench_cli("run", "E1", "--profile", "tiny", "-p", f"tensor_parallel_size={tp}",
                                       "--results", str(root)),
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert message in res.stderr and "Traceback" not in res.stderr
    assert not (root / "E1").exists() or not list((root / "E1").iterdir())


def test_vanilla_brackets_follow_the_tensor_parallel_size():
    from workbench import planning

    p = planning.plan("E1", "tiny", ["tensor_parallel_size=2"])
    assert [(l.kind, l.knobs["tensor_parallel_size"]) for l in p.legs] == [
        ("vanilla", 2), ("spec", 2), ("vanilla", 2)]
