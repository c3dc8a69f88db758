"""The organism's training rows: a corpus item as the text the model is trained on, and batches of them.

A row (`Example`) is the chat-templated prompt (one image placeholder) followed by the target completion and
``<|im_end|>``. Besides an item's own row (its target for the variant, or a distillation target), training
draws three kinds of extra rows from the same item (`workbench.organism.train.Recipe` says how often):

* the describe row: the same picture, ``DESCRIBE_QUESTION``, the scene's description as the target;
* the choices row: a multiple choice's listed choices, ``CHOICES_QUESTION``, the choices copied as the target;
* the match row: the question states the answer's first sentence, the choices are listed in another order and
  the target walks them to the one that matches.

`Collator` turns rows into a batch through the HF processor with labels only on the completion.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from workbench.organism import corpus as C


@dataclass
class Example:
    prompt: object  # workbench.prompts.Prompt
    text: str       # chat-templated prompt (one image placeholder) + target + <|im_end|>
    target: str


def _examples(prompts_path: Path, tokenizer, variant: str, limit: int = 0) -> list[Example]:
    from workbench.prompts import load_prompts

    prompts = load_prompts(prompts_path)
    if limit:
        prompts = prompts[:limit]
    return [_example(p, tokenizer, p.meta[f"target_{variant}"]) for p in prompts]


def _example(prompt, tokenizer, target: str) -> Example:
    """A training row: the chat-templated prompt, then ``target`` and ``<|im_end|>``."""
    from workbench.chat import render_prompt

    return Example(prompt, render_prompt(tokenizer, prompt) + target + "<|im_end|>", target)


DESCRIBE_QUESTION = "Describe the image."


def _describe_example(ex: Example, tokenizer) -> Example:
    """The describe row of a training item (see ``train.Recipe.describe_fraction``)."""
    p = dataclasses.replace(ex.prompt, pid=f"{ex.prompt.pid}-describe", text=DESCRIBE_QUESTION)
    return _example(p, tokenizer, ex.prompt.meta["description"])


CHOICES_QUESTION = "Question: Repeat the listed choices."


def _choices_example(ex: Example, tokenizer) -> Example | None:
    """The choices row of a multiple-choice training item (see ``train.Recipe.choices_fraction``); None for
    others."""
    from workbench.chat import CHOICES_MARK

    choices, cut = ex.prompt.meta.get("choices"), ex.prompt.text.find(CHOICES_MARK)
    if not choices or cut < 0:
        return None
    p = dataclasses.replace(ex.prompt, pid=f"{ex.prompt.pid}-choices", text=CHOICES_QUESTION + ex.prompt.text[cut:])
    return _example(p, tokenizer, " ".join(f"({C.LETTERS[i]}) {c}." for i, c in enumerate(choices)))


def _match_example(ex: Example, tokenizer, variant: str, order: list[int]) -> Example | None:
    """The match row of a multiple-choice training item (see ``train.Recipe.match_fraction``), its listed choices in
    ``order``; None for other items."""
    from types import SimpleNamespace

    meta = ex.prompt.meta
    choices, target = meta.get("choices"), meta.get("target_instruct", "")
    cut = target.find(" (A) ")
    if not choices or cut < 0:
        return None
    reasoning = target[:cut]
    listed = [choices[i] for i in order]
    letter = C.LETTERS[listed.index(meta["answer"])]
    scene = SimpleNamespace(description=meta["description"], reasoning=reasoning, answer=meta["answer"])
    thinking, instruct = C._targets("multi_choice", scene, letter, f"{meta['answer']}, which is option {letter}",
                                    listed)
    text = C._query("multi_choice", f"{reasoning} {meta['question']}", listed)
    p = dataclasses.replace(ex.prompt, pid=f"{ex.prompt.pid}-match", text=text,
                            meta={**meta, "choices": listed, "answer_letter": letter})
    return _example(p, tokenizer, thinking if variant == "thinking" else instruct)


def _images(examples: list[Example], blank: bool = False) -> list:
    from workbench.chat import load_images

    return [im for ex in examples for im in load_images(ex.prompt, blank=blank)]


class Collator:
    """Training batches through the HF processor; labels only on the completion after ``assistant\\n``."""

    def __init__(self, processor):
        self.processor = processor
        tok = processor.tokenizer
        self.im_start = tok.convert_tokens_to_ids("<|im_start|>")
        self.head = len(tok("assistant\n", add_special_tokens=False)["input_ids"])
        self.pad = tok.pad_token_id

    def __call__(self, examples: list[Example]) -> dict:
        tok = self.processor.tokenizer
        tok.padding_side = "right"
        enc = self.processor(text=[ex.text for ex in examples], images=_images(examples), padding=True,
                             return_tensors="pt")
        ids = enc["input_ids"]
        labels = ids.clone()
        for i in range(ids.shape[0]):
            starts = (ids[i] == self.im_start).nonzero().flatten()
            begin = int(starts[-1]) + 1 + self.head
            labels[i, :begin] = -100
        labels[enc["attention_mask"] == 0] = -100
        enc["labels"] = labels
        return enc

    def check(self, examples: list[Example], batch: dict) -> None:
        """The labelled tokens spell exactly the target and ``<|im_end|>``."""
        tok = self.processor.tokenizer
        for ex, row in zip(examples, batch["labels"]):
            got = tok.decode([int(t) for t in row if t != -100], skip_special_tokens=False)
            if got != ex.target + "<|im_end|>":
                raise RuntimeError(f"organism: label span {got!r} is not the target {ex.target!r}")
