"""The draft's decode attention (``csrc/twin_decode_attn.cu*``; issue 37, "the draft's other work"): one query token
per request against its paged KV cache, in one launch.

In the draft's single-token step FlashAttention 3 runs two kernels a layer (split-KV and combine): 12 µs a layer
at batch 1 on an H100 at the 8B shape, 0.43 ms of a 3.4 ms step (``benchmarks/draft_profile.py``), where the K and
V bytes of a few hundred tokens take well under a microsecond to read. This kernel splits each request's tokens
over up to ``S`` CTAs per KV head (FlashDecoding's split; a request uses those its length fills,
:func:`used_splits`), keeps an online softmax per warp and query head, and lets the last CTA of a (request, KV
head) combine the splits, largest max first (deterministic); the sequence lengths are read on the device, so one
CUDA graph serves any length. Head dim 128, 1 / 2 / 4 / 8 query heads per KV head,
bf16 in and out, fp32 inside; K and V as vLLM 0.27.1's FlashAttention backend sees its cache
(``[num_blocks, block_size, Hkv, 128]`` views of ``[num_blocks, Hkv, block_size, 256]``: any strides).

``benchmarks/decode_attention.py`` times it beside FA3; ``vllm_patch.draft_attention`` wires it into the drafter
(knob ``draft_attention``). :func:`emulate` is its arithmetic on the CPU (the splits, the warps' token steps, the
merges), which the suite checks against :func:`reference`. Importing this module needs neither CUDA nor nvcc.
"""

from __future__ import annotations

import math

import torch

from .cuda_ext import load_extension

SOURCES = ("twin_decode_attn.cu",)
HEAD_DIM = 128
GROUPS = (1, 2, 4, 8)  # query heads per KV head the extension has instances for
WIDE_WARPS, NARROW_WARPS, WIDE_MAX_BATCH = 8, 4, 2  # kWideWarps, kNarrowWarps, kWideMaxBatch of twin_decode_attn.cuh
UNROLL = 4  # kUnroll: the tokens a warp takes at a time
MIN_SPLIT_TOKENS = 64  # kMinSplitTokens: a request of L tokens uses ceil(L / max(ceil(L / S), 64)) of the S splits
MAX_SPLITS = 128  # kMaxSplits
_EXT = None


def extension():
    global _EXT
    _EXT = _EXT if _EXT is not None else load_extension("twin_decode_attn", SOURCES)
    return _EXT


def splits_for(batch: int, kv_heads: int, max_len: int, sms: int, min_tokens: int = 16) -> int:
    """Splits so that about two CTAs an SM run (``batch * kv_heads * S`` of them), each with at least ``min_tokens``
    tokens of the longest request: fewer, longer CTAs where the batch alone fills the device."""
    want = max(1, math.ceil(2 * sms / max(1, batch * kv_heads)))
    return max(1, min(want, math.ceil(max_len / min_tokens), MAX_SPLITS))


def warps_for(batch: int) -> int:
    """Warps a CTA at ``batch`` requests, as the binding launches them: 8 at batch 1-2 (more tokens in flight a
    split), 4 above (more CTAs an SM and a shorter merge; H100, 8B batch 16 at 192 tokens: 16.5 against 20.2 µs)."""
    return WIDE_WARPS if batch <= WIDE_MAX_BATCH else NARROW_WARPS


def used_splits(length: int, splits: int) -> tuple[int, int]:
    """(splits used, tokens a split) for a request of ``length`` tokens under a launch of ``splits``: the kernel
    reads the length on the device and leaves the splits past what ``MIN_SPLIT_TOKENS`` a split allows idle."""
    per = max(-(-length // splits), MIN_SPLIT_TOKENS)
    return max(1, -(-length // per)), per


def check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The shapes the kernel takes, with what is wrong named."""
    if q.dim() != 3 or q.shape[2] != HEAD_DIM:
        raise ValueError(f"q must be [batch, query heads, {HEAD_DIM}], not {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape[3] != HEAD_DIM or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must be [blocks, block_size, kv heads, {HEAD_DIM}], not "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    hq, hkv = q.shape[1], k_cache.shape[2]
    if hq % hkv or hq // hkv not in GROUPS:
        raise ValueError(f"{hq} query heads over {hkv} KV heads: the kernel takes {GROUPS} a KV head")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, splits: int, out: torch.Tensor | None = None,
                     workspace: dict | None = None) -> torch.Tensor:
    """``out [B, Hq, 128]``: softmax(q kᵀ scale) v over each request's ``seq_lens[b]`` cached tokens. ``workspace``
    (:func:`workspace`, made before a CUDA-graph capture) holds the split partials and the zeroed counters."""
    check(q, k_cache, v_cache)
    out = torch.empty_like(q) if out is None else out
    ws = workspace or make_workspace(q.shape[0], q.shape[1], k_cache.shape[2], splits, q.device)
    extension().decode_attention(q, k_cache, v_cache, block_table, seq_lens, out, ws["o"], ws["ml"],
                                 ws["counters"], float(scale), int(splits))
    return out


def make_workspace(batch: int, q_heads: int, kv_heads: int, splits: int, device) -> dict:
    """The split partials (fp32) and the arrival counters (zero; every launch leaves them zero)."""
    n = max(1, batch * q_heads * splits)
    return {"o": torch.empty(n * HEAD_DIM, dtype=torch.float32, device=device),
            "ml": torch.empty(n * 2, dtype=torch.float32, device=device),
            "counters": torch.zeros(max(1, batch * kv_heads), dtype=torch.int32, device=device)}


def paged_cache(batch: int, q_heads: int, kv_heads: int, lens, block: int = 16, seed: int = 0, device="cpu"):
    """Random ``q``, K and V, block table and lengths (for the tests and the benchmark): the cache as vLLM 0.27.1's
    FlashAttention backend has it, ``[blocks, KV heads, block, 2 x 128]``, seen as strided K and V views
    ``[blocks, block, KV heads, 128]``; each request's blocks scattered through it."""
    g = torch.Generator().manual_seed(seed)
    per = max(1, -(-max(lens) // block))
    n_blocks = batch * per + 3
    kv = torch.randn(n_blocks, kv_heads, block, 2 * HEAD_DIM, generator=g).to(torch.bfloat16).to(device)
    k, v = kv.transpose(1, 2).split(HEAD_DIM, dim=-1)
    table = torch.randperm(n_blocks, generator=g)[: batch * per].view(batch, per).to(torch.int32).to(device)
    q = torch.randn(batch, q_heads, HEAD_DIM, generator=g).to(torch.bfloat16).to(device)
    return q, k, v, table, torch.tensor(list(lens), dtype=torch.int32, device=device)


def _tokens(k_cache, v_cache, block_table, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[n, Hkv, 128]`` of request ``b``'s first ``n`` cached tokens, through its block table."""
    bs = k_cache.shape[1]
    t = torch.arange(n)
    blocks = block_table[b, t // bs].long()
    return k_cache[blocks, t % bs].float(), v_cache[blocks, t % bs].float()


def reference(q, k_cache, v_cache, block_table, seq_lens, scale: float) -> torch.Tensor:
    """Plain attention in float32 (grouped heads), the result the kernel must give up to rounding."""
    b_n, hq, _ = q.shape
    g = hq // k_cache.shape[2]
    out = torch.zeros(b_n, hq, HEAD_DIM)
    for b in range(b_n):
        n = int(seq_lens[b])
        if n == 0:
            continue
        k, v = _tokens(k_cache, v_cache, block_table, b, n)
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [n, Hq, D]
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v)
    return out


def _merge(a: tuple, m2: torch.Tensor, l2: torch.Tensor, o2: torch.Tensor) -> tuple:
    """(m, l, o) of two partials merged (a partial with m = -inf weighs nothing), as merge_factors does."""
    m1, l1, o1 = a
    m = torch.maximum(m1, m2)
    f1 = torch.where(m1 == -math.inf, 0.0, torch.exp(m1 - m))
    f2 = torch.where(m2 == -math.inf, 0.0, torch.exp(m2 - m))
    return m, l1 * f1 + l2 * f2, o1 * f1[:, None] + o2 * f2[:, None]


def _warp(qh, k, v, scale: float, start: int, end: int, warps: int) -> tuple:
    """One warp's (m, l, o) over tokens ``start, start + warps * UNROLL, ...`` of its split ``[.., end)``: ``UNROLL``
    consecutive tokens at a time, one online-softmax update each time, as the kernel's loop does."""
    g = qh.shape[0]
    m, l, o = torch.full((g,), -math.inf), torch.zeros(g), torch.zeros(g, HEAD_DIM)
    for t in range(start, end, warps * UNROLL):
        ts = range(t, min(t + UNROLL, end))
        sc = torch.stack([(qh @ k[u]) * scale for u in ts], dim=1)  # [G, tokens]
        mn = torch.maximum(m, sc.max(dim=1).values)
        c, e = torch.exp(m - mn), torch.exp(sc - mn[:, None])
        m, l, o = mn, l * c + e.sum(dim=1), o * c[:, None] + e @ torch.stack([v[u] for u in ts])
    return m, l, o


def emulate(q, k_cache, v_cache, block_table, seq_lens, scale: float, splits: int) -> torch.Tensor:
    """The kernel's arithmetic on the CPU in float32: the splits a request's length uses (:func:`used_splits`), in
    each its warps' (:func:`warps_for`) ``UNROLL``-token steps, the warps merged in order, then the splits merged
    largest max first."""
    b_n, hq, _ = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    warps = warps_for(b_n)
    out = torch.zeros(b_n, hq, HEAD_DIM)
    empty = (torch.full((g,), -math.inf), torch.zeros(g), torch.zeros(g, HEAD_DIM))
    for b in range(b_n):
        n = int(seq_lens[b])
        k_all, v_all = _tokens(k_cache, v_cache, block_table, b, n)
        used, per = used_splits(n, splits)
        for h in range(hkv):
            qh = q[b, h * g:(h + 1) * g].float()  # [G, D]
            parts = []
            for s in range(used):
                t0, t1 = s * per, min(n, (s + 1) * per)
                cta = empty
                for w in range(warps):
                    cta = _merge(cta, *_warp(qh, k_all[:, h], v_all[:, h], scale, t0 + w * UNROLL, t1, warps))
                parts.append(cta)
            ms = torch.stack([p[0] for p in parts])  # [S, G]
            w = torch.where(ms == -math.inf, 0.0, torch.exp(ms - ms.max(dim=0).values))
            l = (w * torch.stack([p[1] for p in parts])).sum(dim=0)
            o = (w[:, :, None] * torch.stack([p[2] for p in parts])).sum(dim=0)
            out[b, h * g:(h + 1) * g] = torch.where(l[:, None] > 0, o / l.clamp_min(1e-30)[:, None], 0.0)
    return out
