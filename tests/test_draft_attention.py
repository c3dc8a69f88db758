"""draft_attention=twin wired into the draft's attention layers (vllm_patch.draft_attention), on the CPU: the
decode-only calls reach the kernel with vLLM's paged cache seen as the kernel reads it and give plain attention
(the kernel's arithmetic emulated), everything else stays vLLM's forward, the split count depends on the batch
only (a graph captured at one length replays at any), and the layers the kernel cannot take are named."""
import math
from types import SimpleNamespace

import pytest
import torch

from vllm_patch import draft_attention as da
from vllm_patch import twin_attention as ta


class FlashAttentionImpl:  # the name the wiring checks; vLLM's forward replaced by a marker
    def __init__(self, num_heads=8, num_kv_heads=2, head_size=128, **kw):
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = 1 / math.sqrt(head_size)
        self.attn_type, self.kv_cache_dtype, self.alibi_slopes = "decoder", "auto", None
        self.sliding_window, self.logits_soft_cap, self.sinks, self.dcp_world_size = (-1, -1), 0, None, 1
        self.__dict__.update(kw)
        self.vllm_calls = 0

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        self.vllm_calls += 1
        return output.fill_(-7)


class Layer(torch.nn.Module):
    def __init__(self, impl, name):
        super().__init__()
        self.impl, self.layer_name, self.kv_cache = impl, name, None


def model_of(*impls):
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList(Layer(i, f"model.layers.{n}.self_attn.attn") for n, i in enumerate(impls))
    return m


def emulated_kernel(calls):
    def kernel(q, k_cache, v_cache, block_table, seq_lens, scale, splits, out, workspace):
        calls.append({"splits": splits, "batch": q.shape[0], "ws": workspace})
        out.copy_(ta.emulate(q, k_cache, v_cache, block_table, seq_lens, scale, splits).to(out.dtype))
        return out
    return kernel


def decode_inputs(batch, hq, hkv, lens, block=16, seed=0):
    """q, the cache as vLLM's FA backend holds it ([blocks, Hkv, block, 2 x 128]), table, lengths, metadata."""
    g = torch.Generator().manual_seed(seed)
    per = -(-max(lens) // block)
    kv = torch.randn(batch * per + 2, hkv, block, 2 * 128, generator=g).to(torch.bfloat16)
    table = torch.randperm(batch * per + 2, generator=g)[: batch * per].view(batch, per).to(torch.int32)
    q = torch.randn(batch, hq, 128, generator=g).to(torch.bfloat16)
    md = SimpleNamespace(max_query_len=1, use_cascade=False, causal=True, num_actual_tokens=batch,
                         seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table,
                         mm_prefix_range_tensor=None)
    return q, kv, md


def test_decode_only_calls_give_plain_attention_on_the_kernel_and_the_rest_stays_vllms():
    impls = [FlashAttentionImpl(), FlashAttentionImpl()]
    calls, learned = [], []
    rep = da.install(model_of(*impls), "twin", max_batch=4, max_len=512, dtype=torch.bfloat16, device="cpu",
                     kernel=emulated_kernel(calls), report=lambda **kw: learned.append(kw))
    assert rep == {"draft_attention_requested": "twin", "draft_attention": "twin", "draft_attention_layers": 2,
                   "draft_attention_refused": {}, "draft_attention_ran": False}
    q, kv, md = decode_inputs(3, 8, 2, [5, 40, 17])
    out = torch.zeros(4, 8 * 128, dtype=torch.bfloat16)  # one padded row beyond the batch: untouched
    impls[0].forward(None, q, None, None, kv, md, out)
    k, v = kv.transpose(1, 2).split(128, dim=-1)
    want = ta.reference(q, k, v, md.block_table, md.seq_lens, impls[0].scale)
    got = out[:3].view(3, 8, 128).float()
    assert torch.allclose(got, want, atol=2e-2, rtol=2e-2), (got - want).abs().max()
    assert (out[3] == 0).all() and impls[0].vllm_calls == 0 and len(calls) == 1
    # a first pass (γ + 1 tokens a request), a cascade, no metadata and a batch above the workspace: vLLM's
    for change in ({"max_query_len": 5}, {"use_cascade": True}, {"num_actual_tokens": 5}):
        impls[1].forward(None, q, None, None, kv, SimpleNamespace(**{**vars(md), **change}), out)
    impls[1].forward(None, q, None, None, kv, None, out)
    assert impls[1].vllm_calls == 4 and len(calls) == 1 and (out == -7).all()
    impls[1].forward(None, q, None, None, kv, md, out)
    assert learned == [{"draft_attention_ran": True}]  # learned once, at the first call that reached the kernel


def test_the_split_count_is_the_batchs_so_a_graph_replays_at_any_length():
    impl, calls = FlashAttentionImpl(num_heads=16, num_kv_heads=2), []
    da.install(model_of(impl), "twin", max_batch=8, max_len=4096, dtype=torch.bfloat16, device="cpu",
               kernel=emulated_kernel(calls))
    out = torch.empty(8, 16 * 128, dtype=torch.bfloat16)
    for lens in ([3, 4], [900, 1000], [1, 4000]):
        q, kv, md = decode_inputs(2, 16, 2, lens)
        impl.forward(None, q, None, None, kv, md, out)
    q, kv, md = decode_inputs(8, 16, 2, [50] * 8)
    impl.forward(None, q, None, None, kv, md, out)
    assert [c["splits"] for c in calls[:3]] == [ta.splits_for(2, 2, 4096, 132)] * 3
    assert calls[3]["splits"] == ta.splits_for(8, 2, 4096, 132) < calls[0]["splits"]
    ws = calls[0]["ws"]
    assert all(c["ws"] is ws for c in calls)  # one workspace for every layer and batch, made before any capture
    for b in range(1, 9):  # the kernel's own bounds (twin_decode_attn.cu) hold at every batch up to the largest
        s = ta.splits_for(b, 2, 4096, 132)
        assert ws["o"].numel() >= b * 16 * s * 128 and ws["ml"].numel() >= b * 16 * s * 2
        assert ws["counters"].numel() >= b * 2 and not ws["counters"].any()


@pytest.mark.parametrize("kw,dtype,why", [
    ({"head_size": 64}, torch.bfloat16, "head size 64, not 128"),
    ({"num_heads": 12, "num_kv_heads": 1}, torch.bfloat16, "12 query heads over 1 KV heads"),
    ({"kv_cache_dtype": "fp8_e4m3"}, torch.bfloat16, "KV cache dtype fp8_e4m3"),
    ({"sliding_window": (127, 0)}, torch.bfloat16, "ALiBi, a sliding window, a soft cap or sinks"),
    ({}, torch.float32, "model dtype float32, the kernel is bf16"),
])
def test_layers_the_kernel_cannot_take_keep_vllms_forward_and_are_named(kw, dtype, why):
    fits, other = FlashAttentionImpl(), FlashAttentionImpl(**kw)
    if dtype == torch.bfloat16:
        rep = da.install(model_of(fits, other), "twin", max_batch=2, max_len=64, dtype=dtype, device="cpu",
                         kernel=emulated_kernel([]))
        assert rep["draft_attention"] == "mixed" and rep["draft_attention_layers"] == 1
        assert rep["draft_attention_refused"] == {why: 1}
        assert "_twin_attention" in vars(fits) and "_twin_attention" not in vars(other)
    with pytest.raises(ValueError, match=f"none of the draft's 1 attention layers.*{why}.*draft_attention=vllm"):
        da.install(model_of(FlashAttentionImpl(**kw)), "twin", max_batch=2, max_len=64, dtype=dtype, device="cpu")


def test_another_backend_or_vllm_asked_changes_nothing():
    other = type("TritonAttentionImpl", (FlashAttentionImpl,), {})()
    with pytest.raises(ValueError, match="backend TritonAttentionImpl, not FlashAttentionImpl"):
        da.install(model_of(other), "twin", max_batch=2, max_len=64, dtype=torch.bfloat16, device="cpu")
    impl = FlashAttentionImpl()
    rep = da.install(model_of(impl), "vllm", max_batch=2, max_len=64, dtype=torch.bfloat16, device="cpu")
    assert rep["draft_attention"] == "vllm" and rep["draft_attention_layers"] == 0 and "forward" not in vars(impl)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU, vLLM's FlashAttention and nvcc")
@pytest.mark.parametrize("q_heads,kv_heads", [(32, 8), (64, 8)])  # the 8B and 32B draft's heads
def test_on_vllms_own_flash_attention_impl_the_twin_forward_gives_fa3s_output(q_heads, kv_heads):
    """vLLM's FlashAttentionImpl with its metadata as the drafter's single-token step has it: wrapped, its
    forward gives what FA3 gives (to bf16 rounding), and a first pass still runs FA3 (bit for bit)."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl as FA, FlashAttentionMetadata

    def impl():
        return FA(num_heads=q_heads, head_size=128, scale=128 ** -0.5, num_kv_heads=kv_heads, alibi_slopes=None,
                  sliding_window=None, kv_cache_dtype="auto")

    fa, twin = impl(), impl()
    model = model_of(twin)
    rep = da.install(model, "twin", max_batch=8, max_len=4096, dtype=torch.bfloat16, device="cuda")
    assert rep["draft_attention"] == "twin", rep
    lens = [1, 37, 700, 2049, 5]
    q, kv, md = decode_inputs(len(lens), q_heads, kv_heads, lens)
    q, kv = q.cuda(), kv.cuda()
    b = len(lens)
    meta = FlashAttentionMetadata(
        num_actual_tokens=b, max_query_len=1, query_start_loc=torch.arange(b + 1, dtype=torch.int32, device="cuda"),
        max_seq_len=max(lens), seq_lens=md.seq_lens.cuda(), block_table=md.block_table.cuda(),
        slot_mapping=torch.zeros(b, dtype=torch.int64, device="cuda"), use_cascade=False, common_prefix_len=0,
        cu_prefix_query_lens=None, prefix_kv_lens=None, suffix_kv_lens=None)
    one = torch.ones((), dtype=torch.float32, device="cuda")
    layer = SimpleNamespace(_q_scale=one, _k_scale=one, _v_scale=one)
    want = torch.zeros(b, q_heads * 128, dtype=torch.bfloat16, device="cuda")
    got = torch.zeros_like(want)
    fa.forward(layer, q, None, None, kv, meta, want)
    twin.forward(layer, q, None, None, kv, meta, got)
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2), (got.float() - want.float()).abs().max()
    assert not torch.equal(got, torch.zeros_like(got))
    # a first pass (2 tokens a request): FA3's own path, bit for bit
    q2 = torch.randn(2 * b, q_heads, 128, device="cuda").to(torch.bfloat16)
    meta2 = FlashAttentionMetadata(**{**vars(meta), "num_actual_tokens": 2 * b, "max_query_len": 2,
                                      "query_start_loc": torch.arange(0, 2 * b + 1, 2, dtype=torch.int32,
                                                                      device="cuda")})
    w2, g2 = (torch.zeros(2 * b, q_heads * 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    fa.forward(layer, q2, None, None, kv, meta2, w2)
    twin.forward(layer, q2, None, None, kv, meta2, g2)
    assert torch.equal(w2, g2)
