"""The twin's MLP on the own CUDA kernel: gate_up GEMM and SiluAndMul in one kernel (issue 37).

A Qwen3(-VL) decoder layer's MLP runs ``gate_up_proj`` (one W4A16 GEMM over the merged gate and up rows),
vLLM's ``SiluAndMul`` (a kernel of its own, which reads the GEMM's ``[M, 2 I]`` output back) and
``down_proj``. Where the draft's ``gate_up_proj`` runs on ``own-cuda`` (``twin_cuda``), its row tiles are
paired once at load (gate tile ``i`` beside up tile ``i``, ``twin_cuda_layout.pair_tiles``) and the MLP's
forward calls the kernel with its ``silu(gate) * up`` epilogue: one launch and no ``[M, 2 I]`` round trip a
layer. The epilogue rounds gate and up to bf16 first, as the unfused GEMM's output is, so it computes what
``SiluAndMul`` computes from that output (to its last bit where both use the same ``exp``).

Under ``own-cuda+marlin`` (``twin_hybrid``) the own layout's tiles are paired and the fused epilogue runs up to
``twin_hybrid.SPLIT_M`` tokens; above, Marlin's gate_up and one activation kernel (``twin_cuda.silu_mul_halves``).

Only the draft is changed: the target verifies every drafted token, so the strict tier's output is the
target's whatever the draft's MLP rounds. Layers on another kernel, with a bias, another activation or
halves that are not whole row tiles keep vLLM's forward; the engine report counts both.
"""

from __future__ import annotations

import types

import torch

from . import twin_cuda, twin_hybrid
from . import twin_cuda_layout as layout

FUSABLE = (twin_cuda.KERNEL_NAME, *twin_hybrid.KERNEL_NAMES)  # own-cuda, and the hybrids (own up to SPLIT_M)


def _why_not(module) -> str | None:
    """Why a module with ``gate_up_proj``, ``down_proj`` and ``act_fn`` keeps vLLM's forward, or None."""
    gu = module.gate_up_proj
    kernel = getattr(getattr(gu, "scheme", None), "kernel", None)
    if type(kernel).__name__ not in FUSABLE:
        return f"gate_up_proj runs on {type(kernel).__name__ if kernel is not None else 'no W4A16 kernel'}"
    if type(module.act_fn).__name__ != "SiluAndMul":
        return f"activation {type(module.act_fn).__name__}, not SiluAndMul"
    if getattr(gu, "bias", None) is not None:
        return "gate_up_proj has a bias"
    sizes = list(getattr(gu, "output_partition_sizes", []))
    if len(sizes) != 2 or sizes[0] != sizes[1] or sizes[0] % layout.TILE:
        return f"gate and up partitions {sizes} are not two equal halves of whole {layout.TILE}-row tiles"
    return None


def _pair(gu):
    """The layer's repacked tensors with their row tiles paired (replaced in place, once); the MLP forward that
    reads them."""
    from vllm.model_executor.utils import replace_parameter

    kernel = gu.scheme.kernel
    if type(kernel).__name__ in twin_hybrid.KERNEL_NAMES:
        twin_hybrid.pair(gu)  # the own layout only: Marlin's (Machete's) path applies the activation to its output
        return _hybrid_forward
    paired = layout.pair_tiles(twin_cuda.layer_state(gu))
    replace_parameter(gu, kernel.w_q_name, paired["qw"])
    replace_parameter(gu, kernel.w_s_name, paired["sc"])
    if paired["zp"] is not None:
        replace_parameter(gu, kernel.w_zp_name, paired["zp"])
    gu.twin_cuda_pairs = True
    return _fused_forward


def _fused_forward(self, x: torch.Tensor) -> torch.Tensor:
    out, _ = self.down_proj(twin_cuda.gate_up_silu_mul(x, twin_cuda.layer_state(self.gate_up_proj)))
    return out


def _hybrid_forward(self, x: torch.Tensor) -> torch.Tensor:
    out, _ = self.down_proj(twin_hybrid.gate_up_silu_mul(x, self.gate_up_proj))
    return out


def fuse(model) -> dict:
    """Pair the gate_up tiles and fuse SiluAndMul into the GEMM of every MLP of ``model`` that can; the engine
    report's ``draft_mlp_fused`` (layers fused) and ``draft_mlp_unfused`` (why the others were not)."""
    fused, unfused = 0, {}
    for module in (model.modules() if model is not None else ()):
        if not all(hasattr(module, a) for a in ("gate_up_proj", "down_proj", "act_fn")):
            continue
        why = _why_not(module)
        if why is not None:
            unfused[why] = unfused.get(why, 0) + 1
            continue
        module.forward = types.MethodType(_pair(module.gate_up_proj), module)
        fused += 1
    return {"draft_mlp_fused": fused, "draft_mlp_unfused": unfused}
