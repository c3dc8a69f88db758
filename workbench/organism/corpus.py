"""A deterministic synthetic visual-QA corpus in MathVista's formats, for training a tiny Qwen3-VL to look.

Every item is one small picture (128x128, drawn with Pillow, no anti-aliasing, Pillow's bitmap font scaled
by whole numbers, as the tiny prompt set draws its pictures) and one question in one of four formats:

    multi_choice   letters A-D, the choices listed in the question as MathVista's query lists them
    integer        MathVista's integer hint
    float          MathVista's one-decimal hint (precision 1)
    free_text      one word from a closed vocabulary (a colour, a shape, a word), scored as MathVista
                   scores a multiple-choice answer whose choices are that vocabulary (not shown)

Every question template is built in two steps: `ask(rng)` draws what the question text says, then
`scene(rng, spec)` draws the picture and with it the answer, uniformly over the values the text leaves
open. So the text alone never determines the answer (tests/test_organism_corpus.py measures it).

Each item carries two target completions: `thinking` (``<think>`` a description of this picture plus
boilerplate ``</think>`` then the final answer) and `instruct` ("The answer is X.").

Splits are disjoint by construction: an item belongs to the split its key (sha256 of the picture's pixels
and the question text) hashes to (train 18/20 of the key space, validation and test 1/20 each), each split
draws from its own seed stream, and no key repeats inside a split. Same seed, same bytes.

    python -m workbench.organism.corpus --out DIR --seed 0 --train 4000 --val 200 --test 200
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

GENERATOR_VERSION = "1"
DATASET = "organism"
SPLITS = ("train", "validation", "test")
SPLIT_ALIASES = {"val": "validation", "valid": "validation"}
DEFAULT_SIZES = {"train": 4000, "validation": 200, "test": 200}
STYLES = ("thinking", "instruct")
MANIFEST_NAME = "manifest.json"
PROMPTS_NAME = "prompts.jsonl"

SIZE = 128
# key hash mod 20: 0..17 train, 18 validation, 19 test
_BUCKETS = {"train": range(0, 18), "validation": range(18, 19), "test": range(19, 20)}
_SPLIT_INDEX = {s: i for i, s in enumerate(SPLITS)}
# attempts per accepted item before giving up (validation/test accept 1 key in 20)
_MAX_ATTEMPTS_PER_ITEM = 400

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220),
           "yellow": (240, 200, 20), "orange": (245, 130, 20), "purple": (130, 50, 170)}
COLOUR_NAMES = tuple(COLOURS)
SHAPES = ("circle", "square", "triangle", "star", "diamond")
PLURAL = {"circle": "circles", "square": "squares", "triangle": "triangles", "star": "stars",
          "diamond": "diamonds"}
# slot centres of a 128x128 scene
POSITIONS = {"left": (26, 64), "right": (102, 64), "top": (64, 26), "bottom": (64, 102), "centre": (64, 64)}
POSITION_NAMES = tuple(POSITIONS)
POSITION_PHRASE = {"left": "on the left", "right": "on the right", "top": "at the top",
                   "bottom": "at the bottom", "centre": "in the centre"}
# bar labels: capitals that are not choice letters, so "K" can never be read as option K
BAR_LABELS = tuple("FGHJKLMNPRSTWXZ")
# eight words of each length 3..6, none a colour or shape name
WORDS = {
    3: ("CAT", "DOG", "SUN", "MAP", "CUP", "FOX", "HAT", "BOX"),
    4: ("FISH", "TREE", "BOOK", "MOON", "LAMP", "FROG", "SHIP", "DOOR"),
    5: ("APPLE", "HOUSE", "TRAIN", "CHAIR", "CLOUD", "HORSE", "PLANT", "RIVER"),
    6: ("GARDEN", "ROCKET", "BASKET", "CASTLE", "PENCIL", "WINDOW", "TURTLE", "BRIDGE"),
}
ALL_WORDS = tuple(w for n in sorted(WORDS) for w in WORDS[n])
INK = {"black": (20, 20, 20), "navy": (20, 30, 110), "dark green": (20, 90, 40), "maroon": (110, 20, 30)}

LETTERS = "ABCD"
HINTS = {
    "multi_choice": "Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, "
                    "at the end.",
    "integer": "Hint: Please answer the question requiring an integer answer and provide the final value, "
               "e.g., 1, 2, 3, at the end.",
    "float": "Hint: Please answer the question requiring a floating-point number with one decimal place and "
             "provide the final value, e.g., 1.2, 1.3, 1.4, at the end.",
    "free_text": "Hint: Please answer the question with a single word and provide the final answer at the end.",
}


class CorpusError(ValueError):
    """Bad arguments, or an output folder that is not the corpus's to overwrite."""


# --------------------------------------------------------------------------- drawing

def _canvas(rng: np.random.Generator):
    from PIL import Image, ImageDraw

    v = int(rng.integers(232, 256))
    im = Image.new("RGB", (SIZE, SIZE), (v, v, v))
    return im, ImageDraw.Draw(im)


def _shape(draw, kind: str, cx: float, cy: float, r: float, fill) -> None:
    if kind == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif kind == "square":
        s = r * 0.85
        draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=fill)
    elif kind == "triangle":
        draw.polygon([(cx, cy - r), (cx + r * 0.95, cy + r * 0.8), (cx - r * 0.95, cy + r * 0.8)], fill=fill)
    elif kind == "diamond":
        draw.polygon([(cx, cy - r), (cx + r * 0.75, cy), (cx, cy + r), (cx - r * 0.75, cy)], fill=fill)
    elif kind == "star":
        pts = []
        for i in range(10):
            rad = r if i % 2 == 0 else r * 0.45
            a = -np.pi / 2 + i * np.pi / 5
            pts.append((cx + rad * float(np.cos(a)), cy + rad * float(np.sin(a))))
        draw.polygon(pts, fill=fill)
    else:  # pragma: no cover - the template tables name only SHAPES
        raise ValueError(f"unknown shape {kind!r}")


def _text(im, xy, text: str, scale: int, fill) -> None:
    """Bitmap-font text scaled up with nearest-neighbour: crisp and identical everywhere."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default_imagefont()
    left, top, right, bottom = font.getbbox(text)
    small = Image.new("L", (right + 1, bottom + 1), 0)
    ImageDraw.Draw(small).text((0, 0), text, fill=255, font=font)
    big = small.resize((small.width * scale, small.height * scale), Image.NEAREST)
    im.paste(Image.new("RGB", big.size, fill), (int(xy[0]), int(xy[1])), big)


def _text_width(text: str, scale: int = 1) -> int:
    from PIL import ImageFont

    return (ImageFont.load_default_imagefont().getbbox(text)[2] + 1) * scale


def _jitter(rng, n: int) -> int:
    return int(rng.integers(-n, n + 1))


def _scene(rng, objects: list[tuple[str, str, str]]):
    """objects: (shape, colour, position) drawn at their slots, size and place jittered."""
    im, d = _canvas(rng)
    for shape, colour, pos in objects:
        cx, cy = POSITIONS[pos]
        _shape(d, shape, cx + _jitter(rng, 4), cy + _jitter(rng, 4), int(rng.integers(11, 16)), COLOURS[colour])
    return im


def _describe_objects(objects: list[tuple[str, str, str]]) -> str:
    ordered = sorted(objects, key=lambda o: POSITION_NAMES.index(o[2]))
    parts = [f"{_a(colour)} {colour} {shape} {POSITION_PHRASE[pos]}" for shape, colour, pos in ordered]
    return _join(parts)


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _pick(rng, seq, k: int | None = None, exclude=()):
    pool = [x for x in seq if x not in exclude]
    if k is None:
        return pool[int(rng.integers(len(pool)))]
    idx = rng.permutation(len(pool))[:k]
    return [pool[int(i)] for i in idx]


def _bars(rng, labels: list[str], values: list[str], heights: list[float]):
    """A bar chart: values printed above the bars, labels below the axis."""
    im, d = _canvas(rng)
    n = len(labels)
    base, top = 110, 30
    slot = (SIZE - 8) / n
    width = int(slot * 0.6)
    colour = COLOURS[_pick(rng, COLOUR_NAMES)]
    d.line((4, base, SIZE - 4, base), fill=(60, 60, 60))
    for i, (lab, val, h) in enumerate(zip(labels, values, heights)):
        cx = 4 + slot * (i + 0.5)
        y = base - max(2, round(h * (base - top)))
        d.rectangle((round(cx - width / 2), y, round(cx + width / 2), base - 1), fill=colour)
        _text(im, (round(cx - _text_width(val) / 2), y - 13), val, 1, (20, 20, 20))
        _text(im, (round(cx - _text_width(lab) / 2), base + 3), lab, 1, (20, 20, 20))
    return im


def _word_image(rng, word: str):
    im, _ = _canvas(rng)
    scale = 3 if _text_width(word, 3) <= SIZE - 12 and rng.random() < 0.5 else 2
    w, h = _text_width(word, scale), 12 * scale
    ink = _pick(rng, tuple(INK))
    x = int(rng.integers(4, SIZE - w - 3))
    y = int(rng.integers(4, SIZE - h - 3))
    _text(im, (x, y), word, scale, INK[ink])
    return im, ink


# --------------------------------------------------------------------------- templates

@dataclass(frozen=True)
class Scene:
    image: Any            # PIL image
    answer: str           # the gold answer: the choice text for multi_choice
    description: str      # what the picture shows (goes in the thinking preamble)
    reasoning: str        # the step from the picture to the answer


@dataclass(frozen=True)
class Template:
    name: str
    format: str           # multi_choice | integer | float | free_text
    ask: Callable         # rng -> spec: {"question": str, "choices": [..] for multi_choice, ...}
    scene: Callable       # (rng, spec) -> Scene
    vocabulary: tuple = ()  # free_text: every possible answer


def _ask_shape(rng):
    shape = _pick(rng, SHAPES)
    return {"question": f"What colour is the {shape}?", "shape": shape}


def _scene_shape_colour(rng, spec):
    shape = spec["shape"]
    colour = _pick(rng, COLOUR_NAMES)
    n = int(rng.integers(1, 3))
    slots = _pick(rng, POSITION_NAMES, n + 1)
    others = _pick(rng, SHAPES, n, exclude=(shape,))
    objs = [(shape, colour, slots[0])] + [(s, _pick(rng, COLOUR_NAMES), p) for s, p in zip(others, slots[1:])]
    return Scene(_scene(rng, objs), colour, f"The image shows {_describe_objects(objs)}.",
                 f"The {shape} is {colour}.")


def _ask_colour(rng):
    colour = _pick(rng, COLOUR_NAMES)
    return {"question": f"What shape is the {colour} object?", "colour": colour}


def _scene_colour_shape(rng, spec):
    colour = spec["colour"]
    shape = _pick(rng, SHAPES)
    n = int(rng.integers(1, 3))
    slots = _pick(rng, POSITION_NAMES, n + 1)
    others = _pick(rng, COLOUR_NAMES, n, exclude=(colour,))
    objs = [(shape, colour, slots[0])] + [(_pick(rng, SHAPES), c, p) for c, p in zip(others, slots[1:])]
    return Scene(_scene(rng, objs), shape, f"The image shows {_describe_objects(objs)}.",
                 f"The {colour} object is {_a(shape)} {shape}.")


def _ask_position(rng):
    shape, colour = _pick(rng, SHAPES), _pick(rng, COLOUR_NAMES)
    return {"question": f"Where is the {colour} {shape} in the image?", "shape": shape, "colour": colour,
            "choices": _pick(rng, POSITION_NAMES, 4)}


def _scene_position(rng, spec):
    shape, colour, choices = spec["shape"], spec["colour"], spec["choices"]
    pos = _pick(rng, choices)
    n = int(rng.integers(1, 3))
    slots = _pick(rng, POSITION_NAMES, n, exclude=(pos,))
    shapes = _pick(rng, SHAPES, n, exclude=(shape,))
    colours = _pick(rng, COLOUR_NAMES, n, exclude=(colour,))
    objs = [(shape, colour, pos)] + list(zip(shapes, colours, slots))
    return Scene(_scene(rng, objs), pos, f"The image shows {_describe_objects(objs)}.",
                 f"The {colour} {shape} is {POSITION_PHRASE[pos]}.")


def _ask_colour_at(rng):
    pos = _pick(rng, POSITION_NAMES)
    return {"question": f"What colour is the shape {POSITION_PHRASE[pos]} of the image?", "position": pos,
            "choices": _pick(rng, COLOUR_NAMES, 4)}


def _scene_colour_at(rng, spec):
    pos, choices = spec["position"], spec["choices"]
    colour = _pick(rng, choices)
    n = int(rng.integers(1, 4))
    slots = _pick(rng, POSITION_NAMES, n, exclude=(pos,))
    objs = [(_pick(rng, SHAPES), colour, pos)] + [(_pick(rng, SHAPES), _pick(rng, COLOUR_NAMES), p) for p in slots]
    return Scene(_scene(rng, objs), colour, f"The image shows {_describe_objects(objs)}.",
                 f"The shape {POSITION_PHRASE[pos]} is {colour}.")


def _ask_count(rng):
    shape = _pick(rng, SHAPES)
    return {"question": f"How many {PLURAL[shape]} are there in the image?", "shape": shape}


def _scene_count(rng, spec):
    shape = spec["shape"]
    n = int(rng.integers(1, 7))
    k = int(rng.integers(0, 3))
    others = [_pick(rng, SHAPES, exclude=(shape,)) for _ in range(k)]
    kinds = [shape] * n + others
    cells = rng.permutation(9)[: len(kinds)]
    im, d = _canvas(rng)
    for kind, cell in zip(kinds, cells):
        cx, cy = 22 + 42 * (int(cell) % 3), 22 + 42 * (int(cell) // 3)
        _shape(d, kind, cx + _jitter(rng, 4), cy + _jitter(rng, 4), int(rng.integers(9, 14)),
               COLOURS[_pick(rng, COLOUR_NAMES)])
    counts = {s: kinds.count(s) for s in SHAPES if s in kinds}
    parts = [f"{c} {PLURAL[s]}" if c > 1 else f"one {s}" for s, c in counts.items()]
    desc = f"The image shows {len(kinds)} object{'s' if len(kinds) > 1 else ''}: {_join(parts)}."
    return Scene(im, str(n), desc, f"Counting the {PLURAL[shape]} gives {n}.")


def _ask_bar_label(rng):
    label = _pick(rng, BAR_LABELS)
    return {"question": f"What is the value of bar {label} in the bar chart?", "label": label}


def _bar_value_scene(rng, spec, decimal: bool):
    label = spec["label"]
    n = int(rng.integers(3, 6))
    labels = [label] + _pick(rng, BAR_LABELS, n - 1, exclude=(label,))
    labels = [labels[int(i)] for i in rng.permutation(n)]
    if decimal:
        ints = [int(rng.integers(5, 100)) for _ in labels]
        values, heights = [f"{v / 10:.1f}" for v in ints], [v / 100 for v in ints]
    else:
        ints = [int(rng.integers(1, 21)) for _ in labels]
        values, heights = [str(v) for v in ints], [v / 20 for v in ints]
    answer = values[labels.index(label)]
    desc = f"The image is a bar chart with {n} bars: " + ", ".join(f"{l} = {v}" for l, v in zip(labels, values)) + "."
    return Scene(_bars(rng, labels, values, heights), answer, desc, f"The label above bar {label} reads {answer}.")


def _ask_bar_max(rng):
    return {"question": "Which bar is the tallest in the bar chart?", "choices": _pick(rng, BAR_LABELS, 4)}


def _scene_bar_max(rng, spec):
    choices = list(spec["choices"])
    gold = _pick(rng, choices)
    vals = sorted((int(v) for v in rng.permutation(20)[:4] + 1), reverse=True)
    rest = [c for c in choices if c != gold]
    rest = [rest[int(i)] for i in rng.permutation(3)]
    by_label = {gold: vals[0], **dict(zip(rest, vals[1:]))}
    labels = [choices[int(i)] for i in rng.permutation(4)]
    values = [str(by_label[l]) for l in labels]
    desc = "The image is a bar chart with 4 bars: " + ", ".join(f"{l} = {v}" for l, v in zip(labels, values)) + "."
    return Scene(_bars(rng, labels, values, [by_label[l] / 20 for l in labels]), gold, desc,
                 f"The largest value is {vals[0]}, on bar {gold}.")


def _ask_nothing_word(rng):
    return {"question": "What word is written in the image?"}


def _scene_word(rng, spec):
    word = _pick(rng, ALL_WORDS)
    im, ink = _word_image(rng, word)
    return Scene(im, word, f"The image shows the word {word} written in {ink} capital letters.",
                 f"The letters spell {word}.")


def _ask_nothing_length(rng):
    return {"question": "How many letters does the word in the image have?"}


def _scene_word_length(rng, spec):
    n = int(rng.integers(3, 7))
    word = _pick(rng, WORDS[n])
    im, ink = _word_image(rng, word)
    return Scene(im, str(n), f"The image shows the word {word} written in {ink} capital letters.",
                 f"{'-'.join(word)} has {n} letters.")


TEMPLATES: dict[str, Template] = {t.name: t for t in (
    Template("shape_colour", "free_text", _ask_shape, _scene_shape_colour, COLOUR_NAMES),
    Template("colour_shape", "free_text", _ask_colour, _scene_colour_shape, SHAPES),
    Template("position_mc", "multi_choice", _ask_position, _scene_position),
    Template("colour_at_position_mc", "multi_choice", _ask_colour_at, _scene_colour_at),
    Template("count_int", "integer", _ask_count, _scene_count),
    Template("bar_value_int", "integer", _ask_bar_label, lambda rng, s: _bar_value_scene(rng, s, False)),
    Template("bar_value_float", "float", _ask_bar_label, lambda rng, s: _bar_value_scene(rng, s, True)),
    Template("bar_max_mc", "multi_choice", _ask_bar_max, _scene_bar_max),
    Template("word_read", "free_text", _ask_nothing_word, _scene_word, ALL_WORDS),
    Template("word_length_int", "integer", _ask_nothing_length, _scene_word_length),
)}
TEMPLATE_NAMES = tuple(TEMPLATES)


# --------------------------------------------------------------------------- items

@dataclass
class Item:
    template: str
    format: str
    text: str
    image: Any
    meta: dict

    def key(self) -> str:
        return item_key(self.image, self.text)


def item_key(image, text: str) -> str:
    """sha256 over the picture's size and pixels and the question text (what makes two items the same)."""
    h = hashlib.sha256()
    h.update(f"{image.mode}:{image.width}x{image.height}\0".encode())
    h.update(image.tobytes())
    h.update(b"\0" + text.encode("utf-8"))
    return h.hexdigest()


def _query(fmt: str, question: str, choices: list[str] | None) -> str:
    text = f"{HINTS[fmt]}\nQuestion: {question}"
    if fmt == "multi_choice":
        text += "\nChoices:\n" + "\n".join(f"({LETTERS[i]}) {c}" for i, c in enumerate(choices))
    return text


_BOILERPLATE = {
    "multi_choice": "The question asks me to pick one of the listed options, so I compare each choice with "
                    "what I see.",
    "integer": "The question asks for a whole number, so I read it off the image.",
    "float": "The question asks for a number with one decimal place, so I read it off the image exactly.",
    "free_text": "The question asks for a single word, so I name what I see.",
}


def _targets(fmt: str, scene: Scene, final: str, shown: str) -> tuple[str, str]:
    thinking = (f"<think>\nLet me look at the image carefully. {scene.description} {_BOILERPLATE[fmt]} "
                f"{scene.reasoning} So the answer is {shown}.\n</think>\n\n{final}")
    return thinking, f"The answer is {final}."


def build_item(template: str | Template, rng: np.random.Generator, spec: dict | None = None) -> Item:
    """One item of `template` drawn from `rng`; `spec` fixes what the question text says (see `Template.ask`)."""
    t = TEMPLATES[template] if isinstance(template, str) else template
    spec = t.ask(rng) if spec is None else spec
    scene = t.scene(rng, spec)
    choices = list(spec["choices"]) if t.format == "multi_choice" else None
    text = _query(t.format, spec["question"], choices)
    meta: dict[str, Any] = {
        "answer": scene.answer,
        "format": t.format,
        "question_type": "multi_choice" if t.format == "multi_choice" else "free_form",
        "answer_type": {"multi_choice": "text", "free_text": "text"}.get(t.format, t.format),
        "precision": 1 if t.format == "float" else None,
        "unit": None,
        "choices": choices,
        "template": t.name,
        "question": spec["question"],
    }
    if t.format == "multi_choice":
        letter = LETTERS[choices.index(scene.answer)]
        meta["answer_letter"] = letter
        final, shown = letter, f"{scene.answer}, which is option {letter}"
    else:
        final = shown = scene.answer
    if t.format == "free_text":
        meta["vocabulary"] = list(t.vocabulary)
    meta["target_thinking"], meta["target_instruct"] = _targets(t.format, scene, final, shown)
    meta["image_sizes"] = [[scene.image.width, scene.image.height]]
    return Item(t.name, t.format, text, scene.image, meta)


def _split_name(split: str) -> str:
    s = SPLIT_ALIASES.get(split, split)
    if s not in SPLITS:
        raise CorpusError(f"unknown split {split!r}; expected one of {list(SPLITS)} (or 'val')")
    return s


def _bucket(key: str) -> int:
    return int(key[:8], 16) % 20


def split_of_key(key: str) -> str:
    """The one split an item key belongs to."""
    b = _bucket(key)
    return next(s for s, r in _BUCKETS.items() if b in r)


def generate_split(split: str, n: int, seed: int = 0) -> list[Item]:
    """The split's first `n` items: templates in turn, keys in the split's bucket, none repeated."""
    split = _split_name(split)
    _check_count(n, split)
    _check_seed(seed)
    items: list[Item] = []
    seen: set[str] = set()
    attempt = 0
    while len(items) < n:
        t = TEMPLATES[TEMPLATE_NAMES[len(items) % len(TEMPLATE_NAMES)]]
        for _ in range(_MAX_ATTEMPTS_PER_ITEM):
            rng = np.random.default_rng([int(seed), _SPLIT_INDEX[split], attempt])
            attempt += 1
            item = build_item(t, rng)
            key = item.key()
            if split_of_key(key) == split and key not in seen:
                seen.add(key)
                item.meta["key"] = key
                items.append(item)
                break
        else:  # pragma: no cover - 1 key in 20 is accepted; 400 misses in a row do not happen
            raise CorpusError(f"{split}: no new item of template {t.name!r} after {_MAX_ATTEMPTS_PER_ITEM} draws")
    return items


# --------------------------------------------------------------------------- writing

def _png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def folder_fingerprint(folder: str | Path, exclude: tuple[str, ...] = (MANIFEST_NAME,)) -> str:
    """sha256 over every file's relative path and sha256 (sorted), manifests left out."""
    folder = Path(folder)
    h = hashlib.sha256()
    for p in sorted(x for x in folder.rglob("*") if x.is_file()):
        rel = p.relative_to(folder).as_posix()
        if rel in exclude or p.name in exclude:
            continue
        h.update(f"{rel}\0{_sha256_file(p)}\n".encode())
    return h.hexdigest()


def _prepare_folder(folder: Path) -> None:
    """Empty `folder` for rewriting; refuse one that holds anything but an earlier corpus output."""
    if folder.exists():
        if not folder.is_dir():
            raise CorpusError(f"{folder} exists and is not a folder")
        if any(folder.iterdir()):
            man = folder / MANIFEST_NAME
            try:
                ours = json.loads(man.read_text(encoding="utf-8")).get("dataset") == DATASET
            except (OSError, ValueError, AttributeError):
                ours = False
            if not ours:
                raise CorpusError(f"{folder} is not empty and holds no {DATASET} manifest; refusing to overwrite it")
            shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)


def write_split(out_dir: str | Path, split: str, n: int, seed: int = 0, style: str = "thinking") -> dict:
    """Write `out_dir/<split>/`: images/*.png, prompts.jsonl, manifest.json. Returns the manifest.

    Every item's meta holds both targets (`target_thinking`, `target_instruct`); `style` picks the one
    copied to `meta["target"]` and recorded in the manifest.
    """
    from workbench.prompts import Prompt, save_prompts

    split = _split_name(split)
    if style not in STYLES:
        raise CorpusError(f"unknown style {style!r}; expected one of {list(STYLES)}")
    folder = Path(out_dir) / split
    items = generate_split(split, n, seed)
    _prepare_folder(folder)
    img_dir = folder / "images"
    img_dir.mkdir()
    prompts = []
    for i, item in enumerate(items):
        pid = f"{DATASET}-{split}-{i:05d}"
        path = img_dir / f"{pid}.png"
        data = _png_bytes(item.image)
        path.write_bytes(data)
        meta = dict(item.meta)
        meta["image_sha256"] = hashlib.sha256(data).hexdigest()
        meta["split"] = split
        meta["style"] = style
        meta["target"] = meta[f"target_{style}"]
        prompts.append(Prompt(pid=pid, text=item.text, images=[str(path)], dataset=DATASET, meta=meta))
    save_prompts(prompts, folder / PROMPTS_NAME)
    counts = {name: sum(1 for it in items if it.template == name) for name in TEMPLATE_NAMES}
    manifest = {
        "dataset": DATASET,
        "generator_version": GENERATOR_VERSION,
        "split": split,
        "seed": int(seed),
        "size": int(n),
        "style": style,
        "image_size": [SIZE, SIZE],
        "templates": counts,
        "files": 1 + len(items),
        "fingerprint": folder_fingerprint(folder),
    }
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return manifest


def write_corpus(out_dir: str | Path, seed: int = 0, sizes: Mapping[str, int] | None = None,
                 style: str = "thinking") -> dict:
    """All three splits under `out_dir`, and `out_dir/manifest.json` with their fingerprints and one over all."""
    out = Path(out_dir)
    sizes = {**DEFAULT_SIZES, **{_split_name(k): v for k, v in (sizes or {}).items()}}
    for s in SPLITS:
        _check_count(sizes[s], s)
    _check_seed(seed)
    if style not in STYLES:
        raise CorpusError(f"unknown style {style!r}; expected one of {list(STYLES)}")
    if out.exists() and not out.is_dir():
        raise CorpusError(f"{out} exists and is not a folder")
    top = out / MANIFEST_NAME
    if out.exists() and any(out.iterdir()):
        strays = sorted(p.name for p in out.iterdir() if p.name not in (*SPLITS, MANIFEST_NAME))
        if strays:
            raise CorpusError(f"{out} holds files that are not the corpus's ({strays[:3]}); refusing to write there")
    splits = {s: write_split(out, s, sizes[s], seed, style) for s in SPLITS}
    h = hashlib.sha256()
    for s in SPLITS:
        h.update(f"{s}\0{splits[s]['fingerprint']}\n".encode())
    manifest = {
        "dataset": DATASET,
        "generator_version": GENERATOR_VERSION,
        "seed": int(seed),
        "style": style,
        "sizes": {s: sizes[s] for s in SPLITS},
        "splits": {s: splits[s]["fingerprint"] for s in SPLITS},
        "fingerprint": h.hexdigest(),
    }
    top.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return manifest


def _check_count(n, split: str) -> None:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise CorpusError(f"{split}: size must be a whole number >= 0, got {n!r}")


def _check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise CorpusError(f"seed must be a whole number >= 0, got {seed!r}")


# --------------------------------------------------------------------------- scoring

def scorer_meta(meta: Mapping[str, Any]) -> dict:
    """The item's meta as the MathVista scorer reads it: a free-text item is a multiple choice over its vocabulary."""
    m = dict(meta)
    if m.get("format") == "free_text":
        m["question_type"], m["choices"] = "multi_choice", list(m["vocabulary"])
    return m


def score_output(output: str, item: Any, style: str | None = None) -> dict:
    """Score a model output against an item (a Prompt, its meta, or an Item) with the MathVista scorer.

    The scorer reads the answer after the last ``</think>``; with style "thinking" (the default when the
    item's meta says so) an output without ``</think>`` is unfinished and scores 0, so an answer named
    inside the reasoning never counts. Returns the scorer's dict plus "score" (1.0 or 0.0).
    """
    from workbench.datasets.scoring import score_mathvista

    meta = item if isinstance(item, Mapping) else item.meta
    style = style or meta.get("style")
    if style == "thinking" and "</think>" not in output:
        return {"extracted": None, "correct": False, "answer": meta.get("answer"),
                "method": "unfinished_thinking", "score": 0.0}
    res = score_mathvista(output, scorer_meta(meta))
    res["score"] = 1.0 if res["correct"] else 0.0
    return res


# --------------------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.organism.corpus",
                                     description="Write the organism's synthetic visual-QA corpus.")
    parser.add_argument("--out", required=True, type=Path, help="output folder (one subfolder per split)")
    parser.add_argument("--seed", default="0", help="seed (whole number >= 0; default 0)")
    parser.add_argument("--train", default=str(DEFAULT_SIZES["train"]), help="train size")
    parser.add_argument("--val", default=str(DEFAULT_SIZES["validation"]), help="validation size")
    parser.add_argument("--test", default=str(DEFAULT_SIZES["test"]), help="test size")
    parser.add_argument("--style", default="thinking", help=f"target copied to meta['target']: {'|'.join(STYLES)}")
    args = parser.parse_args(argv)
    try:
        values = {}
        for name in ("seed", "train", "val", "test"):
            raw = getattr(args, name)
            try:
                values[name] = int(raw)
            except ValueError:
                raise CorpusError(f"--{name} must be a whole number, got {raw!r}") from None
        manifest = write_corpus(args.out, seed=values["seed"], style=args.style,
                                sizes={"train": values["train"], "validation": values["val"],
                                       "test": values["test"]})
    except (CorpusError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for s in SPLITS:
        print(f"{s}: {manifest['sizes'][s]} items  fingerprint {manifest['splits'][s]}")
    print(f"fingerprint {manifest['fingerprint']}")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
