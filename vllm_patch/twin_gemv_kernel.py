"""Triton W4A16 GEMV/GEMM for the int4 twin at decode batch sizes (no vLLM import).

``y = x @ dequant(W)^T`` for compressed-tensors ``pack-quantized`` int4 weights
(``uint4`` with group-wise zero points, or symmetric ``uint4b8``), group size
32/64/128/... or channel-wise, bf16/fp16/fp32 activations, fp32 accumulation.

Layout, repacked once at load time (``twin_gemv.repack``):

- ``qweight`` ``[N, K/8]`` int32, row ``n`` contiguous along K. Packed int ``c``
  belongs to block ``b = c // 4`` of 32 input columns; its nibble ``j`` (bits
  ``4j..4j+3``) holds column ``k = 32 b + 4 j + c % 4``. A 16-byte load (four
  ints) is one whole block, inside one quantization group; the activation
  values that nibble ``j`` of four consecutive ints multiply are four
  consecutive elements of ``x``.
- ``scales`` ``[K/G, N]`` (activation dtype) and ``zeros`` ``[K/G, N]`` uint8
  (absent for symmetric weights: zero point 8), by default transposed views of
  ``[N, K/G]`` memory (``repack``'s ``scale_layout``).

Dequantization avoids integer-to-float conversions (a quarter-rate
instruction on Hopper): a nibble masked in place and OR-ed into the bits of
``2^23`` is the float ``2^23 + q * 16^i`` (i = its position in a 16-bit half);
subtracting ``2^23`` gives ``q * 16^i`` exactly, and the ``16^-i`` is folded
into the activation (a power of two, exact). The zero point is applied per
packed int: ``sum_j x_j (q_j - z) = sum_j x_j q_j - z sum_j x_j``.

Two kernels:

- ``gemv`` (M <= 4, rows unrolled so every tensor keeps the weight tile's
  register layout): CUDA-core FMAs into an fp32 tile per CTA, split-K;
- ``mma`` (any M, tiles of 16..128 rows): the dequantized tile ``(q - z) * s``
  (exact in fp32) rounded once to the activation dtype, times ``x`` on the
  tensor cores with fp32 accumulation: what a matmul with the dequantized
  checkpoint computes (``Config.lowp=False``: fp32 operands as tf32 instead,
  ``(q - z) * s`` kept to tf32's 11 significant bits).

Split-K partial sums go to an fp32 workspace; a second small kernel adds them
and casts to the output dtype, or (``Config.fused``, gemv) the last CTA of
each output tile does, counted by an arrival counter it resets. Both add in a
fixed order: deterministic. ``choose_config``: measured ``TUNED`` entries,
else gemv for M <= 2 (M = 1: one-group tiles, fused split-K, PTX nibbles)
and mma above; ``sweep_configs``: what ``benchmarks/int4_gemm.py`` times.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
    MAGIC = tl.constexpr(0x4B000000)  # bits of the float 2**23
except ImportError:  # pragma: no cover - triton ships with torch's CUDA wheels
    HAVE_TRITON = False

BLOCK_K = 32  # input columns per repack block (4 packed ints); the repacking is in twin_gemv.py


# ---------------------------------------------------------------- configs

@dataclass(frozen=True)
class Config:
    kind: str  # "gemv" | "mma"
    bm: int
    bn: int
    bkp: int  # packed ints along K per iteration (8 * bkp input columns)
    warps: int = 4
    stages: int = 2
    lowp: bool = True  # mma: operands in the activation dtype (else fp32 / tf32)
    fused: bool = False  # gemv split-K: the last CTA of a tile adds the partials (no second kernel)
    asm: bool = False  # gemv: nibbles to floats by inline PTX (NIBBLES_ASM); compiled kernels only
    split: int = 0  # split-K factor; 0 = from the CTA target
    waves: int = 8  # CTAs per SM to aim for when split == 0

    @property
    def tag(self) -> str:
        s = f"s{self.split}" if self.split else f"w{self.waves}"
        tf32 = "-tf32" if self.kind == "mma" and not self.lowp else ""
        fused = "-fused" if self.kind == "gemv" and self.fused else ""
        asm = "-asm" if self.kind == "gemv" and self.asm else ""
        return f"{self.kind}-m{self.bm}-n{self.bn}-k{8 * self.bkp}-{s}-nw{self.warps}-st{self.stages}{tf32}{fused}{asm}"


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _pow2_at_least(v: int) -> int:
    return 1 << max(0, (int(v) - 1).bit_length())


# Measured overrides, (N, K/8, M bucket) -> Config, in the form a benchmarks/int4_gemm.py README lists them.
# 32B gate_up, M = 1: 69.8 us vs 84.1 for the heuristic (H200, triton 3.7.1; results/int4-gemm/20261201T230754Z-h200)
TUNED: dict[tuple[int, int, int], Config] = {
    (51200, 640, 1): Config("gemv", bm=1, bn=32, bkp=64, warps=4, stages=2, waves=8, asm=True)}


def m_bucket(m: int) -> int:
    return _pow2_at_least(m) if m <= 16 else 0


def choose_config(n: int, k8: int, m: int) -> Config:
    """Tile table keyed by (N, K, M): ``TUNED`` first, else the heuristic; split-K in ``resolve_split``."""
    tuned = TUNED.get((n, k8, m_bucket(m)))
    if tuned is not None:
        return tuned
    bkp_cap = max(16, _pow2_at_least(k8))
    if m == 1:
        # one-group tiles, fused split-K, PTX nibbles: fastest at 7 of the 8 32B / 8B shapes, 1.2-2.8x the old
        # n32-k512 tile (results/int4-gemm/20261201T230754Z-h200, results/int4-gemm/20261201T231011Z-h200)
        return Config("gemv", bm=1, bn=128, bkp=min(16, bkp_cap), warps=4, waves=4, fused=True, asm=True)
    if m <= 2:
        return Config("gemv", bm=_pow2_at_least(m), bn=32, bkp=min(64, bkp_cap), waves=8)
    if m <= 16:
        return Config("mma", bm=16, bn=64, bkp=min(32, bkp_cap), waves=4)
    bm = min(128, _pow2_at_least(m))
    return Config("mma", bm=bm, bn=64, bkp=min(32, bkp_cap), warps=4 if bm <= 64 else 8, waves=2)


def sweep_configs(m: int, k8: int) -> list[Config]:
    """Small list of alternatives the benchmark measures beside the heuristic's choice."""
    bkp_cap = max(16, _pow2_at_least(k8))
    out = []
    if m <= 4:
        bm = _pow2_at_least(m)
        for bn, bkp, waves, warps, stages, split in (
                (32, 64, 8, 4, 2, 0), (16, 64, 8, 4, 2, 0), (64, 32, 8, 4, 2, 0), (32, 128, 4, 4, 2, 0),
                (32, 32, 16, 4, 2, 0), (64, 64, 4, 8, 2, 0), (32, 64, 8, 4, 1, 0), (32, 64, 8, 4, 3, 0),
                (8, 64, 0, 1, 2, 1), (16, 64, 0, 2, 2, 1)):  # the last two: no split-K, no reduce kernel
            out.append(Config("gemv", bm=bm, bn=bn if bm < 4 else max(8, bn // 2), bkp=min(bkp, bkp_cap),
                              warps=warps, stages=stages, split=split, waves=waves or 8))
        for bn, bkp, waves in ((32, 64, 8), (16, 64, 8)):  # split-K reduced by the last CTA
            out.append(Config("gemv", bm=bm, bn=bn if bm < 4 else max(8, bn // 2), bkp=min(bkp, bkp_cap),
                              waves=waves, fused=True))
        # tiles inside one quantization group (bkp divides the group's packed ints, e.g. 16 for group 128):
        # one scale and zero-point load per row and tile instead of one per packed int
        for bn, bkp, waves, warps, fused in ((64, 16, 4, 4, False), (128, 16, 4, 4, False), (128, 16, 2, 8, False),
                                             (256, 16, 2, 8, False), (128, 8, 4, 4, False), (64, 16, 4, 4, True),
                                             (128, 16, 4, 4, True), (256, 8, 2, 8, True)):
            for asm in (False, True):  # Triton's nibble code, and NIBBLES_ASM (one lop3 a nibble instead of two)
                out.append(Config("gemv", bm=bm, bn=bn if bm < 4 else bn // 2, bkp=min(bkp, bkp_cap), warps=warps,
                                  waves=waves, fused=fused, asm=asm))
        out.append(Config("gemv", bm=bm, bn=32 if bm < 4 else 16, bkp=min(64, bkp_cap), waves=8, asm=True))
    if m <= 16:
        for bn, bkp, waves, warps, lowp in ((64, 32, 4, 4, True), (64, 64, 4, 4, True), (32, 32, 8, 4, True),
                                            (128, 32, 2, 4, True), (64, 32, 4, 4, False), (64, 64, 4, 4, False)):
            out.append(Config("mma", bm=16, bn=bn, bkp=min(bkp, bkp_cap), waves=waves, warps=warps, lowp=lowp))
    return list(dict.fromkeys(out))


def resolve_split(cfg: Config, n: int, k8: int, m: int, sms: int) -> tuple[int, int]:
    """``(split, iters)``: split-K factor so that about ``waves * sms`` CTAs run, and iterations per CTA."""
    k_tiles = -(-k8 // cfg.bkp)
    ctas = -(-n // cfg.bn) * -(-m // cfg.bm)
    split = cfg.split or max(1, -(-cfg.waves * sms // ctas))
    split = min(split, k_tiles)
    iters = -(-k_tiles // split)
    return -(-k_tiles // iters), iters


# PTX of Config.asm: the eight nibbles of one packed int as the floats q * 16^(j % 4) (exact), each by one
# lop3 ((w & mask) | 2^23's bits; Triton's own code needs two logic ops there, its two constants being
# immediates) and one subtraction of 2^23; nibbles 4-7 from the int shifted right by 16.
_NIBBLES_PTX = "{\n.reg .b32 hi, t;\nshr.u32 hi, $8, 16;\n" + "".join(
    f"lop3.b32 t, {'hi' if j >= 4 else '$8'}, {15 << (4 * (j % 4)):#010x}, 0x4b000000, 0xea;\n"
    f"sub.f32 ${j}, t, 0f4B000000;\n" for j in range(8)) + "}"
if HAVE_TRITON:
    NIBBLES_ASM = tl.constexpr(_NIBBLES_PTX)

# ---------------------------------------------------------------- kernels

if HAVE_TRITON:

    @triton.jit
    def _gemv_row(x_row, row_ok, f, kb, j: tl.constexpr, c_ok, t, xsum):
        """One activation row's share of nibble j: ``t += q * x``, ``xsum += x`` (x scaled by 16^-(j%4))."""
        xv = tl.load(x_row + kb + 4 * j, mask=c_ok & row_ok, other=0.0).to(tl.float32)
        return t + f * (xv * (1.0 / (1 << (4 * (j % 4)))))[None, :], xsum + xv

    @triton.jit
    def _w4_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K8, stride_xm, stride_om, stride_split,
                        iters, stride_sg, stride_sn, fin_ptr, cnt_ptr, split, GROUP_INTS: tl.constexpr,
                        HAS_Z: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BKP: tl.constexpr,
                        FUSED: tl.constexpr, ASM: tl.constexpr = False):
        # Rows of x are unrolled (BM in 1, 2, 4), so every tensor keeps the weight tile's 2-D layout.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        c0 = pid_k * iters * BKP
        acc0 = tl.zeros((BN, BKP), dtype=tl.float32)
        acc1 = tl.zeros((BN, BKP), dtype=tl.float32)
        acc2 = tl.zeros((BN, BKP), dtype=tl.float32)
        acc3 = tl.zeros((BN, BKP), dtype=tl.float32)
        for it in range(iters):
            cols = c0 + it * BKP + tl.arange(0, BKP)
            c_ok = cols < K8
            wmask = n_ok[:, None] & c_ok[None, :]
            w = tl.load(qw_ptr + offs_n[:, None] * K8 + cols[None, :], mask=wmask, other=0)
            if GROUP_INTS % BKP == 0:  # the tile lies in one group: one scale (zero point) per row
                cb = c0 + it * BKP
                g1 = (cb // GROUP_INTS) * stride_sg + offs_n * stride_sn
                ok1 = n_ok & (cb < K8)
                sc = tl.load(s_ptr + g1, mask=ok1, other=0.0).to(tl.float32)[:, None]
                if HAS_Z:
                    zp = tl.load(z_ptr + g1, mask=ok1, other=0).to(tl.float32)[:, None]
                else:
                    zp = tl.full((BN, 1), 8.0, dtype=tl.float32)
            else:
                gn = (cols // GROUP_INTS)[None, :] * stride_sg + offs_n[:, None] * stride_sn
                sc = tl.load(s_ptr + gn, mask=wmask, other=0.0).to(tl.float32)
                if HAS_Z:
                    zp = tl.load(z_ptr + gn, mask=wmask, other=0).to(tl.float32)
                else:
                    zp = tl.full((BN, BKP), 8.0, dtype=tl.float32)
            kb = (cols // 4) * 32 + (cols % 4)
            hi = w >> 16
            t0 = tl.zeros((BN, BKP), dtype=tl.float32)
            t1 = tl.zeros((BN, BKP), dtype=tl.float32)
            t2 = tl.zeros((BN, BKP), dtype=tl.float32)
            t3 = tl.zeros((BN, BKP), dtype=tl.float32)
            s0 = tl.zeros((BKP,), dtype=tl.float32)
            s1 = tl.zeros((BKP,), dtype=tl.float32)
            s2 = tl.zeros((BKP,), dtype=tl.float32)
            s3 = tl.zeros((BKP,), dtype=tl.float32)
            if ASM:  # all eight at once: one lop3 (and | or) and one subtraction per nibble
                fs = tl.inline_asm_elementwise(asm=NIBBLES_ASM, constraints="=f,=f,=f,=f,=f,=f,=f,=f,r", args=[w],
                                               dtype=(tl.float32,) * 8, is_pure=True, pack=1)
            for j in tl.static_range(8):
                if ASM:
                    f = fs[j]
                else:
                    if j < 4:
                        src = w
                    else:
                        src = hi
                    # nibble masked in place: the float 2^23 + q * 16^(j%4), minus 2^23
                    f = ((src & (15 << (4 * (j % 4)))) | MAGIC).to(tl.float32, bitcast=True) - 8388608.0
                t0, s0 = _gemv_row(x_ptr, M > 0, f, kb, j, c_ok, t0, s0)
                if BM > 1:
                    t1, s1 = _gemv_row(x_ptr + stride_xm, M > 1, f, kb, j, c_ok, t1, s1)
                if BM > 2:
                    t2, s2 = _gemv_row(x_ptr + 2 * stride_xm, M > 2, f, kb, j, c_ok, t2, s2)
                    t3, s3 = _gemv_row(x_ptr + 3 * stride_xm, M > 3, f, kb, j, c_ok, t3, s3)
            acc0 += (t0 - zp * s0[None, :]) * sc
            if BM > 1:
                acc1 += (t1 - zp * s1[None, :]) * sc
            if BM > 2:
                acc2 += (t2 - zp * s2[None, :]) * sc
                acc3 += (t3 - zp * s3[None, :]) * sc
        out = out_ptr + pid_k * stride_split + offs_n
        tl.store(out, tl.sum(acc0, axis=1).to(out_ptr.dtype.element_ty), mask=n_ok)
        if BM > 1:
            tl.store(out + stride_om, tl.sum(acc1, axis=1).to(out_ptr.dtype.element_ty), mask=n_ok & (M > 1))
        if BM > 2:
            tl.store(out + 2 * stride_om, tl.sum(acc2, axis=1).to(out_ptr.dtype.element_ty), mask=n_ok & (M > 2))
            tl.store(out + 3 * stride_om, tl.sum(acc3, axis=1).to(out_ptr.dtype.element_ty), mask=n_ok & (M > 3))
        if FUSED:  # out_ptr holds fp32 partials; the tile's last CTA to arrive sums them into fin_ptr
            tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == split - 1:
                for r in tl.static_range(BM):
                    tot = tl.zeros((BN,), dtype=tl.float32)
                    for sp in range(split):  # fixed order: deterministic
                        tot += tl.load(out_ptr + sp * stride_split + r * stride_om + offs_n, mask=n_ok & (M > r),
                                       other=0.0, cache_modifier=".cg")
                    tl.store(fin_ptr + r * stride_om + offs_n, tot.to(fin_ptr.dtype.element_ty), mask=n_ok & (M > r))
                tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next call (and graph replay)

    @triton.jit
    def _w4_mma_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K8, stride_xm, stride_om, stride_split,
                       iters, stride_sg, stride_sn, GROUP_INTS: tl.constexpr, HAS_Z: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BKP: tl.constexpr, LOWP: tl.constexpr,
                       PREC: tl.constexpr, EMULATE: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        offs_m = pid_m * BM + tl.arange(0, BM)
        m_ok = offs_m < M
        c0 = pid_k * iters * BKP
        acc = tl.zeros((BN, BM), dtype=tl.float32)  # y^T tile: weights are the left operand
        for it in range(iters):
            cols = c0 + it * BKP + tl.arange(0, BKP)
            c_ok = cols < K8
            wmask = n_ok[:, None] & c_ok[None, :]
            w = tl.load(qw_ptr + offs_n[:, None] * K8 + cols[None, :], mask=wmask, other=0)
            gn = (cols // GROUP_INTS)[None, :] * stride_sg + offs_n[:, None] * stride_sn
            sc = tl.load(s_ptr + gn, mask=wmask, other=0.0).to(tl.float32)
            if HAS_Z:
                zc = tl.load(z_ptr + gn, mask=wmask, other=0).to(tl.float32) + 8388608.0
            else:
                zc = tl.full((BN, BKP), 8388616.0, dtype=tl.float32)  # 2^23 + 8
            kb = (cols // 4) * 32 + (cols % 4)
            for j in tl.static_range(8):
                f = (((w >> (4 * j)) & 15) | MAGIC).to(tl.float32, bitcast=True)  # 2^23 + q
                wd = (f - zc) * sc
                xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + (kb + 4 * j)[:, None],
                             mask=c_ok[:, None] & m_ok[None, :], other=0.0)
                if LOWP and EMULATE:  # Triton's interpreter: the same products in fp32 (its bf16 dot is broken)
                    acc += tl.dot(wd.to(x_ptr.dtype.element_ty).to(tl.float32), xt.to(tl.float32),
                                  input_precision="ieee")
                elif LOWP:  # the dequantized weight rounded once to x's dtype, as a dequantized checkpoint
                    acc += tl.dot(wd.to(x_ptr.dtype.element_ty), xt)
                else:
                    acc += tl.dot(wd, xt.to(tl.float32), input_precision=PREC)
        ptrs = out_ptr + pid_k * stride_split + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])

    @triton.jit
    def _split_reduce_kernel(ws_ptr, out_ptr, total, split, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < total
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(split):
            acc += tl.load(ws_ptr + s * total + offs, mask=ok, other=0.0)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
COUNTER_SLOTS = 1 << 16


def counters(device: torch.device, tiles: int = 0) -> torch.Tensor:
    """Arrival counters of the fused split-K reduction, one zeroed buffer per device.

    Every call leaves them zero again, and calls on one stream run one after
    another, so all layers share it. Create it before CUDA-graph capture
    (``TwinGemvLinearKernel.process_weights_after_loading`` does).
    """
    if tiles > COUNTER_SLOTS:
        raise ValueError(f"{tiles} output tiles > {COUNTER_SLOTS} counters")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def w4a16_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
             group_ints: int, cfg: Config | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [M, K] @ dequant(W)^T -> [M, N]`` with the tensors of ``twin_gemv.repack``."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not importable")
    if x.dim() != 2:
        raise ValueError("x must be 2-D [M, K]")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n, k8 = qweight.shape
    if k != 8 * k8:
        raise ValueError(f"x has {k} columns, weights {8 * k8}")
    out_dtype = out_dtype or x.dtype
    out = torch.empty((m, n), device=x.device, dtype=out_dtype)
    if m == 0:
        return out
    cfg = cfg or choose_config(n, k8, m)
    if cfg.kind == "gemv" and m > cfg.bm:
        cfg = choose_config(n, k8, m) if m > 4 else replace(cfg, bm=_pow2_at_least(m))
    split, iters = resolve_split(cfg, n, k8, m, sm_count(x.device))
    dest = out if split == 1 else torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    has_z = zeros is not None
    zarg = zeros if has_z else scales  # never read without HAS_Z
    grid_m = 1 if cfg.kind == "gemv" else -(-m // cfg.bm)
    grid = (-(-n // cfg.bn), split, grid_m)
    if scales.shape != (k8 // group_ints, n) or (has_z and zeros.stride() != scales.stride()):
        raise ValueError("scales (and zeros) must be [K / group, N] with one layout")
    common = (x, qweight, scales, zarg, dest, m, n, k8, x.stride(0), n, m * n, iters, scales.stride(0),
              scales.stride(1))
    fused = cfg.kind == "gemv" and cfg.fused and split > 1
    if cfg.kind == "gemv":
        cnt = counters(x.device, grid[0]) if fused else qweight
        interpreted = type(_w4_gemv_kernel).__name__ == "InterpretedFunction"  # no inline PTX there
        _w4_gemv_kernel[grid](*common, out, cnt, split, GROUP_INTS=group_ints, HAS_Z=has_z, BM=cfg.bm, BN=cfg.bn,
                              BKP=cfg.bkp, FUSED=fused, ASM=cfg.asm and not interpreted, num_warps=cfg.warps,
                              num_stages=cfg.stages)
    else:
        prec = "ieee" if x.dtype == torch.float32 else "tf32"
        _w4_mma_kernel[grid](*common, GROUP_INTS=group_ints, HAS_Z=has_z, BM=cfg.bm, BN=cfg.bn, BKP=cfg.bkp,
                             LOWP=cfg.lowp and x.dtype != torch.float32, PREC=prec,
                             EMULATE=type(_w4_mma_kernel).__name__ == "InterpretedFunction",
                             num_warps=cfg.warps, num_stages=cfg.stages)
    if split > 1 and not fused:
        total = m * n
        _split_reduce_kernel[(-(-total // 1024),)](dest, out, total, split, BLOCK=1024, num_warps=4)
    return out
