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

The pictures are drawn in `workbench.organism.corpus_drawing`, the question templates are
`workbench.organism.corpus_templates` (both re-exported here); this module builds items from them, splits,
writes and scores them.

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
from typing import Any, Mapping

import numpy as np

# the pictures and the question templates, re-exported: `corpus.TEMPLATES`, `corpus.COLOURS`, ... as before
from workbench.organism.corpus_drawing import (ALL_WORDS, BAR_BASE, BAR_COLUMNS, BAR_FLOAT_STEP,  # noqa: F401
                                               BAR_HALF_WIDTH, BAR_UNIT, BAR_UNITS, COLOUR_NAMES, COLOURS, INK,
                                               PLURAL, POSITION_NAMES, POSITION_PHRASE, POSITIONS, READ_WORDS,
                                               SHAPES, SIZE, WORDS)
from workbench.organism.corpus_templates import (CURRICULUM, TEMPLATE_NAMES, TEMPLATES, Scene,  # noqa: F401
                                                 Template, chance_level)

GENERATOR_VERSION = "6"
DATASET = "organism"
SPLITS = ("train", "validation", "test")
SPLIT_ALIASES = {"val": "validation", "valid": "validation"}
DEFAULT_SIZES = {"train": 4000, "validation": 200, "test": 200}
STYLES = ("thinking", "instruct")
MANIFEST_NAME = "manifest.json"
PROMPTS_NAME = "prompts.jsonl"

# key hash mod 20: 0..17 train, 18 validation, 19 test
_BUCKETS = {"train": range(0, 18), "validation": range(18, 19), "test": range(19, 20)}
_SPLIT_INDEX = {s: i for i, s in enumerate(SPLITS)}
# attempts per accepted item before giving up (validation/test accept 1 key in 20)
_MAX_ATTEMPTS_PER_ITEM = 400

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
