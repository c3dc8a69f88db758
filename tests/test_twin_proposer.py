"""Issue 18 on CPU: the twin proposer class, its graph-mode and kernel selection, the new knobs end to end.

What runs only on CUDA (FULL drafter graphs, Marlin/Humming for the draft, async scheduling) is in
tests/test_gpu.py; here: the selection logic, the refusals, that the single-token step update never
waits on the device, and that every new knob reaches leg.json, the engine's environment, the engine
report and each record, with strict fp32 exactness unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, TINY_PROMPTS, run_leg_process

FP32 = ["--max-tokens", "48", "--ignore-eos", "--dtype", "float32", "--max-model-len", "1024",
        "--prompts", str(TINY_PROMPTS)]


# --------------------------------------------------------------------------- engine (tiny models, CPU)
_NO_SYNC_PROBE = textwrap.dedent("""
    import json, os, sys, torch
    from workbench.leg import in_process_cpu_env
    in_process_cpu_env()
    from vllm import LLM, SamplingParams
    from vllm_patch import twin_proposer as tp

    calls, syncs = {"n": 0}, []
    orig_update = tp.TwinDraftProposer._update_positions_dependent_metadata

    def guarded(self, *a, **k):
        calls["n"] += 1
        saved = {}
        # every way a tensor reaches the host (or a Python value) during the step update
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
            orig = getattr(torch.Tensor, name)
            saved[name] = orig
            def probe(t, *aa, _n=name, _o=orig, **kk):
                syncs.append(_n)
                return _o(t, *aa, **kk)
            setattr(torch.Tensor, name, probe)
        try:
            return orig_update(self, *a, **k)
        finally:
            for name, orig in saved.items():
                setattr(torch.Tensor, name, orig)

    tp.TwinDraftProposer._update_positions_dependent_metadata = guarded
    target, draft = sys.argv[1], sys.argv[2]
    llm = LLM(model=target, dtype="float32", max_model_len=512, max_num_seqs=4, enforce_eager=True,
              gpu_memory_utilization=0.05, distributed_executor_backend="uni", seed=0,
              limit_mm_per_prompt={"image": 0, "video": 0}, skip_tokenizer_init=True,
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 4})
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": list(range(20 + i, 60 + i))} for i in range(3)], sp, use_tqdm=False)
    drafter = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
    print("PROBE " + json.dumps({"calls": calls["n"], "syncs": syncs, "proposer": type(drafter).__name__,
                                 "twin": drafter._twin is not None}))
""")


@pytest.mark.vllm
def test_single_token_step_update_never_reaches_the_host(tiny_models, tmp_path):
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_SPEC_REPORT_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", _NO_SYNC_PROBE, str(tiny_models["target"]),
                          str(tiny_models["twin-dequant"])], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    lines = [x for x in res.stdout.splitlines() if x.startswith("PROBE ")]
    assert res.returncode == 0 and lines, res.stderr[-4000:]
    probe = json.loads(lines[-1][len("PROBE "):])
    assert probe["proposer"] == "TwinDraftProposer" and probe["twin"]
    assert probe["calls"] > 0, "the gamma-1 single-token steps ran"
    assert probe["syncs"] == [], f"host syncs in the single-token step update: {probe['syncs']}"


# The full_all first pass, eagerly on CPU: each uniform first pass reads its query starts and sequence
# lengths from the persistent buffers a FULL graph would read, and drafts exactly what vLLM's own
# metadata drafts. (CPU has no CUDA graphs: the FULL dispatch is run eagerly; capture and replay are
# proven on the GPU host, tests/test_gpu.py.)
_FIRST_PASS_PROBE = textwrap.dedent("""
    import json, sys, torch
    from workbench.leg import in_process_cpu_env
    in_process_cpu_env()
    from vllm import LLM, SamplingParams
    from vllm.config import CUDAGraphMode
    from vllm_patch import twin_proposer as tp

    drafts, used = [], {"persistent": 0, "first_passes": 0}
    orig_propose = tp.TwinDraftProposer.propose
    orig_det = tp.TwinDraftProposer._determine_batch_execution_and_padding
    orig_meta = tp.TwinDraftProposer._first_pass_metadata

    def propose(self, *a, **k):
        out = orig_propose(self, *a, **k)
        drafts.append(out.tolist())
        return out

    def det(self, num_tokens, use_cudagraphs=True):
        mode, padded, dp = orig_det(self, num_tokens, use_cudagraphs)
        return (CUDAGraphMode.NONE if mode == CUDAGraphMode.FULL else mode), padded, dp  # eager stand-in

    def meta(self, cad, new_cad, num_out):
        used["first_passes"] += 1
        out = orig_meta(self, cad, new_cad, num_out)
        if self._twin_first_pad is not None:
            buf = self._twin_first
            assert out.query_start_loc.data_ptr() == buf["qsl"].data_ptr()
            assert out.seq_lens.data_ptr() == buf["seq_lens"].data_ptr()
            assert torch.equal(out.query_start_loc, new_cad.query_start_loc)
            assert torch.equal(out.seq_lens, new_cad.seq_lens)
            used["persistent"] += 1
        return out

    tp.TwinDraftProposer.propose = propose
    tp.TwinDraftProposer._determine_batch_execution_and_padding = det
    tp.TwinDraftProposer._first_pass_metadata = meta
    target, draft, gamma = sys.argv[1], sys.argv[2], int(sys.argv[3])
    llm = LLM(model=target, dtype="float32", max_model_len=512, max_num_seqs=4, enforce_eager=True,
              gpu_memory_utilization=0.05, distributed_executor_backend="uni", seed=0,
              enable_prefix_caching=False, limit_mm_per_prompt={"image": 0, "video": 0},
              skip_tokenizer_init=True,
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": gamma})
    drafter = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": list(range(20 + i, 50 + 3 * i))} for i in range(3)]
    runs = {}
    for name in ("vllm", "persistent"):
        if name == "persistent":  # the full_all state initialize_cudagraph_keys builds on CUDA
            n, q = drafter.max_batch_size, drafter._first_pass_tokens()
            drafter._twin_first = {"q": q, "seq_lens": torch.zeros(n, dtype=torch.int32),
                                   "qsl": torch.arange(n + 1, dtype=torch.int32) * q}
            drafter._first_captured = lambda: set(range(1, n + 1))
        drafts.clear()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        runs[name] = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "drafts": list(drafts)}
    print("PROBE " + json.dumps({"runs": runs, "used": used, "q": drafter._first_pass_tokens(),
                                 "ran": drafter._twin_first_ran}))
""")


@pytest.mark.vllm
def test_full_all_first_pass_reads_persistent_buffers_and_drafts_the_same(tiny_models, tmp_path):
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_SPEC_REPORT_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", _FIRST_PASS_PROBE, str(tiny_models["target"]),
                          str(tiny_models["twin-dequant"]), "3"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    lines = [x for x in res.stdout.splitlines() if x.startswith("PROBE ")]
    assert res.returncode == 0 and lines, res.stderr[-4000:]
    probe = json.loads(lines[-1][len("PROBE "):])
    assert probe["q"] == 3 + 2                      # gamma + 1 verified tokens and the new slot
    vllm_run, ours = probe["runs"]["vllm"], probe["runs"]["persistent"]
    assert ours["tokens"] == vllm_run["tokens"]
    assert ours["drafts"] == vllm_run["drafts"]     # every proposal, step by step
    # decode-step first passes took the persistent path; the prefill's (non-uniform) ones did not
    assert 0 < probe["used"]["persistent"] < probe["used"]["first_passes"]
    assert probe["ran"]["full"] == probe["used"]["persistent"] and probe["ran"]["piecewise"] == 0


def test_first_pass_graphs_have_keys_of_their_own():
    """A first pass of n requests of q tokens may have as many tokens as a single-token step of a larger
    batch (1 x 8 = 8 x 1 at gamma 6): its FULL graph is keyed by requests and uniformity too."""
    from types import SimpleNamespace

    from vllm.forward_context import BatchDescriptor
    from vllm_patch.draft_graphs import first_pass_key, full_captured

    live = SimpleNamespace(cudagraph=object())
    entries = {BatchDescriptor(num_tokens=8): live, first_pass_key(1, 8): live, first_pass_key(2, 8): live,
               first_pass_key(4, 8): SimpleNamespace(cudagraph=None)}
    model = SimpleNamespace(concrete_cudagraph_entries=entries)
    assert first_pass_key(1, 8) != BatchDescriptor(num_tokens=8)
    assert full_captured(model) == {8}
    assert full_captured(model, first_pass=True) == {1, 2}


@pytest.fixture(scope="module")
def knob_legs(tmp_path_factory, tiny_models):
    out = {}
    for name, extra in (("vanilla", []),
                        ("strict_knobs", ["--draft", str(tiny_models["twin-dequant"]), "--gamma", "3",
                                          "--draft-cudagraph-mode", "full", "--draft-linear-kernel", "marlin",
                                          "--async-scheduling"])):
        d = tmp_path_factory.mktemp(name)
        out[name] = run_leg_process(d, "--target", tiny_models["target"], "--leg", name, *FP32, *extra).ok()
    return out


@pytest.mark.vllm
def test_new_knobs_reach_leg_json_env_report_and_records_and_stay_exact(knob_legs):
    van, spec = knob_legs["vanilla"], knob_legs["strict_knobs"]
    # strict fp32 with the dequantized twin: token-identical to vanilla
    assert [r["gen_ids"] for r in spec.records] == [r["gen_ids"] for r in van.records]
    leg_json = json.loads((spec.out / "leg.json").read_text())["knobs"]
    assert (leg_json["draft_cudagraph_mode"], leg_json["draft_linear_kernel"], leg_json["async_scheduling"]) == (
        "full", "marlin", True)
    report = spec.summary["engine_report"]
    # the engine read them from its environment ...
    assert report["knobs"]["draft_cudagraph_mode"] == "full"
    assert report["knobs"]["draft_linear_kernel"] == "marlin"
    assert report["knobs"]["async_scheduling"] is True
    # ... and states what ran: CPU has no CUDA graphs, vLLM's CPU kernels, no async scheduling
    assert report["proposer"] == "TwinDraftProposer"
    assert report["draft_cudagraph_mode"] == "none" and report["draft_cudagraph_mode_planned"] == "none"
    assert report["draft_single_step_modes_ran"] == ["none"]  # the dispatch hook saw the single-token steps
    assert report["draft_linear_kernel_applies"] is False and report["draft_linear_kernel_preferred"] is None
    assert report["async_scheduling"] is False and report["async_scheduling_applies"] is False
    assert "async_scheduling" not in spec.summary["engine_args"]  # a CPU leg does not ask vLLM for it
    assert "draft" in report["linear_kernels"]
    for rec in spec.records:
        k = rec["knobs"]
        assert k["draft_cudagraph_mode"] == "none" and k["draft_cudagraph_mode_requested"] == "full"
        assert k["draft_cudagraph_mode_applies"] is False
        assert k["draft_linear_kernel_requested"] == "marlin" and k["draft_linear_kernel_applies"] is False
        assert k["async_scheduling"] is False and k["async_scheduling_requested"] is True
    from workbench.results import LEG_COLUMNS

    assert {"draft_cudagraph_mode", "draft_linear_kernel", "async_scheduling"} <= set(LEG_COLUMNS)


def test_the_int4_head_holds_what_compressed_tensors_packs_within_half_a_step():
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    from vllm_patch import draft_head

    torch.manual_seed(0)
    w = (torch.randn(260, 256) * 0.05).to(torch.bfloat16)
    w[-4:] = 0  # vLLM pads the vocabulary with zero rows
    q = draft_head.quantize_rows(w, 128, chunk=100)  # chunks of rows give what one pass gives
    assert all(torch.equal(q[k], v) for k, v in draft_head.quantize_rows(w, 128).items())
    assert q["weight_packed"].shape == (260, 32) and q["weight_scale"].shape == (260, 2)
    assert q["weight_zero_point"].shape == (33, 2) and q["weight_shape"].tolist() == [260, 256]
    vals = unpack_from_int32(q["weight_packed"], 4, torch.Size([260, 256]))
    assert int(vals.min()) >= -8 and int(vals.max()) <= 7 and len(vals.unique()) == 16
    def dequantize(q, group):  # the plugin's own reading of a pack-quantized layer (vLLM's unpacking)
        from vllm.scalar_type import scalar_types

        from vllm_patch.cpu_int4 import dequantize_packed

        return dequantize_packed(q["weight_packed"], q["weight_scale"], q["weight_zero_point"], None,
                                 scalar_types.uint4, group, torch.float32)

    d = dequantize(q, 128)
    step = q["weight_scale"].float().repeat_interleave(128, dim=1)
    # half a step, plus what rounding the scale to bf16 (2^-8 relative) moves the 15-step range's far end
    assert torch.all((d - w.float()).abs() <= step * (0.5 + 15 * 2**-8))
    assert torch.equal(d[-4:], torch.zeros(4, 256))
    # a hidden size 128 does not divide: one group per row
    assert draft_head.group_size_for(200) is None and draft_head.quantize_rows(w[:, :200], None)[
        "weight_scale"].shape == (260, 1)
    with pytest.raises(ValueError, match="group size 128 does not divide the hidden size 200"):
        draft_head.quantize_rows(w[:, :200], 128)


@pytest.mark.vllm
def test_an_int4_draft_head_keeps_strict_fp32_exact_and_is_reported(knob_legs, tiny_models, tmp_path):
    # the plugin's int4 fallback forced: the one CPU int4 path with float32 activations, on every CPU kind
    leg = run_leg_process(tmp_path / "int4_head", "--target", tiny_models["target"], "--leg", "int4_head",
                          *FP32, "--draft", str(tiny_models["twin-dequant"]), "--gamma", "3",
                          "--draft-lm-head", "int4", env={"VLLM_SPEC_INT4_FALLBACK": "1"}).ok()
    van, bf16_head = knob_legs["vanilla"], knob_legs["strict_knobs"]
    assert [r["gen_ids"] for r in leg.records] == [r["gen_ids"] for r in van.records]
    report = leg.summary["engine_report"]
    assert report["knobs"]["draft_lm_head"] == "int4"
    assert report["draft_lm_head"] == "int4" and report["draft_lm_head_kernel"] == "TwinTorchWNA16LinearKernel"
    assert report["draft_lm_head_bytes"]["int4"] < report["draft_lm_head_bytes"]["model"] / 6
    assert bf16_head.summary["engine_report"]["draft_lm_head"] == "model"
    assert {r["knobs"]["draft_lm_head"] for r in leg.records} == {"int4"}
    # the drafts come from another head: the acceptance moves, the output does not
    acc = [r["spec"]["accepted"] for r in leg.records], [r["spec"]["accepted"] for r in bf16_head.records]
    assert acc[0] != acc[1] and sum(acc[0]) > 0


@pytest.mark.vllm
def test_an_int4_draft_head_runs_on_this_hosts_own_int4_path(tiny_models, tmp_path):
    """bf16, nothing forced: vLLM's CPU int4 kernel on an AVX-512 host, the plugin's fallback on an AVX2 one,
    the same kernel as the draft's other layers."""
    leg = run_leg_process(tmp_path / "int4_head_bf16", "--target", tiny_models["target"], "--leg", "int4_head_bf16",
                          "--max-tokens", "16", "--ignore-eos", "--dtype", "bfloat16", "--max-model-len", "1024",
                          "--prompts", str(TINY_PROMPTS), "--draft", str(tiny_models["twin-int4"]), "--gamma", "3",
                          "--draft-lm-head", "int4").ok()
    report = leg.summary["engine_report"]
    assert report["draft_lm_head"] == "int4"
    assert report["draft_lm_head_kernel"] == report["draft_linear_kernel"], report
    assert leg.summary["spec"]["num_drafts"] > 0
