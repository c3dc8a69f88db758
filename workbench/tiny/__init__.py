"""Tiny embedded models: a Qwen3-VL target, its int4 twin and the other draft roles.

Everything here is built offline from fixed seeds, on CPU, in seconds, so the
demo, the tests and CI run against real checkpoints without downloading any.

    python -m workbench.tiny build [--out models/tiny] [--force]

Roles (see ``ROLES``):

- ``target``        tiny Qwen3-VL, float32 on disk (every weight is bfloat16-exact,
                    so float32 and bfloat16 runs load identical values)
- ``twin-int4``     the target's W4A16 twin, compressed-tensors ``pack-quantized``
                    (group-wise, asymmetric, as published AWQ checkpoints); the
                    language-model Linear layers are quantized, the vision tower
                    and ``lm_head`` are on the ignore list
- ``twin-dequant``  the twin's int4 values dequantized into the target's plain
                    float32 format (vLLM's CPU int4 kernel has no float32 path)
- ``random-draft``  the target's architecture with other seeds (an unrelated draft)
- ``small-vlm``     a smaller Qwen3-VL cut from the target (one text layer, one
                    vision block), same tokenizer
- ``text-draft``    a text-only Qwen3 cut from the target's text tower (one layer),
                    same tokenizer

The package: ``tokenizer`` (tokenizer, chat template, processors), ``model`` (shapes, configs, seeded
weights), ``twins`` (the int4 twin and its dequantized copy), ``files`` (stable JSON); the build, the
manifest and the command line are here.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ..datasets._common import sha256_file
from .files import _normalise_config, _write_json
from .model import (BRANCH_GAIN, EMBED_STD, LM_HEAD_STD, MLP_GAIN, QK_NORM_GAIN, SEEDS, SMALL_VLM_SHAPE,
                    SPECIAL_ROW_SCALE, TARGET_SHAPE, TEXT_DRAFT_SHAPE, VLShape, _generation_config, _inherit,
                    _init_weights, _param_generator, _text_config, _text_fields, _vl_config)
from .tokenizer import (BPE_VOCAB_SIZE, CHAT_TEMPLATE, CORPUS, MAX_PIXELS, MERGE_SIZE, MIN_PIXELS,
                        MODEL_VOCAB_SIZE, PATCH_SIZE, QWEN_ADDED_TOKENS, QWEN_PRETOKENIZE_REGEX,
                        TEMPORAL_PATCH_SIZE, _build_tokenizer, _token_ids, _write_processors, _write_tokenizer)
from .twins import (QUANT_BITS, QUANT_GROUP_SIZE, _build_twins, _fill_minmax_qparams, _is_language_linear,
                    _quant_scheme_config, _unpack_int4)

# Bump whenever anything that changes the bytes on disk changes.
BUILDER_VERSION = "1"

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ROOT = REPO_ROOT / "models" / "tiny"
MANIFEST_NAME = "manifest.json"

ROLES = ("target", "twin-int4", "twin-dequant", "random-draft", "small-vlm", "text-draft")


def _build_all(out: Path) -> None:
    import torch
    from transformers import Qwen3ForCausalLM, Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    tok = _build_tokenizer()
    ids = _token_ids(tok)
    n_regular = BPE_VOCAB_SIZE

    def write_common(d: Path, multimodal: bool = True) -> None:
        _write_tokenizer(tok, d)
        if multimodal:
            _write_processors(d)
        _write_json(d / "generation_config.json", _generation_config(ids))
        _normalise_config(d / "config.json")

    def build_vl(shape: VLShape, seed: int):
        model = Qwen3VLForConditionalGeneration(_vl_config(shape, ids))
        _init_weights(model, seed, n_regular)
        return model.eval()

    target = build_vl(TARGET_SHAPE, SEEDS["target"])
    target.save_pretrained(out / "target", safe_serialization=True)
    write_common(out / "target")

    _build_twins(target, out / "twin-int4", out / "twin-dequant", write_common)

    random_draft = build_vl(TARGET_SHAPE, SEEDS["random-draft"])
    random_draft.save_pretrained(out / "random-draft", safe_serialization=True)
    write_common(out / "random-draft")

    # The small drafts are cut from the target (as a distilled or same-family
    # small model would relate to it): they agree with it more than chance and
    # less than the twin, and the text-only one cannot see images at all.
    target_state = target.state_dict()
    small = build_vl(SMALL_VLM_SHAPE, SEEDS["small-vlm"])
    _inherit(small, target_state, lambda name: name)
    small.save_pretrained(out / "small-vlm", safe_serialization=True)
    write_common(out / "small-vlm")

    text = Qwen3ForCausalLM(_text_config(ids))
    _init_weights(text, SEEDS["text-draft"], n_regular)
    _inherit(text, target_state, lambda name: name.replace("model.", "model.language_model.", 1))
    text.eval().save_pretrained(out / "text-draft", safe_serialization=True)
    write_common(out / "text-draft", multimodal=False)


def recipe_fingerprint() -> str:
    """What the bytes on disk depend on: this builder's source (every module of ``workbench.tiny``) and the
    libraries that write them.

    A library enters by its release, without the local build label (``2.13.0+cpu`` and
    ``2.13.0+cu128`` are one release): the builder runs on the CPU with seeded generators, so the
    bytes do not depend on the build, and a GPU host reuses tiny models built elsewhere.
    """
    from importlib.metadata import version

    h = hashlib.sha256()
    for source in sorted(Path(__file__).resolve().parent.glob("*.py")):  # the builder: this package
        h.update(source.read_bytes())
    for pkg in ("torch", "transformers", "compressed-tensors", "tokenizers", "safetensors"):
        h.update(f"{pkg}=={release(version(pkg))}".encode())
    return h.hexdigest()


def release(version_string: str) -> str:
    """A version without its local label (PEP 440 ``+...``): ``2.13.0+cu128`` -> ``2.13.0``."""
    return version_string.split("+", 1)[0]


def _manifest_for(root: Path) -> dict:
    roles = {}
    for role in ROLES:
        d = root / role
        files = {p.relative_to(d).as_posix(): sha256_file(p) for p in sorted(d.rglob("*")) if p.is_file()}
        roles[role] = {"dir": role, "files": files}
    return {"builder_version": BUILDER_VERSION, "recipe": recipe_fingerprint(), "roles": roles}


def _manifest_ok(root: Path) -> bool:
    path = root / MANIFEST_NAME
    if not path.is_file():
        return False
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if (
        manifest.get("builder_version") != BUILDER_VERSION
        or manifest.get("recipe") != recipe_fingerprint()
        or set(manifest.get("roles", {})) != set(ROLES)
    ):
        return False
    try:
        return manifest == _manifest_for(root)
    except OSError:
        return False


def role_dirs(root: Path) -> dict[str, Path]:
    return {role: Path(root) / role for role in ROLES}


@contextlib.contextmanager
def built_beside(dest: Path):
    """A fresh staging folder beside ``dest``: when the block ends normally it replaces ``dest`` whole; on
    any error (or an interrupt) it is removed. So an interrupted build never leaves a folder that looks
    complete, and the old one stays until the new one is whole."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.build-", dir=dest.parent))
    try:
        yield staging
        staging.chmod(0o755)
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.replace(dest, old / "x")
            shutil.rmtree(old)
        os.replace(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def build_tiny_models(root: Path = DEFAULT_ROOT) -> dict[str, Path]:
    """Build every role into ``root`` from scratch (replacing what is there)."""
    root = Path(root).resolve()
    with built_beside(root) as staging:
        _build_all(staging)
        _write_json(staging / MANIFEST_NAME, _manifest_for(staging))
    return role_dirs(root)


def ensure_tiny_models(root: Path = DEFAULT_ROOT, force: bool = False) -> dict[str, Path]:
    """Return role -> checkpoint dir, building first if missing, stale or ``force``."""
    root = Path(root).resolve()
    root.parent.mkdir(parents=True, exist_ok=True)
    # Tests, legs and notebooks may call this at the same time: one builds,
    # the others wait and then find a matching manifest.
    with _exclusive_lock(root.parent / f".{root.name}.lock"):
        if force or not _manifest_ok(root):
            return build_tiny_models(root)
    return role_dirs(root)


@contextlib.contextmanager
def _exclusive_lock(path: Path):
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.tiny", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the tiny models (no-op when the manifest matches)")
    b.add_argument("--out", type=Path, default=DEFAULT_ROOT, help="output folder (default: models/tiny)")
    b.add_argument("--force", action="store_true", help="rebuild even when the manifest matches")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    dirs = ensure_tiny_models(args.out, force=args.force)
    print(json.dumps({role: str(p) for role, p in dirs.items()}, indent=2))
    print(f"ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
