"""own-cuda's gate_up with SiluAndMul in its epilogue: the paired layout and its emulation on a CPU, the MLP
fusion of a draft model (which layers, what it replaces), and on a GPU the kernel against the unfused math."""
import types

import pytest
import torch

from vllm_patch import draft_mlp, twin_cuda
from vllm_patch import twin_cuda_layout as L

from test_twin_cuda import checkpoint, reference


def gate_up(i, k, group=128, symmetric=False, seed=0):
    packed, scales, zeros = checkpoint(2 * i, k, group, symmetric, seed=seed)
    return packed, scales, zeros, L.repack(packed, scales, zeros, group)


def unfused(y):
    """vLLM's SiluAndMul on the unfused GEMM's bf16 output [M, 2 I] (gate first), in fp32, rounded once."""
    i = y.shape[1] // 2
    g, u = y[:, :i].to(torch.bfloat16).float(), y[:, i:].to(torch.bfloat16).float()
    return (g / (1.0 + torch.exp(-g)) * u).to(torch.bfloat16)


@pytest.mark.parametrize("symmetric", [False, True])
def test_paired_tiles_give_silu_of_gate_times_up(symmetric):
    """The kernel's reads of a paired layout (its own index math), then its epilogue's silu(gate) * up, equal
    SiluAndMul of the unpaired GEMM bit for bit; the tiles are permuted, not changed."""
    _, _, _, st = gate_up(48, 256, symmetric=symmetric)
    paired = L.pair_tiles(st)
    assert paired["pairs"] and paired["qw"].shape == st["qw"].shape
    assert torch.equal(paired["qw"][1], st["qw"][3]) and torch.equal(paired["sc"][2], st["sc"][1])  # up 0, gate 1
    x = torch.randn(5, 256)
    assert torch.equal(L.silu_mul(L.emulate_mm(x, paired)), unfused(L.emulate_mm(x, st)))


def test_a_layout_that_cannot_pair_is_refused():
    _, _, _, st = gate_up(40, 256)  # halves of 40 rows: not whole tiles
    with pytest.raises(ValueError, match="whole row tiles"):
        L.pair_tiles(st)
    with pytest.raises(ValueError, match="paired once"):
        L.pair_tiles(L.pair_tiles(gate_up(32, 256)[3]))
    with pytest.raises(ValueError, match="r 2 or 4"):
        twin_cuda.plan(64, 256, 1, 128, r=1, pairs=True)
    assert all(twin_cuda.plan(2 * 25600, 5120, m, 128, pairs=True).r % 2 == 0 for m in (1, 4, 8, 9, 16, 33, 64))


# -------------------------------------------------------------- the MLP fusion of a model (no vLLM engine)

class TwinCudaLinearKernel:  # the name draft_mlp looks for
    w_q_name, w_s_name, w_zp_name = "weight_packed", "weight_scale", "weight_zero_point"

    def __init__(self, zero_points=True):
        self.config = types.SimpleNamespace(zero_points=zero_points)

    def _get_weight_params(self, layer):
        return layer.weight_packed, layer.weight_scale, getattr(layer, "weight_zero_point", None), None


class MarlinLinearKernel(TwinCudaLinearKernel):
    pass


class SiluAndMul(torch.nn.Module):
    pass


class GeluAndMul(torch.nn.Module):
    pass


def linear(st, kernel, sizes, bias=None):
    m = torch.nn.Module()
    m.weight_packed = torch.nn.Parameter(st["qw"], requires_grad=False)
    m.weight_scale = torch.nn.Parameter(st["sc"], requires_grad=False)
    if st["zp"] is not None:
        m.weight_zero_point = torch.nn.Parameter(st["zp"], requires_grad=False)
    m.scheme = types.SimpleNamespace(kernel=kernel)
    m.output_partition_sizes = sizes
    m.twin_cuda_shape = (st["n"], st["k"], st["group"])
    m.bias = bias
    return m


def mlp(st, kernel=None, act=SiluAndMul, sizes=None, bias=None):
    m = torch.nn.Module()
    m.gate_up_proj = linear(st, kernel or TwinCudaLinearKernel(), sizes or [st["n"] // 2] * 2, bias)
    m.down_proj = torch.nn.Identity()
    m.act_fn = act()
    return m


def test_fuse_pairs_the_own_cuda_mlps_and_counts_the_others():
    st = gate_up(32, 256)[3]
    model = torch.nn.ModuleList([mlp(st), mlp(st, MarlinLinearKernel()), mlp(st, act=GeluAndMul),
                                 mlp(st, bias=torch.nn.Parameter(torch.zeros(64))), mlp(st, sizes=[40, 24]),
                                 mlp(st)])
    forwards = [m.forward for m in model]
    report = draft_mlp.fuse(model)
    assert report["draft_mlp_fused"] == 2
    assert report["draft_mlp_unfused"] == {
        "gate_up_proj runs on MarlinLinearKernel": 1, "activation GeluAndMul, not SiluAndMul": 1,
        "gate_up_proj has a bias": 1,
        "gate and up partitions [40, 24] are not two equal halves of whole 16-row tiles": 1}
    paired = L.pair_tiles(st)
    for i in (0, 5):  # fused: tiles paired in place, the MLP's forward replaced
        gu = model[i].gate_up_proj
        assert gu.twin_cuda_pairs and torch.equal(gu.weight_packed, paired["qw"])
        assert torch.equal(gu.weight_zero_point, paired["zp"]) and model[i].forward != forwards[i]
    for i in (1, 2, 3, 4):  # the others untouched
        assert torch.equal(model[i].gate_up_proj.weight_packed, st["qw"]) and model[i].forward == forwards[i]
    assert draft_mlp.fuse(None) == {"draft_mlp_fused": 0, "draft_mlp_unfused": {}}


# -------------------------------------------------------------- on a GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (and nvcc to build the extension)")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("symmetric", [False, True])
def test_fused_epilogue_equals_silu_and_mul_of_the_gemm(symmetric):
    """Every plan (one split and several, r 2 and 4, the deep ring, the TMA-fed kernel), the default dispatch
    (above FUSED_MAX_M the unfused GEMM and the one-launch activation) and the large-M path: the fused output
    against SiluAndMul of the kernel's unfused output on the paired tiles (the same fp32 sums: equal but for
    exp's last bit) and against the dequantized reference."""
    dev = torch.device("cuda")
    for i, k in ((32, 256), (1024, 1024), (2560, 5120)):
        packed, scales, zeros, _ = gate_up(i, k, symmetric=symmetric, seed=i)
        st = L.repack(packed.to(dev), scales.to(dev), None if zeros is None else zeros.to(dev), 128)
        paired = L.pair_tiles(st)
        flat = dict(paired, pairs=False)  # the same tiles, no epilogue: [M, 2 I] in paired order
        ref_w = reference(packed, scales, zeros, 128).to(dev)
        for m in (1, 4, 9, 16, 33, twin_cuda.LARGE_M + 3):
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            want = unfused(x.float() @ ref_w.t()).float()
            plans = [None] if m > twin_cuda.LARGE_M else [None] + [
                twin_cuda.plan(2 * i, k, m, 128, twin_cuda.sm_count(dev), r=r, waves=w, deep=d, bulk=b, pairs=True)
                for r in (2, 4) for w in (1.0, 16.0) for d, b in ((False, False), (True, False), (False, True))
                if not b or torch.cuda.get_device_capability(dev)[0] >= 9]
            for p in plans:  # None: what the engine calls (above FUSED_MAX_M: the GEMM, then the activation kernel)
                y = twin_cuda.w4a16_mm(x, paired, p)
                assert y.shape == (m, i)
                h = twin_cuda.mm_large(x, flat) if m > twin_cuda.LARGE_M else twin_cuda.w4a16_mm(x, flat, p)
                same = L.silu_mul(h)
                torch.testing.assert_close(y.float(), same.float(), rtol=8e-3, atol=1e-6)
                err = float((y.float() - want).abs().max() / want.abs().max())
                assert err < 2e-2, (i, k, m, p, err)
    assert int(twin_cuda.counters(dev).abs().sum()) == 0
