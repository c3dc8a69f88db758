"""Shape-true stand-ins for Qwen3-VL-8B / 32B and their int4 twins (no weights).

The time of a target verification step and of a draft step depends on the
shapes and the kernels, not on the weights. These folders hold only what vLLM
needs to build the real architecture (``config.json`` from the published
architecture facts, generation config, and the tiny tokenizer and processor
files so nothing is fetched); vLLM then creates the weights at random with
``load_format="dummy"``, so nothing large is written or sent.

Twins use the published AWQ layout: compressed-tensors ``pack-quantized``
W4A16, group-wise asymmetric (zero points), every decoder Linear quantized,
the vision tower and ``lm_head`` left in bf16. Group size 128 is the AWQ
default; a twin quantized with another group size costs about the same per
step (Marlin's group handling is a scale fetch per group).

    python -m workbench.shapes build [--root models/shapes]
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = REPO_ROOT / "models" / "shapes"
TWIN_GROUP_SIZE = 128

# Files taken from the tiny target so vLLM builds its processor offline.
_AUX_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "preprocessor_config.json", "video_preprocessor_config.json")


@dataclass(frozen=True)
class Qwen3VLShape:
    """Published architecture of one Qwen3-VL dense checkpoint."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int = 128
    vocab: int = 151936
    vision_depth: int = 27
    vision_hidden: int = 1152
    vision_intermediate: int = 4304
    vision_heads: int = 16
    deepstack: tuple[int, ...] = (8, 16, 24)

    def params_b(self) -> float:
        """Decoder parameters in billions (embeddings and lm_head included)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return (self.layers * (attn + mlp) + 2 * self.vocab * self.hidden) / 1e9


SHAPES = {
    "8b": Qwen3VLShape("Qwen3-VL-8B", hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8),
    "32b": Qwen3VLShape("Qwen3-VL-32B", hidden=5120, intermediate=25600, layers=64, heads=64, kv_heads=8),
}

# The other drafter roles of the seed PR's setup, as shapes: Qwen3-VL-2B (small VLM) and Qwen3-0.6B (the
# text-only draft the PR paired with Qwen3-VL-32B). Both tie their embeddings, as published.
DRAFT_SHAPES = {
    "2b-vlm": Qwen3VLShape("Qwen3-VL-2B", hidden=2048, intermediate=6144, layers=28, heads=16, kv_heads=8,
                           vision_depth=24, vision_hidden=1024, vision_intermediate=4096, deepstack=(5, 11, 17)),
    "0.6b-text": Qwen3VLShape("Qwen3-0.6B", hidden=1024, intermediate=3072, layers=28, heads=16, kv_heads=8),
}


def _text_config(shape: Qwen3VLShape, ids: dict[str, int]) -> dict:
    """A text-only Qwen3 (``Qwen3ForCausalLM``) of ``shape``: the seed PR's draft for a Qwen3-VL target."""
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": shape.vocab,
            "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
            "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim, "hidden_act": "silu",
            "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "attention_bias": False,
            "attention_dropout": 0.0, "rope_theta": 1000000.0, "tie_word_embeddings": True, "use_cache": True,
            "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "torch_dtype": "bfloat16"}


def _config(shape: Qwen3VLShape, ids: dict[str, int]) -> dict:
    rope_half = shape.head_dim // 2  # 64: (t, h, w) sections 24/20/20 as published
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "dtype": "bfloat16",
        "image_token_id": ids["image"],
        "video_token_id": ids["video"],
        "vision_start_token_id": ids["vision_start"],
        "vision_end_token_id": ids["vision_end"],
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_vl_text",
            "vocab_size": shape.vocab,
            "hidden_size": shape.hidden,
            "intermediate_size": shape.intermediate,
            "num_hidden_layers": shape.layers,
            "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                "mrope_section": [rope_half - 40, 20, 20], "mrope_interleaved": True},
            "tie_word_embeddings": False,
            "use_cache": True,
            "bos_token_id": ids["bos"],
            "eos_token_id": ids["eos"],
            "dtype": "bfloat16",
        },
        "vision_config": {
            "model_type": "qwen3_vl",
            "depth": shape.vision_depth,
            "hidden_size": shape.vision_hidden,
            "intermediate_size": shape.vision_intermediate,
            "num_heads": shape.vision_heads,
            "hidden_act": "gelu_pytorch_tanh",
            "in_channels": 3,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": shape.hidden,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": list(shape.deepstack),
            "initializer_range": 0.02,
            "dtype": "bfloat16",
        },
    }


def _twin_quantization_config(group_size: int = TWIN_GROUP_SIZE) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
               "group_size": group_size, "dynamic": False, "observer": "minmax", "actorder": None,
               "block_structure": None, "observer_kwargs": {}, "scale_dtype": None, "zp_dtype": "torch.int8"}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": "pack-quantized",
                                      "input_activations": None, "output_activations": None}},
        # the published twins leave the vision tower and lm_head in bf16
        "ignore": ["lm_head", "re:.*visual.*"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
        "version": "0.17.0",
    }


def _special_ids(tiny_target: Path) -> dict[str, int]:
    tok = json.loads((tiny_target / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    return {"image": added["<|image_pad|>"], "video": added["<|video_pad|>"],
            "vision_start": added["<|vision_start|>"], "vision_end": added["<|vision_end|>"],
            "bos": added["<|endoftext|>"], "eos": added["<|im_end|>"]}


def build_shapes(root: Path = DEFAULT_ROOT, tiny_target: Path | None = None) -> dict[str, Path]:
    """Writes ``<root>/<size>-target`` and ``<root>/<size>-twin`` for 8b and 32b; returns the folders."""
    if tiny_target is None:
        from .tiny import ensure_tiny_models

        tiny_target = ensure_tiny_models()["target"]
    ids = _special_ids(tiny_target)
    out: dict[str, Path] = {}
    for size, shape in SHAPES.items():
        for role in ("target", "twin"):
            d = Path(root) / f"{size}-{role}"
            d.mkdir(parents=True, exist_ok=True)
            cfg = _config(shape, ids)
            if role == "twin":
                cfg["quantization_config"] = _twin_quantization_config()
            (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
            (d / "generation_config.json").write_text(json.dumps(
                {"bos_token_id": ids["bos"], "eos_token_id": [ids["eos"]], "do_sample": False}) + "\n")
            for name in _AUX_FILES:
                if (tiny_target / name).exists():
                    shutil.copy2(tiny_target / name, d / name)
            out[f"{size}-{role}"] = d
    for name, shape in DRAFT_SHAPES.items():
        d = Path(root) / name
        d.mkdir(parents=True, exist_ok=True)
        if name.endswith("-text"):
            cfg = _text_config(shape, ids)
        else:
            cfg = _config(shape, ids)
            cfg["tie_word_embeddings"] = cfg["text_config"]["tie_word_embeddings"] = True
        (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        (d / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": ids["bos"], "eos_token_id": [ids["eos"]], "do_sample": False}) + "\n")
        for aux in _AUX_FILES if not name.endswith("-text") else _AUX_FILES[:3]:
            if (tiny_target / aux).exists():
                shutil.copy2(tiny_target / aux, d / aux)
        out[name] = d
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.shapes", description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["build"])
    ap.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    args = ap.parse_args(argv)
    for name, d in build_shapes(args.root).items():
        shape = DRAFT_SHAPES.get(name) or SHAPES[name.split("-")[0]]
        print(f"{name:12s} {d}  ({shape.name}, {shape.params_b():.1f}B decoder parameters)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
