"""Tiny embedded models: a Qwen3-VL target, its int4 twin and the other draft roles.

Everything here is built offline from fixed seeds, on CPU, in seconds, so the
demo, the tests and CI run against real checkpoints without downloading any.

    python -m workbench.tiny build [--out models/tiny] [--force]

Roles (see ``ROLES``):

- ``target``        tiny Qwen3-VL, float32 on disk (every weight is bfloat16-exact,
                    so float32 and bfloat16 runs load identical values)
- ``twin-int4``     the target's W4A16 twin, compressed-tensors ``pack-quantized``
                    (group-wise, asymmetric, as published AWQ checkpoints); the
                    language-model Linear layers are quantized, the vision tower
                    and ``lm_head`` are on the ignore list
- ``twin-dequant``  the twin's int4 values dequantized into the target's plain
                    float32 format (vLLM's CPU int4 kernel has no float32 path)
- ``random-draft``  the target's architecture with other seeds (an unrelated draft)
- ``small-vlm``     a smaller Qwen3-VL cut from the target (one text layer, one
                    vision block), same tokenizer
- ``text-draft``    a text-only Qwen3 cut from the target's text tower (one layer),
                    same tokenizer
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .datasets._common import sha256_file

# Bump whenever anything that changes the bytes on disk changes.
BUILDER_VERSION = "1"

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = REPO_ROOT / "models" / "tiny"
MANIFEST_NAME = "manifest.json"

ROLES = ("target", "twin-int4", "twin-dequant", "random-draft", "small-vlm", "text-draft")

# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------

# Regular (BPE) vocabulary size: 256 byte tokens plus learned merges.
BPE_VOCAB_SIZE = 448
# The model's embedding table is padded past the tokenizer, as in the real Qwen
# checkpoints (151936 rows for 151669 tokens).
MODEL_VOCAB_SIZE = 512

# Qwen's added tokens in Qwen's order; the bool says whether Qwen marks it special.
QWEN_ADDED_TOKENS = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

# Same pre-tokenization as Qwen2/Qwen3 tokenizers.
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# A small built-in corpus, enough for a few hundred merges; it leans on the
# words that the workbench's prompts use (images, charts, questions, numbers).
CORPUS = """\
Describe the image in one sentence.
What is shown in this picture? Answer with a single word.
The picture shows a red square on a blue background.
A green circle sits next to a yellow triangle.
How many objects are there in the image? There are three objects.
The chart shows the number of students in each class.
Which bar is the tallest? The tallest bar is the second one.
What is the value of x in the figure? The value of x is 12.
Read the text in the image and answer the question.
The photo was taken on a sunny day near the river.
A small dog is running across the green grass.
Two people are sitting at a table and talking.
The graph has two lines, one rising and one falling.
What color is the car? The car is red.
Is the light on or off? The light is on.
Compare the left image with the right image.
The left image is brighter than the right image.
Count the number of apples on the plate: one, two, three, four, five.
Answer the question using the information in the table.
The table lists the price of each item in dollars.
The total is 42 and the average is 7.
Solve the problem step by step and give the final answer.
First, find the area of the rectangle. Then subtract the area of the circle.
The answer is 3.14 times the radius squared.
Look at the diagram and find the missing angle.
The sum of the angles in a triangle is 180 degrees.
What is written on the sign? The sign says stop.
There is a tree, a house and a blue sky with white clouds.
The image contains a map of the city with several streets.
The man in the picture is holding a black umbrella.
A cat sleeps on the sofa while the sun shines through the window.
Please explain what happens in the scene.
The scene shows a busy market with many people and colorful fruit.
Which animal is larger, the horse or the mouse? The horse is larger.
The first image shows a kitchen and the second image shows a garden.
In the second image the flowers are pink and white.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 2024.
Yes. No. Maybe. I think so. I do not know.
The quick brown fox jumps over the lazy dog.
She reads a book, he writes a letter, and they walk to the station.
The weather today is cold, but tomorrow it will be warm.
def add(a, b): return a + b
x = [1, 2, 3]; y = {"key": "value"}
Question: what is the main object? Answer: a bicycle.
Question: how many wheels does it have? Answer: two.
"""


def _build_tokenizer():
    """Train the byte-level BPE tokenizer and append Qwen's added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    if tok.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(
            f"tiny tokenizer: BPE training produced {tok.get_vocab_size()} tokens, "
            f"expected {BPE_VOCAB_SIZE}; the built-in corpus is too small for that vocabulary"
        )
    for content, special in QWEN_ADDED_TOKENS:
        added = AddedToken(content, special=special, normalized=False, single_word=False, lstrip=False, rstrip=False)
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
    return tok


def _token_ids(tok) -> dict[str, int]:
    ids = {content: tok.token_to_id(content) for content, _ in QWEN_ADDED_TOKENS}
    missing = [c for c, i in ids.items() if i is None]
    if missing:
        raise RuntimeError(f"tiny tokenizer: added tokens missing: {missing}")
    return ids


# Qwen3-VL style chat template: one ``<|vision_start|><|image_pad|><|vision_end|>``
# per image part, in order; string or list content; optional generation prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' or 'video' in part -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def _write_tokenizer(tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    added = {}
    for content, special in QWEN_ADDED_TOKENS:
        added[str(tok.token_to_id(content))] = {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "processor_class": "Qwen3VLProcessor",
    }
    _write_json(out / "tokenizer_config.json", config)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


# ---------------------------------------------------------------------------
# Image / video processors
# ---------------------------------------------------------------------------

PATCH_SIZE = 16
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
# One merged image token covers a 32x32 pixel tile; these bounds give 16..64
# tokens per image: prompts stay short on CPU, and the image is a large enough
# share of the context to steer the output.
MIN_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2 * 16
MAX_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2 * 64


def _write_processors(out: Path) -> None:
    common = {
        "processor_class": "Qwen3VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
    }
    image = {
        **common,
        "image_processor_type": "Qwen2VLImageProcessor",
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
    }
    video = {
        **common,
        "video_processor_type": "Qwen3VLVideoProcessor",
        "do_sample_frames": True,
        "fps": 2,
        "min_frames": 2,
        "max_frames": 8,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS * 2},
    }
    _write_json(out / "preprocessor_config.json", image)
    _write_json(out / "video_preprocessor_config.json", video)


# ---------------------------------------------------------------------------
# Model shapes and initialisation
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Int4 twin
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# Build, manifest
# ---------------------------------------------------------------------------


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _normalise_config(path: Path) -> None:
    """Rewrite a saved config.json with sorted keys (stable bytes across runs)."""
    cfg = json.loads(path.read_text())
    _write_json(path, cfg)


def _build_all(out: Path) -> None:
    import torch
    from transformers import Qwen3ForCausalLM, Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    tok = _build_tokenizer()
    ids = _token_ids(tok)
    n_regular = BPE_VOCAB_SIZE

    def write_common(d: Path, multimodal: bool = True) -> None:
        _write_tokenizer(tok, d)
        if multimodal:
            _write_processors(d)
        _write_json(d / "generation_config.json", _generation_config(ids))
        _normalise_config(d / "config.json")

    def build_vl(shape: VLShape, seed: int):
        model = Qwen3VLForConditionalGeneration(_vl_config(shape, ids))
        _init_weights(model, seed, n_regular)
        return model.eval()

    target = build_vl(TARGET_SHAPE, SEEDS["target"])
    target.save_pretrained(out / "target", safe_serialization=True)
    write_common(out / "target")

    _build_twins(target, out / "twin-int4", out / "twin-dequant", write_common)

    random_draft = build_vl(TARGET_SHAPE, SEEDS["random-draft"])
    random_draft.save_pretrained(out / "random-draft", safe_serialization=True)
    write_common(out / "random-draft")

    # The small drafts are cut from the target (as a distilled or same-family
    # small model would relate to it): they agree with it more than chance and
    # less than the twin, and the text-only one cannot see images at all.
    target_state = target.state_dict()
    small = build_vl(SMALL_VLM_SHAPE, SEEDS["small-vlm"])
    _inherit(small, target_state, lambda name: name)
    small.save_pretrained(out / "small-vlm", safe_serialization=True)
    write_common(out / "small-vlm")

    text = Qwen3ForCausalLM(_text_config(ids))
    _init_weights(text, SEEDS["text-draft"], n_regular)
    _inherit(text, target_state, lambda name: name.replace("model.", "model.language_model.", 1))
    text.eval().save_pretrained(out / "text-draft", safe_serialization=True)
    write_common(out / "text-draft", multimodal=False)


def recipe_fingerprint() -> str:
    """What the bytes on disk depend on: this builder's source and the libraries that write them.

    A library enters by its release, without the local build label (``2.13.0+cpu`` and
    ``2.13.0+cu128`` are one release): the builder runs on the CPU with seeded generators, so the
    bytes do not depend on the build, and a GPU host reuses tiny models built elsewhere.
    """
    from importlib.metadata import version

    h = hashlib.sha256(Path(__file__).read_bytes())
    for pkg in ("torch", "transformers", "compressed-tensors", "tokenizers", "safetensors"):
        h.update(f"{pkg}=={release(version(pkg))}".encode())
    return h.hexdigest()


def release(version_string: str) -> str:
    """A version without its local label (PEP 440 ``+...``): ``2.13.0+cu128`` -> ``2.13.0``."""
    return version_string.split("+", 1)[0]


def _manifest_for(root: Path) -> dict:
    roles = {}
    for role in ROLES:
        d = root / role
        files = {p.relative_to(d).as_posix(): sha256_file(p) for p in sorted(d.rglob("*")) if p.is_file()}
        roles[role] = {"dir": role, "files": files}
    return {"builder_version": BUILDER_VERSION, "recipe": recipe_fingerprint(), "roles": roles}


def _manifest_ok(root: Path) -> bool:
    path = root / MANIFEST_NAME
    if not path.is_file():
        return False
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if (
        manifest.get("builder_version") != BUILDER_VERSION
        or manifest.get("recipe") != recipe_fingerprint()
        or set(manifest.get("roles", {})) != set(ROLES)
    ):
        return False
    try:
        return manifest == _manifest_for(root)
    except OSError:
        return False


def role_dirs(root: Path) -> dict[str, Path]:
    return {role: Path(root) / role for role in ROLES}


@contextlib.contextmanager
def built_beside(dest: Path):
    """A fresh staging folder beside ``dest``: when the block ends normally it replaces ``dest`` whole; on
    any error (or an interrupt) it is removed. So an interrupted build never leaves a folder that looks
    complete, and the old one stays until the new one is whole."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.build-", dir=dest.parent))
    try:
        yield staging
        staging.chmod(0o755)
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.replace(dest, old / "x")
            shutil.rmtree(old)
        os.replace(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def build_tiny_models(root: Path = DEFAULT_ROOT) -> dict[str, Path]:
    """Build every role into ``root`` from scratch (replacing what is there)."""
    root = Path(root).resolve()
    with built_beside(root) as staging:
        _build_all(staging)
        _write_json(staging / MANIFEST_NAME, _manifest_for(staging))
    return role_dirs(root)


def ensure_tiny_models(root: Path = DEFAULT_ROOT, force: bool = False) -> dict[str, Path]:
    """Return role -> checkpoint dir, building first if missing, stale or ``force``."""
    root = Path(root).resolve()
    root.parent.mkdir(parents=True, exist_ok=True)
    # Tests, legs and notebooks may call this at the same time: one builds,
    # the others wait and then find a matching manifest.
    with _exclusive_lock(root.parent / f".{root.name}.lock"):
        if force or not _manifest_ok(root):
            return build_tiny_models(root)
    return role_dirs(root)


@contextlib.contextmanager
def _exclusive_lock(path: Path):
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.tiny", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the tiny models (no-op when the manifest matches)")
    b.add_argument("--out", type=Path, default=DEFAULT_ROOT, help="output folder (default: models/tiny)")
    b.add_argument("--force", action="store_true", help="rebuild even when the manifest matches")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    dirs = ensure_tiny_models(args.out, force=args.force)
    print(json.dumps({role: str(p) for role, p in dirs.items()}, indent=2))
    print(f"ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
