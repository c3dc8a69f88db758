"""Deterministic stand-in images for prompts whose real image is not available.

A stand-in has the size of the real image (when known) so that the number of
image tokens, and with it prefill cost and prompt length, is realistic; its
content is synthetic, so any accuracy measured on it means nothing. Prompts
that use one carry `meta["image_is_stand_in"] = True`.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from workbench.datasets._common import safe_name

DEFAULT_SIZE = (448, 448)
# Real MathVista images go up to several thousand pixels a side; a cap keeps
# stand-ins cheap while staying above what the Qwen3-VL processor keeps anyway.
MAX_SIDE = 2048


def _rng(pid: str, dataset: str) -> random.Random:
    seed = int.from_bytes(hashlib.sha256(f"stand-in:{dataset}:{pid}".encode()).digest()[:8], "big")
    return random.Random(seed)


def stand_in_size(width, height, max_side: int | None = None) -> tuple[int, int]:
    """The real size, scaled down to fit `max_side` (default MAX_SIDE) with its aspect kept."""
    cap = MAX_SIDE if max_side is None else int(max_side)
    try:
        w, h = int(width), int(height)
    except (TypeError, ValueError):
        return DEFAULT_SIZE
    if w <= 0 or h <= 0:
        return DEFAULT_SIZE
    scale = min(1.0, cap / max(w, h))
    return max(1, round(w * scale)), max(1, round(h * scale))


def draw_stand_in(pid: str, size: tuple[int, int], dataset: str = "mathvista"):
    """A PIL image: flat background, a few shapes, and the words STAND-IN and the pid."""
    from PIL import Image, ImageDraw, ImageFont

    rng = _rng(pid, dataset)
    w, h = size
    bg = tuple(rng.randrange(200, 256) for _ in range(3))
    im = Image.new("RGB", (w, h), bg)
    d = ImageDraw.Draw(im)
    for _ in range(rng.randrange(2, 6)):
        x0, y0 = rng.randrange(0, max(1, w)), rng.randrange(0, max(1, h))
        x1 = min(w - 1, x0 + rng.randrange(1, max(2, w // 3)))
        y1 = min(h - 1, y0 + rng.randrange(1, max(2, h // 3)))
        colour = tuple(rng.randrange(0, 200) for _ in range(3))
        kind = rng.choice(("rect", "ellipse", "line"))
        if kind == "rect":
            d.rectangle((x0, y0, x1, y1), outline=colour, width=2)
        elif kind == "ellipse":
            d.ellipse((x0, y0, x1, y1), outline=colour, width=2)
        else:
            d.line((x0, y0, x1, y1), fill=colour, width=2)
    font = ImageFont.load_default_imagefont()
    d.text((3, 3), f"STAND-IN {dataset} {pid}", fill=(0, 0, 0), font=font)
    return im


def write_stand_in(pid: str, out_dir: Path, size: tuple[int, int], dataset: str = "mathvista") -> Path:
    """Write (or reuse) the stand-in PNG for `pid`; the name carries the size so a size change never reuses it."""
    out_dir = Path(out_dir)
    path = out_dir / f"{safe_name(pid)}_standin_{size[0]}x{size[1]}.png"
    if path.is_file() and path.stat().st_size > 0:
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    # compress_level 1: these are throw-away pictures; speed matters more than size.
    draw_stand_in(pid, size, dataset).save(tmp, format="PNG", compress_level=1)
    tmp.replace(path)
    return path
