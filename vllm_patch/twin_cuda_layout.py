"""The CUDA W4A16 decode kernel's weight layout (``csrc/twin_w4a16.cuh``): repack and CPU emulation.

Pure torch, no CUDA, no vLLM. ``repack`` turns compressed-tensors ``pack-quantized`` tensors
(``weight_packed [N, K/8]`` int32 with nibble ``i`` = column ``8c + i``; ``weight_scale [N, K/G]``;
``weight_zero_point [N/8, K/G]`` int32 packed along the output dimension, or none for ``uint4b8``)
into the layout the kernel reads:

- ``qw [T, C, 32, 4]`` int32, ``T = ceil(N/16)`` row tiles, ``C = K/64`` chunks: lane ``l``
  (``g = l // 4``, ``t = l % 4``) of step ``i`` (``sb = i // 2``, ``ii = i % 2``) covers
  ``k0 = 64 c + 32 sb + 8 t + 4 ii``; nibble ``j = p + 4 h`` holds
  ``W[16 tile + g + 8 (p & 1), k0 + 2 (p >> 1) + h]``. A warp's 16-byte loads of one
  ``(tile, chunk)`` are 512 contiguous bytes, and a tile is contiguous along K.
- ``sc [T, K/G, 8]`` int32: the bf16 scales of rows ``g`` (low half) and ``g + 8`` (high half).
- ``zp [T, K/G, 8]`` uint8: ``z[g] | z[g + 8] << 4`` (``None`` for ``uint4b8``, zero point 8).

Rows past N are padded with zero weights and zero scales. ``kernel_weight`` reconstructs W from
these tensors with the kernel's own index math (``emulate_mm`` the product, accumulated per group as
the kernel does: ``P = sum (128 + q) x - (128 + z) x`` for one token tile, ``sum (q - z) x`` for two,
``acc += s P``), so a layout or math bug shows on a CPU.
"""

from __future__ import annotations

import torch

CHUNK = 64  # input columns per chunk: one 16-byte load per lane and row tile
TILE = 16  # output rows per tile (the MMA's M)
TOKEN_TILE = 8  # tokens per token tile (the MMA's N): above one tile the kernel subtracts z before the MMA
GROUPS = (32, 64, 128)


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` int32, nibble i = column 8c+i -> ``[R, 8C]`` uint8 values 0..15."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    return ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1).to(torch.uint8)


def unpack_rows(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """``[R/8, C]`` int32 packed along dim 0 (compressed-tensors zero points) -> ``[rows, C]`` uint8."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    q = (packed.to(torch.int32).unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF
    return q.reshape(-1, packed.shape[1])[:rows].to(torch.uint8)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``[..., 8]`` values 0..15 -> ``[...]`` int32, element j at bits 4j (two's complement)."""
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    v = (q.to(torch.int64) << shifts).sum(-1)
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def check_shape(n: int, k: int, group: int) -> None:
    if group not in GROUPS:
        raise ValueError(f"group size {group} is not one of {GROUPS}")
    if k % CHUNK or k % group:
        raise ValueError(f"input size {k} is not a multiple of {CHUNK} and of the group size {group}")
    if n <= 0:
        raise ValueError(f"output size {n}")


def repack_qweight(q: torch.Tensor, tiles_per_step: int = 256) -> torch.Tensor:
    """``[N, K]`` uint8 values (natural order) -> ``qw [T, C, 32, 4]`` int32 (rows padded with zeros)."""
    n, k = q.shape
    t_all, c = -(-n // TILE), k // CHUNK
    out = torch.empty((t_all, c, 32, 4), dtype=torch.int32, device=q.device)
    for t0 in range(0, t_all, tiles_per_step):
        t1 = min(t_all, t0 + tiles_per_step)
        part = q[t0 * TILE:t1 * TILE]
        if part.shape[0] < (t1 - t0) * TILE:
            part = torch.cat([part, part.new_zeros((t1 - t0) * TILE - part.shape[0], k)])
        # row = 16 tile + 8 rh + g; k = 64 c + 32 sb + 8 t + 4 ii + 2 kh + h
        v = part.reshape(t1 - t0, 2, 8, c, 2, 4, 2, 2, 2)  # [T, rh, g, C, sb, t, ii, kh, h]
        # -> [T, C, g, t, sb, ii, h, kh, rh]: lane = 4 g + t, step = 2 sb + ii, nibble j = rh + 2 kh + 4 h
        v = v.permute(0, 3, 2, 5, 4, 6, 8, 7, 1)
        out[t0:t1] = pack_nibbles(v.reshape(t1 - t0, c, 32, 4, 8))
    return out


def repack_meta(scales: torch.Tensor, zeros: torch.Tensor | None):
    """``scales [N, G]`` (any float dtype, stored as bf16) and ``zeros [N, G]`` uint8 values (or None)
    -> ``sc [T, G, 8]`` int32 bf16 pairs (rows g, g + 8) and ``zp [T, G, 8]`` uint8 (or None)."""
    n, ng = scales.shape
    t_all = -(-n // TILE)
    s = scales.to(torch.bfloat16)
    if t_all * TILE != n:
        s = torch.cat([s, s.new_zeros(t_all * TILE - n, ng)])
    s = s.reshape(t_all, 2, 8, ng).permute(0, 3, 2, 1).contiguous()  # [T, G, g, rh]
    sc = s.view(torch.int16).to(torch.int32) & 0xFFFF
    sc = (sc[..., 0] | (sc[..., 1] << 16)).to(torch.int64)
    sc = torch.where(sc >= 2**31, sc - 2**32, sc).to(torch.int32)
    zp = None
    if zeros is not None:
        z = zeros.to(torch.uint8)
        if t_all * TILE != n:
            z = torch.cat([z, z.new_zeros(t_all * TILE - n, ng)])
        z = z.reshape(t_all, 2, 8, ng).permute(0, 3, 2, 1).to(torch.int32)
        zp = (z[..., 0] | (z[..., 1] << 4)).to(torch.uint8).contiguous()
    return sc.contiguous(), zp


def repack(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: torch.Tensor | None,
           group: int) -> dict:
    """compressed-tensors tensors -> the kernel's ``{"qw", "sc", "zp", "n", "k", "group"}``."""
    n, k8 = weight_packed.shape
    k = 8 * k8
    check_shape(n, k, group)
    if tuple(weight_scale.shape) != (n, k // group):
        raise ValueError(f"scales {tuple(weight_scale.shape)} do not match ({n}, {k // group})")
    zeros = None if weight_zero_point is None else unpack_rows(weight_zero_point, n)
    if zeros is not None and tuple(zeros.shape) != (n, k // group):
        raise ValueError(f"zero points unpack to {tuple(zeros.shape)}, expected ({n}, {k // group})")
    qw = repack_qweight(unpack_cols(weight_packed))
    sc, zp = repack_meta(weight_scale, zeros)
    return {"qw": qw, "sc": sc, "zp": zp, "n": n, "k": k, "group": group}


def pair_tiles(st: dict) -> dict:
    """A merged gate_up layout (gate rows ``[0, N/2)``, up rows ``[N/2, N)``, N/2 a multiple of 16) with its row
    tiles paired: gate tile ``i`` at ``2 i``, up tile ``i`` at ``2 i + 1``, so that the kernel's silu(gate) * up
    epilogue finds both in one warp (``"pairs": True``; the kernel's output then has N/2 columns)."""
    n, t_all = st["n"], st["qw"].shape[0]
    if n % (2 * TILE) or st.get("pairs"):
        raise ValueError(f"gate_up of {n} rows: each half must be whole row tiles of {TILE} (and paired once)")
    order = torch.arange(t_all, device=st["qw"].device).view(2, t_all // 2).t().reshape(-1)
    out = dict(st, qw=st["qw"][order].contiguous(), sc=st["sc"][order].contiguous(), pairs=True)
    out["zp"] = None if st["zp"] is None else st["zp"][order].contiguous()
    return out


def silu_mul(y: torch.Tensor) -> torch.Tensor:
    """``[M, N]`` output of a paired layout (tiles gate, up, gate, up, ...) -> ``[M, N/2]``
    ``silu(gate) * up`` as the kernel's epilogue computes it: both rounded to bf16, the product in fp32, bf16."""
    m, n = y.shape
    pairs = y.to(torch.bfloat16).float().view(m, n // (2 * TILE), 2, TILE)
    gate, up = pairs[:, :, 0], pairs[:, :, 1]
    return (gate / (1.0 + torch.exp(-gate)) * up).reshape(m, n // 2).to(torch.bfloat16)


def silu_mul_halves(y: torch.Tensor) -> torch.Tensor:
    """``[M, N]`` merged gate_up output (gate columns, then up) -> ``[M, N/2]`` ``silu(gate) * up``, the same
    math as :func:`silu_mul` (``twin_cuda.silu_mul_halves`` on the GPU)."""
    h = y.to(torch.bfloat16).float()
    gate, up = h[:, : h.shape[1] // 2], h[:, h.shape[1] // 2:]
    return (gate / (1.0 + torch.exp(-gate)) * up).to(torch.bfloat16)


# ---------------------------------------------------------------- emulation of the kernel's reads

def _kernel_index(t_all: int, c: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For every ``qw`` nibble ``[T, C, lane, i, j]``: the (row, k) the kernel multiplies it with."""
    tile = torch.arange(t_all, device=device).view(-1, 1, 1, 1, 1)
    ch = torch.arange(c, device=device).view(1, -1, 1, 1, 1)
    lane = torch.arange(32, device=device).view(1, 1, -1, 1, 1)
    i = torch.arange(4, device=device).view(1, 1, 1, -1, 1)
    j = torch.arange(8, device=device).view(1, 1, 1, 1, -1)
    g, t, sb, ii, p, h = lane // 4, lane % 4, i // 2, i % 2, j % 4, j // 4
    k0 = CHUNK * ch + 32 * sb + 8 * t + 4 * ii
    row = TILE * tile + g + 8 * (p & 1)
    return row.expand(t_all, c, 32, 4, 8), (k0 + 2 * (p >> 1) + h).expand(t_all, c, 32, 4, 8)


def kernel_nibbles(st: dict) -> torch.Tensor:
    """``[N, K]`` uint8: where the kernel finds each weight (its index math, not repack's permutation)."""
    qw, n, k = st["qw"], st["n"], st["k"]
    t_all, c = qw.shape[0], qw.shape[1]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qw.device)
    nib = (qw.unsqueeze(-1) >> shifts) & 0xF  # [T, C, 32, 4, 8]: nibble j at bits 4j
    row, col = _kernel_index(t_all, c, qw.device)
    out = torch.full((t_all * TILE, k), -1, dtype=torch.int32, device=qw.device)
    out[row.reshape(-1), col.reshape(-1)] = nib.reshape(-1)
    if (out < 0).any():
        raise AssertionError("the kernel's index math leaves weights unread")
    return out[:n].to(torch.uint8)


def kernel_meta(st: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``scales [N, G]`` and ``128 + z [N, G]`` as the kernel decodes them (lane g: rows g, g + 8)."""
    sc, zp, n = st["sc"], st["zp"], st["n"]
    t_all, ng = sc.shape[0], sc.shape[1]
    words = sc.to(torch.int64) & 0xFFFFFFFF
    lo = ((words & 0xFFFF) << 16).to(torch.int32).view(torch.float32)  # bits of row g's scale
    hi = (words & 0xFFFF0000).to(torch.int32).view(torch.float32)  # row g + 8
    s = torch.stack([lo, hi], dim=1)  # [T, rh, G, g]
    if zp is None:
        zc = torch.full_like(s, 136.0)
    else:
        z = zp.to(torch.int32)
        zc = torch.stack([z & 15, z >> 4], dim=1).to(torch.float32) + 128.0
    s = s.permute(0, 1, 3, 2).reshape(t_all * TILE, ng)[:n]  # row = 16 tile + 8 rh + g
    zc = zc.permute(0, 1, 3, 2).reshape(t_all * TILE, ng)[:n]
    return s, zc


def kernel_weight(st: dict) -> torch.Tensor:
    """fp32 ``[N, K]`` weight the kernel computes with: ``s * ((128 + q) - (128 + z))`` per group."""
    q = kernel_nibbles(st).to(torch.float32) + 128.0
    s, zc = kernel_meta(st)
    g = st["group"]
    return (q - zc.repeat_interleave(g, dim=1)) * s.repeat_interleave(g, dim=1)


def emulate_mm(x: torch.Tensor, st: dict) -> torch.Tensor:
    """``x [M, K]`` -> fp32 ``[M, N]`` accumulated as the kernel does: per group, with one token tile
    (M <= 8) P = sum (128 + q) x + sum -(128 + z) x (both MMAs into one fp32 accumulator), with two
    P = sum (q - z) x (the zero point subtracted in bf16 first, exact), then acc += s * P."""
    q = kernel_nibbles(st).to(torch.float32) + 128.0
    s, zc = kernel_meta(st)
    n, k, g = st["n"], st["k"], st["group"]
    xf = x.to(torch.bfloat16).to(torch.float32)
    acc = torch.zeros((x.shape[0], n), dtype=torch.float32, device=x.device)
    for gi in range(k // g):
        xs = xf[:, gi * g:(gi + 1) * g]
        qg, zg = q[:, gi * g:(gi + 1) * g], zc[:, gi].unsqueeze(1)
        if x.shape[0] > TOKEN_TILE:
            p = xs @ (qg - zg).t()
        else:
            p = -zg.t() * xs.sum(dim=1, keepdim=True) + xs @ qg.t()
        acc += s[:, gi].unsqueeze(0) * p
    return acc
