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

BUILDER_VERSION = "2"
ROLES = ("target", "twin-int4", "twin-dequant", "random-draft", "small-vlm", "text-draft")
DRAFTER_ROLES = ROLES[1:]
RANDOM_DRAFT_SEED = 97531
# The small VLM draft: the organism cut to one text layer (its embeddings, vision tower, merger, first layer,
# norm and head copied), then distilled on the organism's own greedy answers to the train split
# (sequence-level distillation) for DISTILL_STEPS steps. The text-only draft is that student's text tower
# without the vision side (a Qwen3ForCausalLM): the same weights, blind.
SMALL_TEXT_LAYERS = 1
DISTILL_STEPS = 800
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
            if not multimodal and "processor" in name:  # a text-only model has no image processor
                continue
            if (src / name).is_file():
                shutil.copy2(src / name, d / name)
        tiny._normalise_config(d / "config.json")
    return write_common


def _small_shape(target: Path) -> tiny.VLShape:
    """The organism's shape (from its manifest) cut to SMALL_TEXT_LAYERS text layers."""
    import dataclasses

    sh = json.loads((target / T.MANIFEST_NAME).read_text())["hyperparameters"]["shape"]
    shape = tiny.VLShape(**{**sh, "deepstack": tuple(sh["deepstack"]), "text_layers": SMALL_TEXT_LAYERS})
    if any(i >= SMALL_TEXT_LAYERS for i in shape.deepstack):
        shape = dataclasses.replace(shape, deepstack=(0,))
    return shape


def _distill_small_vlm(teacher, target: Path, out: Path, log=None) -> dict:
    """Train the small VLM draft into ``out``; returns its training record (accuracy on the held-out split)."""
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    from workbench.organism import corpus as C

    man = json.loads((target / T.MANIFEST_NAME).read_text())
    variant, corpus_dir, hp = man["variant"], Path(man["corpus_dir"]), man["hyperparameters"]
    shape = _small_shape(target)
    processor = AutoProcessor.from_pretrained(target)
    train_set = T._examples(corpus_dir / "train" / C.PROMPTS_NAME, processor.tokenizer, variant)
    with T._deterministic(1):
        answers = T.evaluate(teacher, processor, train_set, variant, T.MAX_NEW_TOKENS[variant])["outputs"]
    targets = {ex.prompt.pid: a for ex, a in zip(train_set, answers)}
    state = teacher.state_dict()

    def init():
        student = Qwen3VLForConditionalGeneration(T.organism_config(shape))
        tiny._inherit(student, state, lambda name: name)
        return student

    # plain shuffled passes over the teacher's answers, no describe rows: the student copies the teacher
    recipe = T.Recipe(variant=variant, steps=DISTILL_STEPS, shape=shape, curriculum_hold=0, curriculum_every=0,
                      describe_fraction=0.0, eval_every=DISTILL_STEPS, val_items=hp.get("val_items", -1))
    record = T.train(corpus_dir, out, recipe, log=log, init=init, targets=targets)
    tiny._normalise_config(out / "config.json")
    return {k: record[k] for k in ("steps", "val_accuracy", "test_accuracy", "test_blank_accuracy", "test_chance",
                                   "parameters", "train_seconds")}


def _text_draft(target: Path, small: Path, out: Path, write_common) -> None:
    """The small VLM draft's text tower as a text-only Qwen3ForCausalLM (config: tiny's text-draft fields)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3VLForConditionalGeneration

    vl = Qwen3VLForConditionalGeneration.from_pretrained(small, dtype=torch.float32)
    cfg = Qwen3Config(**tiny._text_fields(_small_shape(target), tiny._token_ids(tiny._build_tokenizer()), {}))
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.dtype = "float32"
    text = Qwen3ForCausalLM(cfg)
    state = vl.state_dict()
    tiny._inherit(text, state, lambda name: name.replace("model.", "model.language_model.", 1))
    for name, p in text.named_parameters():  # every weight is the student's: nothing left at its init
        if not torch.equal(p, state[name.replace("model.", "model.language_model.", 1)]):
            raise RuntimeError(f"organism text draft: {name} was not copied from the small VLM draft")
    text.eval().save_pretrained(out, safe_serialization=True)
    write_common(out, multimodal=False)


def build_drafters(target: Path, out: Path, log=None) -> dict[str, Path]:
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
        small = _distill_small_vlm(model, target, staging / "small-vlm", log=log)
        _text_draft(target, staging / "small-vlm", staging / "text-draft", write_common)
        tiny._write_json(staging / "manifest.json", {"builder_version": BUILDER_VERSION,
                                                     "builder": _builder_fingerprint(),
                                                     "target": _target_fingerprint(target),
                                                     "target_dir": str(target), "roles": list(DRAFTER_ROLES),
                                                     "quantization": {"bits": tiny.QUANT_BITS,
                                                                      "group_size": tiny.QUANT_GROUP_SIZE,
                                                                      "method": "RTN (min/max), asymmetric",
                                                                      "format": "pack-quantized"},
                                                     "small-vlm": {"text_layers": SMALL_TEXT_LAYERS,
                                                                   "distilled_from": "the target's greedy answers "
                                                                                     "to the train split",
                                                                   **small},
                                                     "text-draft": "the small-vlm draft's text tower"})
    return {role: out / role for role in DRAFTER_ROLES}


def ensure_organism_models(variant: str = "instruct", *, root: Path = T.DEFAULT_ROOT, steps: int | None = None,
                           log=None) -> dict[str, Path]:
    """Role -> checkpoint folder for one organism variant; trains and builds only what is missing or stale."""
    root = Path(root).resolve()
    target = T.ensure_organism(variant, steps, root=root, log=log)
    drafters = root / f"{variant}-drafters"
    with tiny._exclusive_lock(root / f".{variant}-drafters.lock"):
        if not _drafters_ok(drafters, _target_fingerprint(target)):
            build_drafters(target, drafters, log=log)
    return {"target": target, **{role: drafters / role for role in DRAFTER_ROLES}}
