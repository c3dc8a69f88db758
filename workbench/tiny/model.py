"""Model shapes and initialisation: the tiny Qwen3-VL target's configs and its seeded weights."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from .tokenizer import MERGE_SIZE, MODEL_VOCAB_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE


@dataclass(frozen=True)
class VLShape:
    text_layers: int = 2
    text_hidden: int = 128
    text_intermediate: int = 256
    # head_dim 32: one of the head sizes vLLM's CPU attention backend accepts.
    text_heads: int = 4
    text_kv_heads: int = 2
    head_dim: int = 32
    vision_depth: int = 2
    vision_hidden: int = 64
    vision_intermediate: int = 128
    vision_heads: int = 2
    # one grid side of learned position embeddings; interpolated to any grid
    vision_pos_side: int = 4
    deepstack: tuple[int, ...] = (0,)


TARGET_SHAPE = VLShape()
SMALL_VLM_SHAPE = VLShape(text_layers=1, vision_depth=1, deepstack=(0,))
# The text-only draft: the target's text tower cut to one layer (no vision).
TEXT_DRAFT_SHAPE = VLShape(text_layers=1)

# Init scales, tuned together (tests/test_tiny.py checks what they buy):
# - the residual branches are weaker than the token embedding, so the target's
#   top-1/top-2 logit gaps usually exceed the perturbation that int4
#   quantization of the branch weights causes: the twin is a good draft;
# - attention is stronger than the MLP and q_norm/k_norm gains above 1 sharpen
#   it: the image tokens reach the argmax through attention only, so this is
#   what makes a draft that does not see the image measurably worse;
# - lm_head's scale only sets the logit units: top-1/top-2 gaps of order one,
#   as in real checkpoints, so relaxed acceptance thresholds are meaningful.
EMBED_STD = 1.0
BRANCH_GAIN = 0.9
MLP_GAIN = 0.4
QK_NORM_GAIN = 1.25
LM_HEAD_STD = 0.35
# lm_head rows of added tokens and of the padding rows beyond the tokenizer
# are shrunk so they are (practically) never the argmax: greedy runs then go to
# max_tokens instead of stopping at a random early <|im_end|>.
SPECIAL_ROW_SCALE = 0.05

SEEDS = {"target": 1234, "random-draft": 98765, "small-vlm": 4321, "text-draft": 2468}


def _param_generator(seed: int, name: str):
    import torch

    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _init_weights(model, seed: int, n_regular_tokens: int) -> None:
    """Deterministic init, independent of transformers' own init order.

    Every parameter draws from its own generator seeded by (seed, name), and the
    result is rounded to bfloat16 so float32 and bfloat16 loads see one model.
    """
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            g = _param_generator(seed, name)
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                value = torch.full_like(p, QK_NORM_GAIN)
            elif "norm" in name and leaf == "weight":
                # RMSNorm / LayerNorm gains (input_layernorm, norm1, ...)
                value = torch.ones_like(p)
            elif leaf == "bias":
                value = torch.randn(p.shape, generator=g) * 0.02
            elif name.endswith("embed_tokens.weight"):
                value = torch.randn(p.shape, generator=g) * EMBED_STD
            elif name.endswith("lm_head.weight"):
                value = torch.randn(p.shape, generator=g) * LM_HEAD_STD
                value[n_regular_tokens:] *= SPECIAL_ROW_SCALE
            elif "pos_embed" in name:
                value = torch.randn(p.shape, generator=g) * 0.5
            elif p.ndim >= 2:
                fan_in = math.prod(p.shape[1:])
                gain = MLP_GAIN if ".mlp." in name and "language_model" in name else BRANCH_GAIN
                value = torch.randn(p.shape, generator=g) * (gain / math.sqrt(fan_in))
            else:
                value = torch.randn(p.shape, generator=g) * 0.02
            p.copy_(value.to(torch.bfloat16).to(p.dtype))


def _inherit(model, source_state: dict, source_name) -> None:
    """Copy every parameter whose counterpart (``source_name(name)``) exists in ``source_state`` with the same shape."""
    import torch

    copied = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            src = source_state.get(source_name(name))
            if src is not None and src.shape == p.shape:
                p.copy_(src)
                copied += 1
    if copied == 0:
        raise RuntimeError(f"tiny build: nothing to inherit for {type(model).__name__}")


def _text_fields(shape: VLShape, ids: dict[str, int], rope_extra: dict) -> dict:
    """The text tower's configuration, shared by the VL models and the text-only draft."""
    return dict(
        vocab_size=MODEL_VOCAB_SIZE,
        hidden_size=shape.text_hidden,
        intermediate_size=shape.text_intermediate,
        num_hidden_layers=shape.text_layers,
        num_attention_heads=shape.text_heads,
        num_key_value_heads=shape.text_kv_heads,
        head_dim=shape.head_dim,
        hidden_act="silu",
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, **rope_extra},
        attention_bias=False,
        tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )


def _vl_config(shape: VLShape, ids: dict[str, int]):
    from transformers import Qwen3VLConfig

    rope_half = shape.head_dim // 2
    # Qwen3-VL splits the rotary half-dim into (t, h, w) sections, interleaved.
    mrope = [rope_half - 2 * (rope_half * 5 // 16), rope_half * 5 // 16, rope_half * 5 // 16]
    text = _text_fields(shape, ids, {"mrope_section": mrope, "mrope_interleaved": True})
    text["dtype"] = "float32"
    vision = dict(
        depth=shape.vision_depth,
        hidden_size=shape.vision_hidden,
        hidden_act="gelu_pytorch_tanh",
        intermediate_size=shape.vision_intermediate,
        num_heads=shape.vision_heads,
        in_channels=3,
        patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        out_hidden_size=shape.text_hidden,
        num_position_embeddings=shape.vision_pos_side**2,
        deepstack_visual_indexes=list(shape.deepstack),
    )
    cfg = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    cfg.architectures = ["Qwen3VLForConditionalGeneration"]
    cfg.dtype = "float32"
    return cfg


def _text_config(ids: dict[str, int]):
    from transformers import Qwen3Config

    # M-RoPE with equal (t, h, w) positions, as for text, is plain RoPE with the same theta.
    cfg = Qwen3Config(**_text_fields(TEXT_DRAFT_SHAPE, ids, {}))
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.dtype = "float32"
    return cfg


def _generation_config(ids: dict[str, int]) -> dict:
    # No sampling defaults: vLLM would apply them to every request that does
    # not set its own, and the workbench wants greedy unless asked otherwise.
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    }
