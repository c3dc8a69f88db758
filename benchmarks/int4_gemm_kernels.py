"""The W4A16 GEMM benchmark's kernels (``benchmarks/int4_gemm.py``): what is timed, on which weights.

- the decoder GEMMs of a size (``gemm_shapes``) and the bytes a kernel must move for one (``int4_bytes``,
  ``bf16_bytes``: what the byte floor and the effective bandwidth are computed from);
- random ``pack-quantized`` int4 weights (``random_layer``) and their float32 dequantization, computed
  independently of every kernel's repacking (``dequant_reference``: what ``--check`` compares with);
- one ``Kernel`` per contender, each preparing its own layout from the checkpoint tensors and running
  ``y = x @ W^T``: cuBLAS on the dequantized bf16 weight, the project's Triton (``Ours``) and CUDA
  (``OwnCuda``) kernels, torch's tinygemm, GemLite, and vLLM's Machete / Marlin / Humming
  (``vllm_kernels``, ``gemlite_kernel``: the ones importable here, and why the others are not).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from vllm_patch import twin_gemv as tl4  # noqa: E402 (the repacking; importable without vLLM)
from vllm_patch import twin_gemv_kernel as tk  # noqa: E402
from workbench.shapes import SHAPES  # noqa: E402

GEMMS = ("qkv", "o", "gate_up", "down")
KERNEL_ORDER = ("cublas-bf16", "machete", "marlin", "humming", "tinygemm", "twin-gemv", "own-cuda", "gemlite")
CHECK_TOLERANCE = 2e-2  # max |y - ref| / max |ref|: bf16 output rounding is ~4e-3


def gemm_shapes(size: str) -> dict[str, tuple[int, int]]:
    """``{gemm: (N, K)}`` of one decoder layer (fused qkv and gate_up, as vLLM runs them)."""
    s = SHAPES[size]
    return {"qkv": (s.head_dim * (s.heads + 2 * s.kv_heads), s.hidden), "o": (s.hidden, s.heads * s.head_dim),
            "gate_up": (2 * s.intermediate, s.hidden), "down": (s.hidden, s.intermediate)}


def int4_bytes(n: int, k: int, m: int, group: int, zp: bool) -> int:
    groups = k // (k if group == -1 else group)
    return n * k // 2 + n * groups * 2 + (n // 8 * groups * 4 if zp else 0) + 2 * m * (n + k)


def bf16_bytes(n: int, k: int, m: int) -> int:
    return 2 * n * k + 2 * m * (n + k)


# ---------------------------------------------------------------- weights and reference

def random_layer(n, k, group, symmetric, device, gen):
    groups = 1 if group == -1 else k // group
    packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), device=device, dtype=torch.int32, generator=gen)
    scales = (torch.rand(n, groups, device=device, generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
    zeros = None if symmetric else torch.randint(-2**31, 2**31 - 1, (n // 8, groups), device=device,
                                                 dtype=torch.int32, generator=gen)
    return packed, scales, zeros


def dequant_reference(packed, scales, zeros, group, rows=8192):
    """float32 ``[N, K]`` from the checkpoint tensors, natural column order (independent of the repack)."""
    n, k8 = packed.shape
    g = 8 * k8 if group == -1 else group
    out = torch.empty((n, 8 * k8), device=packed.device, dtype=torch.float32)
    zall = None if zeros is None else tl4.unpack_int4_rows(zeros, n)
    for r in range(0, n, rows):
        q = tl4.unpack_int4_cols(packed[r:r + rows]).to(torch.float32)
        z = 8.0 if zall is None else zall[r:r + rows].to(torch.float32).repeat_interleave(g, dim=1)
        out[r:r + rows] = (q - z) * scales[r:r + rows].to(torch.float32).repeat_interleave(g, dim=1)
    return out


# ---------------------------------------------------------------- kernels

class Kernel:
    name = ""

    def prepare(self, packed, scales, zeros, group, dense_bf16):  # -> state
        raise NotImplementedError

    def run(self, state, x):
        raise NotImplementedError

    def bytes(self, n, k, m, group, zp):
        return int4_bytes(n, k, m, group, zp)


class Cublas(Kernel):
    name = "cublas-bf16"

    def prepare(self, packed, scales, zeros, group, dense_bf16):
        return dense_bf16

    def run(self, state, x):
        return torch.nn.functional.linear(x, state)

    def bytes(self, n, k, m, group, zp):
        return bf16_bytes(n, k, m)


class Ours(Kernel):
    name = "twin-gemv"

    def __init__(self, cfg=None, layout=None):  # layout None: repack's default for the flavour, as the plugin
        self.cfg, self.layout = cfg, layout
        if cfg is not None:
            self.name = f"twin-gemv[{cfg.tag}{',' + layout if layout else ''}]"

    def prepare(self, packed, scales, zeros, group, dense_bf16):
        tk.counters(packed.device)  # before any graph capture
        return tl4.repack(packed, scales, zeros, group, scale_layout=self.layout)

    @staticmethod
    def relayout(state, layout):
        """The same repacked weight with scales / zeros in the other memory order."""
        qw, s, z, gi = state
        if layout == "gn":
            return qw, s.contiguous(), None if z is None else z.contiguous(), gi
        return qw, s.t().contiguous().t(), None if z is None else z.t().contiguous().t(), gi

    def run(self, state, x):
        qw, s, z, gi = state
        return tk.w4a16_mm(x, qw, s, z, gi, cfg=self.cfg)


class OwnCuda(Kernel):
    """``vllm_patch.twin_cuda``: the CUDA C++ kernel on its own repacked layout (``twin_cuda_layout``)."""

    name = "own-cuda"

    def __init__(self, r=None, waves=None, deep=False, pipe=False, pdl=None, bulk=False, large=False):
        # pdl None: the launch twin_cuda.plan picks (programmatic dependent launch but for the staged kernel);
        # False: the plain launch, own-cuda[plain]; bulk: the TMA-fed kernel, own-cuda[bulk]; large: the large-M
        # path (dequantized slices and cuBLAS) at every M, own-cuda[dequant-mm] (the default takes it above LARGE_M)
        self.r, self.waves, self.deep, self.pipe, self.pdl, self.bulk = r, waves, deep, pipe, pdl, bulk
        self.large = large
        if large:
            self.name = "own-cuda[dequant-mm]"
        elif self._variant:
            self.name = "own-cuda[" + "-".join(
                ([f"r{r}"] if r is not None else []) + ([f"w{waves:g}"] if waves is not None else [])
                + (["deep"] if deep else []) + (["pipe"] if pipe else []) + (["bulk"] if bulk else [])
                + (["plain"] if pdl is False else [])
                + (["pdl"] if pdl is True else [])) + "]"

    @property
    def _variant(self) -> bool:
        return self.r is not None or self.deep or self.pipe or self.pdl is not None or self.bulk

    def prepare(self, packed, scales, zeros, group, dense_bf16):
        from vllm_patch import twin_cuda, twin_cuda_layout

        twin_cuda.counters(packed.device)  # before any graph capture
        twin_cuda.extension()  # built once (minutes), outside the timed region
        st = twin_cuda_layout.repack(packed, scales, zeros, group)
        if self._variant:
            n, k = st["n"], st["k"]
            sms = twin_cuda.sm_count(packed.device)
            st["plans"] = {m: twin_cuda.plan(n, k, m, group, sms, r=self.r, waves=self.waves, deep=self.deep,
                                             pipe=self.pipe, pdl=self.pdl, bulk=self.bulk) for m in range(1, 17)}
        return st

    def run(self, state, x):
        from vllm_patch import twin_cuda

        if self.large:
            return twin_cuda.mm_large(x, state)
        p = state.get("plans", {}).get(x.shape[0])
        return twin_cuda.w4a16_mm(x, state, p)


class Tinygemm(Kernel):
    name = "tinygemm"

    def prepare(self, packed, scales, zeros, group, dense_bf16):
        if group == -1:
            raise ValueError("channel-wise scales")
        n, k8 = packed.shape
        q = tl4.unpack_int4_cols(packed)
        w_uint8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        w = torch._convert_weight_to_int4pack(w_uint8, 8)
        z = 8.0 if zeros is None else tl4.unpack_int4_rows(zeros, n).to(torch.float32)
        s = scales.to(torch.float32)
        sz = torch.stack([s, (8.0 - z) * s], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        return w, sz, group

    def run(self, state, x):
        w, sz, group = state
        return torch._weight_int4pack_mm(x, w, group, sz)


class Gemlite(Kernel):
    """GemLite's ``GemLiteLinear`` (Triton), bf16 activations and output, on the checkpoint's int4 values,
    scales and zero points (symmetric ``uint4b8``: the integer shift 8)."""

    name = "gemlite"

    def prepare(self, packed, scales, zeros, group, dense_bf16):
        from gemlite import DType, GemLiteLinear

        if group == -1:
            raise ValueError("channel-wise scales")
        n, k8 = packed.shape
        q = tl4.unpack_int4_cols(packed).to(torch.uint8)  # [N, K], natural column order
        z = 8 if zeros is None else tl4.unpack_int4_rows(zeros, n).to(torch.bfloat16)  # [N, K / group]
        lin = GemLiteLinear(4, group_size=group, in_features=8 * k8, out_features=n, input_dtype=DType.BF16,
                            output_dtype=DType.BF16)
        lin.pack(q, scales.to(torch.bfloat16), z, None)
        return lin

    def run(self, state, x):
        return state(x)


def gemlite_kernel() -> tuple[list[Kernel], dict[str, str]]:
    try:
        import gemlite  # noqa: F401
    except Exception as e:  # noqa: BLE001 - not installed, or no CUDA build of triton
        return [], {"gemlite": f"gemlite not importable ({type(e).__name__}: {e})"}
    return [Gemlite()], {}


class VllmKernel(Kernel):
    """One of vLLM's MPLinearKernel classes on a layer laid out as CompressedTensorsWNA16 creates it."""

    def __init__(self, name, cls):
        self.name, self.cls = name, cls

    def prepare(self, packed, scales, zeros, group, dense_bf16):
        from vllm.model_executor import parameter as P
        from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig
        from vllm.scalar_type import scalar_types

        n, k8 = packed.shape
        k = 8 * k8
        c = MPLinearLayerConfig((k, n), (k, n), scalar_types.uint4b8 if zeros is None else scalar_types.uint4,
                                torch.bfloat16, group, zeros is not None, False)
        ok, reason = self.cls.can_implement(c)
        if not ok:
            raise ValueError(reason)
        noop = lambda *a, **kw: None  # noqa: E731
        layer = torch.nn.Module()
        # what a LinearBase carries and Humming's layer conversion reads (Marlin and Machete ignore it)
        layer.input_size = layer.input_size_per_partition = k
        layer.output_size = layer.output_size_per_partition = n
        layer.output_partition_sizes = [n]
        layer.params_dtype = torch.bfloat16
        layer.has_bias = False
        layer.register_parameter("weight_packed", P.PackedvLLMParameter(
            data=packed.clone(), input_dim=1, output_dim=0, packed_dim=1, packed_factor=8, weight_loader=noop))
        scale_cls = P.ChannelQuantScaleParameter if group == -1 else P.GroupQuantScaleParameter
        kw = dict(output_dim=0) if group == -1 else dict(output_dim=0, input_dim=1)
        layer.register_parameter("weight_scale", scale_cls(data=scales.clone(), weight_loader=noop, **kw))
        if zeros is not None:
            layer.register_parameter("weight_zero_point", P.PackedvLLMParameter(
                data=zeros.clone(), input_dim=1, output_dim=0, packed_dim=0, packed_factor=8, weight_loader=noop))
        kernel = self.cls(c, "weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx")
        kernel.process_weights_after_loading(layer)
        return kernel, layer

    def run(self, state, x):
        kernel, layer = state
        return kernel.apply_weights(layer, x)


def vllm_kernels() -> tuple[list[Kernel], dict[str, str]]:
    skipped = {}
    try:
        from vllm.model_executor import parameter as P

        # one rank without vLLM's distributed state (the parameters ask for their TP rank)
        P.get_tensor_model_parallel_rank = lambda: 0
        P.get_tensor_model_parallel_world_size = lambda: 1
    except Exception as e:  # noqa: BLE001 - any import failure means: no vLLM kernels
        why = f"vLLM not importable ({type(e).__name__}: {e})"
        return [], {"machete": why, "marlin": why, "humming": why}
    out = []
    for name, mod, cls in (("machete", "machete", "MacheteLinearKernel"), ("marlin", "marlin", "MarlinLinearKernel"),
                           ("humming", "humming", "HummingLinearKernel")):
        try:
            module = __import__(f"vllm.model_executor.kernels.linear.mixed_precision.{mod}", fromlist=[cls])
            out.append(VllmKernel(name, getattr(module, cls)))
        except Exception as e:  # noqa: BLE001
            skipped[name] = f"{type(e).__name__}: {e}"
    return out, skipped

