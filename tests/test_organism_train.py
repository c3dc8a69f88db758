"""The organism's training loop (#21): deterministic, the loss falls, fingerprinted manifest, cached reuse, a
rebuild on a new seed, a checkpoint transformers loads and generates from. Light: a ~100-item corpus, a
smaller shape than the organism's, 16 steps; no engine."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from workbench import tiny
from workbench.organism import corpus as C
from workbench.organism import train as T

SIZES = {"train": 90, "validation": 8, "test": 2}
STEPS = 16
# the tiny target's architecture at test size (one layer each side, head_dim 32 as the organism's)
SHAPE = tiny.VLShape(text_layers=1, text_hidden=64, text_intermediate=128, text_heads=2, text_kv_heads=1,
                     vision_depth=1, vision_hidden=32, vision_intermediate=64, vision_heads=1, vision_pos_side=8)
RECIPE = T.Recipe(batch_size=4, warmup_steps=2, lr=5e-3, eval_every=STEPS, eval_batch=8, shape=SHAPE)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("organism") / "corpus"
    C.write_corpus(out, seed=5, sizes=SIZES)
    return out


@pytest.fixture(scope="module")
def trained(corpus_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    folder = T.ensure_organism("instruct", STEPS, root=root, corpus_dir=corpus_dir, recipe=RECIPE)
    return root, folder, json.loads((folder / T.MANIFEST_NAME).read_text())


def test_same_seed_same_weights_and_loss_curve(trained, corpus_dir, tmp_path):
    _, folder, manifest = trained
    again = T.build_organism(tmp_path / "instruct", corpus_dir, dataclasses.replace(RECIPE, steps=STEPS))
    assert again["loss_curve"] == manifest["loss_curve"]
    assert (tmp_path / "instruct" / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    assert again["files"] == manifest["files"] and again["recipe"] == manifest["recipe"]


def test_the_loss_decreases(trained):
    curve = trained[2]["loss_curve"]
    assert len(curve) == STEPS
    assert sum(curve[-4:]) / 4 < 0.7 * sum(curve[:4]) / 4, curve


def test_manifest_fingerprints(trained, corpus_dir):
    _, folder, m = trained
    recipe = dataclasses.replace(RECIPE, steps=STEPS).resolved()
    assert m["recipe"] == T.recipe_fingerprint(recipe)
    assert m["corpus"] == json.loads((corpus_dir / C.MANIFEST_NAME).read_text())["fingerprint"]
    assert m["steps"] == STEPS and m["variant"] == "instruct" and m["seed"] == 0
    assert m["hyperparameters"]["shape"]["text_hidden"] == SHAPE.text_hidden
    assert 0.0 <= m["val_accuracy"] <= 1.0 and 0.0 <= m["blank_accuracy"] <= 1.0
    assert m["val_items"] == SIZES["validation"] and m["best_step"] == STEPS and m["steps_per_s"] > 0
    assert m["files"] == T._files(folder)
    assert {"model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja",
            "preprocessor_config.json", "generation_config.json"} <= set(m["files"])
    # the tokenizer and processor files are the tiny target's own writers' output
    assert (folder / "chat_template.jinja").read_text() == tiny.CHAT_TEMPLATE
    # the recipe fingerprint sees the seed, the steps, the hyperparameters and the shape
    for change in ({"seed": 1}, {"steps": STEPS + 1}, {"lr": 1e-3}, {"vision_lr_scale": 3.0},
                   {"shape": dataclasses.replace(SHAPE, text_layers=2)}):
        assert T.recipe_fingerprint(dataclasses.replace(recipe, **change)) != m["recipe"], change


def test_reuse_without_rebuild_and_rebuild_on_a_new_seed(trained, corpus_dir, tmp_path):
    root, _, manifest = trained
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    weights = copy / "instruct" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert T.ensure_organism("instruct", STEPS, root=copy, corpus_dir=corpus_dir, recipe=RECIPE) == copy / "instruct"
    assert weights.stat().st_mtime_ns == before, "ensure_organism retrained although nothing changed"

    folder = T.ensure_organism("instruct", STEPS, root=copy, corpus_dir=corpus_dir,
                               recipe=dataclasses.replace(RECIPE, seed=1))
    m = json.loads((folder / T.MANIFEST_NAME).read_text())
    assert m["seed"] == 1 and m["recipe"] != manifest["recipe"] and m["corpus"] == manifest["corpus"]
    assert weights.read_bytes() != (root / "instruct" / "model.safetensors").read_bytes()
    assert m["loss_curve"] != manifest["loss_curve"]


def test_the_checkpoint_loads_with_transformers_and_generates(trained, corpus_dir):
    import torch
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    from workbench.chat import load_images, render_prompt
    from workbench.prompts import load_prompts

    _, folder, _ = trained
    model = Qwen3VLForConditionalGeneration.from_pretrained(folder).eval()
    assert model.config.architectures == ["Qwen3VLForConditionalGeneration"]
    assert model.config.text_config.hidden_size == SHAPE.text_hidden
    assert list(model.config.vision_config.deepstack_visual_indexes) == list(SHAPE.deepstack)
    processor = AutoProcessor.from_pretrained(folder)
    prompt = load_prompts(corpus_dir / "validation" / C.PROMPTS_NAME)[0]
    enc = processor(text=[render_prompt(processor.tokenizer, prompt)], images=load_images(prompt),
                    return_tensors="pt")
    assert int((enc["input_ids"] == model.config.image_token_id).sum()) == 16  # 128x128 -> 4x4 merged tokens
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > enc["input_ids"].shape[1]


def test_the_organism_config_is_tinys_architecture_at_other_sizes():
    cfg = T.organism_config()
    ref = T.organism_config(tiny.TARGET_SHAPE)
    assert cfg.architectures == ref.architectures == ["Qwen3VLForConditionalGeneration"]
    assert cfg.image_token_id == ref.image_token_id and cfg.text_config.vocab_size == tiny.MODEL_VOCAB_SIZE
    assert cfg.text_config.rope_parameters["mrope_interleaved"] is True
    assert cfg.text_config.hidden_size == T.ORGANISM_SHAPE.text_hidden
    assert cfg.vision_config.depth == T.ORGANISM_SHAPE.vision_depth
    assert cfg.text_config.head_dim == 32
    assert 1_000_000 < T.parameter_count() < 3_000_000


@pytest.mark.parametrize("variant", T.VARIANTS)
def test_the_loss_sees_only_the_target_completion(corpus_dir, trained, variant):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(trained[1])
    examples = T._examples(corpus_dir / "train" / C.PROMPTS_NAME, processor.tokenizer, variant, limit=3)
    collate = T.Collator(processor)
    batch = collate(examples)
    collate.check(examples, batch)  # raises unless the labelled tokens spell target + <|im_end|>
    tok = processor.tokenizer
    n_target = sum(len(tok(ex.target + "<|im_end|>", add_special_tokens=False)["input_ids"]) for ex in examples)
    assert int((batch["labels"] != -100).sum()) == n_target
    # the image tokens and the prompt are never labelled
    assert not ((batch["labels"] != -100) & (batch["input_ids"] == processor.image_token_id)).any()


def test_the_curriculum_adds_one_template_at_a_time():
    pools = {t: [0] for t in C.TEMPLATE_NAMES}
    r = dataclasses.replace(RECIPE, curriculum_hold=5, curriculum_every=3).resolved()
    assert T._active_templates(0, r, pools) == [C.CURRICULUM[0]]
    assert T._active_templates(4, r, pools) == [C.CURRICULUM[0]]
    assert T._active_templates(5, r, pools) == list(C.CURRICULUM[:2])
    assert T._active_templates(8, r, pools) == list(C.CURRICULUM[:3])
    assert T._active_templates(10_000, r, pools) == list(C.CURRICULUM)
    # templates the split lacks are skipped; none: plain shuffled passes
    assert T._active_templates(0, r, {"word_read": [0]}) == ["word_read"]
    plain = dataclasses.replace(RECIPE, curriculum_hold=0, curriculum_every=0).resolved()
    assert (plain.curriculum_hold, plain.curriculum_every) == (0, 0)


def test_the_manifest_reports_test_blank_and_chance(trained):
    m = trained[2]
    assert m["test_items"] == SIZES["test"] and 0.0 <= m["test_accuracy"] <= 1.0
    assert 0.0 <= m["test_blank_accuracy"] <= 1.0 and 0.0 < m["chance"] < 1.0
    assert set(m["val_per_template"]) <= set(C.TEMPLATE_NAMES)


def test_describe_rows_label_the_whole_picture(corpus_dir, tmp_path):
    """A describe row keeps its item's picture, asks DESCRIBE_QUESTION and labels exactly the scene's
    description; a training with describe rows runs; a fraction outside [0, 1] is refused by name."""
    from transformers import AutoProcessor

    from workbench.chat import load_images

    T._write_common(tmp_path)
    processor = AutoProcessor.from_pretrained(tmp_path)
    train = T._examples(corpus_dir / "train" / C.PROMPTS_NAME, processor.tokenizer, "instruct", 4)
    rows = [T._describe_example(ex, processor.tokenizer) for ex in train]
    for ex, row in zip(train, rows):
        assert row.target == ex.prompt.meta["description"] and row.prompt.text == T.DESCRIBE_QUESTION
        assert row.prompt.images == ex.prompt.images and row.target in ex.prompt.meta["target_thinking"]
        assert [im.tobytes() for im in load_images(row.prompt)] == [im.tobytes() for im in load_images(ex.prompt)]
    collate = T.Collator(processor)
    collate.check(rows, collate(rows))  # the labelled span is the description and <|im_end|>, nothing else
    rec = T.train(corpus_dir, tmp_path / "d", dataclasses.replace(RECIPE, steps=2, eval_every=2,
                                                                   describe_fraction=1.0))
    assert rec["steps"] == 2 and all(x == x for x in rec["loss_curve"])
    with pytest.raises(ValueError, match="describe_fraction"):
        T.train(corpus_dir, tmp_path / "e", dataclasses.replace(RECIPE, steps=2, describe_fraction=1.5))


def test_template_weights_are_checked_before_any_training():
    T.Recipe(template_weights=(("position_mc", 3.0),)).resolved()
    with pytest.raises(ValueError, match="template_weights.*no_such_template"):
        T.Recipe(template_weights=(("no_such_template", 2.0),)).resolved()
    with pytest.raises(ValueError, match="template_weights"):
        T.Recipe(template_weights=(("position_mc", 0.0),)).resolved()
    # the weights are part of the recipe fingerprint
    assert T.recipe_fingerprint(T.Recipe()) != T.recipe_fingerprint(T.Recipe(template_weights=(("position_mc", 3.0),)))


def test_choices_rows_copy_a_multiple_choices_listed_choices(corpus_dir, tmp_path):
    """A choices row keeps its item's picture and Choices block, asks CHOICES_QUESTION and labels the listed
    choices in order; other formats have none; a fraction outside [0, 1] is refused by name."""
    from transformers import AutoProcessor

    from workbench.chat import chat_messages

    T._write_common(tmp_path)
    processor = AutoProcessor.from_pretrained(tmp_path)
    train = T._examples(corpus_dir / "train" / C.PROMPTS_NAME, processor.tokenizer, "instruct")
    mc = [ex for ex in train if ex.prompt.meta["format"] == "multi_choice"][:3]
    other = next(ex for ex in train if ex.prompt.meta["format"] != "multi_choice")
    assert mc and T._choices_example(other, processor.tokenizer) is None
    for ex in mc:
        row = T._choices_example(ex, processor.tokenizer)
        choices = ex.prompt.meta["choices"]
        assert row.target == " ".join(f"({letter}) {c}." for letter, c in zip("ABCD", choices))
        assert row.prompt.text.startswith(T.CHOICES_QUESTION + "\nChoices:\n(A) " + choices[0])
        assert row.prompt.images == ex.prompt.images
        # the picture sits between the question and the choices, as in the item's own prompt
        assert [c["type"] for c in chat_messages(row.prompt)[0]["content"]] == ["text", "image", "text"]
    rows = [T._choices_example(ex, processor.tokenizer) for ex in mc]
    collate = T.Collator(processor)
    collate.check(rows, collate(rows))  # the labelled span is the copied choices and <|im_end|>
    with pytest.raises(ValueError, match="choices_fraction"):
        T.train(corpus_dir, tmp_path / "e", dataclasses.replace(RECIPE, steps=2, choices_fraction=-0.1))


def test_match_rows_state_the_fact_and_walk_shuffled_choices(corpus_dir, tmp_path):
    """A match row states the answer's first sentence in the question, lists the item's choices in the given
    order and labels the walk to the matching one and its letter; other formats have none; a training with
    match rows runs; a fraction outside [0, 1] is refused by name."""
    from transformers import AutoProcessor

    from workbench.chat import chat_messages

    T._write_common(tmp_path)
    processor = AutoProcessor.from_pretrained(tmp_path)
    tok = processor.tokenizer
    train = T._examples(corpus_dir / "train" / C.PROMPTS_NAME, tok, "instruct")
    mc = [ex for ex in train if ex.prompt.meta["format"] == "multi_choice"][:3]
    other = next(ex for ex in train if ex.prompt.meta["format"] != "multi_choice")
    assert mc and T._match_example(other, tok, "instruct", [0]) is None
    for ex in mc:
        meta = ex.prompt.meta
        order = [3, 1, 0, 2]
        row = T._match_example(ex, tok, "instruct", order)
        listed = [meta["choices"][i] for i in order]
        letter = "ABCD"[listed.index(meta["answer"])]
        fact = meta["target_instruct"].split(" (A) ")[0]
        assert row.prompt.meta["choices"] == listed and row.prompt.meta["answer_letter"] == letter
        assert f"Question: {fact} {meta['question']}\nChoices:\n(A) {listed[0]}\n" in row.prompt.text
        assert row.target.startswith(fact + " (A) ") and row.target.endswith(f"The answer is {letter}.")
        assert f"({letter}) {meta['answer']}: yes." in row.target
        assert C.score_output(row.target, row.prompt.meta, style="instruct")["score"] == 1.0
        assert [c["type"] for c in chat_messages(row.prompt)[0]["content"]] == ["text", "image", "text"]
        thinking = T._match_example(ex, tok, "thinking", order)
        assert thinking.target.endswith(f"which is option {letter}.\n</think>\n\n{letter}")
    rows = [T._match_example(ex, tok, "instruct", [1, 0, 2, 3]) for ex in mc]
    collate = T.Collator(processor)
    collate.check(rows, collate(rows))
    rec = T.train(corpus_dir, tmp_path / "m", dataclasses.replace(RECIPE, steps=2, eval_every=2, match_fraction=1.0))
    assert rec["steps"] == 2 and all(x == x for x in rec["loss_curve"])
    with pytest.raises(ValueError, match="match_fraction"):
        T.train(corpus_dir, tmp_path / "e", dataclasses.replace(RECIPE, steps=2, match_fraction=2.0))


def test_the_command_line_sets_recipe_fields(monkeypatch, tmp_path):
    """--set FIELD=JSON reaches the recipe ensure_organism gets (dicts as pairs); an unknown field is refused."""
    seen = {}

    def fake(variant, steps, *, root, corpus_dir, recipe, force, log):
        seen["recipe"] = recipe
        raise SystemExit(0)

    monkeypatch.setattr(T, "ensure_organism", fake)
    with pytest.raises(SystemExit):
        T.main(["--out", str(tmp_path), "--set", "match_fraction=0.5", "--set", 'template_weights={"word_read": 2}'])
    assert seen["recipe"].match_fraction == 0.5 and seen["recipe"].template_weights == (("word_read", 2),)
    with pytest.raises(SystemExit) as err:
        T.main(["--out", str(tmp_path), "--set", "no_such_field=1"])
    assert err.value.code == 2
