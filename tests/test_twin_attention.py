"""The draft's decode attention (vllm_patch.twin_attention): its arithmetic on the CPU against plain attention,
the split rule, the shape checks, the CUDA source compiled for sm_90a by NVRTC (registers, no spills); on a GPU
the kernel against the reference, deterministic, and replayed in a CUDA graph at other lengths."""
import re

import pytest
import torch

from vllm_patch import twin_attention as ta
from vllm_patch import twin_cuda_compile as cc
from vllm_patch.cuda_ext import CSRC


@pytest.mark.parametrize("lengths", [[0, 5, 37, 300], [300, 0]], ids=["batch-4-narrow", "batch-2-wide"])
@pytest.mark.parametrize("q_heads,kv_heads", [(8, 2), (16, 2), (4, 4)])
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_the_emulated_kernel_is_plain_attention(q_heads, kv_heads, splits, lengths):
    """Every split, warp order (8 warps a CTA at batch 1-2, 4 above) and merge of the kernel gives
    softmax(q k^T s) v; a request with no tokens gives 0, a short one uses fewer splits than launched (300
    tokens: 5 of 8)."""
    q, k, v, table, lens = ta.paged_cache(len(lengths), q_heads, kv_heads, lengths)
    scale = ta.HEAD_DIM ** -0.5
    want = ta.reference(q, k, v, table, lens, scale)
    got = ta.emulate(q, k, v, table, lens, scale, splits)
    empty = lengths.index(0)
    assert torch.equal(got[empty], torch.zeros_like(got[empty]))
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(want[0], want[-1], atol=1e-2)  # the requests read their own blocks


def test_warps_a_cta_follow_the_batch_as_the_binding_launches_them():
    """8 warps at batch 1-2, 4 above, in the Python emulation and in the CUDA source alike."""
    src = (CSRC / "twin_decode_attn.cuh").read_text()
    const = {n: int(re.search(rf"constexpr int {n} = (\d+);", src).group(1))
             for n in ("kWideWarps", "kNarrowWarps", "kWideMaxBatch")}
    assert (const["kWideWarps"], const["kNarrowWarps"], const["kWideMaxBatch"]) == (
        ta.WIDE_WARPS, ta.NARROW_WARPS, ta.WIDE_MAX_BATCH)
    assert [ta.warps_for(b) for b in (1, 2, 3, 16)] == [8, 8, 4, 4]
    binding = (CSRC / "twin_decode_attn.cu").read_text()
    assert "p.B <= twin_attn::kWideMaxBatch" in binding


def test_a_request_uses_the_splits_its_length_fills():
    assert ta.used_splits(3584, 33) == (33, 109)
    assert ta.used_splits(192, 33) == (3, 64)  # the drafter's 33 at batch 1: a short context uses 3
    assert ta.used_splits(1024, 33) == (16, 64)
    assert ta.used_splits(65, 2) == (2, 64) and ta.used_splits(64, 2) == (1, 64)
    assert ta.used_splits(0, 8) == (1, 64)


def test_splits_fill_the_device_but_never_go_below_the_minimum_tokens():
    assert ta.splits_for(1, 8, 400, sms=132) == 25  # ceil(400 / 16) caps ceil(264 / 8) = 33
    assert ta.splits_for(1, 8, 4000, sms=132) == 33
    assert ta.splits_for(16, 8, 4000, sms=132) == 3
    assert ta.splits_for(64, 8, 4000, sms=132) == 1
    assert ta.splits_for(1, 8, 1, sms=132) == 1


def test_shapes_are_checked_with_the_problem_named():
    q, k, v, _, _ = ta.paged_cache(1, 8, 2, [4])
    with pytest.raises(ValueError, match="query heads over"):
        ta.check(q[:, :6], k, v)
    with pytest.raises(ValueError, match=r"\[batch, query heads, 128\]"):
        ta.check(q[..., :64], k, v)
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        ta.check(q, k, v[:, :8])


def test_the_cuda_source_compiles_for_sm90a_without_spills():
    paths = cc.nvrtc_paths()
    if paths is None:
        pytest.fail("no NVRTC in this environment: torch's CUDA wheels (nvidia-cuda-nvrtc) install it")
    lib, inc = paths
    src = (cc._RTC_PRELUDE + '#include "twin_decode_attn.cuh"\nnamespace twin_attn {\n'
           + "".join(f"TWIN_ATTN_INSTANTIATE_KERNEL({g}, {w})\n" for g in ta.GROUPS
                     for w in (ta.WIDE_WARPS, ta.NARROW_WARPS)) + "}\n")
    cubin, log = cc.nvrtc_compile(src, "sm_90a", [CSRC, inc], lib)
    assert cubin
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    spills = [(int(a), int(b)) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    assert len(regs) == 2 * len(ta.GROUPS) and max(regs) <= 255
    assert spills and all(s == (0, 0) for s in spills), log


def test_the_benchmarks_dry_run_checks_the_arithmetic(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_attention.py"
    spec = importlib.util.spec_from_file_location("decode_attention_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("against float32 attention") == 4 and "32b {1: {256: 16" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and nvcc")
@pytest.mark.parametrize("q_heads,kv_heads", [(32, 8), (64, 8), (16, 16)])
def test_the_kernel_matches_the_reference_at_batch_1_and_2(q_heads, kv_heads):
    """8 warps a CTA (batch 1-2): against float32 attention, deterministic."""
    for lengths in ([200], [1, 300]):
        q, k, v, table, lens = ta.paged_cache(len(lengths), q_heads, kv_heads, lengths, device="cuda")
        scale = ta.HEAD_DIM ** -0.5
        want = ta.reference(q.cpu(), k.cpu(), v.cpu(), table.cpu(), lens.cpu(), scale)
        for splits in (1, 4, 13):
            ws = ta.make_workspace(len(lengths), q_heads, kv_heads, splits, "cuda")
            got = ta.decode_attention(q, k, v, table, lens, scale, splits, workspace=ws)
            assert torch.allclose(got.float().cpu(), want, atol=2e-2, rtol=2e-2), (lengths, splits)
            assert torch.equal(ta.decode_attention(q, k, v, table, lens, scale, splits, workspace=ws), got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and nvcc")
@pytest.mark.parametrize("q_heads,kv_heads", [(32, 8), (64, 8), (16, 16)])
def test_the_kernel_matches_the_reference_and_replays_in_a_graph(q_heads, kv_heads):
    q, k, v, table, lens = ta.paged_cache(4, q_heads, kv_heads, [1, 17, 200, 0], device="cuda")
    scale = ta.HEAD_DIM ** -0.5
    want = ta.reference(q.cpu(), k.cpu(), v.cpu(), table.cpu(), lens.cpu(), scale)
    for splits in (1, 4, 13):
        ws = ta.make_workspace(4, q_heads, kv_heads, splits, "cuda")
        got = ta.decode_attention(q, k, v, table, lens, scale, splits, workspace=ws)
        assert torch.allclose(got.float().cpu(), want, atol=2e-2, rtol=2e-2), splits
        assert torch.equal(ta.decode_attention(q, k, v, table, lens, scale, splits, workspace=ws), got)
        assert int(ws["counters"].abs().sum()) == 0  # every launch leaves them zero
    ws, out = ta.make_workspace(4, q_heads, kv_heads, 4, "cuda"), torch.empty_like(q)
    ta.decode_attention(q, k, v, table, lens, scale, 4, out=out, workspace=ws)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ta.decode_attention(q, k, v, table, lens, scale, 4, out=out, workspace=ws)
    lens.copy_(torch.tensor([3, 40, 120, 9], dtype=torch.int32))
    graph.replay()
    want = ta.reference(q.cpu(), k.cpu(), v.cpu(), table.cpu(), lens.cpu(), scale)
    assert torch.allclose(out.float().cpu(), want, atol=2e-2, rtol=2e-2)
