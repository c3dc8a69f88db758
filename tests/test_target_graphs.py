"""Knob ``target_graphs=full`` (vllm_patch.target_graphs): the target's FULL decode graphs under vLLM's
batch-size γ schedule. CUDA graphs need a GPU; here vLLM's own dispatcher builds and dispatches the keys
(no capture), and the wrappers are checked around stand-ins of the runner's methods."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.config import CUDAGraphMode, VllmConfig  # noqa: E402
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

from vllm_patch import target_graphs  # noqa: E402
from vllm_patch.knobs import SWITCHES, KnobError  # noqa: E402

MAX_SEQS = 32
GAMMA_MAX = 2  # the 8B schedule auto chose: γ 2 at batch 1-2, 0 from 3
VANILLA_SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96]  # vLLM's list before its rounding


def _dispatcher(q: int = 1 + GAMMA_MAX) -> CudagraphDispatcher:
    """vLLM's dispatcher as its V1 runner sets it up for FULL_AND_PIECEWISE at verification length ``q``,
    with the capture sizes vLLM rounds to multiples of ``q`` (``adjust_cudagraph_sizes_for_spec_decode``)."""
    sizes = sorted({-(-s // q) * q for s in VANILLA_SIZES})
    d = object.__new__(CudagraphDispatcher)
    d.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=MAX_SEQS), lora_config=None)
    d.compilation_config = SimpleNamespace(cudagraph_capture_sizes=sizes, max_cudagraph_capture_size=sizes[-1],
                                           compile_sizes=None, cudagraph_specialize_lora=False)
    d.uniform_decode_query_len = q
    d.cudagraph_keys = {CUDAGraphMode.PIECEWISE: set(), CUDAGraphMode.FULL: set()}
    d.keys_initialized = False
    d.specialize_lora_count = False
    d.cudagraph_mode = CUDAGraphMode.NONE
    d.initialize_cudagraph_keys(CUDAGraphMode.FULL_AND_PIECEWISE, q)
    return d


def test_the_knob_is_in_the_table_and_refuses_other_values():
    k = SWITCHES["target_graphs"]
    assert (k.default, k.env, k.applies_on_cpu) == ("vllm", "VLLM_SPEC_TARGET_GRAPHS", False)
    assert k.validate("full") == "full" and k.validate("vllm") == "vllm"
    for bad in ("FULL", "piecewise"):
        with pytest.raises(KnobError, match="target_graphs"):
            k.validate(bad)


def _with_one_token_family(sizes_before_rounding=VANILLA_SIZES):
    d = _dispatcher()
    vllms = set(d.cudagraph_keys[CUDAGraphMode.FULL])
    keys = target_graphs.single_token_keys(d, MAX_SEQS, sizes_before_rounding)
    for k in keys:
        d.add_cudagraph_key(CUDAGraphMode.FULL, k)
    return d, vllms, keys


def _dispatch(d, num_tokens, **kw):
    """The dispatch of a one-token step as the installed wrappers run it (query length 1)."""
    runner = SimpleNamespace(uniform_decode_query_len=3, cudagraph_dispatcher=d)
    with target_graphs.query_len(runner, 1):
        out = target_graphs.dispatch_one_token(CudagraphDispatcher.dispatch, d, num_tokens, True, **kw)
    assert (runner.uniform_decode_query_len, d.uniform_decode_query_len) == (3, 3)  # restored
    return out


def test_one_token_keys_beside_vllms_own_at_a_vanilla_engines_sizes():
    d, vllms, keys = _with_one_token_family()
    assert vllms and all(k.num_tokens == 3 * k.num_reqs for k in vllms)  # γ_max + 1 tokens a request
    assert keys and all(target_graphs.is_single_token_key(k) for k in keys)
    assert sorted(k.num_tokens for k in keys) == [1, 2, 4, 8, 16, 24, 32]  # vanilla's sizes up to max_num_seqs
    assert not vllms & set(keys) and d.uniform_decode_query_len == 3
    regular = d._bs_to_padded_graph_size
    assert regular[32] == 33 and d._twin_one_token_table[32] == 32 and d._twin_one_token_table[33] == 33


@pytest.mark.parametrize("batch,padded", [(1, 1), (3, 4), (16, 16), (17, 24), (31, 32), (32, 32)])
def test_a_one_token_step_runs_a_full_graph_padded_as_vanilla_pads_it(batch, padded):
    d, _, _ = _with_one_token_family()
    mode, desc = _dispatch(d, batch)
    assert (mode, desc.num_tokens, desc.num_reqs, desc.uniform) == (CUDAGraphMode.FULL, padded, padded, True)
    # vLLM's own dispatch of the same step (no knob): a mixed batch, PIECEWISE on the rounded sizes
    mode, desc = d.dispatch(batch, uniform_decode=False)
    assert mode == CUDAGraphMode.PIECEWISE and desc.num_tokens % 3 == 0


def test_the_gamma_max_family_and_mixed_steps_keep_vllms_padding():
    d, _, _ = _with_one_token_family()
    # a step at γ_max (10 requests x 3 tokens) keeps vLLM's own FULL graph (padded to its size 33)
    mode, desc = target_graphs.dispatch_one_token(CudagraphDispatcher.dispatch, d, 30, True)
    assert (mode, desc.num_tokens, desc.num_reqs) == (CUDAGraphMode.FULL, 33, 11)
    assert d._bs_to_padded_graph_size[32] == 33  # the table was swapped back


def test_a_one_token_step_without_full_falls_back_to_vllms_piecewise_graph():
    d, _, _ = _with_one_token_family()
    mode, desc = _dispatch(d, 16, invalid_modes={CUDAGraphMode.FULL})  # vLLM: cascade attention
    assert (mode, desc.num_tokens) == (CUDAGraphMode.PIECEWISE, 18)  # a captured piecewise size, not 16


def test_without_the_list_before_rounding_the_rounded_sizes_up_to_max_num_seqs():
    d, _, keys = _with_one_token_family(sizes_before_rounding=None)
    assert sorted(k.num_tokens for k in keys) == [3, 6, 9, 18, 24]
    assert _dispatch(d, 16)[1].num_tokens == 18
    assert _dispatch(d, 32)[0] == CUDAGraphMode.PIECEWISE  # 33 tokens: past max_num_seqs


def test_no_keys_where_vllm_has_no_separate_full_decode_routine():
    d = _dispatcher()
    d.cudagraph_mode = CUDAGraphMode.PIECEWISE
    assert target_graphs.single_token_keys(d, MAX_SEQS) == []
    assert target_graphs.single_token_keys(_dispatcher(q=1), MAX_SEQS) == []  # no speculation: one family


@pytest.fixture
def installed(monkeypatch):
    """``install`` around stand-ins of the four methods it wraps (restored after the test); what each saw."""
    seen = []

    def override(self):
        seen.append(("override", self))

    def setup(self, *a, **kw):
        self.cudagraph_dispatcher = _dispatcher()

    def capture(self, desc, *a, **kw):
        seen.append(("capture", desc.num_tokens, self.uniform_decode_query_len,
                     self.cudagraph_dispatcher.uniform_decode_query_len))

    def planning(self, num_tokens, num_reqs, np_tokens, max_tokens, *a, **kw):
        seen.append(("plan", num_tokens, self.uniform_decode_query_len,
                     self.cudagraph_dispatcher.uniform_decode_query_len))
        return "planned"

    monkeypatch.setattr(VllmConfig, "_maybe_override_dynamic_sd_cudagraph_mode", override)
    monkeypatch.setattr(VllmConfig, "_twin_target_graphs", False, raising=False)
    monkeypatch.setattr(CudagraphDispatcher, "dispatch", CudagraphDispatcher.dispatch)
    for name, fn in (("_check_and_update_cudagraph_mode", setup), ("_warmup_and_capture", capture),
                     ("_determine_batch_execution_and_padding", planning)):
        monkeypatch.setattr(GPUModelRunner, name, fn)
    target_graphs.install(SimpleNamespace(target_graphs="full"))
    return seen


def _config(dynamic: bool):
    return SimpleNamespace(speculative_config=SimpleNamespace(uses_dynamic_speculative_decoding=lambda: dynamic))


def test_install_keeps_full_graphs_and_runs_one_token_steps_at_query_length_one(installed):
    # vLLM's override: skipped under the schedule, kept without it
    dyn, static = _config(True), _config(False)
    assert VllmConfig._maybe_override_dynamic_sd_cudagraph_mode(dyn) is None
    VllmConfig._maybe_override_dynamic_sd_cudagraph_mode(static)
    assert installed == [("override", static)]
    installed.clear()
    runner = object.__new__(GPUModelRunner)
    runner.vllm_config, runner.uniform_decode_query_len = dyn, 3
    runner.scheduler_config = SimpleNamespace(max_num_seqs=MAX_SEQS)
    runner.compilation_config = SimpleNamespace(cudagraph_capture_sizes=list(VANILLA_SIZES))
    GPUModelRunner._check_and_update_cudagraph_mode(runner, [], [])
    assert runner._twin_sizes_before_rounding == VANILLA_SIZES
    added = runner._twin_single_token_graphs
    assert added == len(target_graphs.single_token_keys(_dispatcher(), MAX_SEQS, VANILLA_SIZES)) == 7
    # the dispatcher class dispatches a one-token step on the family's padding (32 requests: 32, not 33)
    with target_graphs.query_len(runner, 1):
        mode, desc = runner.cudagraph_dispatcher.dispatch(32, uniform_decode=True)
    assert (mode, desc.num_tokens) == (CUDAGraphMode.FULL, 32)
    full = runner.cudagraph_dispatcher.cudagraph_keys[CUDAGraphMode.FULL]
    one = [k for k in full if target_graphs.is_single_token_key(k)]
    assert len(one) == added
    # capture: a one-token key at query length 1, vLLM's own at 3
    GPUModelRunner._warmup_and_capture(runner, one[0], CUDAGraphMode.FULL)
    own = next(k for k in full if not target_graphs.is_single_token_key(k))
    GPUModelRunner._warmup_and_capture(runner, own, CUDAGraphMode.FULL)
    assert installed == [("capture", one[0].num_tokens, 1, 1), ("capture", own.num_tokens, 3, 3)]
    installed.clear()
    # planning: a step of one token per request at 1; a γ_max step, a mixed step and a capture's forced
    # planning as they come
    assert GPUModelRunner._determine_batch_execution_and_padding(runner, 16, 16, None, 1) == "planned"
    GPUModelRunner._determine_batch_execution_and_padding(runner, 30, 10, None, 3)
    GPUModelRunner._determine_batch_execution_and_padding(runner, 20, 4, None, 17)
    GPUModelRunner._determine_batch_execution_and_padding(runner, 16, 16, None, 1, force_uniform_decode=False)
    assert installed == [("plan", 16, 1, 1), ("plan", 30, 3, 3), ("plan", 20, 3, 3), ("plan", 16, 3, 3)]
    assert runner.uniform_decode_query_len == 3 and runner.cudagraph_dispatcher.uniform_decode_query_len == 3


def test_install_changes_nothing_without_a_schedule_or_with_vllms_rule(installed, monkeypatch):
    runner = object.__new__(GPUModelRunner)
    runner.vllm_config, runner.uniform_decode_query_len = _config(False), 3
    runner.scheduler_config = SimpleNamespace(max_num_seqs=MAX_SEQS)
    runner.compilation_config = SimpleNamespace(cudagraph_capture_sizes=list(VANILLA_SIZES))
    GPUModelRunner._check_and_update_cudagraph_mode(runner, [], [])
    assert not getattr(runner, "_twin_single_token_graphs", 0)
    GPUModelRunner._determine_batch_execution_and_padding(runner, 16, 16, None, 1)
    assert installed == [("plan", 16, 3, 3)]
    # the default (vllm) installs nothing
    before = VllmConfig._maybe_override_dynamic_sd_cudagraph_mode
    monkeypatch.setattr(VllmConfig, "_twin_target_graphs", False)
    target_graphs.install(SimpleNamespace(target_graphs="vllm"))
    assert VllmConfig._maybe_override_dynamic_sd_cudagraph_mode is before
