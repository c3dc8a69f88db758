"""``draft_linear_kernel=own-cuda+marlin``: each draft layer on the faster W4A16 kernel for its token count (issue 37).

Measured on one H100 (``docs/benchmarks.md``, results/int4-gemm/20261206T142658Z-h100), a 32B layer set takes
114.9 / 122.9 / 176.8 µs on ``own-cuda`` at M = 1 / 4 / 16 tokens and 124.0 / 124.7 / 131.4 on Marlin; the 8B
set 53.5 / 60.5 / 85.3 against 66.0 / 66.0 / 69.5. In the engine (E16, 8B, γ 4) that made ``own-cuda`` the faster
draft alone (c 0.558 against 0.606) and the slower at batch 16 (1.084 against 0.792), and its prefill path
(dequantized slices and cuBLAS) put 8 ms on the first token. No one kernel wins at every M.

This class holds a layer in both layouts: ``own-cuda``'s (repacked from the checkpoint first, kept beside the
layer's parameters) and Marlin's (vLLM's ``MarlinLinearKernel`` then transforms the parameters as it always
does). The GEMM is one custom op, opaque to torch.compile, that picks by the token count it is called with:
``own-cuda`` up to :data:`SPLIT_M` tokens, Marlin above (decode at larger batches, the first pass at batch 16,
short prefills), and above :data:`DEQUANT_M` tokens (long prefills, many prompts at once) own-cuda's large-M path:
the weight dequantized to bf16 slice by slice and multiplied on cuBLAS. Under CUDA graphs M is fixed per captured
graph, so each graph holds one kernel per layer. The price is memory: the twin's packed weights twice (the engine
report's ``draft_hybrid_extra_bytes``).

The MLP: ``draft_mlp`` pairs the own layout's gate_up tiles and calls :func:`gate_up_silu_mul`: on the own
layout the kernel's fused ``silu(gate) * up`` epilogue (on the large-M path one kernel after cuBLAS), on Marlin's
its gate_up and the own extension's ``silu(gate) * up`` over every element (``twin_cuda.silu_mul_halves``; vLLM's
``silu_and_mul`` launches one CTA a token, 4x the time at 16 tokens).

``own-cuda+marlin+machete`` (:data:`MACHETE_KERNEL_NAME`) holds Machete's layout too, made from the checkpoint
tensors before Marlin's transform as vLLM's ``MacheteLinearKernel`` makes it, and takes it above
:data:`MACHETE_M` tokens (a third copy of the packed weights).
"""

from __future__ import annotations

import itertools
import weakref

import torch

from . import custom_ops, twin_cuda
from . import twin_cuda_layout as layout
from .mp_kernel import checkpoint_tensors, lazy_class

KERNEL_NAME = "TwinHybridLinearKernel"
# draft_linear_kernel=own-cuda+marlin+machete: the same, with Machete's layout held too (SM 9.0) for the calls above
# MACHETE_M tokens (the first pass at batch 16, prefills)
MACHETE_KERNEL_NAME = "TwinHybridMacheteLinearKernel"
KERNEL_NAMES = (KERNEL_NAME, MACHETE_KERNEL_NAME)
OP_NAME = "w4a16_by_m"
# own-cuda up to this many tokens (H100: ahead of Marlin at M = 1 and 4 at both shapes, behind at 16; at 32B
# M = 8 138.4 µs against Marlin's 124.7-131.4 at 4-16)
SPLIT_M = 4
# ... and above this many, the own layout's large-M path (its slices dequantized to bf16, then cuBLAS): Marlin's
# cost grows with M where cuBLAS's bf16 GEMM is compute-efficient. H100, 8B shape, a draft's prefill
# (results/draft-profile/20261206T224809Z-h100-marlin-traced): Marlin's GEMMs 2.4x the target's bf16 GEMMs at
# 2048 tokens (85.2 against 35.1 ms), 1.7x at 129; the large-M path is 1.9x a bf16 GEMM at 512 tokens and 1.4x at
# 2048 (32B layer set, results/int4-gemm/20261206T141942Z-h100), 2.4x at 128
DEQUANT_M = 512
# ... and with Machete's layout held, Machete above this many (Marlin's tile is 64 rows: above 64 it passes over
# the weights twice). H100, results/int4-gemm/20261207T011059Z-h100, 32B layer set, µs at M = 48 / 80 / 128 / 512 /
# 2048: Machete 190 / 244 / 247 / 853 / 2849, Marlin 191 / 374 / 381 / 1618 / 6310, own-cuda's large-M path - /
# 867 / 894 / 1333 / 3515, cuBLAS bf16 360 / 375 / 376 / 720 / 2607; at M = 16 Marlin 133 against Machete's 163
MACHETE_M = 64

_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> layer (the op's handle)
_IDS = itertools.count()


def own_state(layer) -> dict:
    """The layer's ``own-cuda`` tensors and shape, as ``twin_cuda.w4a16_mm`` takes them."""
    return layer.twin_hybrid_own


def register(layer) -> str:
    """The key the custom op finds ``layer`` by (held weakly): the layer's module path where vLLM gave it one, so
    that a compiled graph (and vLLM's compile cache) names the same layer in every engine of the same model; a
    later engine's layer of the same path takes the key over (the one before it is gone or going)."""
    prefix = getattr(layer, "prefix", "") or ""
    key = f"twin_hybrid:{prefix}" if prefix else f"twin_hybrid#{next(_IDS)}"
    layer.twin_hybrid_key = key
    _LAYERS[key] = layer
    return key


def layer_of(key: str):
    try:
        return _LAYERS[key]
    except KeyError:
        raise KeyError(f"{OP_NAME}: no live draft layer {key!r} (its model was freed)") from None


def path(m: int, machete: bool = False) -> str:
    """The layout a call with ``m`` tokens runs on: ``own`` (``own-cuda`` up to :data:`SPLIT_M`; its large-M path
    above :data:`DEQUANT_M`), ``machete`` (above :data:`MACHETE_M`, where the layer holds Machete's layout), else
    ``marlin``."""
    if m <= SPLIT_M:
        return "own"
    if machete and m > MACHETE_M:
        return "machete"
    return "own" if m > DEQUANT_M else "marlin"


def uses_own(m: int) -> bool:
    """Whether a call with ``m`` tokens runs on the own layout on a layer without Machete's."""
    return path(m) == "own"


def machete_state(c, w_q: torch.Tensor, w_s: torch.Tensor, w_zp: torch.Tensor | None) -> dict:
    """Machete's tensors for a layer from its checkpoint tensors (compressed-tensors: ``w_q [N, K / 8]`` packed
    along K, ``w_s [N, K / group]``, ``w_zp [N / 8, K / group]`` packed along N), as vLLM 0.27.1's
    ``MacheteLinearKernel.process_weights_after_loading`` makes them from the same parameters (K-major, the
    zero points unpacked and scaled: ``-s z``); ``{"unavailable": reason}`` where Machete cannot run the layer."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.kernels.linear import MacheteLinearKernel
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32

    ok, why = MacheteLinearKernel.can_implement(c)
    if not ok or c.has_g_idx:  # the twin has no act order; vLLM's Machete path would permute x for one
        return {"unavailable": str(why) if not ok else "act order (g_idx)"}
    b_q = ops.machete_prepack_B(w_q.contiguous().t(), a_type=c.act_type, b_type=c.weight_type,
                                group_scales_type=c.act_type)
    scales = w_s.t().contiguous()
    zeros = None
    if w_zp is not None:
        z = unpack_quantized_values_into_int32(w_zp.t(), c.weight_type, packed_dim=1)[:, : scales.shape[1]]
        zeros = (-1.0 * scales * z.to(scales.dtype)).contiguous()
    return {"b_q": b_q, "type_id": c.weight_type.id, "scales": scales, "zeros": zeros, "group": c.group_size}


def _machete(layer, x: torch.Tensor) -> torch.Tensor:
    st = layer.twin_hybrid_machete
    y = torch.ops._C.machete_mm(x, st["b_q"], st["type_id"], None, st["scales"], st["zeros"], st["group"], None,
                                None, None)
    bias = getattr(layer, "twin_hybrid_bias", None)
    return y if bias is None else y + bias


def _has_machete(layer) -> bool:
    st = getattr(layer, "twin_hybrid_machete", None)
    return st is not None and "b_q" in st


def _marlin_gemm(args: tuple, x: torch.Tensor) -> torch.Tensor:
    """Marlin's GEMM with the arguments vLLM's apply would compute, computed once at load (``marlin_args``)."""
    return torch.ops._C.marlin_gemm(x, None, *args[:-1], x.shape[0], *args[-1])


def _marlin(layer, x: torch.Tensor) -> torch.Tensor:
    args = getattr(layer, "twin_hybrid_marlin", None)
    if args is not None:
        return _marlin_gemm(args, x)
    # the kernel that loaded the layer (not layer.scheme: the int4 draft head's holder has none, draft_head)
    return layer.twin_hybrid_kernel.marlin_apply(layer, x, getattr(layer, "bias", None))


def _mm_impl(x: torch.Tensor, key: str, n: int) -> torch.Tensor:
    layer = layer_of(key)
    way = path(x.shape[0], _has_machete(layer))
    if way != "own":
        return _marlin(layer, x) if way == "marlin" else _machete(layer, x)
    y = twin_cuda.w4a16_mm(x, own_state(layer))
    bias = getattr(layer, "twin_hybrid_bias", None)
    return y if bias is None else y + bias


def _silu_mul_impl(x: torch.Tensor, key: str, n: int) -> torch.Tensor:
    layer = layer_of(key)
    way = path(x.shape[0], _has_machete(layer))
    if way == "own":
        return twin_cuda.w4a16_mm(x, own_state(layer))  # the paired layout: silu(gate) * up in the epilogue
    # one kernel over every element (vLLM's silu_and_mul: one CTA a token, 4x the time at M = 16)
    return twin_cuda.silu_mul_halves(_marlin(layer, x) if way == "marlin" else _machete(layer, x))


_SCHEMA = "(Tensor x, str key, int n) -> Tensor"
_LIB = custom_ops.library()  # registered directly (custom_ops: custom_op costs 5× as much a call)
by_m_op = custom_ops.register(_LIB, OP_NAME, _SCHEMA, _mm_impl, lambda x, key, n: x.new_empty((x.shape[0], n)))
by_m_silu_mul_op = custom_ops.register(_LIB, OP_NAME + "_silu_mul", _SCHEMA, _silu_mul_impl,
                                       lambda x, key, n: x.new_empty((x.shape[0], n // 2)))


def hybrid_linear(x: torch.Tensor, layer) -> torch.Tensor:
    """``x [..., K] -> [..., N]`` (bias included) through the op."""
    n = own_state(layer)["n"]
    y = by_m_op(x.reshape(-1, x.shape[-1]), layer.twin_hybrid_key, n)
    return y.reshape(*x.shape[:-1], n)


def gate_up_silu_mul(x: torch.Tensor, layer) -> torch.Tensor:
    """``x [..., K] -> [..., N / 2]``: a gate_up layer whose own tiles are paired (``draft_mlp``), SiluAndMul
    applied, on the kernel of the call's token count."""
    n = own_state(layer)["n"]
    y = by_m_silu_mul_op(x.reshape(-1, x.shape[-1]), layer.twin_hybrid_key, n)
    return y.reshape(*x.shape[:-1], n // 2)


def pair(layer) -> None:
    """Pair the own layout's gate_up tiles (Marlin's layout is not touched: its path applies the activation after
    its GEMM)."""
    layer.twin_hybrid_own = layout.pair_tiles(own_state(layer))


def extra_bytes(model) -> int:
    """Bytes the own layouts (and Machete's, where held) add to the draft (the price of holding several)."""
    total = 0
    for module in (model.modules() if model is not None else ()):
        st = getattr(module, "twin_hybrid_own", None)
        if st:
            total += sum(t.numel() * t.element_size() for t in (st["qw"], st["sc"], st["zp"]) if t is not None)
        if _has_machete(module):
            st = module.twin_hybrid_machete
            total += sum(t.numel() * t.element_size() for t in (st["b_q"], st["scales"], st["zeros"])
                         if t is not None)
    return total


def machete_layers(model) -> tuple[int, dict[str, int]]:
    """Layers holding Machete's layout; the reasons the others of the Machete class do not (reason -> layers)."""
    held, why = 0, {}
    for module in (model.modules() if model is not None else ()):
        st = getattr(module, "twin_hybrid_machete", None)
        if st is None:
            continue
        if "b_q" in st:
            held += 1
        else:
            why[st["unavailable"]] = why.get(st["unavailable"], 0) + 1
    return held, why


def direct_layers(model) -> int:
    """Layers whose Marlin path calls ``marlin_gemm`` directly (the rest go through vLLM's apply)."""
    return sum(getattr(m, "twin_hybrid_marlin", None) is not None for m in (model.modules() if model else ()))


# ---------------------------------------------------------------- the vLLM kernel class

def _build_class():
    """Marlin's class, with the own layout repacked first and the GEMM picked per call by its token count."""
    from vllm.model_executor.kernels.linear import MarlinLinearKernel

    class TwinHybridLinearKernel(MarlinLinearKernel):
        @classmethod
        def get_min_capability(cls) -> int:
            return max(twin_cuda.MIN_CAPABILITY, MarlinLinearKernel.get_min_capability())

        @classmethod
        def can_implement(cls, c) -> tuple[bool, str | None]:
            from vllm.platforms import current_platform

            if not current_platform.is_cuda():
                return False, f"{KERNEL_NAME} needs CUDA"
            reason = twin_cuda.unavailable_reason()
            if reason:
                return False, f"{KERNEL_NAME}: {reason}"
            ok, why = twin_cuda.check_config(c)
            if not ok:
                return False, f"{KERNEL_NAME} (own-cuda): {why}"
            ok, why = MarlinLinearKernel.can_implement.__func__(cls, c)
            return ok, (None if ok else f"{KERNEL_NAME} (Marlin): {why}")

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            layer.twin_hybrid_own = twin_cuda.repack_layer(self.config, *checkpoint_tensors(self, layer, KERNEL_NAME))
            bias = getattr(layer, "bias", None)
            layer.twin_hybrid_bias = None if bias is None else bias.detach().clone()  # Marlin permutes its own
            layer.twin_hybrid_kernel = self
            register(layer)
            super().process_weights_after_loading(layer)
            layer.twin_hybrid_marlin = self.checked_marlin_args(layer)

        def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
            return hybrid_linear(x, layer)

        def marlin_apply(self, layer, x, bias):
            return MarlinLinearKernel.apply_weights(self, layer, x, bias)

        def checked_marlin_args(self, layer):
            """:meth:`marlin_args`, kept only where its GEMM equals vLLM's apply bit for bit on a probe x."""
            args = self.marlin_args(layer)
            if args is None or not args[0].is_cuda:
                return None
            x = torch.randn((SPLIT_M + 1, self.config.partition_weight_shape[0]), device=args[0].device,
                            generator=torch.Generator(args[0].device).manual_seed(0)).to(torch.bfloat16)
            want = self.marlin_apply(layer, x, getattr(layer, "bias", None))
            try:
                return args if torch.equal(_marlin_gemm(args, x), want) else None
            except RuntimeError:
                return None

        def marlin_args(self, layer):
            """``torch.ops._C.marlin_gemm``'s arguments after x, c and size_m, as vLLM 0.27.1's
            ``apply_gptq_marlin_linear`` computes them for this layer (bf16 activations, no padding): its host
            work (about 20 µs a call, on the draft's prefill path) done once. None where it pads or quantizes x:
            then its apply runs."""
            from vllm.model_executor.layers.quantization.utils import marlin_utils as mu

            c = self.config
            w_q, w_s, w_zp, w_gidx = self._get_weight_params(layer)
            k, n = c.partition_weight_shape
            padded_n, padded_k = mu.marlin_repacked_nk(w_q, c.weight_type.size_bits)
            if (padded_n, padded_k) != (n, k) or c.act_type != torch.bfloat16:
                return None
            atomic = mu.should_use_atomic_add_reduce(m=1, n=padded_n, k=padded_k, device=w_q.device,
                                                     dtype=c.act_type)  # m is not read (vLLM 0.27.1)
            return (w_q, getattr(layer, "bias", None), w_s, None, None, w_zp, w_gidx, layer.g_idx_sort_indices,
                    self.workspace, c.weight_type.id,
                    (padded_n, padded_k, self.is_k_full, atomic, mu.USE_FP32_REDUCE_DEFAULT, False))

    TwinHybridLinearKernel.__qualname__ = KERNEL_NAME

    class TwinHybridMacheteLinearKernel(TwinHybridLinearKernel):
        """The hybrid with Machete's layout beside (made first, from the checkpoint tensors, before Marlin's
        transform replaces them); a layer Machete cannot run keeps the two layouts (the report counts it)."""

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            layer.twin_hybrid_machete = machete_state(self.config,
                                                      *checkpoint_tensors(self, layer, MACHETE_KERNEL_NAME))
            super().process_weights_after_loading(layer)

    TwinHybridMacheteLinearKernel.__qualname__ = TwinHybridMacheteLinearKernel.__name__ = MACHETE_KERNEL_NAME
    return {KERNEL_NAME: TwinHybridLinearKernel, MACHETE_KERNEL_NAME: TwinHybridMacheteLinearKernel}


__getattr__ = lazy_class(__name__, KERNEL_NAMES, _build_class)  # built on first access (imports need no vLLM)
