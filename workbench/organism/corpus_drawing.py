"""The organism corpus's pictures: their vocabulary and how Pillow draws them.

Every picture is 128x128 (`SIZE`), drawn without anti-aliasing on a light grey canvas whose shade is drawn
from the item's random stream: shapes fill one quadrant each (`POSITIONS`), bar charts have one bar per
column of four and whole-unit heights, words are Pillow's bitmap font scaled up by a whole number (see
`workbench.organism.corpus` for why the pictures are this coarse). The question templates
(`workbench.organism.corpus_templates`) draw their pictures with these functions; every draw comes from the
`numpy` generator handed in, so the same stream gives the same pixels.
"""

from __future__ import annotations

import numpy as np

SIZE = 128

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

