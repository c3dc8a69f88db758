"""The tiny embedded models: determinism, checkpoint structure, twin quality, vLLM loading."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from workbench import testing, tiny
from workbench.teacher import TeacherForcer

REPO = Path(__file__).resolve().parents[1]

# Thresholds the init is tuned for (workbench/tiny/model.py, "Init scales").
MIN_TWIN_AGREEMENT = 0.80
MAX_RANDOM_AGREEMENT = 0.05


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny") / "models"
    t0 = time.perf_counter()
    dirs = tiny.ensure_tiny_models(root)
    return root, dirs, time.perf_counter() - t0


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for key in f.keys():
            out[key] = f.get_tensor(key)
    return out


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


# ---------------------------------------------------------------------------
# Build, determinism, manifest
# ---------------------------------------------------------------------------


def test_build_is_complete(build, record_property):
    root, dirs, seconds = build
    # A figure, not a timed assertion: `pytest -s` and the junit report show it.
    print(f"\ntiny build (cold, all roles): {seconds:.1f} s")
    record_property("tiny_build_seconds", round(seconds, 3))
    assert set(dirs) == set(tiny.ROLES)
    manifest = json.loads((root / tiny.MANIFEST_NAME).read_text())
    assert manifest["builder_version"] == tiny.BUILDER_VERSION
    for role, d in dirs.items():
        assert d == root / role
        files = manifest["roles"][role]["files"]
        on_disk = sorted(p.name for p in d.iterdir() if p.is_file())
        assert sorted(files) == on_disk
        for needed in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                       "chat_template.jinja", "generation_config.json"):
            assert needed in files, f"{role} lacks {needed}"
        if role != "text-draft":
            assert "preprocessor_config.json" in files and "video_preprocessor_config.json" in files


def test_two_builds_are_byte_identical(build, tmp_path):
    root, _, _ = build
    other = tiny.build_tiny_models(tmp_path / "again")
    a = json.loads((root / tiny.MANIFEST_NAME).read_text())
    b = json.loads((tmp_path / "again" / tiny.MANIFEST_NAME).read_text())
    assert a == b
    for role, d in other.items():
        for name in a["roles"][role]["files"]:
            assert (d / name).read_bytes() == (root / role / name).read_bytes(), f"{role}/{name} differs"


def test_ensure_is_noop_when_manifest_matches_and_rebuilds_otherwise(build, tmp_path):
    root, _, _ = build
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    weights = copy / "twin-int4" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    tiny.ensure_tiny_models(copy)
    assert weights.stat().st_mtime_ns == before, "ensure rebuilt although the manifest matched"

    good = (copy / "twin-int4" / "config.json").read_bytes()
    (copy / "twin-int4" / "config.json").write_text("{}")
    tiny.ensure_tiny_models(copy)
    assert (copy / "twin-int4" / "config.json").read_bytes() == good

    (copy / tiny.MANIFEST_NAME).unlink()
    dirs = tiny.ensure_tiny_models(copy)
    assert (copy / tiny.MANIFEST_NAME).is_file()
    assert (dirs["target"] / "model.safetensors").read_bytes() == (root / "target" / "model.safetensors").read_bytes()


def test_failed_build_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    def broken(out):
        (out / "target").mkdir()
        (out / "target" / "config.json").write_text("{}")
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(tiny, "_build_all", broken)
    with pytest.raises(RuntimeError, match="simulated failure"):
        tiny.ensure_tiny_models(tmp_path / "models")
    assert not (tmp_path / "models").exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


# ---------------------------------------------------------------------------
# Tokenizer, processor, configs
# ---------------------------------------------------------------------------


def test_tokenizer_special_tokens_and_chat_template(build):
    from transformers import AutoProcessor, AutoTokenizer

    _, dirs, _ = build
    cfg = _config(dirs["target"])
    tok = AutoTokenizer.from_pretrained(dirs["target"])
    ids = {t: tok.convert_tokens_to_ids(t) for t, _ in tiny.QWEN_ADDED_TOKENS}
    assert cfg["image_token_id"] == ids["<|image_pad|>"]
    assert cfg["video_token_id"] == ids["<|video_pad|>"]
    assert cfg["vision_start_token_id"] == ids["<|vision_start|>"]
    assert cfg["vision_end_token_id"] == ids["<|vision_end|>"]
    # Qwen's order: consecutive ids after the regular vocabulary.
    assert list(ids.values()) == list(range(tiny.BPE_VOCAB_SIZE, tiny.BPE_VOCAB_SIZE + len(ids)))
    assert len(tok) <= cfg["text_config"]["vocab_size"]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"

    for text in ["Describe the image in one sentence.", "Zebra über 42 — 3.14?", "  spaces\n\nnewlines\t"]:
        enc = tok(text)["input_ids"]
        assert tok.decode(enc) == text
    assert tok("<|image_pad|>")["input_ids"] == [ids["<|image_pad|>"]]

    proc = AutoProcessor.from_pretrained(dirs["target"])
    prompt = testing.chat_prompt(proc, "Compare them.", 2)
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    assert prompt == f"<|im_start|>user\n{placeholder}{placeholder}Compare them.<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_processor_makes_few_image_tokens(build):
    from PIL import Image
    from transformers import AutoProcessor

    _, dirs, _ = build
    proc = AutoProcessor.from_pretrained(dirs["target"])
    image_pad = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for size, expected in [((128, 128), 16), ((64, 64), 16), ((256, 256), 64), ((1024, 768), None)]:
        inputs = proc(text=[testing.chat_prompt(proc, "What is it?", 1)], images=[Image.new("RGB", size, "red")],
                      return_tensors="pt")
        n = int((inputs["input_ids"] == image_pad).sum())
        assert n == int(inputs["image_grid_thw"].prod()) // 4
        if expected is not None:
            assert n == expected
        assert 16 <= n <= 64, f"{size} -> {n} image tokens"


def test_configs_and_parameter_counts(build):
    _, dirs, _ = build
    target, small, text = (_config(dirs[r]) for r in ("target", "small-vlm", "text-draft"))
    assert target["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert text["architectures"] == ["Qwen3ForCausalLM"]
    assert small["text_config"]["num_hidden_layers"] < target["text_config"]["num_hidden_layers"]
    assert text["vocab_size"] <= target["text_config"]["vocab_size"]
    for cfg in (target["text_config"], text):
        # vLLM's CPU attention backend accepts only some head sizes
        assert cfg["head_dim"] in (32, 64, 80, 96, 112, 128)
    assert _config(dirs["random-draft"])["text_config"] == target["text_config"]
    counts = testing.parameter_counts(dirs)
    assert counts["target"] <= 1_000_000
    assert counts["small-vlm"] < counts["target"] and counts["text-draft"] < counts["small-vlm"]
    assert counts["twin-dequant"] == counts["random-draft"] == counts["target"]
    for role in tiny.ROLES:
        if role != "text-draft":
            assert (dirs[role] / "tokenizer.json").read_bytes() == (dirs["target"] / "tokenizer.json").read_bytes()


# ---------------------------------------------------------------------------
# The int4 twin
# ---------------------------------------------------------------------------

LANGUAGE_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def test_twin_checkpoint_is_pack_quantized_w4a16(build):
    _, dirs, _ = build
    cfg = _config(dirs["twin-int4"])
    q = cfg["quantization_config"]
    assert q["quant_method"] == "compressed-tensors"
    assert q["format"] == "pack-quantized"
    assert q["quantization_status"] == "compressed"
    (group,) = q["config_groups"].values()
    assert group["targets"] == ["Linear"] and group["input_activations"] is None
    w = group["weights"]
    assert (w["num_bits"], w["type"], w["strategy"], w["symmetric"]) == (4, "int", "group", False)
    assert w["group_size"] == tiny.QUANT_GROUP_SIZE
    assert cfg["dtype"] == "bfloat16"

    tensors = _tensors(dirs["twin-int4"])
    # Linear layers: 2-D weights that are not embedding tables (patch_embed is a Conv3d)
    linears = sorted({k.rsplit(".", 1)[0] for k, v in tensors.items()
                      if (k.endswith(".weight") and v.ndim == 2 and "embed" not in k) or k.endswith(".weight_packed")})
    visual = [n for n in linears if n.startswith("model.visual.")]
    assert visual and set(visual) | {"lm_head"} == set(q["ignore"])
    assert not any("language_model" in n for n in q["ignore"])

    text_cfg = cfg["text_config"]
    n_layers = text_cfg["num_hidden_layers"]
    for layer in range(n_layers):
        for lin in LANGUAGE_LINEARS:
            base = f"model.language_model.layers.{layer}.{lin}"
            assert f"{base}.weight" not in tensors
            out_f, in_f = (int(s) for s in tensors[f"{base}.weight_shape"])
            g = tiny.QUANT_GROUP_SIZE
            assert in_f % g == 0
            assert tensors[f"{base}.weight_packed"].dtype == torch.int32
            assert tuple(tensors[f"{base}.weight_packed"].shape) == (out_f, in_f // 8)
            assert tensors[f"{base}.weight_scale"].dtype == torch.bfloat16
            assert tuple(tensors[f"{base}.weight_scale"].shape) == (out_f, in_f // g)
            assert tensors[f"{base}.weight_zero_point"].dtype == torch.int32
            assert tuple(tensors[f"{base}.weight_zero_point"].shape) == (out_f // 8, in_f // g)
    for name in visual + ["lm_head"]:
        assert tensors[f"{name}.weight"].dtype == torch.bfloat16
    assert len([k for k in tensors if k.endswith(".weight_packed")]) == n_layers * len(LANGUAGE_LINEARS)


def test_twin_dequant_holds_exactly_the_packed_int4_values(build):
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    _, dirs, _ = build
    packed, dequant, target = (_tensors(dirs[r]) for r in ("twin-int4", "twin-dequant", "target"))
    scheme = QuantizationScheme.model_validate(
        next(iter(_config(dirs["twin-int4"])["quantization_config"]["config_groups"].values())))
    quantized = {k[: -len(".weight_packed")] for k in packed if k.endswith(".weight_packed")}
    assert quantized
    for base in quantized:
        state = {k.rsplit(".", 1)[-1]: v for k, v in packed.items() if k.startswith(base + ".")}
        # (q - zp) * scale is exact in float32 (the scales are bfloat16 values); in bfloat16 it would round
        state["weight_scale"] = state["weight_scale"].float()
        w = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
        assert w.dtype == torch.float32
        assert torch.equal(w, dequant[f"{base}.weight"]), base
        rel = ((w - target[f"{base}.weight"]).norm() / target[f"{base}.weight"].norm()).item()
        assert 0.01 < rel < 0.2, f"{base}: relative int4 error {rel:.3f}"
    for key, value in dequant.items():
        if key[: -len(".weight")] not in quantized:
            assert torch.equal(value, target[key]), key
            assert torch.equal(packed[key], target[key].to(torch.bfloat16)), key
    # bfloat16-exact target: float32 and bfloat16 engines load the same model
    for key, value in target.items():
        assert torch.equal(value.to(torch.bfloat16).float(), value), key


def test_twin_agrees_with_target_random_draft_does_not(build, tmp_path):
    _, dirs, _ = build
    drafts = {"twin": dirs["twin-dequant"], "small-vlm": dirs["small-vlm"], "random": dirs["random-draft"]}
    r = testing.greedy_and_agreement(dirs["target"], drafts, tmp_path, n_prompts=8, max_new_tokens=40)
    assert r["positions"] == 8 * 40
    print(f"teacher-forced top-1 agreement over {r['positions']} positions: {r['agreement']}")
    assert r["agreement"]["twin"] >= MIN_TWIN_AGREEMENT
    assert r["agreement"]["random"] <= MAX_RANDOM_AGREEMENT
    # cut from the target: a plausible but clearly weaker draft
    assert MAX_RANDOM_AGREEMENT < r["agreement"]["small-vlm"] < r["agreement"]["twin"] - 0.2
    for out in r["outputs"]:
        assert len(set(out)) >= 8, f"greedy output collapsed: {out}"
        assert max(out) < tiny.BPE_VOCAB_SIZE, "a special or padding token was generated"


def test_image_changes_the_output_and_a_wrong_image_is_a_worse_draft(build, tmp_path):
    """Greedy target output with image i; teacher-forced agreement of the twin
    given the same image, and of the twin given another image (a draft that
    does not see the prompt's image, as a blind-MM draft)."""
    _, dirs, _ = build
    target = TeacherForcer(str(dirs["target"]), dtype="float32", device="cpu")
    twin = TeacherForcer(str(dirs["twin-dequant"]), dtype="float32", device="cpu")
    images = testing.demo_image_files(tmp_path)
    question = "Describe the image in one sentence."

    outputs, twin_hits, wrong_hits, total = [], 0, 0, 0
    for i, image in enumerate(images):
        gen = target.greedy(testing.demo_prompt(f"p{i}", question, [image]), max_new_tokens=32)
        outputs.append(tuple(gen))
        wrong = testing.demo_prompt(f"p{i}-wrong", question, [images[(i + 1) % len(images)]])
        twin_hits += sum(twin.agreement(testing.demo_prompt(f"p{i}", question, [image]), gen))
        wrong_hits += sum(twin.agreement(wrong, gen))
        total += len(gen)
    print(f"twin {twin_hits / total:.3f}, twin given another image {wrong_hits / total:.3f} ({total} positions)")
    assert len(set(outputs)) == len(images), "different images gave the same greedy continuation"
    assert twin_hits / total >= MIN_TWIN_AGREEMENT
    assert wrong_hits / total < twin_hits / total - 0.10


def test_teacher_forcer_greedy_agreement_and_a_text_only_draft(build, tmp_path):
    _, dirs, _ = build
    prompt = testing.demo_prompts(tmp_path, 2)[1]
    assert len(prompt.images) == 1
    target = TeacherForcer(str(dirs["target"]), dtype="float32", device="cpu")
    gen = target.greedy(prompt, max_new_tokens=16, min_new_tokens=16)
    assert len(gen) == 16
    assert target.agreement(prompt, gen) == [True] * 16, "a model's own greedy output is its top-1 everywhere"
    text = TeacherForcer(str(dirs["text-draft"]), dtype="float32", device="cpu")
    assert not text.is_vl
    assert len(text.agreement(prompt, gen)) == 16
    assert text.prompt_len(prompt) < target.prompt_len(prompt), "a text-only draft reads no image tokens"


def test_score_leg_agreement_records(build, tmp_path):
    """`python -m workbench.score`: a model scored on its own greedy output agrees everywhere."""
    _, dirs, _ = build
    prompts = testing.demo_prompts(tmp_path / "images", 3)
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps(p.to_dict()) + "\n" for p in prompts))
    target = TeacherForcer(str(dirs["target"]), dtype="float32", device="cpu")
    reference = tmp_path / "reference.jsonl"
    reference.write_text("".join(json.dumps({"pid": p.pid, "gen_ids": target.greedy(p, 8, 8), "leg": "vanilla_1"})
                                 + "\n" for p in prompts))
    for model, out in ((dirs["target"], tmp_path / "self"), (dirs["text-draft"], tmp_path / "text")):
        proc = subprocess.run([sys.executable, "-m", "workbench.score", "--model", str(model), "--reference",
                               str(reference), "--prompts", str(prompt_file), "--dtype", "float32", "--out", str(out)],
                              cwd=REPO, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert sorted(p.name for p in out.iterdir()) == ["records.jsonl", "summary.json"]
        records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
        assert [r["pid"] for r in records] == [p.pid for p in prompts]
        assert all(r["n_scored"] == 8 and r["tier"] == "score" for r in records)
        summary = json.loads((out / "summary.json").read_text())
        assert summary["status"] == "complete" and summary["n_prompts"] == 3
    self_records = [json.loads(line) for line in (tmp_path / "self" / "records.jsonl").read_text().splitlines()]
    assert all(r["agreement"] == 1.0 and r["first_disagreement"] is None for r in self_records)
    assert json.loads((tmp_path / "text" / "summary.json").read_text())["pooled_agreement"] < 1.0


# ---------------------------------------------------------------------------
# vLLM
# ---------------------------------------------------------------------------


def _smoke(model_dir: Path, dtype: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "workbench.testing", "vllm-smoke", str(model_dir), "--dtype", dtype,
           "--json", str(out), "--images", str(out.parent / "images")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"vllm-smoke {model_dir.name} failed:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def test_vllm_smoke_rejects_a_folder_without_checkpoint(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "workbench.testing", "vllm-smoke", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "not a checkpoint folder" in proc.stderr and str(tmp_path) in proc.stderr


@pytest.mark.vllm
def test_vllm_loads_target_float32_and_twin_int4_bfloat16(build, tmp_path):
    _, dirs, _ = build
    target = _smoke(dirs["target"], "float32", tmp_path / "target.json")
    kinds = {o["kind"]: o for o in target["outputs"]}
    assert set(kinds) == {"text", "image-a", "image-b", "two-images"}
    for o in target["outputs"]:
        assert len(o["ids"]) == 24, o
    assert kinds["image-a"]["prompt_len"] > kinds["text"]["prompt_len"]
    assert kinds["image-a"]["ids"] != kinds["image-b"]["ids"], "the image did not change vLLM's output"
    assert target["quantization"] is None

    twin = _smoke(dirs["twin-int4"], "bfloat16", tmp_path / "twin.json")
    assert twin["quantization"] == "compressed-tensors"
    methods = twin["linear_methods"]
    language = {k: v for k, v in methods.items() if "language_model" in k and "proj" in k}
    assert language and all(v.endswith("CompressedTensorsWNA16") for v in language.values()), methods
    assert all(v.startswith("Unquantized") for k, v in methods.items() if k.startswith("visual.")), methods
    assert all(len(o["ids"]) == 24 for o in twin["outputs"])
    # The int4 twin as vLLM runs it tracks the target: the target, teacher-forced on the twin's
    # greedy outputs, picks the twin's token at most positions.
    judge = TeacherForcer(str(dirs["target"]), dtype="float32", device="cpu")
    prompts = testing.smoke_prompts(tmp_path / "images")
    hits = [a for o in twin["outputs"] for a in judge.agreement(prompts[o["kind"]], o["ids"])]
    print(f"vLLM twin-int4 (bf16) outputs vs target (fp32) top-1: {sum(hits) / len(hits):.3f} over {len(hits)}")
    assert sum(hits) / len(hits) >= 0.7


def test_built_beside_swaps_in_whole_or_not_at_all(tmp_path):
    """Every builder (tiny models, organism, its drafters) writes through this: an error inside the block
    leaves the old folder as it was and no staging folder behind; success replaces the folder whole."""
    from workbench.tiny import built_beside

    dest = tmp_path / "models"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="half-way"):
        with built_beside(dest) as staging:
            (staging / "new.txt").write_text("new")
            raise RuntimeError("half-way")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]
    assert sorted(p.name for p in dest.iterdir()) == ["old.txt"]
    with built_beside(dest) as staging:
        assert staging.parent == tmp_path and staging != dest
        (staging / "new.txt").write_text("new")
        assert (dest / "old.txt").is_file()  # the old folder stays until the new one is whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]
    assert sorted(p.name for p in dest.iterdir()) == ["new.txt"]
