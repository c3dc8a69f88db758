"""Issue 36: synthetic acceptance, the batch-size γ schedule and the GPU memory plan (no engine),
and the synthetic sampler's CPU path against its CUDA kernel's semantics; one offline pair of legs
(α = 1 synthetic against the wide-open relaxed gate) that must cost the same steps."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from conftest import REPO, TINY_PROMPTS, run_leg_process

from workbench import acceptance as acc
from workbench.acceptance import AcceptanceError
from workbench.knobs import Knobs
from workbench.memory_plan import GiB, MemoryPlanError, model_memory, plan_memory

ORGANISM_E1 = REPO / "results" / "E1" / "20261203T082615Z-df50104d"
H200_BYTES = 143771 * 1024 * 1024   # nvidia-smi's memory.total of an H200
H100_BYTES = 81559 * 1024 * 1024    # and of an H100 80GB HBM3


# --------------------------------------------------------------------------- acceptance profiles
def test_alpha_is_conditional_per_position():
    assert acc.unconditional_rates("alpha:0.9", 4) == pytest.approx([0.9, 0.81, 0.729, 0.6561])
    assert acc.unconditional_rates("alpha:1", 3) == [1.0, 1.0, 1.0]
    assert acc.unconditional_rates("real", 4) is None


def test_length_becomes_the_geometric_profile_of_that_length():
    rates = acc.unconditional_rates("length:2.49", 4)
    assert acc.expected_tokens(rates) == pytest.approx(2.49, abs=1e-6)
    a = rates[0]
    assert rates == pytest.approx([a, a ** 2, a ** 3, a ** 4])   # not vLLM's step profile [1, 0.49, 0, 0]
    with pytest.raises(AcceptanceError, match="exceeds gamma"):
        acc.unconditional_rates("length:6", 4)


def test_rates_are_unconditional_non_increasing_and_cover_gamma():
    assert acc.unconditional_rates("rates:0.9/0.8/0.7/0.6/0.5", 4) == [0.9, 0.8, 0.7, 0.6]
    with pytest.raises(AcceptanceError, match="non-increasing"):
        acc.check_acceptance("rates:0.5/0.9")
    with pytest.raises(AcceptanceError, match="at least 4"):
        acc.unconditional_rates("rates:0.9/0.8", 4)
    for bad in ("alpha:1.2", "alpha:x", "length:0.5", "rates:", "fixed:3", "beta:0.9"):
        with pytest.raises(AcceptanceError):
            acc.check_acceptance(bad)


@pytest.mark.skipif(not ORGANISM_E1.is_dir(), reason="the organism's committed E1 run folder is absent")
def test_from_a_recorded_leg_is_its_measured_per_position_acceptance():
    recs = [json.loads(l) for l in (ORGANISM_E1 / "legs" / "strict_g6" / "records.jsonl").read_text().splitlines()]
    drafts = sum(r["spec"]["drafts"] for r in recs)
    want = [sum(r["spec"]["accepted_per_pos"][i] for r in recs) / drafts for i in range(6)]
    got = acc.unconditional_rates(f"from:{ORGANISM_E1}:strict_g6", 6)
    assert got == pytest.approx([min(want[:i + 1]) for i in range(6)])
    # the run's only spec leg is found without naming it; a shorter γ takes the first positions
    assert acc.unconditional_rates(f"from:{ORGANISM_E1}", 4) == pytest.approx(got[:4])
    with pytest.raises(AcceptanceError, match="does not exist"):
        acc.unconditional_rates(f"from:{ORGANISM_E1}:nope", 4)


def test_synthetic_knobs_are_a_tier_of_their_own_and_refuse_the_relaxed_gate():
    k = Knobs(gamma=4, acceptance="alpha:0.9")
    assert k.tier == "synthetic"
    extra, info = k.spec_config_extra(8)
    assert extra == {"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.9, 0.81, 0.729, 0.6561]}
    assert info["synthetic_acceptance_length"] == pytest.approx(4.0951)
    with pytest.raises(ValueError, match="relax_logtau"):
        Knobs(gamma=4, acceptance="alpha:0.9", relax_logtau=0.7)
    with pytest.raises(ValueError, match="need a draft"):
        Knobs(acceptance="alpha:0.9")
    assert Knobs(gamma=4).spec_config_extra(8) == ({}, {"num_speculative_tokens": 4})


# --------------------------------------------------------------------------- the γ schedule
def test_explicit_schedule_is_vllms_inclusive_ranges():
    extra, _ = Knobs(gamma=4, gamma_schedule="1-4:4/5-16:2/17-64:0").spec_config_extra(64)
    assert extra == {"num_speculative_tokens": 4,
                     "num_speculative_tokens_per_batch_size": [[1, 4, 4], [5, 16, 2], [17, 64, 0]]}
    for bad, why in (("2-4:4", "start at batch size 1"), ("1-4:4/6-8:2", "must start at 5"),
                     ("1-4:0", "off at every batch"), ("1-4", "must be none")):
        with pytest.raises(AcceptanceError, match=why):
            acc.parse_schedule(bad)
    with pytest.raises(AcceptanceError, match="above the leg's gamma"):
        Knobs(gamma=2, gamma_schedule="1-4:4").spec_config_extra(8)


def _cost_run(tmp_path: Path, cells: list[tuple[int, int, float]], name: str = "E16run",
              card: str | None = None) -> Path:
    """An E16 run folder's cost table: (batch, γ, measured S at α = 1, decode only) per cell; ``card``: the GPU
    its ``env.json`` names."""
    run = tmp_path / name
    (run / "tables").mkdir(parents=True)
    if card is not None:
        (run / "env.json").write_text(json.dumps({"gpu": {"devices": [{"name": card, "index": 0}]}}))
    lines = ["size,batch,gamma,draft_graphs,verify_ms,propose_ms,c,decode_ms,S_measured_alpha1,"
             "S_measured_decode_alpha1"]
    lines += [f"32b [x],{b},{g},True,18,{9 * g},0.5,18,{s * 0.9},{s}" for b, g, s in cells]
    (run / "tables" / "cost_ratio.csv").write_text("\n".join(lines) + "\n")
    return run


def test_auto_schedule_picks_the_best_predicted_gamma_and_turns_speculation_off_where_nothing_pays(tmp_path):
    run = _cost_run(tmp_path, [(1, 2, 1.40), (1, 4, 1.64), (4, 2, 1.30), (4, 4, 1.35), (16, 2, 0.80),
                               (16, 4, 0.83)])
    k = Knobs(gamma=4, acceptance="alpha:0.9", gamma_schedule=f"auto:{run}", draft_idle="skip")
    extra, info = k.spec_config_extra(32)
    # S(α) = E[tokens](α, γ) / (γ + 1) · S_measured(α = 1): at 0.9, γ 4 keeps 4.10 / 5 of 1.64 = 1.34 at batch 1
    # (γ 2: 2.71 / 3 · 1.40 = 1.26), γ 2 wins at batch 4 (1.17 vs 1.11), nothing pays at 16
    assert extra["num_speculative_tokens_per_batch_size"] == [[1, 2, 4], [3, 10, 2], [11, 32, 0]]
    assert info["draft_idle"] == "skip"
    # vLLM's own γ 0 still runs the draft's pass over the batch: off costs 1 / (1 + c) = 0.67 at c 0.5, so
    # γ 2's 0.72 at batch 16 is the better step there, and it holds past the table
    sync_extra, sync_info = Knobs(gamma=4, acceptance="alpha:0.9", gamma_schedule=f"auto:{run}").spec_config_extra(32)
    assert sync_extra["num_speculative_tokens_per_batch_size"] == [[1, 2, 4], [3, 32, 2]]
    row16 = next(r for r in sync_info["gamma_schedule_table"] if r["batch"] == 16 and r["gamma"] == 2)
    assert row16["S_off_predicted"] == pytest.approx(1 / 1.5) and row16["chosen"]
    assert extra["num_speculative_tokens"] == 4 and len(extra["synthetic_acceptance_rates"]) == 4
    chosen = {(r["batch"], r["gamma"]): r for r in info["gamma_schedule_table"]}
    assert chosen[(1, 4)]["S_predicted"] == pytest.approx(4.0951 / 5 * 1.64) and chosen[(1, 4)]["chosen"]
    with pytest.raises(AcceptanceError, match="acceptance profile"):
        Knobs(gamma=4, gamma_schedule=f"auto:{run}").spec_config_extra(8)
    slow = _cost_run(tmp_path / "slow", [(1, 2, 0.9), (4, 2, 0.8)])
    with pytest.raises(AcceptanceError, match="no γ is predicted to pay"):
        Knobs(gamma=4, acceptance="alpha:0.9", gamma_schedule=f"auto:{slow}").spec_config_extra(8)


def test_auto_schedule_reads_the_decode_only_speedup_before_the_end_to_end_one(tmp_path):
    # an E16 table without the decode-only column: the step times' ratio (decode only, what TPOT sees)
    # is used, not the end-to-end ratio that holds the prefill
    run = tmp_path / "old"
    (run / "tables").mkdir(parents=True)
    (run / "tables" / "cost_ratio.csv").write_text(
        "size,batch,gamma,draft_graphs,verify_ms,propose_ms,c,decode_ms,S_steps_alpha1,S_measured_alpha1\n"
        "32b [x],1,4,True,18,36,0.5,18,1.60,1.20\n32b [x],16,4,True,30,40,0.6,20,1.10,0.80\n")
    table = acc.schedule_table(run, lambda g: [0.9 ** (i + 1) for i in range(g)], 32)
    assert [(r["batch"], r["S_basis"], r["S_measured_alpha1"]) for r in table] == [
        (1, "S_steps_alpha1", 1.60), (16, "S_steps_alpha1", 1.10)]


def test_bare_auto_finds_the_newest_cost_run_of_the_targets_size(tmp_path):
    _cost_run(tmp_path, [(1, 2, 1.2), (4, 2, 1.1)], "20260101T000000Z-a")
    _cost_run(tmp_path, [(1, 4, 1.5), (16, 4, 0.9)], "20260102T000000Z-b")
    _cost_run(tmp_path, [(1, 4, 1.5)], "20260103T000000Z-c")   # one batch size: no schedule from it
    assert acc.default_cost_run("models/shapes/32b-target", root=tmp_path).name == "20260102T000000Z-b"
    with pytest.raises(AcceptanceError, match="size '8b'"):
        acc.default_cost_run("models/shapes/8b-target", root=tmp_path)


def test_auto_schedule_turns_speculation_off_past_the_largest_measured_batch(tmp_path):
    """An 8B table measured at batch 1 and 4 held γ 4 up to 32 on the H200, where the twin ran at 0.80x vanilla's
    TPOT: past the table's largest batch nothing was measured, so speculation is off there."""
    run = _cost_run(tmp_path, [(1, 4, 1.30), (4, 4, 1.28)])
    extra, info = Knobs(gamma=4, acceptance="alpha:0.9", gamma_schedule=f"auto:{run}",
                        draft_idle="skip").spec_config_extra(32)
    assert extra["num_speculative_tokens_per_batch_size"] == [[1, 4, 4], [5, 32, 0]]
    # with vLLM's γ 0 (the draft's pass still runs) off is no cheaper: batch 4's γ holds (a constant schedule)
    extra, info = Knobs(gamma=4, acceptance="alpha:0.9", gamma_schedule=f"auto:{run}").spec_config_extra(32)
    assert "num_speculative_tokens_per_batch_size" not in extra and info["gamma_schedule"] == [[1, 32, 4]]
    # a table reaching the server's largest batch is preferred to a newer one that stops short of it
    root = tmp_path / "E16"
    _cost_run(root, [(1, 4, 1.5), (16, 4, 0.9), (32, 4, 0.8)], "20260101T000000Z-far")
    _cost_run(root, [(1, 4, 1.5), (4, 4, 1.4)], "20260102T000000Z-near")
    assert acc.default_cost_run("models/shapes/32b-target", root=root, max_batch=32).name == "20260101T000000Z-far"
    assert acc.default_cost_run("models/shapes/32b-target", root=root, max_batch=4).name == "20260102T000000Z-near"


def test_a_constant_schedule_is_not_handed_to_vllm():
    """One γ at every batch size is no schedule; vLLM would switch the target's graphs to PIECEWISE for it."""
    extra, info = Knobs(gamma=4, gamma_schedule="1-8:4").spec_config_extra(8)
    assert "num_speculative_tokens_per_batch_size" not in extra and extra["num_speculative_tokens"] == 4
    assert info["gamma_schedule"] == [[1, 8, 4]] and info["gamma_schedule_constant"]


# --------------------------------------------------------------------------- the memory plan
def _shapes():
    from workbench.shapes import build_shapes
    from workbench.tiny import ensure_tiny_models

    root = REPO / "models" / "shapes"
    if not (root / "0.6b-text" / "config.json").is_file():
        build_shapes(root, ensure_tiny_models()["target"])
    return root


def test_weights_from_the_config_match_what_vllm_loaded_at_32b():
    root = _shapes()
    weights = sum(model_memory(root / r).weights_bytes for r in ("32b-target", "32b-twin"))
    # vLLM 0.27.1 on an H200: "Model loading took 82.01 GiB" for the 32B target and its W4A16 twin
    assert weights / GiB == pytest.approx(82.01, rel=0.03)
    assert model_memory(root / "32b-target").kv_bytes_per_token == 2 * 64 * 8 * 128 * 2


def test_plan_sizes_the_kv_cache_and_refuses_with_numbers_and_a_way_out():
    root = _shapes()
    models = {"target": root / "32b-target", "draft": root / "32b-twin"}
    p = plan_memory(models, max_model_len=2048, max_num_seqs=32, device_bytes=H200_BYTES)
    assert p.kv_cache_memory_bytes == p.kv_tokens * 512 * 1024 and p.kv_tokens >= 32 * 2048
    assert p.needed_bytes <= p.gpu_memory_utilization * H200_BYTES <= 0.94 * H200_BYTES
    with pytest.raises(MemoryPlanError) as exc:
        plan_memory(models, max_model_len=3584, max_num_seqs=64, device_bytes=H200_BYTES)
    msg = str(exc.value)
    assert "weights 81." in msg and "max_model_len 3584 × max_num_seqs 64" in msg and "lower max_num_seqs to" in msg
    # the knob caps the plan: the old E17 default (0.6) cannot hold the 32B pair at all
    with pytest.raises(MemoryPlanError, match="gpu_memory_utilization 0.6"):
        plan_memory(models, max_model_len=3584, max_num_seqs=1, device_bytes=H200_BYTES, cap=0.6)


def test_plan_counts_the_layouts_a_hybrid_draft_kernel_holds():
    """own-cuda+marlin holds the twin's int4 layers twice, own-cuda+marlin+machete three times: the plan adds
    them, and refuses (naming the kernel) a ladder that fits with Marlin alone."""
    root = _shapes()
    models = {"target": root / "32b-target", "draft": root / "32b-twin"}
    q = model_memory(root / "32b-twin").quantized_bytes
    assert 15 * GiB < q < 20 * GiB and model_memory(root / "32b-target").quantized_bytes == 0
    base = plan_memory(models, max_model_len=2048, max_num_seqs=4, device_bytes=H200_BYTES)
    two = plan_memory(models, max_model_len=2048, max_num_seqs=4, device_bytes=H200_BYTES,
                      draft_linear_kernel="own-cuda+marlin")
    three = plan_memory(models, max_model_len=2048, max_num_seqs=4, device_bytes=H200_BYTES,
                        draft_linear_kernel="own-cuda+marlin+machete")
    assert two.weights_bytes - base.weights_bytes == q and three.weights_bytes - base.weights_bytes == 2 * q
    assert three.gpu_memory_utilization > two.gpu_memory_utilization > base.gpu_memory_utilization
    plan_memory(models, max_model_len=2048, max_num_seqs=32, device_bytes=H200_BYTES)  # fits with Marlin alone
    with pytest.raises(MemoryPlanError, match="int4 layers 3 times: draft_linear_kernel own-cuda"):
        plan_memory(models, max_model_len=2048, max_num_seqs=32, device_bytes=H200_BYTES,
                    draft_linear_kernel="own-cuda+marlin+machete")
    vanilla = plan_memory({"target": models["target"]}, max_model_len=2048, max_num_seqs=4,
                          device_bytes=H200_BYTES, draft_linear_kernel="own-cuda+marlin+machete")
    assert vanilla.weights_bytes == model_memory(models["target"]).weights_bytes  # no draft, nothing added


def test_plan_reads_safetensors_sizes_where_the_folder_has_weights(tiny_models):
    folder = Path(tiny_models["target"])
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    m = model_memory(folder)
    assert m.source == "safetensors" and m.weights_bytes == size > 0


# --------------------------------------------------------------------------- the CPU sampler path
class _Meta:
    all_greedy = True
    generators: dict = {}


@pytest.mark.vllm
def test_cpu_synthetic_sampler_has_the_cuda_kernels_semantics():
    import torch
    from vllm.v1.spec_decode.utils import unconditional_to_conditional_rates

    from vllm_patch.relaxed_gate import synthetic_greedy_cpu

    torch.manual_seed(0)
    vocab, gamma, batch = 11, 4, 2000
    logits = torch.randn(batch * gamma, vocab)
    argmax = logits.argmax(-1)
    drafts = (argmax + 1) % vocab                       # every drafted token is wrong for the target
    drafts[5] = -1                                      # a placeholder never passes
    bonus = torch.full((batch, 1), 7, dtype=torch.int64)
    cu = torch.arange(1, batch + 1) * gamma

    def run(rates):
        cond = torch.tensor(unconditional_to_conditional_rates(rates), dtype=torch.float32)   # as vLLM builds it
        return synthetic_greedy_cpu(drafts, [gamma] * batch, gamma, cu, None, logits.clone(), bonus, _Meta(),
                                    synthetic_mode=True, synthetic_conditional_rates=cond)

    out = run([1.0] * gamma)
    assert (out[0, :gamma] == drafts[:gamma].int()).all() and int(out[0, gamma]) == 7   # all kept + bonus
    assert int(out[1, 1]) == int(argmax[5]) and (out[1, 2:] == -1).all()                 # the -1 fails
    out = run([0.0] * gamma)
    assert (out[:, 0] == argmax[::gamma].int()).all() and (out[:, 1:] == -1).all()
    rates = acc.unconditional_rates("alpha:0.8", gamma)
    kept = ((run(rates)[:, :gamma] == drafts.view(batch, gamma).int()).sum(1)).float()
    assert kept.mean().item() == pytest.approx(sum(rates), abs=0.08)     # mean accepted per draft


@pytest.mark.vllm
def test_synthetic_alpha_one_costs_what_the_wide_open_gate_costs(tmp_path, tiny_models):
    """At α = 1 synthetic acceptance keeps every drafted token, as relax_logtau=1e9 does: the same steps,
    the same drafted and accepted counts (so the same cost); the leg is marked synthetic."""
    common = ["--target", str(tiny_models["target"]), "--draft", str(tiny_models["twin-int4"]), "--gamma", "4",
              "--max-tokens", "24", "--ignore-eos", "--dtype", "bfloat16", "--max-model-len", "1024",
              "--prompts", str(TINY_PROMPTS), "--n", "3"]
    syn = run_leg_process(tmp_path / "syn", *common, "--leg", "syn", "--acceptance", "alpha:1").ok()
    wide = run_leg_process(tmp_path / "wide", *common, "--leg", "wide", "--relax-logtau", "1e9").ok()
    assert {r["tier"] for r in syn.records} == {"synthetic"}
    for a, b in zip(sorted(syn.records, key=lambda r: r["pid"]), sorted(wide.records, key=lambda r: r["pid"])):
        sa, sb = a["spec"], b["spec"]
        assert (sa["drafts"], sa["draft_tokens"], sa["accepted"]) == (sb["drafts"], sb["draft_tokens"], sb["accepted"])
        assert sa["accepted"] == sa["draft_tokens"] and a["gen_len"] == b["gen_len"] == 24
    spec_cfg = syn.summary["engine_args"]["speculative_config"]
    assert spec_cfg["rejection_sample_method"] == "synthetic" and spec_cfg["synthetic_acceptance_rates"] == [1.0] * 4


@pytest.mark.vllm
def test_schedule_turns_speculation_off_at_the_batch_sizes_it_names(tmp_path, tiny_models):
    """vLLM's batch-size schedule with γ 0 past batch 1: four requests at once never draft; alone they do."""
    common = ["--target", str(tiny_models["target"]), "--draft", str(tiny_models["twin-int4"]), "--gamma", "4",
              "--gamma-schedule", "1-1:4/2-64:0", "--max-tokens", "16", "--ignore-eos", "--dtype", "bfloat16",
              "--max-model-len", "1024", "--prompts", str(TINY_PROMPTS), "--n", "4"]
    batched = run_leg_process(tmp_path / "b4", *common, "--leg", "b4", "--max-num-seqs", "4").ok()
    alone = run_leg_process(tmp_path / "b1", *common, "--leg", "b1", "--max-num-seqs", "1").ok()
    assert sum(r["spec"]["drafts"] for r in batched.records) == 0
    assert all(r["spec"]["drafts"] > 0 for r in alone.records)
    assert batched.summary["engine_args"]["speculative_config"]["num_speculative_tokens_per_batch_size"] == [
        [1, 1, 4], [2, 64, 0]]
    # the engine reports the schedule as on (on CUDA, vLLM's V1 runner then runs the target on PIECEWISE graphs)
    assert batched.summary["engine_report"]["gamma_schedule_dynamic"] is True
    # vLLM's γ 0 still runs the draft's pass over the batch every step; draft_idle=skip runs none at a
    # decode-only step, and the output is the same tokens
    skip = run_leg_process(tmp_path / "b4s", *common, "--leg", "b4s", "--max-num-seqs", "4",
                           "--draft-idle", "skip").ok()
    assert not batched.summary["engine_report"].get("draft_idle_skips")
    # every decode step after the prompts' (16 tokens: 15 of them), counted to the leg's end
    assert skip.summary["engine_report"]["draft_idle_skips"] >= 15
    assert skip.records[0]["knobs"]["draft_idle"] == "skip"
    assert [r["gen_ids"] for r in skip.records] == [r["gen_ids"] for r in batched.records]
    # skip_all: the step that admits the four prompts at once (batch 4, γ 0) runs no draft pass either
    assert not skip.summary["engine_report"].get("draft_idle_prompt_skips")
    skip_all = run_leg_process(tmp_path / "b4a", *common, "--leg", "b4a", "--max-num-seqs", "4",
                               "--draft-idle", "skip_all").ok()
    report = skip_all.summary["engine_report"]
    assert report["draft_idle_prompt_skips"] >= 1 and report["knobs"]["draft_idle"] == "skip_all"
    assert report["draft_idle_skips"] >= 15 + report["draft_idle_prompt_skips"]
    assert [r["gen_ids"] for r in skip_all.records] == [r["gen_ids"] for r in batched.records]
    # target_graphs=full: the engine starts with it and decodes the same tokens; a CPU has no graphs to keep
    full = run_leg_process(tmp_path / "b4f", *common, "--leg", "b4f", "--max-num-seqs", "4",
                           "--target-graphs", "full").ok()
    assert full.records[0]["knobs"]["target_graphs"] == "full"
    assert full.summary["engine_report"]["knobs"]["target_graphs"] == "full"
    assert full.summary["engine_report"]["target_single_token_graphs"] == 0
    assert full.summary["engine_report"]["target_cudagraph_mode"] == "NONE"
    assert [r["gen_ids"] for r in full.records] == [r["gen_ids"] for r in batched.records]


def test_serving_prediction_uses_the_cost_ladders_c_at_the_cells_batch_and_gamma(tmp_path):
    from workbench.serving_predict import _cost_cell, predicted_speedup

    (tmp_path / "leg.json").write_text(json.dumps({"target": "models/shapes/32b-target"}))
    summary = {"tier": "synthetic", "knobs": {"draft_linear_kernel": "auto"},
               "speculative": {"num_speculative_tokens": 4, "synthetic_acceptance_rates": [0.9, 0.81, 0.729, 0.6561]}}
    cell = _cost_cell("32b", 1, 4)
    if cell is None:
        pytest.skip("no committed E16 run with a 32B batch-1 gamma-4 cell")
    p = predicted_speedup(tmp_path, summary, 1)
    assert p["c"] == cell[0] and p["S_predicted"] == pytest.approx(4.0951 / (1 + 4 * cell[0]))
    # under a schedule γ is the schedule's at the cell's concurrency; 0 is speculation off
    sched = dict(summary, speculative=dict(summary["speculative"], gamma_schedule=[[1, 2, 4], [3, 64, 0]],
                                           draft_idle="skip"))
    assert predicted_speedup(tmp_path, sched, 16) == {
        "S_predicted": 1.0, "c": None, "c_source": "speculation off at this batch size, no draft pass",
        "expected_tokens": 1.0}
    # vLLM's γ 0 (draft_idle sync): the draft's pass still runs, one draft step of c at that batch
    sync = dict(sched, speculative=dict(sched["speculative"], draft_idle="sync"))
    off = predicted_speedup(tmp_path, sync, 16)
    cell16 = next((_cost_cell("32b", 16, g) for g in range(1, 9) if _cost_cell("32b", 16, g)), None)
    if cell16 is not None:
        assert off["S_predicted"] == pytest.approx(1 / (1 + cell16[0])) and off["S_predicted"] < 1
    assert predicted_speedup(tmp_path, dict(summary, tier="strict"), 1) == {}
    # an `auto` leg's cell reads the c its schedule priced it at (the same cost table), not the newest one
    table = [{"batch": 1, "gamma": 2, "c": 0.7736, "source": "results/E16/X"},
             {"batch": 1, "gamma": 4, "c": 0.7644, "source": "results/E16/X"}]
    auto = dict(summary, speculative=dict(summary["speculative"], gamma_schedule=[[1, 2, 2], [3, 32, 0]],
                                          gamma_schedule_table=table, draft_idle="skip"))
    p = predicted_speedup(tmp_path, auto, 1)
    assert p["c"] == 0.7736 and p["c_source"] == "results/E16/X (the schedule's table)"
    assert p["S_predicted"] == pytest.approx((1 + 0.9 + 0.81) / (1 + 2 * 0.7736))


def test_serving_prediction_reads_a_table_of_the_legs_card_first_and_names_another_card(tmp_path):
    from workbench.serving_predict import _cost_cell, predicted_speedup

    root = tmp_path / "E16"
    _cost_run(root, [(1, 4, 1.6)], "20260101T000000Z-h100", card="NVIDIA H100 80GB HBM3")
    _cost_run(root, [(1, 4, 1.1)], "20260102T000000Z-h200", card="NVIDIA H200")
    assert _cost_cell("32b", 1, 4, root=root)[1].endswith("20260102T000000Z-h200")  # newest
    assert _cost_cell("32b", 1, 4, root=root, card="NVIDIA H100 80GB HBM3")[1].endswith("20260101T000000Z-h100")
    assert _cost_cell("32b", 1, 4, root=root, card="NVIDIA A100")[1].endswith("20260102T000000Z-h200")
    # a leg on an H100 whose schedule priced its cell from the H200's table: c_source says so
    leg = tmp_path / "leg"
    leg.mkdir()
    (leg / "leg.json").write_text(json.dumps({"target": "models/shapes/32b-target"}))
    (leg / "placement.json").write_text(json.dumps({"gpus": [{"name": "NVIDIA H100 80GB HBM3"}]}))
    table = [{"batch": 1, "gamma": 2, "c": 0.77, "source": str(root / "20260102T000000Z-h200")}]
    summary = {"tier": "synthetic", "speculative": {"synthetic_acceptance_rates": [0.9, 0.81], "draft_idle": "skip",
                                                    "gamma_schedule": [[1, 2, 2], [3, 32, 0]],
                                                    "gamma_schedule_table": table}}
    p = predicted_speedup(leg, summary, 1)
    assert p["c_source"].endswith("(the schedule's table); measured on NVIDIA H200, the leg ran on NVIDIA H100 80GB HBM3")
    (leg / "placement.json").write_text(json.dumps({"gpus": [{"name": "NVIDIA H200"}]}))
    assert "measured on" not in predicted_speedup(leg, summary, 1)["c_source"]


def test_serving_prediction_reads_no_cost_table_made_after_the_run(tmp_path, monkeypatch):
    """Exporting a run again later gives the prediction it had: the newest cost table made before the run,
    not one measured after it (a later E16 run once moved an 8B run's S at concurrency 1 from 1.465 to 1.472)."""
    import functools

    from workbench import serving_predict
    from workbench.serving_predict import _cost_cell, predicted_speedup

    root = tmp_path / "E16"
    _cost_run(root, [(1, 4, 1.6)], "20260101T000000Z-early")
    _cost_run(root, [(1, 4, 1.6)], "20260301T000000Z-later")
    assert _cost_cell("32b", 1, 4, root=root)[1].endswith("20260301T000000Z-later")
    assert _cost_cell("32b", 1, 4, root=root, before="20260201T000000Z-run")[1].endswith("20260101T000000Z-early")
    assert _cost_cell("32b", 1, 4, root=root, before="20251201T000000Z-run") is None  # nothing before it
    monkeypatch.setattr(serving_predict, "_cost_cell", functools.partial(_cost_cell, root=root))
    (tmp_path / "leg.json").write_text(json.dumps({"target": "models/shapes/32b-target"}))
    summary = {"tier": "synthetic", "run_id": "20260201T000000Z-run",
               "speculative": {"num_speculative_tokens": 4, "synthetic_acceptance_rates": [0.9, 0.81, 0.729, 0.6561]}}
    assert predicted_speedup(tmp_path, summary, 1)["c_source"].endswith("20260101T000000Z-early")
    later = predicted_speedup(tmp_path, dict(summary, run_id="20260401T000000Z-run"), 1)
    assert later["c_source"].endswith("20260301T000000Z-later")


def test_a_run_that_cannot_fit_is_refused_before_any_leg(monkeypatch):
    """The run's preflight plans every leg's memory on a CUDA host (here a 96 GiB device, stated): the 32B
    pair at concurrency 32 does not fit it, the vanilla target alone does."""
    from workbench import memory_plan
    from workbench.planning import plan

    root = _shapes()
    monkeypatch.setattr(memory_plan, "device_memory_bytes", lambda: 96 * GiB)
    p = plan("E18", "32b-shape", ["legs=twin_a1"])
    models = {"target": str(root / "32b-target"), "twin": str(root / "32b-twin")}
    problems = memory_plan.memory_problems(p, models, set())
    assert len(problems) == 1 and problems[0].startswith("leg twin_a1: does not fit the device")
    monkeypatch.setattr(memory_plan, "device_memory_bytes", lambda: None)   # no CUDA device: nothing to plan
    assert memory_plan.memory_problems(p, models, set()) == []


def test_bare_auto_prefers_the_faster_drafter_setup_among_tables_of_equal_reach(tmp_path):
    """The 8B tables of 1 December (here as 32B) both reach batch 16; the newer one measured a slower setup (S 1.02 at
    batch 1) and predicted that nothing pays at α 0.9. The table of the faster setup is the one to read."""
    _cost_run(tmp_path, [(1, 4, 1.25), (16, 4, 0.97)], "20260101T000000Z-fast")
    _cost_run(tmp_path, [(1, 4, 1.02), (16, 4, 0.70)], "20260102T000000Z-slow")
    assert acc.default_cost_run("models/shapes/32b-target", root=tmp_path, max_batch=32).name == "20260101T000000Z-fast"
    # reach still comes first: a slow table that reaches the server's batch beats a fast one that stops short
    _cost_run(tmp_path, [(1, 4, 1.01), (32, 4, 0.70)], "20260103T000000Z-far")
    assert acc.default_cost_run("models/shapes/32b-target", root=tmp_path, max_batch=32).name == "20260103T000000Z-far"


def test_bare_auto_prefers_a_cost_table_of_the_gpu_here_and_says_when_it_has_none(tmp_path, monkeypatch, capsys):
    """The 8B twin at α 1, γ 4 behind a server on an H100 paid 1.59x at concurrency 4 where the H200's table
    measured 1.03x: a table of another card prices a draft step wrongly, so the GPU's own table comes first."""
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    _cost_run(tmp_path, [(1, 4, 1.60), (16, 4, 1.29)], "20260101T000000Z-h100", card=h100)
    _cost_run(tmp_path, [(1, 4, 1.11), (16, 4, 0.78), (32, 4, 0.7)], "20260102T000000Z-h200", card=h200)
    assert acc.run_card(tmp_path / "20260101T000000Z-h100") == h100 and acc.run_card(tmp_path) is None
    pick = acc.default_cost_run("models/shapes/32b-target", root=tmp_path, max_batch=32, card=h100)
    assert pick.name == "20260101T000000Z-h100"  # its own card before reach
    assert acc.default_cost_run("models/shapes/32b-target", root=tmp_path, max_batch=32,
                                card=h200).name == "20260102T000000Z-h200"
    # no table of this card (or no GPU here): the rules of reach and speed as before
    for card in ("NVIDIA A100", None):
        assert acc.default_cost_run("models/shapes/32b-target", root=tmp_path, max_batch=32,
                                    card=card).name == "20260102T000000Z-h200"
    # the records say which card the table was measured on, and a mismatch is said once on stderr
    monkeypatch.setattr(acc, "host_card", lambda: "NVIDIA A100")
    run = tmp_path / "20260102T000000Z-h200"
    info = Knobs(gamma=4, acceptance="alpha:1", gamma_schedule=f"auto:{run}", draft_idle="skip").spec_config_extra(32)[1]
    assert (info["gamma_schedule_card"], info["gamma_schedule_host_card"], info["gamma_schedule_same_card"]) == (
        h200, "NVIDIA A100", False)
    Knobs(gamma=4, acceptance="alpha:1", gamma_schedule=f"auto:{run}", draft_idle="skip").spec_config_extra(32)
    err = capsys.readouterr().err
    assert err.count("was measured on NVIDIA H200, this leg runs on NVIDIA A100") == 1
    monkeypatch.setattr(acc, "host_card", lambda: h200)
    info = Knobs(gamma=4, acceptance="alpha:1", gamma_schedule=f"auto:{run}", draft_idle="skip").spec_config_extra(32)[1]
    assert info["gamma_schedule_same_card"] is True and "measured on" not in capsys.readouterr().err
    # without a GPU here nothing is compared
    monkeypatch.setattr(acc, "host_card", lambda: None)
    info = Knobs(gamma=4, acceptance="alpha:1", gamma_schedule=f"auto:{run}", draft_idle="skip").spec_config_extra(32)[1]
    assert info["gamma_schedule_same_card"] is None


def test_host_card_is_none_without_a_gpu(monkeypatch):
    from workbench import placement

    acc.host_card.cache_clear()
    monkeypatch.setattr(placement, "gpu_probe", lambda: None)
    try:
        assert acc.host_card() is None
        acc.host_card.cache_clear()
        monkeypatch.setattr(placement, "gpu_probe", lambda: {"gpus": [{"index": "0", "uuid": "GPU-x", "name": "NVIDIA H200"}]})
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        assert acc.host_card() == "NVIDIA H200"
    finally:
        acc.host_card.cache_clear()


def test_an_unresolvable_schedule_or_acceptance_is_refused_before_any_leg(tmp_path, tiny_models, monkeypatch, capsys):
    """`gamma_schedule=auto` with no E16 cost table of the target's size, or `acceptance=from:` a folder that
    holds no such leg, stops the run in its checks, naming the leg and the knob; a relative `from:` folder is
    read from the repository (where legs run) whatever folder the run is started in."""
    from workbench import cli, protocol
    from workbench.planning import plan
    from workbench.preparing import schedule_problems

    monkeypatch.chdir(tmp_path)  # a user's own folder: the catalogue's relative from: still resolves
    models = {"target": str(tiny_models["target"]), "twin": str(tiny_models["twin-int4"])}
    p = plan("E18", "tiny", ["legs=twin_a0.9_auto,twin_organism"], True)
    monkeypatch.setattr(acc, "RESULTS_E16", tmp_path / "no-E16")
    problems = schedule_problems(p, models)
    assert len(problems) == 1 and problems[0].startswith("leg twin_a0.9_auto: knob 'gamma_schedule': auto found no")
    p = plan("E18", "tiny", ["legs=twin_organism", "acceptance=from:results/E1/no-such-run:strict_g6"], True)
    assert [q.split(":")[0] for q in schedule_problems(p, models)] == ["leg twin_organism"]

    monkeypatch.setattr(protocol, "execute", lambda *a, **k: pytest.fail("a leg was started"))
    root = tmp_path / "results"
    rc = cli.main(["run", "E18", "--profile", "tiny", "--smoke", "-p", "legs=twin_a1,twin_a0.9_auto",
                   "--results", str(root), "--no-notebook", "--formats", "html"])
    err = capsys.readouterr().err
    assert rc == 2 and "nothing was created" in err and "leg twin_a0.9_auto: knob 'gamma_schedule'" in err, err
    assert not root.exists()


def test_the_documented_32b_ladder_fits_an_h200_and_the_twin_is_refused_on_an_h100(monkeypatch):
    """docs/serving.md's 32B E18 command, read from the doc as printed: every leg's weights and KV cache fit an
    H200 (the E17 ladder's speculative servers died at start there for KV memory); on an 80 GB H100 the twin's
    legs are refused before anything starts (at concurrency 32 the target's KV cache alone does not fit there
    either)."""
    import re
    import shlex

    from workbench import memory_plan
    from workbench.cli import build_parser
    from workbench.planning import plan

    cmds = re.findall(r"^workbench run E18 --profile 32b-shape .*$", (REPO / "docs" / "serving.md").read_text(), re.M)
    assert cmds, "docs/serving.md prints no 32B E18 command"
    root = _shapes()
    models = {"target": str(root / "32b-target"), "twin": str(root / "32b-twin"), "text-draft": str(root / "0.6b-text")}
    for cmd in cmds:
        args = build_parser().parse_args(shlex.split(cmd)[1:])   # the CLI's own parser, as `workbench` reads it
        p = plan(args.experiment, args.profile, args.param)
        drafts = {l.name: l.draft for l in p.legs if l.kind == "spec"}
        assert drafts and set(drafts.values()) <= set(models), (cmd, drafts)
        monkeypatch.setattr(memory_plan, "device_memory_bytes", lambda: H200_BYTES)
        assert memory_plan.memory_problems(p, models, set()) == [], cmd
        monkeypatch.setattr(memory_plan, "device_memory_bytes", lambda: H100_BYTES)
        refused = {pr.split(":")[0].removeprefix("leg ") for pr in memory_plan.memory_problems(p, models, set())}
        assert {n for n, d in drafts.items() if d == "twin"} <= refused, (cmd, refused)


def test_bare_auto_reads_the_table_and_setup_of_the_legs_draft_kernel(tmp_path):
    """An own-cuda table, faster and newer, priced the schedule of a leg drafting on Marlin (8B H100, E18
    20261207T235605Z-869510a1: predicted S 1.27 from own-cuda's c, measured 1.218): the leg's kernel comes first."""
    def run(name, label, s1):
        path = _cost_run(tmp_path, [(1, 4, s1), (16, 4, 0.9)], name)
        table = path / "tables" / "cost_ratio.csv"
        table.write_text(table.read_text().replace("32b [x]", f"32b [{label} full_all]"))
        return path

    run("20260101T000000Z-marlin", "marlin", 1.40)
    run("20260102T000000Z-own", "own-cuda", 1.55)
    pick = functools.partial(acc.default_cost_run, "models/shapes/32b-target", root=tmp_path, max_batch=16)
    assert pick().name == "20260102T000000Z-own"  # no kernel named: the fastest setup, as before
    assert pick(kernel="auto").name == "20260101T000000Z-marlin"  # auto drafts on Marlin
    assert pick(kernel="marlin").name == "20260101T000000Z-marlin"
    assert pick(kernel="own-cuda").name == "20260102T000000Z-own"
    assert pick(kernel="humming").name == "20260102T000000Z-own"  # no table of it: the rules as before
    # one table holding both setups is read at the leg's
    both = tmp_path / "both"
    (both / "tables").mkdir(parents=True)
    rows = ["size,batch,gamma,draft_graphs,verify_ms,propose_ms,c,decode_ms,S_measured_alpha1,"
            "S_measured_decode_alpha1"]
    rows += [f"32b [{k} full_all],{b},4,True,18,36,{c},18,1.0,{s}" for k, c, s in (("marlin", 0.6, 1.4),
             ("own-cuda", 0.5, 1.55)) for b in (1, 16)]
    (both / "tables" / "cost_ratio.csv").write_text("\n".join(rows) + "\n")
    rates = functools.partial(acc.unconditional_rates, "alpha:0.9")
    assert {r["setup"] for r in acc.schedule_table(both, rates, 16, kernel="auto")} == {"32b [marlin full_all]"}
    assert {r["setup"] for r in acc.schedule_table(both, rates, 16)} == {"32b [own-cuda full_all]"}
    knobs = Knobs(gamma=4, acceptance="alpha:0.9", gamma_schedule=f"auto:{both}", draft_idle="skip")
    info = knobs.spec_config_extra(16)[1]
    assert {r["setup"] for r in info["gamma_schedule_table"]} == {"32b [marlin full_all]"}  # the knobs' default: auto
