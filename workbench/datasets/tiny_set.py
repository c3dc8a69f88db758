"""The built-in `tiny` prompt set: short questions on small pictures drawn by the project.

`build()` draws every image with Pillow, without anti-aliasing or system fonts,
so the files can be regenerated exactly; the generated files are committed in
data/tiny/. Sizes cover the tiny Qwen3-VL's friendly multiples of 32 (patch 16,
merge 2), odd sizes, a portrait image, two images in one prompt, and text only.
"""

from __future__ import annotations

from pathlib import Path

from workbench.datasets._common import data_root
from workbench.prompts import Prompt, load_prompts, save_prompts

NAME = "tiny"

WHITE = (255, 255, 255)
BLACK = (0, 0, 0)
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220),
           "yellow": (240, 200, 20), "orange": (245, 130, 20), "purple": (130, 50, 170)}


def default_dir() -> Path:
    return data_root() / NAME


def _canvas(w, h, bg=WHITE):
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (w, h), bg)
    return im, ImageDraw.Draw(im)


def _big_text(im, xy, text, scale, fill=BLACK):
    """Bitmap-font text scaled up with nearest-neighbour, so it is crisp and identical everywhere."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default_imagefont()
    left, top, right, bottom = font.getbbox(text)
    small = Image.new("L", (right + 1, bottom + 1), 0)
    ImageDraw.Draw(small).text((0, 0), text, fill=255, font=font)
    big = small.resize((small.width * scale, small.height * scale), Image.NEAREST)
    im.paste(Image.new("RGB", big.size, fill), xy, big)


def _img_circle(w=64, h=64, colour="red"):
    im, d = _canvas(w, h)
    m = min(w, h) // 8
    d.ellipse((m, m, w - 1 - m, h - 1 - m), fill=COLOURS[colour])
    return im


def _img_two_squares():
    im, d = _canvas(96, 96)
    d.rectangle((10, 30, 40, 60), fill=COLOURS["blue"])
    d.rectangle((56, 30, 86, 60), fill=COLOURS["blue"])
    return im


def _img_triangle():
    im, d = _canvas(128, 128)
    d.polygon([(64, 14), (114, 112), (14, 112)], fill=COLOURS["green"])
    return im


def _img_word():
    im, _ = _canvas(160, 96)
    _big_text(im, (30, 28), "CAT", 4)
    return im


def _img_three_circles():
    im, d = _canvas(224, 224)
    for (x, y), c in zip([(30, 40), (120, 60), (70, 140)], ["red", "green", "blue"]):
        d.ellipse((x, y, x + 60, y + 60), fill=COLOURS[c])
    return im


def _img_bars():
    im, d = _canvas(256, 192)
    d.line((20, 160, 240, 160), fill=BLACK, width=2)
    for i, (label, height) in enumerate([("A", 60), ("B", 130), ("C", 90)]):
        x = 40 + i * 70
        d.rectangle((x, 160 - height, x + 40, 159), fill=COLOURS["purple"])
        _big_text(im, (x + 14, 166), label, 2)
    return im


def _img_sum():
    im, _ = _canvas(320, 240)
    _big_text(im, (70, 95), "7 + 5", 6)
    return im


def _img_odd_rectangle():
    im, d = _canvas(77, 53)
    d.rectangle((12, 10, 64, 42), fill=COLOURS["orange"])
    return im


def _img_vertical_line():
    im, d = _canvas(192, 320)
    d.line((96, 30, 96, 290), fill=BLACK, width=6)
    return im


def _img_big_circle_blue():
    return _img_circle(128, 96, "blue")


def _img_odd_stripes():
    im, d = _canvas(101, 67)
    for i, c in enumerate(["red", "yellow", "green"]):
        d.rectangle((0, i * 22, 100, i * 22 + 21), fill=COLOURS[c])
    return im


# pid, question, [(image file, drawer)], meta
SPEC = [
    ("tiny-001", "What colour is the circle?", [("circle_red_64x64.png", _img_circle)],
     {"answer": "red"}),
    ("tiny-002", "How many squares are there?", [("two_squares_96x96.png", _img_two_squares)],
     {"answer": "2"}),
    ("tiny-003", "What shape is this?", [("triangle_128x128.png", _img_triangle)],
     {"answer": "triangle"}),
    ("tiny-004", "What word is written?", [("word_cat_160x96.png", _img_word)],
     {"answer": "CAT"}),
    ("tiny-005", "How many circles are there?", [("three_circles_224x224.png", _img_three_circles)],
     {"answer": "3"}),
    ("tiny-006", "Which bar is the tallest?", [("bars_256x192.png", _img_bars)],
     {"answer": "B"}),
    ("tiny-007", "What is the result of the sum shown?", [("sum_320x240.png", _img_sum)],
     {"answer": "12"}),
    ("tiny-008", "What colour is the rectangle?", [("rectangle_orange_77x53.png", _img_odd_rectangle)],
     {"answer": "orange"}),
    ("tiny-009", "Is the line horizontal or vertical?", [("vertical_line_192x320.png", _img_vertical_line)],
     {"answer": "vertical"}),
    ("tiny-010", "Are the two circles the same colour?",
     [("circle_red_64x64.png", _img_circle), ("circle_blue_128x96.png", _img_big_circle_blue)],
     {"answer": "no"}),
    ("tiny-011", "List the colours from top to bottom.", [("stripes_101x67.png", _img_odd_stripes)],
     {"answer": "red, yellow, green"}),
    ("tiny-012", "What is 2 + 3?", [], {"answer": "5"}),
    ("tiny-013", "Name a primary colour.", [], {"answer": "red, yellow or blue"}),
]


def build(out_dir: str | Path | None = None) -> list[Prompt]:
    """Draw the images and write prompts.jsonl into `out_dir` (default data/tiny/)."""
    out = Path(out_dir) if out_dir is not None else default_dir()
    img_dir = out / "images"
    img_dir.mkdir(parents=True, exist_ok=True)
    drawn: dict[str, Path] = {}
    prompts = []
    for pid, question, images, meta in SPEC:
        paths = []
        for name, draw in images:
            if name not in drawn:
                im = draw()
                path = img_dir / name
                # optimize + max compression keeps the committed files at a few hundred bytes.
                im.save(path, format="PNG", optimize=True)
                drawn[name] = path
            paths.append(str(drawn[name]))
        m = dict(meta)
        m["image_sizes"] = [list(_size_of(Path(p))) for p in paths]
        prompts.append(Prompt(pid=pid, text=question, images=paths, dataset=NAME, meta=m))
    save_prompts(prompts, out / "prompts.jsonl")
    return prompts


def _size_of(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as im:
        return im.size


def load_tiny(pids=None, n: int | None = None, source: str | Path | None = None) -> list[Prompt]:
    path = Path(source) if source is not None else default_dir() / "prompts.jsonl"
    if path.is_dir():
        path = path / "prompts.jsonl"
    return load_prompts(path, pids=pids, n=n)
