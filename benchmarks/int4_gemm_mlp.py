"""The W4A16 GEMM benchmark's MLP scope (``benchmarks/int4_gemm.py``): gate_up, SiluAndMul and down in sequence,
per kernel, beside ``own-cuda[fused-mlp]``, whose gate_up GEMM writes ``silu(gate) * up`` itself (the paired
layout of ``vllm_patch.twin_cuda_layout.pair_tiles``, what ``vllm_patch.draft_mlp`` runs in the engine).

The unfused activation is one Triton kernel, as vLLM runs it (its ``SiluAndMul`` op, or Inductor's fusion of
the native one): bf16 gate and up in, the product in fp32, bf16 out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(h_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < inter
    g = tl.load(h_ptr + row * 2 * inter + cols, mask=keep).to(tl.float32)
    u = tl.load(h_ptr + row * 2 * inter + inter + cols, mask=keep).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (g / (1.0 + tl.exp(-g)) * u).to(tl.bfloat16, fp_downcast_rounding="rtne"),
             mask=keep)


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """``[M, 2 I]`` (gate first) -> ``[M, I]`` bf16, one launch."""
    m, inter = h.shape[0], h.shape[1] // 2
    out = torch.empty((m, inter), dtype=torch.bfloat16, device=h.device)
    _silu_mul_kernel[(m, triton.cdiv(inter, 1024))](h, out, inter, BLOCK=1024)
    return out


FUSED = "own-cuda[fused-mlp]"


def mlp_timers(m, xs, active, states, timer, log) -> dict:
    """``{kernel name: Timer}`` of gate_up -> SiluAndMul -> down at batch ``m`` for each kernel holding both
    GEMMs' weights (its default plan), and of own-cuda's fused gate_up -> down on paired copies."""
    from vllm_patch import twin_cuda_layout

    runs = {}
    for kn in active.values():
        if "[" in kn.name or not (states["gate_up"].get(kn.name) and states["down"].get(kn.name)):
            continue
        runs[kn.name] = (kn, states["gate_up"][kn.name], lambda kn, st, x: silu_mul(kn.run(st, x)))
        if kn.name == "own-cuda":
            paired = [twin_cuda_layout.pair_tiles(st) for st in states["gate_up"][kn.name]]
            runs[FUSED] = (kn, paired, lambda kn, st, x: kn.run(st, x))
    timers = {}
    for name, (kn, gate_up, first) in runs.items():
        down = states["down"][kn.name]
        n = min(len(gate_up), len(down))
        fns = [(lambda gu=gate_up[i % n], dn=down[i % n], kn=kn, first=first: kn.run(dn, first(kn, gu, xs[m]["gate_up"])))
               for i in range(max(8, n))]
        try:
            timers[name] = timer(fns)
        except Exception as e:  # noqa: BLE001
            log(f"  mlp M={m}: {name} failed ({type(e).__name__}: {str(e)[:160]})")
    return timers
