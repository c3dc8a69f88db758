"""A tiny Qwen3-VL the project has never shipped, and its own int4 twin.

Different shape, seed and quantization scheme from ``models/tiny``: three text
layers of width 192, a symmetric group-wise W4A16 scheme with group 64
(vLLM's ``uint4b8``), written with compressed-tensors alone, as a third party
would. Used to check that the int4 paths (native and fallback) draft
token-exactly for a checkpoint nothing here was tuned on.
"""

from __future__ import annotations

import shutil
from pathlib import Path

GROUP = 64
SEED = 777


def _symmetric_qparams(module, group: int) -> None:
    import torch

    w = module.weight.detach().float()
    out_f, in_f = w.shape
    amax = w.reshape(out_f, in_f // group, group).abs().amax(-1)
    scale = (amax / 7.0).to(torch.bfloat16).float()
    scale = torch.where(scale == 0, torch.full_like(scale, 2.0**-20), scale)
    module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
    if getattr(module, "weight_zero_point", None) is not None:
        module.weight_zero_point.data.zero_()


def build_unseen(root: Path) -> dict[str, Path]:
    """Writes ``target``, ``twin-int4`` (symmetric, group 64) under ``root``."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from transformers import Qwen3VLForConditionalGeneration

    from workbench import tiny

    dirs = {"target": root / "target", "twin-int4": root / "twin-int4"}
    if all((d / "config.json").exists() for d in dirs.values()):
        return dirs
    shutil.rmtree(root, ignore_errors=True)
    tok = tiny._build_tokenizer()
    ids = tiny._token_ids(tok)

    def write_common(d: Path) -> None:
        tiny._write_tokenizer(tok, d)
        tiny._write_processors(d)
        tiny._write_json(d / "generation_config.json", tiny._generation_config(ids))

    shape = tiny.VLShape(text_layers=3, text_hidden=192, text_intermediate=384, text_heads=6,
                         text_kv_heads=3, head_dim=32, vision_depth=1, deepstack=(0,))
    model = Qwen3VLForConditionalGeneration(tiny._vl_config(shape, ids))
    tiny._init_weights(model, SEED, tiny.BPE_VOCAB_SIZE)
    model.eval().save_pretrained(dirs["target"], safe_serialization=True)
    write_common(dirs["target"])

    twin = Qwen3VLForConditionalGeneration(tiny._vl_config(shape, ids))
    twin.load_state_dict(model.state_dict())
    ignore = [n for n, m in twin.named_modules()
              if isinstance(m, torch.nn.Linear) and not n.startswith("model.language_model.layers.")]
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                               group_size=GROUP, dynamic=False, observer="minmax")
    qcfg = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                              ignore=ignore, quantization_status="initialized")
    apply_quantization_config(twin, qcfg)
    for _, m in twin.named_modules():
        if getattr(m, "quantization_scheme", None) is not None:
            _symmetric_qparams(m, GROUP)
    compressor = ModelCompressor.from_pretrained_model(twin, quantization_format="pack-quantized")
    compressor.compress_model(twin)
    twin.to(torch.bfloat16)
    for cfg in (twin.config, twin.config.text_config, twin.config.vision_config):
        cfg.dtype = "bfloat16"
    twin.save_pretrained(dirs["twin-int4"], safe_serialization=True)
    compressor.update_config(str(dirs["twin-int4"]))
    write_common(dirs["twin-int4"])
    return dirs
