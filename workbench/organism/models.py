"""The organism's model roles: the trained target and the drafters made from it, built once and cached.

    ensure_organism_models("instruct") -> {"target": ..., "twin-int4": ..., "twin-dequant": ..., "random-draft": ...}

- ``target``: the trained organism (`workbench.organism.train.ensure_organism`, which trains it when its
  manifest does not match the recipe and the corpus).
- ``twin-int4``: its int4 twin, made the way the project's tiny twin is made (`workbench.tiny._build_twins`):
  compressed-tensors' own quantization lifecycle, asymmetric group-wise round-to-nearest from each group's
  min and max (the AWQ/GPTQ tools of llm-compressor are not installable beside the pinned versions, so the
  twin is RTN, as the tiny one is), written as ``pack-quantized``; the language model's linear layers only
  (vision tower and ``lm_head`` kept, as published AWQ twins keep them).
- ``twin-dequant``: the same int4 values dequantized to float32 (exactness checks in float32).
- ``random-draft``: the organism's architecture with fresh random weights: the baseline a twin's acceptance
  is compared with.

Each variant's drafters live in ``<root>/<variant>-drafters/<role>/`` with a ``manifest.json`` naming the
target's manifest fingerprint and this builder's; a target that was retrained rebuilds them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from workbench import tiny
from workbench.organism import train as T

BUILDER_VERSION = "1"
ROLES = ("target", "twin-int4", "twin-dequant", "random-draft")
DRAFTER_ROLES = ROLES[1:]
RANDOM_DRAFT_SEED = 97531
COMMON_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                "special_tokens_map.json")


def _target_fingerprint(target: Path) -> str:
    return hashlib.sha256((target / T.MANIFEST_NAME).read_bytes()).hexdigest()


def _builder_fingerprint() -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(tiny.recipe_fingerprint().encode())  # the twin's quantization code and settings
    h.update(BUILDER_VERSION.encode())
    return h.hexdigest()


def _drafters_ok(folder: Path, target_fp: str) -> bool:
    try:
        man = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return (man.get("target") == target_fp and man.get("builder") == _builder_fingerprint()
            and all((folder / r / "config.json").is_file() for r in DRAFTER_ROLES))


def _copy_common(src: Path):
    def write_common(d: Path, multimodal: bool = True) -> None:
        for name in COMMON_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, d / name)
        tiny._normalise_config(d / "config.json")
    return write_common


def build_drafters(target: Path, out: Path) -> dict[str, Path]:
    """Write the drafters of the organism at ``target`` into ``out`` (built beside it, swapped in at the end)."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    target, out = Path(target).resolve(), Path(out).resolve()
    with tiny.built_beside(out) as staging:
        model = Qwen3VLForConditionalGeneration.from_pretrained(target, dtype=torch.float32).eval()
        write_common = _copy_common(target)
        tiny._build_twins(model, staging / "twin-int4", staging / "twin-dequant", write_common)
        torch.manual_seed(RANDOM_DRAFT_SEED)
        rand = Qwen3VLForConditionalGeneration(model.config)
        tiny._init_weights(rand, RANDOM_DRAFT_SEED, tiny.BPE_VOCAB_SIZE)
        rand.eval().save_pretrained(staging / "random-draft", safe_serialization=True)
        write_common(staging / "random-draft")
        tiny._write_json(staging / "manifest.json", {"builder_version": BUILDER_VERSION,
                                                     "builder": _builder_fingerprint(),
                                                     "target": _target_fingerprint(target),
                                                     "target_dir": str(target), "roles": list(DRAFTER_ROLES),
                                                     "quantization": {"bits": tiny.QUANT_BITS,
                                                                      "group_size": tiny.QUANT_GROUP_SIZE,
                                                                      "method": "RTN (min/max), asymmetric",
                                                                      "format": "pack-quantized"}})
    return {role: out / role for role in DRAFTER_ROLES}


def ensure_organism_models(variant: str = "instruct", *, root: Path = T.DEFAULT_ROOT, steps: int | None = None,
                           log=None) -> dict[str, Path]:
    """Role -> checkpoint folder for one organism variant; trains and builds only what is missing or stale."""
    root = Path(root).resolve()
    target = T.ensure_organism(variant, steps, root=root, log=log)
    drafters = root / f"{variant}-drafters"
    with tiny._exclusive_lock(root / f".{variant}-drafters.lock"):
        if not _drafters_ok(drafters, _target_fingerprint(target)):
            build_drafters(target, drafters)
    return {"target": target, **{role: drafters / role for role in DRAFTER_ROLES}}
