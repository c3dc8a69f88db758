"""The twin's ``lm_head`` in int4 (knob ``draft_lm_head``); the target's untouched.

A W4A16 checkpoint made by llm-compressor leaves ``lm_head`` in bf16 (its recipes ignore it by module
name), and vLLM's compressed-tensors path would not quantize a ``ParallelLMHead`` anyway: the quant
config hands it the unquantized embedding method. For the twin that head is the largest single GEMM
of a draft step: 151,936 × 5,120 bf16 at Qwen3-VL-32B is 1.56 GB read per step (0.37 ms on an H200,
issue 18), against 0.39 GB in int4.

``draft_lm_head=int4`` quantizes the loaded draft's head once, round-to-nearest, with
compressed-tensors' own quantization functions (``calculate_qparams``, ``quantize``,
``pack_to_int32``) into the same ``pack-quantized`` tensors a W4A16 checkpoint holds (asymmetric
uint4 with zero points, group 128, or one group per row where the hidden size is not a multiple of
128), and builds its GEMM with vLLM's own ``CompressedTensorsWNA16`` scheme, so it runs on the kernel
the draft's other layers run on (``draft_kernels.prefer``). The head's quant method is then wrapped:
``apply`` (the logits) goes through the int4 GEMM, ``embedding`` (a head tied to the input embedding)
stays the bf16 lookup. The bf16 weight stays in memory. ``model`` (the default) leaves the head as the
checkpoint has it.

The draft is only proposing: the target verifies every drafted token, so a head that ranks two near-tied
tokens the other way changes the acceptance, never the output of the strict tier.
"""

from __future__ import annotations

import torch

GROUP_SIZE = 128  # the group of a W4A16 twin's other layers (llm-compressor's AWQ / GPTQ default)


def _args(group_size: int | None):
    from compressed_tensors.quantization import QuantizationArgs

    if group_size is None:
        return QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="channel")
    return QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=group_size)


def group_size_for(hidden: int) -> int | None:
    """The head's quantization group: 128 where it divides the hidden size, else one group per row (None)."""
    return GROUP_SIZE if hidden % GROUP_SIZE == 0 else None


@torch.no_grad()
def quantize_rows(weight: torch.Tensor, group_size: int | None = GROUP_SIZE, chunk: int = 8192) -> dict:
    """``weight`` [N, K] as compressed-tensors ``pack-quantized`` tensors: ``weight_packed`` int32
    [N, K/8], ``weight_scale`` [N, K/g] in the weight's dtype, ``weight_zero_point`` int32 [N/8, K/g]
    (N padded to a multiple of 8 for the zero points only), ``weight_shape`` [N, K]; round-to-nearest,
    min/max per group, ``chunk`` rows at a time (float32 work space stays ~chunk x K)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    n, k = weight.shape
    g = k if group_size is None else group_size
    if k % g:
        raise ValueError(f"draft_lm_head=int4: group size {g} does not divide the hidden size {k}")
    args = _args(group_size)
    packed, scales, zeros = [], [], []
    for r in range(0, n, chunk):
        w = weight[r:r + chunk].float()
        grouped = w.view(w.shape[0], k // g, g)
        # calculate_qparams widens the range to include 0, as the twin's observers do
        scale, zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        q = quantize(w, scale.to(weight.dtype).float(), zp, args)
        packed.append(pack_to_int32(q.to(torch.int8), 4, packed_dim=1))
        scales.append(scale.to(weight.dtype))
        zeros.append(zp.to(torch.int8))
    zp_all = torch.cat(zeros)
    pad = (-n) % 8
    if pad:
        zp_all = torch.cat([zp_all, zp_all.new_zeros(pad, zp_all.shape[1])])
    return {"weight_packed": torch.cat(packed), "weight_scale": torch.cat(scales),
            "weight_zero_point": pack_to_int32(zp_all, 4, packed_dim=0),
            "weight_shape": torch.tensor([n, k], dtype=torch.int64)}


class Int4HeadMethod:
    """The head's quant method with ``apply`` through an int4 GEMM; everything else its original's."""

    def __init__(self, original, scheme, holder: torch.nn.Module):
        self.original, self.scheme, self.holder = original, scheme, holder

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.scheme.apply_weights(self.holder, x, bias)

    def __getattr__(self, name):
        return getattr(self.original, name)


def find_head(model) -> torch.nn.Module:
    """The one vocabulary projection the draft's logits go through (the ``lm_head`` of its language model)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    heads = {id(m.lm_head): m.lm_head for m in model.modules()
             if isinstance(getattr(m, "lm_head", None), VocabParallelEmbedding)}
    if len(heads) != 1:
        raise ValueError(f"draft_lm_head=int4: expected one lm_head in the draft model, found {len(heads)}")
    return next(iter(heads.values()))


def install(model, preferred_kernel: str | None) -> dict:
    """Quantize the draft ``model``'s head in place (see the module docstring); the report's fields."""
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsWNA16

    from . import draft_kernels

    head = find_head(model)
    weight = head.weight.data
    n, k = weight.shape
    group = group_size_for(k)
    q = quantize_rows(weight, group)
    scheme = CompressedTensorsWNA16(strategy="group" if group else "channel", num_bits=4, group_size=group,
                                    symmetric=False, layer_name="lm_head")
    holder = torch.nn.Module()
    holder.prefix = "draft_lm_head"  # a module path for kernels that name their layers (twin_hybrid)
    holder.register_parameter("bias", None)  # the logits' bias, if any, comes with each call (vLLM's CPU kernel reads it)
    try:
        with torch.device(weight.device), draft_kernels.prefer(preferred_kernel):
            scheme.create_weights(holder, output_size=n, input_size=k, output_partition_sizes=[n],
                                  input_size_per_partition=k, params_dtype=weight.dtype, weight_loader=None)
    except ValueError as e:  # no W4A16 kernel for this head here (a float32 draft on vLLM's CPU kernel, say)
        raise ValueError(f"draft_lm_head=int4: no W4A16 kernel takes the draft's {n} x {k} {weight.dtype} "
                         f"head on this platform: {e}") from e
    for name, value in q.items():
        getattr(holder, name).data.copy_(value)
    scheme.process_weights_after_loading(holder)
    head.quant_method = Int4HeadMethod(head.quant_method, scheme, holder)
    return {"draft_lm_head": "int4", "draft_lm_head_applies": True, "draft_lm_head_kernel": type(scheme.kernel).__name__,
            "draft_lm_head_group_size": group or k,
            "draft_lm_head_bytes": {"model": weight.numel() * weight.element_size(),
                                    "int4": sum(t.numel() * t.element_size() for t in q.values())}}
