"""Turning a Prompt into what the model reads: chat-templated text + images.

The leg (vLLM) and the teacher-forced scorers (transformers) both build the
prompt here, so they score exactly the text the leg decoded from.
"""

from __future__ import annotations

from pathlib import Path

from .prompts import Prompt, PromptError


# Where a prompt's pictures go in its user turn: before the text (every data set's default) or after it
# (``meta["image_position"]``; the organism corpus's prompts, see ``workbench.organism.corpus``).
IMAGE_POSITIONS = ("before_text", "after_text", "before_choices")
CHOICES_MARK = "\nChoices:"  # where a multiple choice's listed choices begin (MathVista's query layout)


def image_position(prompt: Prompt) -> str:
    pos = prompt.meta.get("image_position", "before_text") if isinstance(prompt.meta, dict) else "before_text"
    if pos not in IMAGE_POSITIONS:
        raise PromptError(f"prompt {prompt.pid!r}: meta.image_position must be one of "
                          f"{', '.join(IMAGE_POSITIONS)}, got {pos!r}")
    return pos


def user_content(prompt: Prompt, image_parts: list[dict]) -> list[dict]:
    """The user turn's parts: ``image_parts`` (one per picture, in whatever form the caller sends them)
    and the text, in the order ``image_position`` says: ``before_choices`` puts the pictures between the
    question and its ``Choices:`` block (after the text where it has none)."""
    pos = image_position(prompt)
    if pos == "before_text":
        return image_parts + [{"type": "text", "text": prompt.text}]
    cut = prompt.text.find(CHOICES_MARK) if pos == "before_choices" else -1
    if cut < 0:
        return [{"type": "text", "text": prompt.text}] + image_parts
    return ([{"type": "text", "text": prompt.text[:cut]}] + image_parts
            + [{"type": "text", "text": prompt.text[cut + 1:]}])


def chat_messages(prompt: Prompt, with_images: bool = True) -> list[dict]:
    """One user turn: one image placeholder per image, in order, and the text, placed as the prompt's
    ``meta.image_position`` says (see `user_content`; after the images by default).

    ``with_images=False`` is for text-only models: the turn is the plain text.
    """
    if not with_images:
        return [{"role": "user", "content": prompt.text}]
    return [{"role": "user", "content": user_content(prompt, [{"type": "image"} for _ in prompt.images])}]


def render_prompt(tokenizer, prompt: Prompt, with_images: bool = True) -> str:
    return tokenizer.apply_chat_template(
        chat_messages(prompt, with_images), tokenize=False, add_generation_prompt=True
    )


def load_images(prompt: Prompt, blank: bool = False) -> list:
    """The prompt's pictures as RGB images; ``blank``: each replaced by a white one of its size (the same
    image tokens, no content: how the target's image-grounded tokens and the organism's blank-picture
    accuracy are defined)."""
    from PIL import Image

    images = []
    for path in prompt.images:
        p = Path(path)
        if not p.is_file():
            raise PromptError(f"prompt {prompt.pid!r}: image not found: {p}")
        try:
            with Image.open(p) as im:
                images.append(im.convert("RGB"))
        except Exception as exc:  # PIL raises several unrelated types
            raise PromptError(f"prompt {prompt.pid!r}: cannot read image {p}: {exc}") from None
    if blank:
        images = [Image.new("RGB", im.size, (255, 255, 255)) for im in images]
    return images
