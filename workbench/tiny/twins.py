"""The int4 twin: the target's W4A16 twin (compressed-tensors ``pack-quantized``) and its dequantized copy."""

from __future__ import annotations

import copy
from pathlib import Path


QUANT_BITS = 4
# Divides every language-model Linear input width (128, 256) and is what the
# published AWQ twins of Qwen3-VL use.
QUANT_GROUP_SIZE = 32


def _quant_scheme_config(ignore: list[str]):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=QUANT_BITS,
        type="int",
        symmetric=False,
        strategy="group",
        group_size=QUANT_GROUP_SIZE,
        dynamic=False,
        observer="minmax",
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    return QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore, quantization_status="initialized")


def _is_language_linear(name: str) -> bool:
    return name.startswith("model.language_model.layers.")


def _fill_minmax_qparams(module) -> None:
    """AWQ-style asymmetric group qparams from each group's min and max.

    Scales are rounded to bfloat16 (the twin's on-disk dtype) before the zero
    points are derived, so the float32 dequantized twin and vLLM's bfloat16
    kernel see the same scales.
    """
    import torch

    w = module.weight.detach().float()
    out_f, in_f = w.shape
    groups = w.reshape(out_f, in_f // QUANT_GROUP_SIZE, QUANT_GROUP_SIZE)
    lo = groups.amin(-1).clamp(max=0.0)
    hi = groups.amax(-1).clamp(min=0.0)
    qmin, qmax = -(2 ** (QUANT_BITS - 1)), 2 ** (QUANT_BITS - 1) - 1
    scale = ((hi - lo) / (qmax - qmin)).to(torch.bfloat16).float()
    scale = torch.where(scale == 0, torch.full_like(scale, 2.0**-20), scale)
    zero_point = torch.clamp(torch.round(qmin - lo / scale), qmin, qmax)
    module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
    module.weight_zero_point.data.copy_(zero_point.to(module.weight_zero_point.dtype))


def _unpack_int4(packed, zero_point, scale, shape):
    """Dequantize one pack-quantized Linear back to float32 via compressed-tensors."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    out_f, in_f = (int(s) for s in shape)
    q = unpack_from_int32(packed, QUANT_BITS, torch.Size((out_f, in_f))).float()
    zp = unpack_from_int32(zero_point, QUANT_BITS, torch.Size((out_f, scale.shape[-1])), packed_dim=0).float()
    s = scale.float()
    g = QUANT_GROUP_SIZE
    w = (q.reshape(out_f, -1, g) - zp.unsqueeze(-1)) * s.unsqueeze(-1)
    return w.reshape(out_f, in_f)


def _build_twins(target_model, int4_dir: Path, dequant_dir: Path, write_common) -> None:
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config

    twin = copy.deepcopy(target_model)
    ignore = [
        name
        for name, m in twin.named_modules()
        if isinstance(m, torch.nn.Linear) and not _is_language_linear(name)
    ]
    apply_quantization_config(twin, _quant_scheme_config(ignore))
    quantized = [
        (name, m) for name, m in twin.named_modules() if getattr(m, "quantization_scheme", None) is not None
    ]
    if not quantized or any(not _is_language_linear(n) for n, _ in quantized):
        raise RuntimeError(f"tiny twin: unexpected quantized module set: {[n for n, _ in quantized]}")
    for _, m in quantized:
        _fill_minmax_qparams(m)

    compressor = ModelCompressor.from_pretrained_model(twin, quantization_format="pack-quantized")
    compressor.compress_model(twin)
    # Published twins are bfloat16 checkpoints; every float here is bf16-exact.
    twin.to(torch.bfloat16)
    for cfg in (twin.config, twin.config.text_config, twin.config.vision_config):
        cfg.dtype = "bfloat16"
    twin.save_pretrained(int4_dir, safe_serialization=True)
    compressor.update_config(str(int4_dir))
    write_common(int4_dir)

    # Full-precision copy of the very int4 values that were packed.
    dequant = copy.deepcopy(target_model)
    modules = dict(dequant.named_modules())
    with torch.no_grad():
        for name, m in quantized:
            w = _unpack_int4(m.weight_packed, m.weight_zero_point, m.weight_scale, m.weight_shape)
            modules[name].weight.copy_(w)
    dequant.save_pretrained(dequant_dir, safe_serialization=True)
    write_common(dequant_dir)
