"""The twin's own W4A16 linear kernel for vLLM: ``TwinGemvLinearKernel`` (an ``MPLinearKernel``).

For the draft's compressed-tensors ``pack-quantized`` int4 layers
(``CompressedTensorsWNA16``: ``uint4`` with zero points, or symmetric
``uint4b8``), group-wise (group size a multiple of 32) or channel-wise,
bf16/fp16/fp32 activations, on CUDA with Triton. The math and the Triton
kernels are in ``twin_gemv_kernel`` (no vLLM import there, so the kernel
benchmark runs on a host without vLLM).

``process_weights_after_loading`` repacks the checkpoint's tensors once
(``repack``, here; the layout is described in ``twin_gemv_kernel``); ``apply_weights`` calls the custom op
``torch.ops.twin_spec.w4a16_mm`` (opaque to ``torch.compile``, safe under CUDA
graphs: every buffer comes from the caching allocator, the launch
configuration depends only on the shapes).

Refused by ``can_implement`` (vLLM then tries its next kernel): act-order
(``g_idx``), other bit widths or scalar types, a group size that is not a
multiple of 32 dividing the partition's input size, an input size not a
multiple of 32, an output size not a multiple of 8, no CUDA or no Triton.

The class is built on first access (``from vllm_patch.twin_gemv import
TwinGemvLinearKernel``), so importing this module needs neither vLLM nor CUDA.
"""

from __future__ import annotations

import torch

from . import twin_gemv_kernel as _k
from .mp_kernel import build, lazy_class

KERNEL_NAME = "TwinGemvLinearKernel"
OP_NAMESPACE = "twin_spec"
OP_NAME = "w4a16_mm"
MIN_CAPABILITY = 80  # tf32 tensor-core MMA, cp.async-era loads


def unavailable_reason() -> str | None:
    """Why this process cannot run the kernel, or ``None`` when it can."""
    if not _k.HAVE_TRITON:
        return "triton is not importable"
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if 10 * major + minor < MIN_CAPABILITY:
        return f"compute capability {major}.{minor} < {MIN_CAPABILITY / 10:.1f}"
    return None


def is_available() -> bool:
    """True where ``TwinGemvLinearKernel`` can run (CUDA GPU of SM 8.0+ and Triton)."""
    return unavailable_reason() is None


# ---------------------------------------------------------------- repacking (torch)

def unpack_int4_cols(packed: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` int32 with 8 nibbles each (nibble i = column 8c+i) -> ``[R, 8C]`` uint8 values."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    q = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF
    return q.reshape(packed.shape[0], -1).to(torch.uint8)


def unpack_int4_rows(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """``[R/8, C]`` int32 packed along dim 0 (compressed-tensors zero points) -> ``[rows, C]`` uint8."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    q = (packed.to(torch.int32).unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF
    return q.reshape(-1, packed.shape[1])[:rows].to(torch.uint8)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``[..., 8]`` values 0..15 -> ``[...]`` int32, element j at bits 4j (two's complement wrap)."""
    q = q.to(torch.int64)
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    v = (q << shifts).sum(-1)
    v = torch.where(v >= 2**31, v - 2**32, v)
    return v.to(torch.int32)


def repack_qweight(packed: torch.Tensor, chunk_rows: int = 4096) -> torch.Tensor:
    """compressed-tensors ``[N, K/8]`` int32 (nibble i = column 8c+i) -> this kernel's ``[N, K/8]``."""
    n, k8 = packed.shape
    if (8 * k8) % _k.BLOCK_K:
        raise ValueError(f"input size {8 * k8} is not a multiple of {_k.BLOCK_K}")
    out = torch.empty_like(packed, dtype=torch.int32)
    for r0 in range(0, n, chunk_rows):
        q = unpack_int4_cols(packed[r0:r0 + chunk_rows])  # [R, K]
        r = q.shape[0]
        # k = 32 b + 4 j + l  ->  [R, b, j, l]  ->  int (b, l) holds nibbles j
        q = q.view(r, -1, 8, 4).permute(0, 1, 3, 2)
        out[r0:r0 + r] = _pack_nibbles(q).reshape(r, k8)
    return out


def unrepack_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse view of ``repack_qweight``: ``[N, K]`` uint8 values in natural column order."""
    n, k8 = qweight.shape
    q = unpack_int4_cols(qweight).view(n, k8 // 4, 4, 8)  # [n, b, l, j]
    return q.permute(0, 1, 3, 2).reshape(n, 8 * k8)


def default_scale_layout(zero_points: bool) -> str:
    """``repack``'s memory order of scales / zeros when none is named: ``ng`` with zero points, ``gn`` for
    symmetric weights (see ``repack``)."""
    return "ng" if zero_points else "gn"


def repack(weight_packed, weight_scale, weight_zero_point, group_size: int, scale_layout: str | None = None):
    """compressed-tensors tensors -> ``(qweight, scales [G, N], zeros [G, N] uint8 or None, group_ints)``.

    ``scale_layout`` is the memory order of scales and zeros: ``ng`` (one
    output's groups contiguous, as in the checkpoint: the scale pointers then
    have no contiguous dimension, so Triton gives their loads the weight tile's
    register layout) or ``gn`` (one group's outputs contiguous); the tensors
    are ``[G, N]``-shaped either way (the kernel reads the strides). ``None``
    picks by flavour, as measured on the H200 (32B layer set): ``ng`` with zero
    points, ``gn`` for symmetric weights, whose ``mma`` tiles (M = 2-16) run
    1.6-2.5x faster in ``gn`` and whose M = 1 tiles are no slower
    (results/int4-gemm/20261203T172039Z-h200).
    """
    n, k8 = weight_packed.shape
    k = 8 * k8
    g = k if group_size in (-1, None) else int(group_size)
    if g % _k.BLOCK_K or k % g:
        raise ValueError(f"group size {group_size} with input size {k}: needs a multiple of "
                         f"{_k.BLOCK_K} that divides the input size")
    n_groups = k // g
    if weight_scale.shape != (n, n_groups):
        raise ValueError(f"scales {tuple(weight_scale.shape)} do not match ({n}, {n_groups})")
    if scale_layout is None:
        scale_layout = default_scale_layout(weight_zero_point is not None)
    if scale_layout not in ("ng", "gn"):
        raise ValueError(f"scale_layout {scale_layout!r} is not 'gn' or 'ng'")
    qweight = repack_qweight(weight_packed)
    scales = weight_scale.contiguous()  # [N, G]
    zeros = None
    if weight_zero_point is not None:
        zeros = unpack_int4_rows(weight_zero_point, n)
        if zeros.shape != (n, n_groups):
            raise ValueError(f"zero points unpack to {tuple(zeros.shape)}, expected ({n}, {n_groups})")
    scales = scales.t() if scale_layout == "ng" else scales.t().contiguous()
    if zeros is not None:
        zeros = zeros.t() if scale_layout == "ng" else zeros.t().contiguous()
    return qweight, scales, zeros, g // 8


def dequant_repacked(qweight, scales, zeros, group_ints: int) -> torch.Tensor:
    """fp32 ``[N, K]`` weight from the repacked tensors (torch; the kernel's math)."""
    q = unrepack_qweight(qweight).to(torch.float32)
    group_of_col = torch.arange(q.shape[1], device=q.device) // (8 * group_ints)
    z = 8.0 if zeros is None else zeros.t().to(torch.float32)[:, group_of_col]
    return (q - z) * scales.t().to(torch.float32)[:, group_of_col]


# ---------------------------------------------------------------- custom op

def _w4a16_mm_impl(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   zeros: torch.Tensor | None, group_ints: int) -> torch.Tensor:
    return _k.w4a16_mm(x, qweight, scales, zeros, group_ints)


def _register_op():
    qualname = f"{OP_NAMESPACE}::{OP_NAME}"
    if hasattr(torch.ops, OP_NAMESPACE) and hasattr(getattr(torch.ops, OP_NAMESPACE), OP_NAME):
        return getattr(getattr(torch.ops, OP_NAMESPACE), OP_NAME)
    op = torch.library.custom_op(
        qualname, mutates_args=(),
        schema="(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, int group_ints) -> Tensor",
    )(_w4a16_mm_impl)

    @op.register_fake
    def _(x, qweight, scales, zeros, group_ints):
        return x.new_empty((x.shape[0], qweight.shape[0]))

    return op


w4a16_mm_op = _register_op()


def twin_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                group_ints: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] -> [..., N]`` through the custom op (any leading shape)."""
    x2 = x.reshape(-1, x.shape[-1])
    y = w4a16_mm_op(x2, qweight, scales, zeros, group_ints)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], qweight.shape[0])


# ---------------------------------------------------------------- the vLLM kernel class

def check_config(c) -> tuple[bool, str | None]:
    """``can_implement``'s shape/type rules, without the device checks (testable anywhere)."""
    from vllm.scalar_type import scalar_types

    if c.weight_type not in (scalar_types.uint4, scalar_types.uint4b8):
        return False, f"weight type {c.weight_type} is not uint4 (zero points) or uint4b8"
    if (c.weight_type == scalar_types.uint4) != bool(c.zero_points):
        return False, f"weight type {c.weight_type} with zero_points={c.zero_points} is not supported"
    if c.has_g_idx:
        return False, "act-order (g_idx) is not supported"
    if c.act_type not in (torch.bfloat16, torch.float16, torch.float32):
        return False, f"activation dtype {c.act_type} is not bf16/fp16/fp32"
    if c.out_type is not None and c.out_type != c.act_type:
        return False, f"output dtype {c.out_type} differs from the activation dtype {c.act_type}"
    k, n = c.partition_weight_shape
    if k % _k.BLOCK_K:
        return False, f"input size per partition {k} is not a multiple of {_k.BLOCK_K}"
    if n % 8:
        return False, f"output size per partition {n} is not a multiple of 8"
    g = c.group_size
    if g != -1 and (g <= 0 or g % _k.BLOCK_K or k % g):
        return False, f"group size {g} is not a multiple of {_k.BLOCK_K} dividing the input size {k}"
    if g == -1 and c.full_weight_shape[0] != k:
        return False, "channel-wise scales with a partitioned input dimension"
    return True, None


def _load(kernel, layer, w_q, w_s, w_zp, replace_parameter) -> None:
    qweight, scales, zeros, group_ints = repack(w_q.data, w_s.data, None if w_zp is None else w_zp.data,
                                                kernel.config.group_size)
    replace_parameter(layer, kernel.w_q_name, qweight)
    replace_parameter(layer, kernel.w_s_name, scales)
    if zeros is not None:
        replace_parameter(layer, kernel.w_zp_name, zeros)
    kernel.group_ints = group_ints
    layer.twin_gemv_group_ints = group_ints
    if qweight.is_cuda:
        _k.counters(qweight.device)  # the fused split-K's counters exist before graph capture


def _apply(kernel, layer, x, bias):
    w_q, w_s, w_zp, _ = kernel._get_weight_params(layer)
    zeros = w_zp if kernel.config.zero_points else None
    return twin_linear(x, w_q, w_s, zeros, kernel.group_ints, bias)


def _build_class():
    """Split-K Triton W4A16 GEMV (M <= 2) / tensor-core GEMM (larger M; prefill too) for the int4 twin."""
    return build(KERNEL_NAME, MIN_CAPABILITY, unavailable_reason, check_config, _load, _apply)


__getattr__ = lazy_class(__name__, KERNEL_NAME, _build_class)  # the class is built on first access
