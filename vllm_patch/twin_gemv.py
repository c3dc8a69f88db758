"""The twin's own W4A16 linear kernel for vLLM: ``TwinGemvLinearKernel`` (an ``MPLinearKernel``).

For the draft's compressed-tensors ``pack-quantized`` int4 layers
(``CompressedTensorsWNA16``: ``uint4`` with zero points, or symmetric
``uint4b8``), group-wise (group size a multiple of 32) or channel-wise,
bf16/fp16/fp32 activations, on CUDA with Triton. The math and the Triton
kernels are in ``twin_gemv_kernel`` (no vLLM import there, so the kernel
benchmark runs on a host without vLLM).

``process_weights_after_loading`` repacks the checkpoint's tensors once
(``twin_gemv_kernel.repack``); ``apply_weights`` calls the custom op
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


def _build_class():
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearKernel
    from vllm.model_executor.utils import replace_parameter
    from vllm.platforms import current_platform

    class TwinGemvLinearKernel(MPLinearKernel):
        """Split-K Triton W4A16 GEMV (M <= 2) / tensor-core GEMM (larger M; prefill too) for the int4 twin."""

        @classmethod
        def get_min_capability(cls) -> int:
            return MIN_CAPABILITY

        @classmethod
        def can_implement(cls, c) -> tuple[bool, str | None]:
            if not current_platform.is_cuda():
                return False, "TwinGemvLinearKernel needs CUDA"
            reason = unavailable_reason()
            if reason:
                return False, f"TwinGemvLinearKernel: {reason}"
            return check_config(c)

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            c = self.config
            w_q, w_s, w_zp, _ = self._get_weight_params(layer)
            k, n = c.partition_weight_shape
            if tuple(w_q.shape) != (n, k // 8):
                raise ValueError(f"{KERNEL_NAME}: packed weight {tuple(w_q.shape)} is not [out={n}, in/8={k // 8}]")
            qweight, scales, zeros, group_ints = _k.repack(
                w_q.data, w_s.data, w_zp.data if c.zero_points else None, c.group_size)
            replace_parameter(layer, self.w_q_name, qweight)
            replace_parameter(layer, self.w_s_name, scales)
            if zeros is not None:
                replace_parameter(layer, self.w_zp_name, zeros)
            self.group_ints = group_ints
            layer.twin_gemv_group_ints = group_ints
            if qweight.is_cuda:
                _k.counters(qweight.device)  # the fused split-K's counters exist before graph capture

        def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
            w_q, w_s, w_zp, _ = self._get_weight_params(layer)
            zeros = w_zp if self.config.zero_points else None
            return twin_linear(x, w_q, w_s, zeros, self.group_ints, bias)

    TwinGemvLinearKernel.__qualname__ = KERNEL_NAME
    return TwinGemvLinearKernel


_CLASS = None


def __getattr__(name: str):
    global _CLASS
    if name == KERNEL_NAME:
        if _CLASS is None:
            _CLASS = _build_class()
        return _CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
