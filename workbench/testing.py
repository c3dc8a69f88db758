"""Test instruments for the tiny models: demo prompts, twin-quality checks, a vLLM smoke load.

``workbench.tiny`` builds the models; this module measures them (tests/test_tiny.py,
and by hand when tuning the init). Teacher forcing goes through
``workbench.teacher.TeacherForcer``, the workbench's one path for it.

    python -m workbench.testing vllm-smoke models/tiny/twin-int4 --dtype bfloat16 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from . import engine as engines
from .prompts import Prompt

DEMO_QUESTIONS = (
    "Describe the image in one sentence.",
    "What is shown in this picture?",
    "How many objects are there in the image?",
    "Which bar is the tallest in the chart?",
    "Read the text in the image and answer the question.",
    "What color is the car?",
)
DEMO_IMAGE_SIZES = ((64, 64), (96, 64), (128, 128), (64, 128))


def demo_images():
    """A few deterministic synthetic PIL images of different sizes and content."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(7)
    images = []
    for i, (w, h) in enumerate(DEMO_IMAGE_SIZES):
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([(xx * (3 + i)) % 256, (yy * (5 + 2 * i)) % 256, ((xx + yy) * (7 - i)) % 256], -1)
        noise = rng.integers(0, 64, size=(h, w, 3))
        images.append(Image.fromarray(((base + noise) % 256).astype("uint8")))
    return images


def demo_image_files(folder: str | Path) -> list[Path]:
    """``demo_images()`` as PNG files in ``folder`` (lossless: the same pixels)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, image in enumerate(demo_images()):
        path = folder / f"demo-{i}.png"
        image.save(path)
        paths.append(path)
    return paths


def demo_prompt(pid: str, text: str, images: list[Path]) -> Prompt:
    return Prompt(pid=pid, text=text, images=[str(p) for p in images], dataset="tiny-demo")


def demo_prompts(folder: str | Path, n_prompts: int) -> list[Prompt]:
    """Prompt i: text-only, one image, two images in turn (images of ``demo_image_files``)."""
    files = demo_image_files(folder)
    return [demo_prompt(f"demo-{i}", DEMO_QUESTIONS[i % len(DEMO_QUESTIONS)],
                        [files[(i + k) % len(files)] for k in range(i % 3)])
            for i in range(n_prompts)]


def chat_prompt(processor, text: str, n_images: int) -> str:
    content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def greedy_and_agreement(target_dir: Path, draft_dirs: dict[str, Path], folder: str | Path, n_prompts: int = 6,
                         max_new_tokens: int = 48) -> dict:
    """Greedy target outputs on ``demo_prompts``, and each draft's teacher-forced top-1 agreement on them.

    Returns ``{"outputs": [[ids], ...], "agreement": {name: fraction}, "positions": N}``.
    """
    from .teacher import TeacherForcer

    prompts = demo_prompts(folder, n_prompts)
    target = TeacherForcer(str(target_dir), dtype="float32", device="cpu")
    outputs = [target.greedy(p, max_new_tokens, min_new_tokens=max_new_tokens) for p in prompts]
    agreement = {}
    for name, d in draft_dirs.items():
        draft = TeacherForcer(str(d), dtype="float32", device="cpu")
        hits = [a for p, out in zip(prompts, outputs) for a in draft.agreement(p, out)]
        agreement[name] = sum(hits) / len(hits)
    return {"outputs": outputs, "agreement": agreement, "positions": sum(len(o) for o in outputs)}


def parameter_counts(dirs: dict[str, Path]) -> dict[str, int]:
    from safetensors import safe_open

    counts = {}
    for role, d in dirs.items():
        n = 0
        for f in sorted(Path(d).glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                for key in st.keys():
                    n += math.prod(st.get_slice(key).get_shape())
        counts[role] = n
    return counts


# ---------------------------------------------------------------------------
# vLLM smoke check
# ---------------------------------------------------------------------------


def smoke_prompts(folder: str | Path) -> dict[str, Prompt]:
    """Text-only, two one-image prompts (different images), one two-image prompt."""
    files = demo_image_files(folder)
    question = DEMO_QUESTIONS[0]
    return {
        "text": demo_prompt("text", question, []),
        "image-a": demo_prompt("image-a", question, [files[2]]),
        "image-b": demo_prompt("image-b", question, [files[3]]),
        "two-images": demo_prompt("two-images", "Compare the two images.", files[:2]),
    }


def _linear_methods(llm) -> dict[str, str]:
    """Quant method (and scheme) class of each Linear kind in the first decoder layer and the vision tower."""

    def probe(model):
        found = {}
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if method is None or not ("layers.0." in name or "blocks.0." in name or name.endswith("lm_head")):
                continue
            scheme = getattr(module, "scheme", None)
            found[name] = type(method).__name__ + (f"/{type(scheme).__name__}" if scheme is not None else "")
        return found

    try:
        return llm.apply_model(probe)[0]
    except Exception as exc:  # only a diagnostic; the outputs are what the smoke check is about
        return {"error": f"{type(exc).__name__}: {exc}"}


def vllm_smoke(model_dir: Path, dtype: str, folder: str | Path, max_tokens: int = 24) -> dict:
    """Load ``model_dir`` in vLLM and decode the smoke prompts greedily (images written into ``folder``).

    A text-only checkpoint decodes the text prompt only. Call under ``if __name__ == "__main__":``.
    """
    # Engine core and worker in this process: on CPU, engine start drops from
    # ~30 s to a few seconds. Only effective before vLLM is first imported.
    engines.in_process_env(cpu=True, threads=None, force=False)
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from .chat import load_images, render_prompt

    model_dir = Path(model_dir)
    multimodal = (model_dir / "preprocessor_config.json").is_file()
    prompts = smoke_prompts(folder)
    if not multimodal:
        prompts = {"text": prompts["text"]}
    kw = dict(model=str(model_dir), dtype=dtype, max_model_len=1024, seed=0, **engines.cpu_args())
    if multimodal:
        kw["limit_mm_per_prompt"] = {"image": 2, "video": 0}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    llm, start_s = engines.build(kw)
    requests = []
    for p in prompts.values():
        # Image placeholders stay unexpanded: vLLM expands them itself.
        req = {"prompt": render_prompt(tokenizer, p, with_images=multimodal)}
        if p.images:
            req["multi_modal_data"] = {"image": load_images(p)}
        requests.append(req)
    outs = llm.generate(requests, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return {
        "model": str(model_dir),
        "dtype": dtype,
        "engine_start_s": round(start_s, 1),
        "quantization": llm.llm_engine.vllm_config.model_config.quantization,
        "linear_methods": _linear_methods(llm),
        "outputs": [
            {"kind": kind, "prompt_len": len(o.prompt_token_ids), "ids": list(o.outputs[0].token_ids),
             "text": o.outputs[0].text}
            for kind, o in zip(prompts, outs)
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.testing", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("vllm-smoke", help="load one checkpoint in vLLM, decode text/image prompts, print JSON")
    v.add_argument("model_dir", type=Path)
    v.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    v.add_argument("--max-tokens", type=int, default=24)
    v.add_argument("--images", type=Path, default=None, help="folder for the demo images (default: a temporary one)")
    v.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"{args.model_dir}: not a checkpoint folder (no config.json)")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = vllm_smoke(args.model_dir, args.dtype, args.images or tmp, args.max_tokens)
    text = json.dumps(result, indent=2)
    if args.json is not None:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
