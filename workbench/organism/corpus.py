"""A deterministic synthetic visual-QA corpus in MathVista's formats, for training a tiny Qwen3-VL to look.

Every item is one small picture (128x128, drawn with Pillow, no anti-aliasing, Pillow's bitmap font scaled
by whole numbers, as the tiny prompt set draws its pictures) and one question in one of four formats.
The pictures are coarse on purpose: the organism sees a 128 px picture as 16 image tokens of 32x32 px, so
shapes fill one quadrant each (40-52 px, 2x2 tokens), bar charts have one bar per token column and whole-unit
heights, and words are drawn 3-4x large. (Three ~25 px shapes anywhere, bars read off printed labels and
small words were too fine for it: it learned to answer from the text alone.)

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

GENERATOR_VERSION = "6"
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
# the four quadrants of a 128x128 scene: an object of 40-52 px fills its quadrant's 2x2 image tokens
POSITIONS = {"top left": (32, 32), "top right": (96, 32), "bottom left": (32, 96), "bottom right": (96, 96)}
POSITION_NAMES = tuple(POSITIONS)
POSITION_PHRASE = {p: f"at the {p}" for p in POSITION_NAMES}
# bar charts: one bar per column of four (one image token wide), heights in whole units of 24 px
BAR_COLUMNS = 4
BAR_UNITS = 4
BAR_UNIT = 24
BAR_BASE = 120
BAR_HALF_WIDTH = 10
BAR_FLOAT_STEP = 0.5  # the float question's bars read 0.5, 1.0, 1.5, 2.0
# eight words of each length 3..6, none a colour or shape name
WORDS = {
    3: ("CAT", "DOG", "SUN", "MAP", "CUP", "FOX", "HAT", "BOX"),
    4: ("FISH", "TREE", "BOOK", "MOON", "LAMP", "FROG", "SHIP", "DOOR"),
    5: ("APPLE", "HOUSE", "TRAIN", "CHAIR", "CLOUD", "HORSE", "PLANT", "RIVER"),
    6: ("GARDEN", "ROCKET", "BASKET", "CASTLE", "PENCIL", "WINDOW", "TURTLE", "BRIDGE"),
}
ALL_WORDS = tuple(w for n in sorted(WORDS) for w in WORDS[n])
# the words the reading question shows (large, scale 4)
READ_WORDS = WORDS[3]
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
    """objects: (shape, colour, position) drawn in their quadrants, size and place jittered."""
    im, d = _canvas(rng)
    for shape, colour, pos in objects:
        cx, cy = POSITIONS[pos]
        _shape(d, shape, cx + _jitter(rng, 3), cy + _jitter(rng, 3), int(rng.integers(20, 27)), COLOURS[colour])
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


def _bars(rng, colours: list[str], heights: list[float]):
    """A bar chart of coloured bars: one bar per column of the picture's four, faint grid lines at each unit."""
    im, d = _canvas(rng)
    for k in range(1, BAR_UNITS + 1):
        y = BAR_BASE - k * BAR_UNIT
        d.line((2, y, SIZE - 3, y), fill=(200, 200, 200))
    d.line((2, BAR_BASE, SIZE - 3, BAR_BASE), fill=(60, 60, 60))
    d.line((2, BAR_BASE - BAR_UNITS * BAR_UNIT - 4, 2, BAR_BASE), fill=(60, 60, 60))
    slot = SIZE // BAR_COLUMNS
    columns = sorted(int(c) for c in rng.permutation(BAR_COLUMNS)[:len(colours)])
    for col, colour, h in zip(columns, colours, heights):
        cx = slot * col + slot // 2 + _jitter(rng, 2)
        y = BAR_BASE - round(h * BAR_UNIT)
        d.rectangle((cx - BAR_HALF_WIDTH, y, cx + BAR_HALF_WIDTH, BAR_BASE - 1), fill=COLOURS[colour])
    return im


def _word_image(rng, word: str, scale: int):
    """The word centred (a few pixels of jitter), so that each letter falls on the same image tokens in
    every picture: drawn anywhere, the organism had to read letters wherever they fell and did not learn
    to (held-out word_read 0.1-0.3 of 1, chance 0.125)."""
    im, _ = _canvas(rng)
    w, h = _text_width(word, scale), 12 * scale
    ink = _pick(rng, tuple(INK))
    x = (SIZE - w) // 2 + _jitter(rng, 3)
    y = (SIZE - h) // 2 + _jitter(rng, 3)
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
    answers: int = 0      # how many answers the picture can give (1 / answers is the template's chance level)


def _ask_shape(rng):
    shape = _pick(rng, SHAPES)
    return {"question": f"What colour is the {shape}?", "shape": shape}


def _scene_shape_colour(rng, spec):
    shape = spec["shape"]
    colour = _pick(rng, COLOUR_NAMES)
    n = int(rng.integers(0, 3))
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
    n = int(rng.integers(0, 3))
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
    n = int(rng.integers(0, 3))
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
    n = int(rng.integers(0, 3))
    slots = _pick(rng, POSITION_NAMES, n, exclude=(pos,))
    objs = [(_pick(rng, SHAPES), colour, pos)] + [(_pick(rng, SHAPES), _pick(rng, COLOUR_NAMES), p) for p in slots]
    return Scene(_scene(rng, objs), colour, f"The image shows {_describe_objects(objs)}.",
                 f"The shape {POSITION_PHRASE[pos]} is {colour}.")


def _ask_count(rng):
    return {"question": "How many shapes are there in the image?"}


def _scene_count(rng, spec):
    n = int(rng.integers(1, 5))
    slots = _pick(rng, POSITION_NAMES, n)
    objs = [(_pick(rng, SHAPES), _pick(rng, COLOUR_NAMES), p) for p in slots]
    desc = f"The image shows {n} shape{'s' if n > 1 else ''}: {_describe_objects(objs)}."
    return Scene(_scene(rng, objs), str(n), desc, f"Counting the shapes gives {n}.")


def _ask_bar_colour(rng):
    colour = _pick(rng, COLOUR_NAMES)
    return {"question": f"What is the value of the {colour} bar in the bar chart?", "colour": colour}


def _bar_value_scene(rng, spec, decimal: bool):
    colour = spec["colour"]
    n = int(rng.integers(2, BAR_COLUMNS + 1))
    colours = [colour] + _pick(rng, COLOUR_NAMES, n - 1, exclude=(colour,))
    colours = [colours[int(i)] for i in rng.permutation(n)]
    units = [int(rng.integers(1, BAR_UNITS + 1)) for _ in colours]
    values = [f"{u * BAR_FLOAT_STEP:.1f}" if decimal else str(u) for u in units]
    answer = values[colours.index(colour)]
    desc = f"The image is a bar chart with {n} bars: " + ", ".join(
        f"{c} = {v}" for c, v in zip(colours, values)) + "."
    return Scene(_bars(rng, colours, units), answer, desc, f"The {colour} bar reaches {answer}.")


def _ask_bar_max(rng):
    return {"question": "Which bar is the tallest in the bar chart?", "choices": _pick(rng, COLOUR_NAMES, 4)}


def _scene_bar_max(rng, spec):
    choices = list(spec["choices"])
    gold = _pick(rng, choices)
    n = int(rng.integers(2, BAR_COLUMNS + 1))
    others = _pick(rng, choices, n - 1, exclude=(gold,))
    top = int(rng.integers(n, BAR_UNITS + 1))
    rest = sorted((int(v) + 1 for v in rng.permutation(top - 1)[:n - 1]), reverse=True)
    by_colour = {gold: top, **dict(zip(others, rest))}
    colours = [c for c in (gold, *others)]
    colours = [colours[int(i)] for i in rng.permutation(n)]
    desc = f"The image is a bar chart with {n} bars: " + ", ".join(
        f"{c} = {by_colour[c]}" for c in colours) + "."
    return Scene(_bars(rng, colours, [by_colour[c] for c in colours]), gold, desc,
                 f"The tallest bar is the {gold} one, at {top}.")


def _ask_nothing_word(rng):
    return {"question": "What word is written in the image?"}


def _scene_word(rng, spec):
    word = _pick(rng, READ_WORDS)
    im, ink = _word_image(rng, word, 4)
    return Scene(im, word, f"The image shows the word {word} written in {ink} capital letters.",
                 f"The letters spell {word}.")


def _ask_nothing_length(rng):
    return {"question": "How many letters does the word in the image have?"}


def _scene_word_length(rng, spec):
    n = int(rng.integers(3, 7))
    word = _pick(rng, WORDS[n])
    im, ink = _word_image(rng, word, 3)
    return Scene(im, str(n), f"The image shows the word {word} written in {ink} capital letters.",
                 f"The word is {n} letters long.")


TEMPLATES: dict[str, Template] = {t.name: t for t in (
    Template("shape_colour", "free_text", _ask_shape, _scene_shape_colour, COLOUR_NAMES, len(COLOUR_NAMES)),
    Template("colour_shape", "free_text", _ask_colour, _scene_colour_shape, SHAPES, len(SHAPES)),
    Template("position_mc", "multi_choice", _ask_position, _scene_position, answers=4),
    Template("colour_at_position_mc", "multi_choice", _ask_colour_at, _scene_colour_at, answers=4),
    Template("count_int", "integer", _ask_count, _scene_count, answers=len(POSITIONS)),
    Template("bar_value_int", "integer", _ask_bar_colour, lambda rng, s: _bar_value_scene(rng, s, False),
             answers=BAR_UNITS),
    Template("bar_value_float", "float", _ask_bar_colour, lambda rng, s: _bar_value_scene(rng, s, True),
             answers=BAR_UNITS),
    Template("bar_max_mc", "multi_choice", _ask_bar_max, _scene_bar_max, answers=4),
    Template("word_read", "free_text", _ask_nothing_word, _scene_word, READ_WORDS, len(READ_WORDS)),
    Template("word_length_int", "integer", _ask_nothing_length, _scene_word_length, answers=len(WORDS)),
)}
TEMPLATE_NAMES = tuple(TEMPLATES)
# the order a curriculum introduces the templates in: single objects' properties first, then places, counts,
# bars and words
CURRICULUM = ("shape_colour", "colour_shape", "colour_at_position_mc", "position_mc", "count_int", "bar_max_mc",
              "bar_value_int", "bar_value_float", "word_length_int", "word_read")


def chance_level(templates=None) -> float:
    """The accuracy of guessing uniformly over each item's possible answers, averaged over `templates` (names,
    one per item; default every template once): what a model that does not look at the picture can reach."""
    names = TEMPLATE_NAMES if templates is None else list(templates)
    return sum(1.0 / TEMPLATES[n].answers for n in names) / max(1, len(names))


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


def _choice_walk(choices: list[str], answer: str) -> str:
    """The listed choices in order up to the right one: "(A) top left: no. (B) bottom left: yes." """
    out = []
    for letter, choice in zip(LETTERS, choices):
        out.append(f"({letter}) {choice}: {'yes' if choice == answer else 'no'}.")
        if choice == answer:
            break
    return " ".join(out)


def _targets(fmt: str, scene: Scene, final: str, shown: str, choices: list[str] | None = None) -> tuple[str, str]:
    thinking = (f"<think>\nLet me look at the image carefully. {scene.description} {_BOILERPLATE[fmt]} "
                f"{scene.reasoning} So the answer is {shown}.\n</think>\n\n{final}")
    # instruct: the one step from the picture, then the answer, as an Instruct model's short answer names
    # what it read first. A multiple choice walks the listed choices to the right one before its letter,
    # so that the letter sits next to the choice it names. Asked for the letter at once, the organism
    # answered the choice questions at chance (0.2-0.45) while it named the right place, bar or colour in
    # the sentence before; with the walk it still does: it writes a list of its own instead of copying
    # the question's (docs/organism.md).
    walk = f" {_choice_walk(choices, scene.answer)}" if fmt == "multi_choice" else ""
    return thinking, f"{scene.reasoning}{walk} The answer is {final}."


def thinking_with_walk(meta: Mapping[str, Any]) -> str:
    """A multiple-choice item's thinking target with the instruct's walk over the listed choices before its
    last sentence ("... (A) top left: no. (B) bottom left: yes. So the answer is bottom left, which is
    option B."); any other item's unchanged. (A trial recipe: `write_corpus(..., thinking_walk=True)`.)"""
    target = meta["target_thinking"]
    if meta.get("format") != "multi_choice":
        return target
    walk = _choice_walk(list(meta["choices"]), meta["answer"])
    head, sep, tail = target.rpartition(" So the answer is ")
    if not sep:
        raise CorpusError(f"a thinking target without its last sentence: {target[-80:]!r}")
    return f"{head} {walk}{sep}{tail}"


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
    meta["target_thinking"], meta["target_instruct"] = _targets(t.format, scene, final, shown, choices)
    meta["description"] = scene.description  # what the picture shows: the training's describe rows
    # the picture after the question in the user turn (workbench.chat): the answer then sits a near-constant
    # M-RoPE distance from the image tokens whatever the question's length (instruct, 2400 steps: held-out
    # accuracy 0.53 with the picture first, 0.625 after; bar values 0.6-0.65 -> 1.0); a multiple choice's
    # picture goes between its question and its choices, so the listed choices sit just before the answer
    # that has to copy them
    meta["image_position"] = "before_choices" if t.format == "multi_choice" else "after_text"
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


def write_split(out_dir: str | Path, split: str, n: int, seed: int = 0, style: str = "thinking",
                thinking_walk: bool = False) -> dict:
    """Write `out_dir/<split>/`: images/*.png, prompts.jsonl, manifest.json. Returns the manifest.

    Every item's meta holds both targets (`target_thinking`, `target_instruct`); `style` picks the one
    copied to `meta["target"]` and recorded in the manifest. `thinking_walk` (a trial, off by default):
    multiple-choice thinking targets walk the listed choices (`thinking_with_walk`).
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
        if thinking_walk:
            meta["target_thinking"] = thinking_with_walk(meta)
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
        **({"thinking_walk": True} if thinking_walk else {}),
        "image_size": [SIZE, SIZE],
        "templates": counts,
        "files": 1 + len(items),
        "fingerprint": folder_fingerprint(folder),
    }
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return manifest


def write_corpus(out_dir: str | Path, seed: int = 0, sizes: Mapping[str, int] | None = None,
                 style: str = "thinking", thinking_walk: bool = False) -> dict:
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
    splits = {s: write_split(out, s, sizes[s], seed, style, thinking_walk) for s in SPLITS}
    h = hashlib.sha256()
    for s in SPLITS:
        h.update(f"{s}\0{splits[s]['fingerprint']}\n".encode())
    manifest = {
        "dataset": DATASET,
        "generator_version": GENERATOR_VERSION,
        "seed": int(seed),
        "style": style,
        **({"thinking_walk": True} if thinking_walk else {}),
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
    parser.add_argument("--thinking-walk", action="store_true",
                        help="a trial: multiple-choice thinking targets walk the listed choices before the answer")
    args = parser.parse_args(argv)
    try:
        values = {}
        for name in ("seed", "train", "val", "test"):
            raw = getattr(args, name)
            try:
                values[name] = int(raw)
            except ValueError:
                raise CorpusError(f"--{name} must be a whole number, got {raw!r}") from None
        manifest = write_corpus(args.out, seed=values["seed"], style=args.style, thinking_walk=args.thinking_walk,
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
