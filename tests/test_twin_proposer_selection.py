"""Issue 18 on CPU, without an engine: the twin proposer's graph-mode and kernel selection, the refusals of
its knobs, the padding tables of its FULL graphs and the dispatch switch. The engine tests (the single-token
step update never waits on the device; every new knob end to end, strict fp32 exact) are
tests/test_twin_proposer.py's; what runs only on CUDA is tests/test_gpu.py's.
"""

from __future__ import annotations

import json

import pytest

from conftest import REPO, TINY_PROMPTS, run_leg_process

FP32 = ["--max-tokens", "48", "--ignore-eos", "--dtype", "float32", "--max-model-len", "1024",
        "--prompts", str(TINY_PROMPTS)]


# --------------------------------------------------------------------------- selection logic
def test_graph_mode_resolution():
    from vllm_patch.draft_graphs import resolve_graph_mode

    assert resolve_graph_mode("full", True, on_cuda=False)[0] == "none"   # CPU: no CUDA graphs at all
    assert resolve_graph_mode("auto", True, on_cuda=False)[0] == "none"
    assert resolve_graph_mode("piecewise", False, on_cuda=True)[0] == "none"  # draft_cudagraph off wins
    assert resolve_graph_mode("auto", True, on_cuda=True, full_verified=False)[0] == "piecewise"
    assert resolve_graph_mode("auto", True, on_cuda=True)[0] == "full_all"   # what the H200 runs verified (E16)
    assert resolve_graph_mode("auto", True, on_cuda=True, full_verified=True, full_all_verified=False)[0] == "full"
    assert resolve_graph_mode("auto", True, on_cuda=True, full_verified=True, full_all_verified=True)[0] == "full_all"
    for mode in ("none", "piecewise", "full", "full_all"):
        assert resolve_graph_mode(mode, True, on_cuda=True) == (mode, "requested")



def test_full_decode_sizes_cover_every_batch_the_scheduler_can_form():
    """The FULL single-token graphs are keyed by the drafter's own padded batch sizes. vLLM's FULL decode
    sizes are the target's (multiples of 1 + gamma), so at max_num_seqs 1 there were none at all and the
    first dispatch asserted (the engine death of the first H200 run)."""
    from vllm_patch.draft_graphs import full_decode_sizes, padded_size

    assert full_decode_sizes(1) == [1]
    assert full_decode_sizes(8) == list(range(1, 9))               # every size: exact-fit replays only
    assert full_decode_sizes(13) == list(range(1, 14))
    assert full_decode_sizes(50) == [*range(1, 33), 40, 48, 50]    # beyond 32: every 8, and the largest
    assert full_decode_sizes(13, dense=4) == [1, 2, 3, 4, 8, 13]
    assert full_decode_sizes(0) == []
    for max_batch in (1, 3, 8, 13, 40, 256):
        sizes = full_decode_sizes(max_batch)
        for batch in range(1, max_batch + 1):
            padded = padded_size(batch, sizes)
            assert padded is not None and batch <= padded <= max_batch
            assert padded - batch < max(8, batch // 2 + 1)      # never more than one step of padding
    assert padded_size(9, [1, 2, 4, 8]) is None                 # beyond the largest graph: no FULL replay
    assert padded_size(3, set()) is None


def test_full_graphs_replay_padded_batches_unless_switched_off(monkeypatch):
    """A FULL graph replays a smaller batch padded (the smallest captured size that holds it) unless
    ``VLLM_SPEC_FULL_PADDED_REPLAY=0``; then only a batch of its own size replays (others run piecewise).
    A batch beyond the largest graph never replays; a bad value is refused by name."""
    from vllm_patch import draft_graphs as dg

    sizes = [1, 2, 4, 8, 16]
    monkeypatch.delenv(dg.PADDED_REPLAY_ENV, raising=False)
    assert dg.padded_replays() is True
    assert [dg.replay_size(b, sizes) for b in (1, 3, 5, 9, 17)] == [1, 4, 8, 16, None]
    monkeypatch.setenv(dg.PADDED_REPLAY_ENV, "0")
    assert [dg.replay_size(b, sizes) for b in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, None, 4, None, 8, None, 16]
    assert dg.replay_size(5, sizes, padded=False) is None and dg.replay_size(5, sizes, padded=True) == 8
    monkeypatch.setenv(dg.PADDED_REPLAY_ENV, "yes")
    with pytest.raises(ValueError, match="VLLM_SPEC_FULL_PADDED_REPLAY='yes': expected 0 or 1"):
        dg.replay_size(3, sizes)


def test_dense_sizes_knob_and_the_report_of_padded_replays(monkeypatch):
    """``VLLM_SPEC_FULL_DENSE_SIZES`` bounds the exact-size FULL graphs (1: a graph of 1, then every 8, so a
    concurrency-8 run pads its batches of 2-7); bad values are refused by name. The report learns once per
    kind of pass that a padded replay ran, and never for an exact fit."""
    from types import SimpleNamespace

    from vllm_patch import draft_graphs as dg
    from vllm_patch.engine_report import EngineReport
    from vllm_patch.knobs import EngineKnobs

    monkeypatch.delenv(dg.DENSE_SIZES_ENV, raising=False)
    assert dg.dense_sizes() == dg.DENSE_SIZES
    monkeypatch.setenv(dg.DENSE_SIZES_ENV, "1")
    assert dg.full_decode_sizes(8, dg.dense_sizes()) == [1, 8]
    assert [dg.replay_size(b, [1, 8], padded=True) for b in range(1, 9)] == [1] + [8] * 7
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv(dg.DENSE_SIZES_ENV, bad)
        with pytest.raises(ValueError, match=f"VLLM_SPEC_FULL_DENSE_SIZES={bad!r}"):
            dg.dense_sizes()

    prop = SimpleNamespace(_twin_engine=SimpleNamespace(report=EngineReport(EngineKnobs())))
    facts = prop._twin_engine.report.facts
    dg.note_padded(prop, 8, 8, "single")
    assert "draft_full_padded_replays_ran" not in facts          # an exact fit is no padded replay
    dg.note_padded(prop, 5, 8, "single")
    dg.note_padded(prop, 3, 8, "single")
    dg.note_padded(prop, 2, 8, "first")
    assert facts["draft_full_padded_replays_ran"] == ["first", "single"]


def _padding_proposer(n_max: int, q: int):
    """The attributes of a drafter that padded_metadata reads, with CPU tensors."""
    import torch
    from types import SimpleNamespace

    table = torch.arange(n_max * 4, dtype=torch.int32).reshape(n_max, 4)
    runner = SimpleNamespace(input_batch=SimpleNamespace(
        block_table=[SimpleNamespace(get_device_tensor=lambda k: table[:k])]))
    return SimpleNamespace(
        arange=torch.arange(n_max * q + 1, dtype=torch.int32), kv_cache_gid=0, _twin={"runner": runner},
        _slot_mapping_buffer=torch.arange(n_max * q, dtype=torch.int64),
        _twin_full={"seq_lens": torch.full((n_max,), 99, dtype=torch.int32)},
        _twin_first={"q": q, "seq_lens": torch.full((n_max,), 99, dtype=torch.int32),
                     "qsl": torch.arange(n_max + 1, dtype=torch.int32) * q})


@pytest.mark.parametrize("first_pass", [False, True])
def test_padded_metadata_describes_the_batch_the_graph_launches(first_pass):
    """With padded replays on, the metadata a FULL pass is built from (and FA3 schedules) has the graph's
    batch: its query starts, zero-length sequences for the padded requests, block-table rows and slots
    up to the padded size; the live requests' values untouched. An exact fit is passed through."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm_patch import draft_graphs as dg

    q = 6 if first_pass else 1
    prop = _padding_proposer(8, q)
    state = prop._twin_first if first_pass else prop._twin_full
    n, pad = 5, 8
    state["seq_lens"][:n] = torch.tensor([17, 30, 9, 41, 12], dtype=torch.int32)
    qsl = state["qsl"][: n + 1] if first_pass else prop.arange[: n + 1]
    cad = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=state["seq_lens"][:n], num_reqs=n,
        num_actual_tokens=n * q, max_query_len=q, max_seq_len=41, block_table_tensor=torch.zeros(n, 4),
        slot_mapping=prop._slot_mapping_buffer[: n * q], causal=True)
    out = dg.padded_metadata(prop, cad, pad, first_pass)
    assert out.num_reqs == pad and out.num_actual_tokens == pad * q and out.max_query_len == q
    assert out.query_start_loc.tolist() == [i * q for i in range(pad + 1)]
    assert out.query_start_loc_cpu.tolist() == [i * q for i in range(pad + 1)]
    assert out.seq_lens.tolist() == [17, 30, 9, 41, 12, 0, 0, 0]
    assert out.seq_lens.data_ptr() == state["seq_lens"].data_ptr()   # the persistent buffer the graph reads
    assert out.block_table_tensor.shape[0] == pad and out.slot_mapping.shape[0] == pad * q
    assert out.max_seq_len == 41 and cad.num_reqs == n                # the live batch's copy is unchanged
    assert dg.padded_metadata(prop, cad, n, first_pass) is cad


def test_full_pass_metadata_builds_the_padded_batch_with_scheduling_on():
    """The builder of every draft attention group gets the padded batch and fast_build off."""
    import torch
    from types import SimpleNamespace
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm_patch import draft_graphs as dg

    prop = _padding_proposer(4, 1)
    seen = []
    builder = SimpleNamespace(build=lambda **kw: seen.append(kw) or "md")
    prop.draft_attn_groups = [SimpleNamespace(get_metadata_builder=lambda: builder, layer_names=["a", "b"])]
    cad = CommonAttentionMetadata(
        query_start_loc=prop.arange[:4], query_start_loc_cpu=torch.arange(4, dtype=torch.int32),
        seq_lens=prop._twin_full["seq_lens"][:3], num_reqs=3, num_actual_tokens=3, max_query_len=1,
        max_seq_len=99, block_table_tensor=torch.zeros(3, 4), slot_mapping=prop._slot_mapping_buffer[:3])
    per_group, per_layer = dg.full_pass_metadata(prop, cad, 4, first_pass=False)
    assert per_group == ["md"] and per_layer == {"a": "md", "b": "md"}
    assert seen[0]["fast_build"] is False and seen[0]["common_attn_metadata"].num_reqs == 4


def test_a_kernel_asked_for_by_name_that_runs_no_layer_is_refused():
    """humming without its package ran every draft layer on Machete on the H200, under humming's name."""
    import torch
    from types import SimpleNamespace
    from vllm_patch import draft_kernels as dk

    def model(*kernels):
        m = torch.nn.Module()
        for i, k in enumerate(kernels):
            layer = torch.nn.Module()
            layer.scheme = SimpleNamespace(kernel=type(k, (), {})())
            m.add_module(f"l{i}", layer)
        return m

    said = ["Weight output_size_per_partition = 8 is not divisible by min_thread_n = 64"]
    with pytest.raises(RuntimeError, match="draft_linear_kernel=humming: none of the draft's 2 quantized "
                                           "layers can run on HummingLinearKernel here \\(it said: Weight "
                                           "output_size_per_partition = 8 is not divisible"):
        dk.checked_report(model("MacheteLinearKernel", "MacheteLinearKernel"), "HummingLinearKernel", "humming", said)
    mixed = dk.checked_report(model("HummingLinearKernel", "MarlinLinearKernel"), "HummingLinearKernel", "humming",
                              said)
    assert mixed["draft_linear_kernel"] == "mixed"
    assert mixed["draft_linear_kernel_fallback_layers"] == {"MarlinLinearKernel": 1}
    assert mixed["draft_linear_kernel_refused"] == said                       # why the one layer fell back
    # auto accepts vLLM's fallback (the reason the knob exists is a preference, not a demand)
    assert dk.checked_report(model("MacheteLinearKernel"), "MarlinLinearKernel", "auto")["draft_linear_kernel"] \
        == "MacheteLinearKernel"


def test_full_captured_reads_the_graph_wrappers_entries():
    """Whether a FULL graph exists is the wrapper's word, not a set of our own: vLLM's memory profile
    captures graphs and clears them all, and replaying a cleared key would capture mid-serving."""
    from types import SimpleNamespace

    from vllm.forward_context import BatchDescriptor
    from vllm_patch.draft_graphs import full_captured

    entries = {BatchDescriptor(num_tokens=4): SimpleNamespace(cudagraph=object()),
               BatchDescriptor(num_tokens=2): SimpleNamespace(cudagraph=None)}   # key made, graph not (yet)
    assert full_captured(SimpleNamespace(concrete_cudagraph_entries=entries)) == {4}
    entries.clear()                                                              # clear_all_graphs()
    assert full_captured(SimpleNamespace(concrete_cudagraph_entries=entries)) == set()
    assert full_captured(object()) == set()                                      # no FULL wrapper at all

def test_linear_kernel_resolution_never_machete_for_auto_on_cuda():
    from vllm_patch import draft_kernels as dk

    assert dk.resolve("auto", on_cuda=True)[0] == "MarlinLinearKernel"
    assert dk.resolve("humming", on_cuda=True)[0] == "HummingLinearKernel"
    assert dk.resolve("own", on_cuda=True)[0] == "TwinGemvLinearKernel"
    for value in ("auto", "machete", "marlin", "own"):  # CPU: vLLM's CPU kernels, whatever is asked
        assert dk.resolve(value, on_cuda=False)[0] is None
    # every named vLLM class exists in vLLM 0.27.1
    from vllm.model_executor.kernels import linear

    assert dk.resolve("own-cuda", on_cuda=True)[0] == "TwinCudaLinearKernel"
    from vllm_patch.knobs import OWN_KERNEL_MODULES

    for value, name in dk.KERNEL_CLASSES.items():
        if value not in OWN_KERNEL_MODULES:  # the project's own classes are built by their modules
            assert hasattr(linear, name), name
        else:
            assert dk.kernel_class(name).__name__ == name


def test_preferred_kernel_is_chosen_for_the_draft_and_the_list_restored():
    """The seam the knob uses: vLLM's own choose_mp_linear_kernel picks the class put first, inside only."""
    import torch
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig
    from vllm.platforms import current_platform
    from vllm.scalar_type import scalar_types

    from vllm_patch import cpu_int4, draft_kernels as dk

    cpu_int4.install()
    cfg = MPLinearLayerConfig(full_weight_shape=(256, 256), partition_weight_shape=(256, 256),
                              weight_type=scalar_types.uint4b8, act_type=torch.float32, group_size=128,
                              zero_points=False, has_g_idx=False)
    before = list(linear._POSSIBLE_KERNELS[current_platform._enum])
    with dk.prefer("CPUWNA16LinearKernel"):
        assert linear.choose_mp_linear_kernel(cfg).__name__ == "CPUWNA16LinearKernel"
        assert linear._POSSIBLE_KERNELS[current_platform._enum][0].__name__ == "CPUWNA16LinearKernel"
    assert linear._POSSIBLE_KERNELS[current_platform._enum] == before
    # a preferred class that cannot implement the layer falls through to vLLM's order, and what it said is kept
    marlin = linear.MarlinLinearKernel
    own = marlin.__dict__.get("can_implement")
    ok, why = marlin.can_implement(cfg)
    assert not ok and why
    with dk.prefer("MarlinLinearKernel") as refused:
        assert linear.choose_mp_linear_kernel(cfg).__name__ != "MarlinLinearKernel"
        linear.choose_mp_linear_kernel(cfg)
    assert refused == [str(why)]                                       # once, however many layers it refused
    assert marlin.__dict__.get("can_implement") is own                 # the class is as it was
    assert linear._POSSIBLE_KERNELS[current_platform._enum] == before
    with dk.prefer("CPUWNA16LinearKernel") as refused_again:           # each load has its own list
        linear.choose_mp_linear_kernel(cfg)
    assert refused_again == [] and refused == [str(why)]


def test_the_draft_kernel_is_a_factor_of_the_drafters_compile_cache_key():
    # vLLM's compile cache is keyed on VllmConfig.compute_hash: without the kernel in it, an engine
    # with Marlin draft layers loaded the drafter graph an engine with Humming layers had compiled
    import copy

    from vllm.config import VllmConfig

    from vllm_patch import draft_kernels as dk

    target = VllmConfig()
    hashes = {target.compute_hash()}
    for requested, preferred in (("marlin", "MarlinLinearKernel"), ("humming", "HummingLinearKernel"),
                                 ("auto", "MarlinLinearKernel"), ("auto", None)):
        draft = copy.copy(target)  # like vLLM's draft config: a shallow copy, the dict shared
        assert dk.tag_config(draft, requested, preferred) is draft
        hashes.add(draft.compute_hash())
        assert draft.additional_config[dk.CONFIG_TAG] == f"{requested}:{preferred or 'vllm-order'}"
    assert len(hashes) == 5
    assert target.additional_config == {}  # the target's config is not touched


def test_new_knobs_are_refused_by_name_before_an_engine_starts(monkeypatch):
    import vllm_patch.knobs as vk
    from vllm_patch.knobs import KnobError, read_knobs
    from workbench.knobs import Knobs

    with pytest.raises(ValueError, match="draft_cudagraph_mode"):
        Knobs(gamma=2, draft_cudagraph_mode="loop")
    with pytest.raises(ValueError, match="draft_linear_kernel"):
        Knobs(gamma=2, draft_linear_kernel="cutlass")
    with pytest.raises(ValueError, match="draft_cudagraph_mode.*draft_cudagraph"):
        Knobs(gamma=2, draft_cudagraph=False, draft_cudagraph_mode="full")
    assert Knobs(gamma=2, draft_cudagraph=False, draft_cudagraph_mode="none").draft_cudagraph_mode == "none"
    monkeypatch.setattr(vk, "own_kernel_available", lambda: False)
    with pytest.raises(ValueError, match="draft_linear_kernel.*twin_gemv"):
        Knobs(gamma=2, draft_linear_kernel="own")
    with pytest.raises(KnobError, match="VLLM_SPEC_DRAFT_LINEAR_KERNEL"):
        read_knobs({"VLLM_SPEC_DRAFT_LINEAR_KERNEL": "own"})
    monkeypatch.setattr(vk, "own_kernel_available", lambda: True)
    assert Knobs(gamma=2, draft_linear_kernel="own").draft_linear_kernel == "own"
    with pytest.raises(KnobError, match="VLLM_SPEC_DRAFT_CUDAGRAPH_MODE"):
        read_knobs({"VLLM_SPEC_DRAFT_CUDAGRAPH_MODE": "fast"})
    with pytest.raises(KnobError, match="draft_cudagraph_mode"):
        read_knobs({"VLLM_SPEC_DISABLE_DRAFT_CUDAGRAPH": "1", "VLLM_SPEC_DRAFT_CUDAGRAPH_MODE": "piecewise"})


def test_async_scheduling_is_an_engine_argument_on_cuda_only():
    from workbench.knobs import Knobs

    k = Knobs(gamma=3, async_scheduling=True)
    assert k.engine_args(on_cuda=True) == {"async_scheduling": True}
    assert k.engine_args(on_cuda=False) == {}          # vLLM's CPU platform turns it off anyway
    assert Knobs(gamma=3).engine_args(on_cuda=True) == {}
    assert Knobs().engine_args(on_cuda=True) == {}     # vanilla leg: no draft, vLLM's default
    assert k.to_env()["VLLM_SPEC_ASYNC_SCHEDULING"] == "1"


def test_bad_knob_on_the_leg_command_line_starts_no_engine(tmp_path, tiny_models):
    res = run_leg_process(tmp_path / "leg", "--target", tiny_models["target"], "--draft",
                          tiny_models["twin-dequant"], "--gamma", "2", *FP32, "--draft-linear-kernel", "cublas")
    assert res.returncode != 0 and "draft_linear_kernel" in res.stderr
    assert "engine_start_s" not in (res.summary or {})



def test_protocol_leg_carries_the_new_knobs():
    """experiments.yaml defaults -> planned leg -> leg.json knobs (runners.leg_knobs)."""
    from workbench.runners import leg_knobs
    from workbench.knobs import Knobs
    from workbench.planning import parse_overrides, plan

    p = plan("E1", "tiny", parse_overrides(["draft_linear_kernel=humming", "draft_cudagraph_mode=piecewise",
                                            "async_scheduling=true"]))
    (spec,) = [leg for leg in p.legs if leg.kind == "spec"]
    k = leg_knobs(spec, vanilla=Knobs())
    assert (k.draft_linear_kernel, k.draft_cudagraph_mode, k.async_scheduling) == ("humming", "piecewise", True)
    assert "not applicable on CPU" in spec.notes["draft_linear_kernel"]
    assert k.to_env()["VLLM_SPEC_DRAFT_LINEAR_KERNEL"] == "humming"


def test_tiny_model_fingerprint_ignores_the_local_build_label(monkeypatch):
    """A GPU host (torch 2.13.0+cu128) reuses tiny models a CPU host (2.13.0 / 2.13.0+cpu) built: no rebuild."""
    import importlib.metadata as md

    from workbench import tiny

    real = md.version

    def fingerprint_with(label: str) -> str:
        monkeypatch.setattr(md, "version", lambda pkg: real(pkg).split("+")[0] + label if pkg == "torch" else real(pkg))
        return tiny.recipe_fingerprint()

    assert fingerprint_with("") == fingerprint_with("+cpu") == fingerprint_with("+cu128")
    monkeypatch.setattr(md, "version", lambda pkg: "9.9.9" if pkg == "torch" else real(pkg))
    assert tiny.recipe_fingerprint() != fingerprint_with(""), "another torch release still rebuilds"


def test_async_scheduling_trace_keeps_only_committed_steps():
    """Under async scheduling the engine verifies one more step of a request that has just finished, and
    vLLM's scheduler drops it (no drafts, no accepted tokens counted). The per-prompt statistics keep only
    the steps whose tokens were committed: on the H200's recorded async legs they then equal vLLM's
    counters exactly (before, 1391 accepted against the counters' 1358), and sync legs lose no step."""
    from workbench.leg import committed_steps, per_prompt_spec

    # prefill gives token 1; steps give accepted + 1: 1 + 3 + 4 = 8 >= 8, so the third step is after the end
    steps = [[6, 2, [], 0, []], [6, 3, [], 0, []], [6, 6, [], 0, []]]
    assert committed_steps(steps, 8) == steps[:2]
    assert committed_steps(steps, 9) == steps          # the last kept step may overshoot (trimmed tokens)
    assert committed_steps(steps, 1) == []
    legs = REPO / "results" / "cuda-verify" / "20261201T1200Z-h200-077f25d" / "legs"
    for name, extra in (("fp32_async_c1", True), ("fp32_async_c8", True), ("fp32_full_async_c8", True),
                        ("fp32_strict_c1", False), ("fp32_graph_full_c8", False)):
        counters = json.loads((legs / name / "summary.json").read_text())["spec"]
        recs = [json.loads(line) for line in (legs / name / "records.jsonl").read_text().splitlines()]
        totals = {"drafts": 0, "accepted": 0, "draft_tokens": 0}
        dropped = 0
        for r in recs:
            raw = [[s["drafted"], s["accepted"], s["margins"], s.get("invalid", 0), s.get("ties", [])]
                   for s in r["trace"]["steps"]]
            kept = committed_steps(raw, len(r["gen_ids"]))
            dropped += len(raw) - len(kept)
            spec = per_prompt_spec(kept, 6)
            for k in totals:
                totals[k] += spec[k]
        assert (totals["drafts"], totals["draft_tokens"], totals["accepted"]) == (
            counters["num_drafts"], counters["num_draft_tokens"], counters["num_accepted_tokens"]), name
        assert (dropped > 0) == extra, (name, dropped)


@pytest.mark.parametrize("built,asked,expect", [
    ("full", True, ("full", False, False, True)), ("full", "piecewise", ("piecewise", False, True, True)),
    ("full", False, ("none", True, True, True)), ("piecewise", "built", ("piecewise", False, True, True)),
    ("piecewise", "none", ("none", True, True, True)), ("none", True, ("none", True, True, True)),
    ("full_all", True, ("full_all", False, False, False)), ("full_all", "full", ("full", False, False, True)),
    ("full_all", "piecewise", ("piecewise", False, True, True)),
])
def test_the_dispatch_switch_sets_what_the_built_graphs_allow(built, asked, expect):
    from types import SimpleNamespace

    from vllm_patch.twin_proposer import TwinDraftProposer

    fake = SimpleNamespace(built_graph_mode=lambda: built, _twin_graphs_off=None, _twin_full_off=None,
                           _twin_first_off=None)
    got = TwinDraftProposer.set_dispatch(fake, asked)
    assert (got, fake._twin_graphs_off, fake._twin_full_off, fake._twin_first_off) == expect


@pytest.mark.parametrize("built,asked,message", [
    ("piecewise", "full", "this engine built 'piecewise'"), ("none", "piecewise", "this engine built 'none'"),
    ("full", "full_all", "this engine built 'full'"), ("full", "loop", "expected one of"),
])
def test_the_dispatch_switch_refuses_graphs_that_were_not_built(built, asked, message):
    from types import SimpleNamespace

    from vllm_patch.twin_proposer import TwinDraftProposer

    fake = SimpleNamespace(built_graph_mode=lambda: built, _twin_graphs_off=False, _twin_full_off=False)
    with pytest.raises(ValueError, match=message):
        TwinDraftProposer.set_dispatch(fake, asked)
    assert fake._twin_graphs_off is False and fake._twin_full_off is False  # nothing changed
