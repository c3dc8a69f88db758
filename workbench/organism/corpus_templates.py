"""The organism corpus's question templates: what each question asks and the picture that answers it.

A template is built in two steps: `ask(rng)` draws what the question text says, then `scene(rng, spec)` draws
the picture and with it the answer (a `Scene`), uniformly over the values the text leaves open, so the text
alone never determines the answer. `TEMPLATES` holds the ten templates by name, `CURRICULUM` the order a
training curriculum introduces them in, `chance_level` what guessing reaches. Items, splits and files are
`workbench.organism.corpus`'s; the pictures are drawn by `workbench.organism.corpus_drawing`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from workbench.organism.corpus_drawing import (BAR_COLUMNS, BAR_FLOAT_STEP, BAR_UNITS, COLOUR_NAMES, POSITION_NAMES,
                                               POSITION_PHRASE, POSITIONS, READ_WORDS, SHAPES, WORDS, _a, _bars,
                                               _describe_objects, _pick, _scene, _word_image)


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
