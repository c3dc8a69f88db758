"""The twin's CUDA C++ W4A16 decode GEMM (``csrc/twin_w4a16*.cu*``): build, launch plan, custom op, vLLM class.

``draft_linear_kernel=own-cuda`` (``TwinCudaLinearKernel``) while it is measured against the Triton
kernel of ``twin_gemv`` (``own``); issue 37 keeps one own kernel in the end, the faster one.

The kernel: ``y [M, N] = x [M, K] @ dequant(W)^T`` for compressed-tensors ``pack-quantized`` int4
(``uint4`` with zero points, or symmetric ``uint4b8``), groups 32 / 64 / 128, bf16 activations and
output, fp32 accumulation, any M (tiles of 8 or 16 tokens), on the tensor cores (``mma.sync``
m16n8k16; SM 8.0+, built for ``sm_90a`` on Hopper). Each warp streams R row tiles of 16 along its K
range with 16-byte loads, several chunks in flight; with one token tile (zero points) the CTA first stages
its rows of x over its K range in shared memory; split-K where N is small, the last CTA of a row
block adding the partials in split order (deterministic). The layout, the repack and a CPU
emulation of the kernel's index math are in ``twin_cuda_layout``.

Built at first use with ``torch.utils.cpp_extension.load`` (cached under torch's extensions folder,
``~/.cache/torch_extensions``), with the host's ``nvcc``. Importing this module needs neither CUDA,
nvcc nor vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import custom_ops
from . import twin_cuda_layout as layout
from . import twin_gemv_kernel as _gemv_kernel
from .cuda_ext import CSRC, extension_name, load_extension, toolchain_reason  # noqa: F401 (re-exported)
from .mp_kernel import build, lazy_class

SOURCES = ("twin_w4a16_torch.cpp", "twin_w4a16_zp.cu", "twin_w4a16_zp_deep.cu", "twin_w4a16_sym.cu",
           "twin_w4a16_sym_deep.cu", "twin_w4a16_pipe.cu", "twin_w4a16_bulk.cu", "twin_w4a16_dequant.cu")
WARPS = 4  # kWarps of twin_w4a16_api.h
KERNEL_NAME = "TwinCudaLinearKernel"
OP_NAMESPACE = "twin_spec"
OP_NAME = "w4a16_cuda_mm"
MIN_CAPABILITY = 80  # mma.sync m16n8k16 bf16
# (R, NT, group / 32, zero points, deep scale ring): every instance the extension has (TWIN_W4_FOR_EACH)
INSTANCES = tuple((r, nt, gs, z, d) for z in (False, True) for gs in (1, 2, 4) for d in (False, True)
                  for nt in (1, 2) for r in (1, 2, 4))
# (R, NT, group / 32, zero points): the staged kernel's instances (TWIN_W4_PIPE_FOR_EACH, twin_w4a16_pipe.cuh)
PIPE_INSTANCES = tuple((r, nt, gs, z) for z in (False, True) for gs in (1, 2, 4) for nt in (1, 2) for r in (1, 2))
# (R, NT, group / 32, zero points): the TMA-fed kernel's instances (TWIN_W4_BULK_FOR_EACH, twin_w4a16_bulk.cuh)
BULK_INSTANCES = tuple((r, nt, gs, z) for z in (False, True) for gs in (1, 2, 4) for nt in (1, 2) for r in (1, 2, 4))
X_STAGE_BYTES = 96 * 1024  # the default kernel's staged x rows of a split (x_stage_bytes of twin_w4a16.cuh), at most
BULK_META_BYTES = 8 * 1024  # kBulkMetaBytes of twin_w4a16_bulk.cuh: a warp's scales and zero points (48 B a group)
# Above this many tokens w4a16_mm takes the large-M path (slices of the weight dequantized to bf16, then cuBLAS):
# the decode kernel reads every weight once per 16 tokens, so a prefill of thousands of tokens would read the
# twin's weights hundreds of times (and its split-K counters would not cover the blocks)
LARGE_M = 64
# A paired gate_up layout takes the silu(gate) * up epilogue up to this many tokens: above, two token tiles want
# one row tile a warp where the pairing needs two (H100, 8B MLP at M = 16: 77.8 fused against 62.4 µs unfused,
# results/int4-gemm/20261206T141629Z-h100), so the GEMM runs unfused and one kernel applies the activation
FUSED_MAX_M = 8
DEQUANT_SLICE_BYTES = 64 << 20  # the bf16 buffer of one slice of rows, at most


# ---------------------------------------------------------------- launch plan

@dataclass(frozen=True)
class Plan:
    r: int  # row tiles of 16 per warp
    nt: int  # token tiles of 8 per CTA (1: M <= 8)
    ring: int  # chunks of 64 K per warp's load ring
    cps: int  # chunks per split
    splits: int
    grid: tuple[int, int, int]
    deep: bool = False  # scales and zero points loaded as far ahead as the weight ring (else one span)
    pipe: bool = False  # the staged kernel (cp.async into shared memory, twin_w4a16_pipe.cuh), r 1 or 2
    pdl: bool = False  # launched as a programmatic dependent (SM 9.0+): weights stream in while the kernel before ends
    bulk: bool = False  # the TMA-fed kernel (bulk copies into a shared-memory ring, twin_w4a16_bulk.cuh), SM 9.0+

    @property
    def tag(self) -> str:
        return (f"r{self.r}-nt{self.nt}-s{self.splits}" + ("-deep" if self.deep else "") + ("-pipe" if self.pipe else "")
                + ("-bulk" if self.bulk else "") + ("-pdl" if self.pdl else ""))


def ring_depth(r: int) -> int:
    """``ring_depth`` of twin_w4a16.cuh."""
    return 8 if r == 1 else 4


def plan(n: int, k: int, m: int, group: int, sms: int = 132, r: int | None = None,
         waves: float | None = None, deep: bool = False, pipe: bool = False, pdl: bool | None = None,
         bulk: bool = False, pairs: bool = False) -> Plan:
    """About ``waves * sms`` CTAs of 4 warps (launch bounds guarantee 2 resident per SM). ``waves`` None: 3
    (measured: the configuration sweep of ``benchmarks/int4_gemm.py --cuda-sweep`` on an H100, zero-point
    twin, 32B layer set: 3 waves take M = 1 from 147.7 to 133.6 µs and M = 4 from 155.0 to 138.8, every GEMM
    faster). ``r`` None: with one token tile (M <= 8) 2 row tiles a warp where the row blocks fit the wave, else
    4 (the 32B gate_up: 400 CTAs of 2 would leave a tail); with two (M > 8) the fewest row tiles whose row
    blocks fit the wave, 1, 2 or 4 (H100, x staged, 32B at M = 16: 1 row tile and 3 waves take qkv from 29.8 to
    26.8 µs, o from 31.3 to 21.5, down from 58.8 to 56.6 against 2 tiles and 2 waves; gate_up stays at 4 tiles,
    72.4 either way; results/int4-gemm/20261206T113453Z-h100). Split-K
    fills the wave where N is small; splits start on a group and a ring. ``deep``: the kernel instance whose
    scales' ring is as deep as the weights' (H100, 32B layer set: 2 % slower than the default, so not the
    default). ``pipe``: the staged kernel, its loads in shared memory (r at most 2; H100: 10 % slower at M = 1,
    42 % at M = 16; docs/benchmarks.md). ``pdl``: launched as a programmatic dependent of the kernel before it
    (the weight ring and scales load before the kernel waits for x); None: on, except for the staged kernel
    (H100, the layer set against the plain launch: 32B 129.3 -> 122.4 µs at M = 1, 134.5 -> 128.3 at 4,
    209.2 -> 204.4 at 16, either flavour; 8B 59.4 -> 53.2 at M = 1; bit for bit the same output). ``bulk``: the
    TMA-fed kernel (its weights, x and the split's scales by bulk copies into shared memory; SM 9.0+), without
    the deep scale ring or the staged kernel (H100, 32B layer set at M = 1: 129-183 µs across its plans against
    the default's 124 in the same run; docs/benchmarks.md). With one token tile the default kernel stages the CTA's x
    rows over its split in shared memory (zero points), at most ``X_STAGE_BYTES``: splits are capped to that."""
    if pdl is None:
        pdl = not pipe
    if pairs and r is not None and r % 2:
        raise ValueError(f"a paired gate_up layout (silu(gate) * up epilogue) takes r 2 or 4, not r={r}")
    nt = 1 if m <= 8 else 2
    if waves is None:
        waves = 3.0
    c = k // layout.CHUNK
    t = -(-n // layout.TILE)
    token_blocks = -(-m // (8 * nt))
    if r is None:
        fits = [rr for rr in ((1, 2) if nt == 2 and not pairs else (2,))
                if -(-t // (WARPS * rr)) * token_blocks <= waves * sms]
        r = 2 if pipe else fits[0] if fits else 4
    if pipe and (r > 2 or deep or pdl):
        raise ValueError("the staged kernel (pipe) takes r 1 or 2 without the deep scale ring and without "
                         f"programmatic dependent launch, not r={r}, deep={deep}, pdl={pdl}")
    if bulk and (deep or pipe):
        raise ValueError(f"the TMA-fed kernel (bulk) has neither the deep scale ring nor staging: deep={deep}, pipe={pipe}")
    ring = ring_depth(r)
    row_blocks = -(-t // (WARPS * r))
    want = max(1, int(waves * sms // (row_blocks * token_blocks)))
    cps = -(-c // want)
    cps = -(-cps // ring) * ring  # a multiple of the ring (and so of group 128's two chunks)
    # one token tile: the CTA stages its x rows over the split in shared memory, at most X_STAGE_BYTES (every
    # kernel's plan keeps to it, so that a plan stays valid for the default kernel with another flag turned off)
    if nt == 1:
        cps = min(cps, max(ring, (X_STAGE_BYTES // min(m, 8) // 16 - 1) // 8 // ring * ring))
    if bulk:  # the TMA-fed kernel holds a split's scales and zero points in shared memory: at most 8 KB a warp
        cps = min(cps, max(ring, BULK_META_BYTES // (r * 48) * group // layout.CHUNK // ring * ring))
    if cps >= c:
        cps = c
    splits = -(-c // cps)
    return Plan(r=r, nt=nt, ring=ring, cps=cps, splits=splits, grid=(row_blocks, splits, token_blocks), deep=deep,
                pipe=pipe, pdl=pdl, bulk=bulk)


def sweep_plans(n: int, k: int, m: int, group: int, sms: int = 132) -> list[Plan]:
    """Alternatives the benchmark times beside ``plan``'s default."""
    out = [plan(n, k, m, group, sms, r=r, waves=w) for r in (1, 2, 4) for w in (1.0, 2.0, 3.0, 6.0)]
    out += [plan(n, k, m, group, sms, deep=True), plan(n, k, m, group, sms, r=2, deep=True)]
    out += [plan(n, k, m, group, sms, r=r, pipe=True) for r in (1, 2)]
    out += [plan(n, k, m, group, sms, pdl=False)]  # the plain launch
    out += [plan(n, k, m, group, sms, r=r, waves=w, bulk=True) for r in (None, 1, 2, 4) for w in (None, 1.5, 6.0)]
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------- build and launch

_EXT = None


def unavailable_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if 10 * major + minor < MIN_CAPABILITY:
        return f"compute capability {major}.{minor} < {MIN_CAPABILITY / 10:.1f}"
    return toolchain_reason()


def extension():
    """The GEMM's compiled extension (built once, then loaded from torch's extension cache)."""
    global _EXT
    _EXT = _EXT if _EXT is not None else load_extension("twin_w4a16", SOURCES)
    return _EXT


# the split-K arrival counters: the Triton kernel's buffer (one zeroed int32 buffer a device, every call of
# either kernel leaves it zero, calls on one stream run one after another), made before CUDA-graph capture
COUNTER_SLOTS = _gemv_kernel.COUNTER_SLOTS
counters = _gemv_kernel.counters


_SMS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def w4a16_mm(x: torch.Tensor, st: dict, p: Plan | None = None) -> torch.Tensor:
    """``x [M, K]`` bf16 -> ``[M, N]`` bf16 with the tensors of ``twin_cuda_layout.repack`` (on the GPU)."""
    if x.dim() != 2 or x.shape[1] != st["k"]:
        raise ValueError(f"x {tuple(x.shape)} is not [M, {st['k']}]")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x is {x.dtype}; the kernel takes bf16")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    m, n, pairs = x.shape[0], st["n"], bool(st.get("pairs"))
    if m > LARGE_M and p is None:
        return mm_large(x, st)
    if pairs and p is None and m > FUSED_MAX_M:  # the GEMM's own best plan, then the activation (one launch)
        return silu_mul_pairs(w4a16_mm(x, dict(st, pairs=False)))
    y = torch.empty((m, n // 2 if pairs else n), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return y
    p = p or plan(n, st["k"], m, st["group"], sm_count(x.device), pairs=pairs)
    if p.nt != (1 if m <= 8 else 2):
        p = plan(n, st["k"], m, st["group"], sm_count(x.device), r=p.r, deep=p.deep, pipe=p.pipe, pdl=p.pdl,
                 bulk=p.bulk, pairs=pairs)
    if p.grid[0] * p.grid[2] > COUNTER_SLOTS:
        raise ValueError(f"{p.grid[0] * p.grid[2]} row x token blocks > {COUNTER_SLOTS} counters")
    ws = torch.empty(p.splits * m * n if p.splits > 1 else 0, dtype=torch.float32, device=x.device)
    extension().w4a16_mm(x, st["qw"], st["sc"], st["zp"], y, ws, counters(x.device), n, st["group"], p.r, p.nt,
                         p.cps, p.deep, p.pipe, p.pdl, p.bulk, pairs)
    return y


def dequant(st: dict, tile0: int = 0, tiles: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Row tiles ``[tile0, tile0 + tiles)`` of the layout as bf16 rows ``[rows, K]`` (``s (q - z)``, rounded
    once; rows past N are left out), into ``out`` (at least that many rows) or a new tensor."""
    n, k, qw = st["n"], st["k"], st["qw"]
    tiles = qw.shape[0] - tile0 if tiles is None else tiles
    rows = max(0, min(16 * tiles, n - 16 * tile0))
    w = torch.empty((rows, k), dtype=torch.bfloat16, device=qw.device) if out is None else out
    extension().w4a16_dequant(qw, st["sc"], st["zp"], w, n, st["group"], tile0, tiles)
    return w[:rows]


def mm_large(x: torch.Tensor, st: dict) -> torch.Tensor:
    """``x [M, K] @ dequant(W)^T`` for large M: slices of at most ``DEQUANT_SLICE_BYTES`` of bf16 rows, each
    dequantized into one buffer and multiplied on cuBLAS (fp32 accumulation, bf16 out); a paired gate_up layout
    then gives ``silu(gate) * up`` as the decode kernel's epilogue does."""
    n, k, t_all = st["n"], st["k"], st["qw"].shape[0]
    per = max(1, DEQUANT_SLICE_BYTES // (16 * k * 2))  # row tiles a slice
    if per >= t_all:
        y = x @ dequant(st).t()
    else:
        y = torch.empty((x.shape[0], n), dtype=torch.bfloat16, device=x.device)
        buf = torch.empty((16 * per, k), dtype=torch.bfloat16, device=x.device)
        for t0 in range(0, t_all, per):
            w = dequant(st, t0, min(per, t_all - t0), out=buf)
            y[:, 16 * t0:16 * t0 + w.shape[0]] = x @ w.t()
    return silu_mul_pairs(y) if st.get("pairs") else y


def silu_mul_pairs(h: torch.Tensor, halves: bool = False) -> torch.Tensor:
    """``[M, N]`` output of a paired layout (``halves``: of a merged gate_up, gate then up, as Marlin writes it) ->
    ``[M, N / 2]`` ``silu(gate) * up`` in one kernel over every element, the decode kernel's epilogue math
    (``twin_cuda_layout.silu_mul`` / ``silu_mul_halves`` emulate it). vLLM's ``silu_and_mul`` (one CTA a token)
    took 4x a compiled activation's time in the hybrid's batch-16 draft step (``results/draft-profile``)."""
    y = torch.empty((h.shape[0], h.shape[1] // 2), dtype=torch.bfloat16, device=h.device)
    if h.shape[0]:
        getattr(extension(), "w4a16_silu_mul_halves" if halves else "w4a16_silu_mul_pairs")(h.contiguous(), y)
    return y


def silu_mul_halves(h: torch.Tensor) -> torch.Tensor:
    return silu_mul_pairs(h, halves=True)


# ---------------------------------------------------------------- custom op (opaque to torch.compile)

def _op_impl(x: torch.Tensor, qw: torch.Tensor, sc: torch.Tensor, zp: torch.Tensor | None, n: int,
             group: int) -> torch.Tensor:
    return w4a16_mm(x, {"qw": qw, "sc": sc, "zp": zp, "n": n, "k": x.shape[1], "group": group})


def _op_pairs_impl(x: torch.Tensor, qw: torch.Tensor, sc: torch.Tensor, zp: torch.Tensor | None, n: int,
                   group: int) -> torch.Tensor:
    return w4a16_mm(x, {"qw": qw, "sc": sc, "zp": zp, "n": n, "k": x.shape[1], "group": group, "pairs": True})


_SCHEMA = "(Tensor x, Tensor qw, Tensor sc, Tensor? zp, int n, int group) -> Tensor"
_LIB = custom_ops.library()  # the ops live as long as this module (registered directly: custom_ops says why)
w4a16_cuda_op = custom_ops.register(_LIB, OP_NAME, _SCHEMA, _op_impl,
                                    lambda x, qw, sc, zp, n, group: x.new_empty((x.shape[0], n)))
# the paired gate_up layout with the silu(gate) * up epilogue: [M, K] -> [M, N / 2]
w4a16_cuda_silu_mul_op = custom_ops.register(_LIB, OP_NAME + "_silu_mul", _SCHEMA, _op_pairs_impl,
                                             lambda x, qw, sc, zp, n, group: x.new_empty((x.shape[0], n // 2)))


def twin_linear(x: torch.Tensor, st: dict, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] -> [..., N]`` through the custom op (any leading shape)."""
    x2 = x.reshape(-1, x.shape[-1])
    y = w4a16_cuda_op(x2, st["qw"], st["sc"], st["zp"], st["n"], st["group"])
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], st["n"])


def gate_up_silu_mul(x: torch.Tensor, st: dict) -> torch.Tensor:
    """``x [..., K] -> [..., N / 2]``: a paired gate_up layout (``twin_cuda_layout.pair_tiles``) and SiluAndMul,
    one kernel (the large-M path: cuBLAS, then the same silu(gate) * up)."""
    x2 = x.reshape(-1, x.shape[-1])
    y = w4a16_cuda_silu_mul_op(x2, st["qw"], st["sc"], st["zp"], st["n"], st["group"])
    return y.reshape(*x.shape[:-1], st["n"] // 2)


# ---------------------------------------------------------------- static compile check (no GPU)

from .twin_cuda_compile import compile_check, compile_cubin, instance_name  # noqa: E402,F401


# ---------------------------------------------------------------- the vLLM kernel class

def check_config(c) -> tuple[bool, str | None]:
    """``can_implement``'s shape/type rules without the device checks (testable anywhere)."""
    from vllm.scalar_type import scalar_types

    if c.weight_type not in (scalar_types.uint4, scalar_types.uint4b8):
        return False, f"weight type {c.weight_type} is not uint4 (zero points) or uint4b8"
    if (c.weight_type == scalar_types.uint4) != bool(c.zero_points):
        return False, f"weight type {c.weight_type} with zero_points={c.zero_points} is not supported"
    if c.has_g_idx:
        return False, "act-order (g_idx) is not supported"
    if c.act_type != torch.bfloat16 or (c.out_type is not None and c.out_type != torch.bfloat16):
        return False, f"activations {c.act_type} / output {c.out_type}: the CUDA kernel takes bf16"
    k, n = c.partition_weight_shape
    if c.group_size not in layout.GROUPS:
        return False, f"group size {c.group_size} is not one of {layout.GROUPS}"
    if k % layout.CHUNK or k % c.group_size:
        return False, f"input size per partition {k} is not a multiple of {layout.CHUNK} and the group size"
    return True, None


def repack_layer(c, w_q, w_s, w_zp) -> dict:
    """A layer's checkpoint tensors (config ``c``) in the kernel's layout, as ``w4a16_mm`` takes them; on a GPU the
    counters and the extension made ready now, before graph capture and the first forward."""
    k, n = c.partition_weight_shape
    st = layout.repack(w_q.data, w_s.data, None if w_zp is None else w_zp.data, c.group_size)
    if st["qw"].is_cuda:
        counters(st["qw"].device)
        extension()
    return dict(st, n=n, k=k, group=c.group_size, pairs=False)


def _load(kernel, layer, w_q, w_s, w_zp, replace_parameter) -> None:
    st = repack_layer(kernel.config, w_q, w_s, w_zp)
    replace_parameter(layer, kernel.w_q_name, st["qw"])
    replace_parameter(layer, kernel.w_s_name, st["sc"])
    if st["zp"] is not None:
        replace_parameter(layer, kernel.w_zp_name, st["zp"])
    layer.twin_cuda_shape = (st["n"], st["k"], st["group"])


def layer_state(layer) -> dict:
    """A loaded layer's repacked tensors and shape as ``w4a16_mm`` takes them (``pairs``: its gate_up tiles were
    paired, ``draft_mlp``)."""
    kernel = layer.scheme.kernel
    w_q, w_s, w_zp, _ = kernel._get_weight_params(layer)
    n, k, group = layer.twin_cuda_shape
    return {"qw": w_q, "sc": w_s, "zp": w_zp if kernel.config.zero_points else None, "n": n, "k": k,
            "group": group, "pairs": bool(getattr(layer, "twin_cuda_pairs", False))}


def _apply(kernel, layer, x, bias):
    return twin_linear(x, layer_state(layer), bias)


def _build_class():
    """CUDA C++ W4A16 decode GEMM (tensor cores, split-K) for the int4 twin; measured against ``own``."""
    return build(KERNEL_NAME, MIN_CAPABILITY, unavailable_reason, check_config, _load, _apply)


__getattr__ = lazy_class(__name__, KERNEL_NAME, _build_class)  # the class is built on first access
