"""The tiny models' tokenizer (a byte-level BPE learned from a built-in corpus, Qwen's added tokens and
chat template) and their image / video processors."""

from __future__ import annotations

from pathlib import Path

from .files import _write_json


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
