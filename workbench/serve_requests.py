"""The requests a serving leg sends: its prompts as vLLM's ``custom_image`` benchmark dataset, fresh or repeated.

A server in production rarely sees one request twice, but a benchmark that cycles a small prompt set does, and
vLLM's caches make a repeated request cheap: the prefix cache keeps its prompt's KV blocks (with the images'
tokens), the multimodal caches its images' processing. A serving leg used to send its prompt set again in every
cell, after a warm-up and a prime pass with the same requests, so every measured request was a cache hit: its
time to the first token was a cached prompt's, and under load its prefill cost the batch almost nothing.

``fresh`` (knob ``serve_requests``, the default) makes each request a server receives its own: a short nonce as
the first text part of the user turn (every KV block after it differs) and each image with its first pixels
changed (a 96-bit stamp: another content hash, no multimodal cache hit; the same size, so the same number of
image tokens). A nonce depends on the cell and the request's index, never on the leg, so every leg of a run
sends the same requests in each cell and pairs stay paired. ``repeat`` is the old behaviour, for measuring a
cache-friendly workload.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import json
import mimetypes
from pathlib import Path
from typing import Any

FRESH, REPEAT = "fresh", "repeat"
MODES = (FRESH, REPEAT)

__all__ = ["FRESH", "REPEAT", "MODES", "nonce", "write_requests", "bench_dataset"]


def nonce(tag: str, index: int) -> str:
    """The first text part of fresh request ``index`` of the requests tagged ``tag`` (fixed width)."""
    return f"[{tag}{index:04d}]"


@functools.lru_cache(maxsize=64)
def _original_url(path: str) -> str:
    mime = mimetypes.guess_type(path)[0] or "image/png"
    return f"data:{mime};base64,{base64.b64encode(Path(path).read_bytes()).decode()}"


STAMP_VALUES = 12  # pixel values a fresh image's stamp moves: 96 bits from the salt, so no two images of a run match


def _salted_url(path: str, salt: str) -> str:
    """The image at ``path`` with its first ``STAMP_VALUES`` pixel values (row-major, channels interleaved: the
    first four pixels of an RGB image) moved by a stamp of the salt's hash, the first by 1-255, as PNG.

    One value moved by 1-255 (the first version) let two requests of a run send the same image once in 255
    pairs: the first fresh H100 run had 2 such images among 112 (``mm_cache_hit_rate`` 0.067 and 0.033 at
    concurrency 16 and 32, results/E18/20261207T235605Z-869510a1)."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        img = im.convert("RGB") if im.mode not in ("RGB", "RGBA", "L") else im.copy()
    arr = np.array(img)
    flat = arr.reshape(-1)
    k = min(STAMP_VALUES, flat.size)
    stamp = np.frombuffer(hashlib.sha256(salt.encode()).digest()[:k], dtype=np.uint8).astype(np.uint16)
    stamp[0] = 1 + stamp[0] % 255  # never the original image
    flat[:k] = ((flat[:k].astype(np.uint16) + stamp) % 256).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}"


def request_content(prompt: Any, salt: str | None, first_text: str | None = None) -> list[dict]:
    """The user turn of one request: the prompt's images (as data URLs, so the server reads no local file) and
    text in the order offline legs use (``workbench.chat.user_content``); ``salt``: each image salted
    (``_salted_url``); ``first_text``: a text part before everything."""
    from .chat import user_content

    images = [{"type": "image_url", "image_url": {
        "url": _original_url(str(img)) if salt is None else _salted_url(str(img), f"{salt}/{j}")}}
        for j, img in enumerate(prompt.images)]
    parts = user_content(prompt, images)
    return ([{"type": "text", "text": first_text}] if first_text else []) + parts


def write_requests(prompts: list, path: Path, n: int, mode: str = REPEAT, tag: str = "") -> None:
    """``n`` requests into ``path``, request ``i`` from ``prompts[i % len(prompts)]``: as they are
    (``repeat``), or each its own (``fresh``: nonce ``tag`` + ``i`` and its images salted by it)."""
    if mode not in MODES:
        raise ValueError(f"serve_requests must be one of {', '.join(MODES)}, got {mode!r}")
    if not prompts:
        raise ValueError("no prompts to write requests from")
    with Path(path).open("w") as f:
        for i in range(n):
            p = prompts[i % len(prompts)]
            fresh = mode == FRESH
            content = request_content(p, f"{tag}{i}" if fresh else None, nonce(tag, i) if fresh else None)
            f.write(json.dumps({"content": content}) + "\n")


def bench_dataset(prompts: list, path: Path) -> None:
    """The prompt set as vLLM's ``custom_image`` dataset, one request per prompt as it is (runs by hand)."""
    write_requests(prompts, path, len(prompts), REPEAT)
