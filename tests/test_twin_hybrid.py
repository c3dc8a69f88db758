"""draft_linear_kernel=own-cuda+marlin: the kernel picked per call by its token count, inside one custom op that
torch.compile cannot bake a branch into; the MLP fusion on its own layout; the knob, the class and the report.
On a GPU (with vLLM): a real compressed-tensors layer built on the class, against the dequantized reference."""
import os
import types

import pytest
import torch

from vllm_patch import draft_kernels, draft_mlp, twin_cuda, twin_hybrid
from vllm_patch import twin_cuda_layout as L

from test_twin_cuda import checkpoint, reference


class TwinHybridLinearKernel:  # the name draft_mlp and the report look for
    w_q_name, w_s_name, w_zp_name = "weight_packed", "weight_scale", "weight_zero_point"

    def __init__(self, calls):
        self.calls = calls

    def marlin_apply(self, layer, x, bias):
        self.calls.append(("marlin", x.shape[0]))
        return torch.full((x.shape[0], layer.twin_hybrid_own["n"]), 7.0)


def hybrid_layer(n=64, k=256, calls=None, bias=None, scheme=False):
    packed, scales, zeros = checkpoint(n, k, 128, False, seed=n)
    layer = torch.nn.Module()
    layer.twin_hybrid_own = dict(L.repack(packed, scales, zeros, 128), n=n, k=k, group=128, pairs=False)
    layer.twin_hybrid_bias = bias
    kernel = TwinHybridLinearKernel(calls if calls is not None else [])
    layer.twin_hybrid_kernel = kernel  # what the op calls Marlin through: no layer.scheme (the int4 head's holder
    twin_hybrid.register(layer)         # has none: an engine died on that in serving, draft_head)
    if scheme:
        layer.scheme = types.SimpleNamespace(kernel=kernel)
    return layer


@pytest.fixture
def own_on_cpu(monkeypatch):
    """twin_cuda.w4a16_mm as the kernel's CPU emulation (its index math and sums), recording each call."""
    calls = []

    def emulated(x, st, p=None):
        calls.append(("own", x.shape[0]))
        y = L.emulate_mm(x.float(), dict(st, pairs=False)).to(torch.bfloat16)
        return L.silu_mul(y) if st.get("pairs") else y

    def halves(h):
        calls.append(("silu_mul_halves", h.shape[0]))
        return L.silu_mul_halves(h)

    monkeypatch.setattr(twin_cuda, "w4a16_mm", emulated)
    monkeypatch.setattr(twin_cuda, "silu_mul_halves", halves)
    return calls


def test_the_op_runs_own_cuda_up_to_the_split_marlin_above_and_the_large_m_path_above_that(own_on_cpu):
    layer = hybrid_layer(calls=own_on_cpu, bias=torch.full((64,), 0.5, dtype=torch.bfloat16))
    big = twin_hybrid.DEQUANT_M
    for m in (1, twin_hybrid.SPLIT_M, twin_hybrid.SPLIT_M + 1, 80, big, big + 1):
        x = torch.randn(m, 256).to(torch.bfloat16)
        y = twin_hybrid.hybrid_linear(x.view(1, m, 256), layer)
        assert y.shape == (1, m, 64)
        if m <= twin_hybrid.SPLIT_M or m > big:  # the own layout, its bias (Marlin's is permuted in place)
            want = L.emulate_mm(x.float(), layer.twin_hybrid_own).to(torch.bfloat16) + 0.5
            assert torch.equal(y[0], want)
        else:
            assert torch.equal(y[0], torch.full((m, 64), 7.0))
    assert own_on_cpu == [("own", 1), ("own", 4), ("marlin", 5), ("marlin", 80), ("marlin", big), ("own", big + 1)]


@pytest.fixture
def machete_on_cpu(own_on_cpu, monkeypatch):
    """Machete's GEMM as a recorded stand-in (its layout is vLLM's CUDA-only prepack)."""
    def machete(layer, x):
        own_on_cpu.append(("machete", x.shape[0]))
        return torch.full((x.shape[0], layer.twin_hybrid_own["n"]), 3.0)

    monkeypatch.setattr(twin_hybrid, "_machete", machete)
    return own_on_cpu


def test_with_machetes_layout_the_calls_above_its_split_run_on_machete(machete_on_cpu):
    """own-cuda+marlin+machete: own-cuda up to SPLIT_M, Marlin up to MACHETE_M (one 64-row tile), Machete above,
    the large-M range included; a layer Machete refused keeps the two-layout routing."""
    assert twin_hybrid.SPLIT_M < twin_hybrid.MACHETE_M < twin_hybrid.DEQUANT_M
    layer = hybrid_layer(calls=machete_on_cpu)
    layer.twin_hybrid_machete = {"b_q": torch.zeros(1)}
    refused = hybrid_layer(n=32, calls=machete_on_cpu)
    refused.twin_hybrid_machete = {"unavailable": "Machete requires compute capability of 90 (Hopper)"}
    ms = (1, twin_hybrid.SPLIT_M + 1, twin_hybrid.MACHETE_M, twin_hybrid.MACHETE_M + 1, twin_hybrid.DEQUANT_M + 1)
    for m in ms:
        y = twin_hybrid.hybrid_linear(torch.randn(m, 256).to(torch.bfloat16), layer)
        if m > twin_hybrid.MACHETE_M:
            assert torch.equal(y, torch.full((m, 64), 3.0))
        twin_hybrid.hybrid_linear(torch.randn(m, 256).to(torch.bfloat16), refused)
    big = twin_hybrid.DEQUANT_M + 1
    assert machete_on_cpu == [("own", 1), ("own", 1), ("marlin", 5), ("marlin", 5), ("marlin", 64), ("marlin", 64),
                              ("machete", 65), ("marlin", 65), ("machete", big), ("own", big)]
    assert [twin_hybrid.path(m, True) for m in ms] == ["own", "marlin", "marlin", "machete", "machete"]
    assert [twin_hybrid.path(m) for m in ms] == ["own", "marlin", "marlin", "marlin", "own"]


def test_machetes_path_applies_silu_after_its_gemm(machete_on_cpu):
    layer = hybrid_layer(n=64, calls=machete_on_cpu)
    layer.twin_hybrid_machete = {"b_q": torch.zeros(1)}
    y = twin_hybrid.gate_up_silu_mul(torch.randn(80, 256).to(torch.bfloat16), layer)
    assert torch.equal(y, L.silu_mul_halves(torch.full((80, 64), 3.0)))
    assert machete_on_cpu == [("machete", 80), ("silu_mul_halves", 80)]


def test_compiled_code_keeps_the_choice_per_call(own_on_cpu):
    """The op is opaque: a graph traced with a dynamic token count still asks per call (a Python branch on M in
    the layer's forward would be traced once and guard or bake in one kernel)."""
    layer = hybrid_layer(calls=own_on_cpu)
    f = torch.compile(lambda x: twin_hybrid.hybrid_linear(x, layer) * 2, backend="aot_eager", dynamic=True,
                      fullgraph=True)
    for m in (2, 9, 3, 17, twin_hybrid.DEQUANT_M + 3):
        f(torch.randn(m, 256).to(torch.bfloat16))
    assert [c[0] for c in own_on_cpu] == ["own", "marlin", "own", "marlin", "own"]


def test_gate_up_pairs_the_own_layout_and_applies_silu_on_either_path(own_on_cpu):
    layer = hybrid_layer(n=64, calls=own_on_cpu, scheme=True)
    flat = dict(layer.twin_hybrid_own)
    mlp = torch.nn.Module()
    mlp.gate_up_proj = layer
    layer.output_partition_sizes = [32, 32]
    layer.bias = None
    mlp.down_proj = lambda h: (h, None)
    mlp.act_fn = type("SiluAndMul", (torch.nn.Module,), {})()
    report = draft_mlp.fuse(torch.nn.ModuleList([mlp]))
    assert report == {"draft_mlp_fused": 1, "draft_mlp_unfused": {}}
    assert layer.twin_hybrid_own["pairs"] and torch.equal(layer.twin_hybrid_own["qw"], L.pair_tiles(flat)["qw"])
    x = torch.randn(3, 256).to(torch.bfloat16)
    want = L.silu_mul(L.emulate_mm(x.float(), L.pair_tiles(flat)))
    assert torch.equal(mlp.forward(x), want)  # own path: the fused epilogue on the paired tiles
    big = mlp.forward(torch.randn(6, 256).to(torch.bfloat16))  # Marlin's [M, 2 I] of 7.0, then one silu * up kernel
    assert big.shape == (6, 32) and torch.allclose(big.float(), torch.full((6, 32), 7.0 / (1 + torch.exp(
        torch.tensor(-7.0))) * 7.0), rtol=1e-2)
    assert torch.equal(big, L.silu_mul_halves(torch.full((6, 64), 7.0)))
    long = mlp.forward(torch.randn(twin_hybrid.DEQUANT_M + 1, 256).to(torch.bfloat16))  # the large-M path: own
    assert long.shape == (twin_hybrid.DEQUANT_M + 1, 32)
    assert own_on_cpu == [("own", 3), ("marlin", 6), ("silu_mul_halves", 6), ("own", twin_hybrid.DEQUANT_M + 1)]


def test_knob_class_and_report():
    from vllm_patch.knobs import ENV_LINEAR_KERNEL, KnobError, read_knobs

    assert read_knobs({ENV_LINEAR_KERNEL: "own-cuda+marlin"}).draft_linear_kernel == "own-cuda+marlin"
    with pytest.raises(KnobError, match="own-cuda\\+marlin"):  # the error lists the values, this one too
        read_knobs({ENV_LINEAR_KERNEL: "marlin+own-cuda"})
    assert draft_kernels.resolve("own-cuda+marlin", on_cuda=True)[0] == twin_hybrid.KERNEL_NAME
    assert draft_kernels.resolve("own-cuda+marlin", on_cuda=False)[0] is None
    cls = draft_kernels.kernel_class(twin_hybrid.KERNEL_NAME)
    from vllm.model_executor.kernels.linear import MarlinLinearKernel

    assert issubclass(cls, MarlinLinearKernel) and cls.__name__ == twin_hybrid.KERNEL_NAME
    if not torch.cuda.is_available():
        ok, why = cls.can_implement(None)
        assert not ok and "needs CUDA" in why
    layers = torch.nn.ModuleList([hybrid_layer(scheme=True), hybrid_layer(n=32, scheme=True)])
    rep = draft_kernels.report(layers, twin_hybrid.KERNEL_NAME)
    own = [m.twin_hybrid_own for m in layers]
    assert rep["draft_linear_kernel"] == twin_hybrid.KERNEL_NAME and rep["draft_hybrid_split_m"] == 4
    assert rep["draft_hybrid_marlin_direct"] == 0  # CPU stand-ins: no direct Marlin arguments
    assert rep["draft_hybrid_extra_bytes"] == sum(
        t.numel() * t.element_size() for st in own for t in (st["qw"], st["sc"], st["zp"]))
    assert "draft_hybrid_machete_layers" not in rep


def test_the_machete_knob_class_and_report():
    from vllm_patch.knobs import ENV_LINEAR_KERNEL, read_knobs

    assert read_knobs({ENV_LINEAR_KERNEL: "own-cuda+marlin+machete"}).draft_linear_kernel == "own-cuda+marlin+machete"
    assert draft_kernels.resolve("own-cuda+marlin+machete", on_cuda=True)[0] == twin_hybrid.MACHETE_KERNEL_NAME
    cls = draft_kernels.kernel_class(twin_hybrid.MACHETE_KERNEL_NAME)
    assert issubclass(cls, draft_kernels.kernel_class(twin_hybrid.KERNEL_NAME))
    assert cls.__name__ == twin_hybrid.MACHETE_KERNEL_NAME
    layers = torch.nn.ModuleList([hybrid_layer(scheme=True), hybrid_layer(n=32, scheme=True)])
    for m in layers:
        m.scheme.kernel.__class__ = type(twin_hybrid.MACHETE_KERNEL_NAME, (TwinHybridLinearKernel,), {})
    b_q = torch.zeros(64, 32, dtype=torch.int32)
    scales = torch.zeros(2, 64, dtype=torch.bfloat16)
    layers[0].twin_hybrid_machete = {"b_q": b_q, "scales": scales, "zeros": scales.clone()}
    layers[1].twin_hybrid_machete = {"unavailable": "no Hopper"}
    rep = draft_kernels.report(layers, twin_hybrid.MACHETE_KERNEL_NAME)
    assert rep["draft_linear_kernel"] == twin_hybrid.MACHETE_KERNEL_NAME
    assert rep["draft_hybrid_machete_m"] == twin_hybrid.MACHETE_M
    assert rep["draft_hybrid_machete_layers"] == 1 and rep["draft_hybrid_machete_refused"] == {"no Hopper": 1}
    own = sum(t.numel() * t.element_size() for m in layers for t in (m.twin_hybrid_own["qw"],
                                                                     m.twin_hybrid_own["sc"], m.twin_hybrid_own["zp"]))
    assert rep["draft_hybrid_extra_bytes"] == own + b_q.numel() * 4 + 2 * scales.numel() * 2


def test_keys_follow_the_module_path():
    """The same module path gives the same key (a compiled graph names the layer of each engine of the model); a
    layer without one gets a key of its own."""
    a, b = torch.nn.Module(), torch.nn.Module()
    a.prefix = b.prefix = "model.layers.0.mlp.down_proj"
    assert twin_hybrid.register(a) == "twin_hybrid:model.layers.0.mlp.down_proj"
    assert twin_hybrid.register(b) == a.twin_hybrid_key and twin_hybrid.layer_of(a.twin_hybrid_key) is b
    c, d = torch.nn.Module(), torch.nn.Module()
    assert twin_hybrid.register(c) != twin_hybrid.register(d)


def test_a_freed_layer_is_named():
    layer = hybrid_layer()
    key = layer.twin_hybrid_key
    del layer
    import gc

    gc.collect()
    with pytest.raises(KeyError, match="no live draft layer"):
        twin_hybrid.layer_of(key)


# -------------------------------------------------------------- on a GPU, with vLLM's Marlin

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU, nvcc and vLLM's CUDA kernels")
@pytest.mark.parametrize("machete", [False, True], ids=["own-cuda+marlin", "own-cuda+marlin+machete"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_a_compressed_tensors_layer_on_the_hybrid_class(symmetric, machete):
    """vLLM's own scheme builds the layer and picks the class (put first as the engine does); every M gives the
    dequantized reference, the own path what own-cuda alone gives, the Marlin path what Marlin alone gives."""
    pytest.importorskip("vllm", reason="needs vLLM's Marlin (a kernel-only GPU host has no vLLM)")
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16 import (
        CompressedTensorsWNA16)

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with set_current_vllm_config(VllmConfig()):  # vLLM's layers and ops read it when built and called
        if not ps.model_parallel_is_initialized():  # the parameters ask for their tensor-parallel rank
            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                            distributed_init_method=f"tcp://127.0.0.1:{29500 + os.getpid() % 1000}")
            ps.initialize_model_parallel(1, 1)
        _compressed_tensors_layer_on_the_hybrid_class(symmetric, machete, CompressedTensorsWNA16)


def _compressed_tensors_layer_on_the_hybrid_class(symmetric, machete, CompressedTensorsWNA16):
    dev, n, k = torch.device("cuda"), 1024, 2048
    packed, scales, zeros = checkpoint(n, k, 128, symmetric, seed=3)

    def build(kernel_name):
        layer, scheme = torch.nn.Module(), CompressedTensorsWNA16("group", 4, 128, symmetric=symmetric)
        with torch.device(dev), draft_kernels.prefer(kernel_name):
            scheme.create_weights(layer, output_size=n, input_size=k, output_partition_sizes=[n],
                                  input_size_per_partition=k, params_dtype=torch.bfloat16,
                                  weight_loader=lambda *a, **kw: None)
        layer.weight_packed.data.copy_(packed.to(dev))
        layer.weight_scale.data.copy_(scales.to(dev).to(layer.weight_scale.dtype))
        if zeros is not None:
            layer.weight_zero_point.data.copy_(zeros.to(dev))
        layer.scheme = scheme
        scheme.process_weights_after_loading(layer)
        return layer, scheme

    name = twin_hybrid.MACHETE_KERNEL_NAME if machete else twin_hybrid.KERNEL_NAME
    layer, scheme = build(name)
    assert type(scheme.kernel).__name__ == name
    assert layer.twin_hybrid_marlin is not None  # the direct marlin_gemm call, equal to vLLM's apply on its probe
    assert twin_hybrid._has_machete(layer) == machete, getattr(layer, "twin_hybrid_machete", None)
    alone = {way: build(cls) for way, cls in (("marlin", "MarlinLinearKernel"), ("machete", "MacheteLinearKernel"))}
    assert [type(s.kernel).__name__ for _, s in alone.values()] == ["MarlinLinearKernel", "MacheteLinearKernel"]
    ref_w = reference(packed, scales, zeros, 128).to(dev)
    for m in (1, 4, 5, 16, 64, 65, 80, twin_hybrid.DEQUANT_M + 1, 2048):
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        y = scheme.apply_weights(layer, x, None).float()
        ref = x.float() @ ref_w.t()
        assert float((y - ref).abs().max() / ref.abs().max()) < 8e-3, m
        way = twin_hybrid.path(m, machete)
        if way == "own":  # own-cuda, or its large-M path (dequantized slices and cuBLAS)
            assert torch.equal(y, twin_cuda.w4a16_mm(x, twin_hybrid.own_state(layer)).float()), m
        else:  # bit for bit what vLLM's Marlin / Machete class gives on the same checkpoint
            other_layer, other = alone[way]
            assert torch.equal(y, other.apply_weights(other_layer, x, None).float()), (m, way)


def test_own_cuda_ops_trace_opaquely_too(own_on_cpu):
    """twin_cuda's ops (registered directly since the hybrid, as vLLM registers its own) inside a compiled graph
    with a dynamic token count: the fake gives the shapes, the kernel runs per call (here its CPU emulation)."""
    layer = hybrid_layer()
    st = twin_hybrid.own_state(layer)
    f = torch.compile(lambda x: twin_cuda.twin_linear(x, st) + 1, backend="aot_eager", dynamic=True, fullgraph=True)
    for m in (2, 7):
        x = torch.randn(m, 256).to(torch.bfloat16)
        assert torch.equal(f(x), L.emulate_mm(x.float(), st).to(torch.bfloat16) + 1)
    paired = L.pair_tiles(st)
    g = torch.compile(lambda x: twin_cuda.gate_up_silu_mul(x, paired), backend="aot_eager", dynamic=True,
                      fullgraph=True)
    x = torch.randn(3, 256).to(torch.bfloat16)
    assert g(x).shape == (3, 32) and torch.equal(g(x), L.silu_mul(L.emulate_mm(x.float(), paired)))
    assert [c[1] for c in own_on_cpu] == [2, 7, 3, 3]
