"""The organism's synthetic visual-QA corpus (#21): deterministic, disjoint splits, MathVista formats, answers
that need the image, scored by the project's MathVista scorer. Light: no engine, no model, a few seconds."""

from __future__ import annotations

import collections
import hashlib
import json
import math
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from conftest import REPO
from workbench.organism import corpus as C
from workbench.prompts import load_prompts

SIZES = {"train": 120, "validation": 20, "test": 20}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("organism") / "corpus"
    manifest = C.write_corpus(out, seed=3, sizes=SIZES)
    return out, manifest


def _all_bytes(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes_other_seed_other_bytes(written, tmp_path):
    out, manifest = written
    again = C.write_corpus(tmp_path / "again", seed=3, sizes=SIZES)
    assert again == manifest
    assert _all_bytes(out) == _all_bytes(tmp_path / "again")
    # rewriting in place gives the same bytes too (the old output is replaced, not appended to)
    C.write_corpus(tmp_path / "again", seed=3, sizes=SIZES)
    assert _all_bytes(out) == _all_bytes(tmp_path / "again")
    other = C.write_split(tmp_path / "other", "train", SIZES["train"], seed=4)
    assert other["fingerprint"] != manifest["splits"]["train"]


def test_manifest_and_fingerprint(written):
    out, manifest = written
    assert manifest["sizes"] == SIZES and manifest["generator_version"] == C.GENERATOR_VERSION
    for split in C.SPLITS:
        m = json.loads((out / split / "manifest.json").read_text())
        assert m["size"] == SIZES[split] and m["seed"] == 3 and m["split"] == split
        assert m["fingerprint"] == manifest["splits"][split] == C.folder_fingerprint(out / split)
        assert sum(m["templates"].values()) == SIZES[split]
    # the fingerprint sees every file
    img = sorted((out / "test" / "images").glob("*.png"))[0]
    before = C.folder_fingerprint(out / "test")
    data = img.read_bytes()
    try:
        img.write_bytes(data + b"\0")
        assert C.folder_fingerprint(out / "test") != before
    finally:
        img.write_bytes(data)


def test_splits_load_as_prompt_sets(written):
    out, _ = written
    for split in C.SPLITS:
        prompts = load_prompts(out / split / "prompts.jsonl")
        assert len(prompts) == SIZES[split]
        for p in prompts:
            assert p.dataset == "organism" and len(p.images) == 1
            assert p.images[0].endswith(".png")
            m = p.meta
            for key in ("answer", "answer_type", "precision", "choices", "template", "format",
                        "target_thinking", "target_instruct", "target", "image_sha256", "key", "description"):
                assert key in m, key
            assert m["description"] in m["target_thinking"]  # the thinking target opens with it
            assert m["split"] == split and m["target"] == m["target_thinking"]
            assert m["target_thinking"].startswith("<think>\n") and "\n</think>\n\n" in m["target_thinking"]
            assert m["format"] in ("multi_choice", "integer", "float", "free_text")
            if m["format"] == "multi_choice":
                assert len(m["choices"]) == 4 and m["answer"] in m["choices"]
                for letter, choice in zip("ABCD", m["choices"]):
                    assert f"({letter}) {choice}" in p.text
                assert m["choices"]["ABCD".index(m["answer_letter"])] == m["answer"]
            elif m["format"] == "float":
                assert m["precision"] == 1 and len(m["answer"].split(".")[1]) == 1
            elif m["format"] == "integer":
                assert str(int(m["answer"])) == m["answer"]
            else:
                assert m["answer"] in m["vocabulary"]
            assert p.text.startswith("Hint: ") and "\nQuestion: " in p.text
        # raw (relative) image paths, as in data/tiny/prompts.jsonl
        first = json.loads((out / split / "prompts.jsonl").read_text().splitlines()[0])
        assert first["images"][0].startswith("images/")


def test_splits_are_disjoint(written):
    out, _ = written
    keys, pairs = {}, {}
    for split in C.SPLITS:
        for p in load_prompts(out / split / "prompts.jsonl"):
            with Image.open(p.images[0]) as im:
                key = C.item_key(im.convert("RGB"), p.text)
            assert key == p.meta["key"] and C.split_of_key(key) == split
            sha = hashlib.sha256(open(p.images[0], "rb").read()).hexdigest()
            assert sha == p.meta["image_sha256"]
            keys.setdefault(key, []).append(split)
            pairs.setdefault((sha, p.text), []).append(split)
    assert all(len(v) == 1 for v in keys.values())
    assert all(len(v) == 1 for v in pairs.values())


def test_every_template_appears_evenly(written):
    out, manifest = written
    counts = json.loads((out / "train" / "manifest.json").read_text())["templates"]
    assert set(counts) == set(C.TEMPLATE_NAMES) and max(counts.values()) - min(counts.values()) <= 1
    assert {C.TEMPLATES[t].format for t in C.TEMPLATE_NAMES} == {"multi_choice", "integer", "float", "free_text"}


def _entropy_ratio(counter):
    n = sum(counter.values())
    h = -sum(c / n * math.log(c / n) for c in counter.values())
    return h / math.log(len(counter))


@pytest.mark.parametrize("name", C.TEMPLATE_NAMES)
def test_the_text_does_not_determine_the_answer(name):
    """For fixed question texts, the answer over many pictures is near-uniform over >= 3 values."""
    t = C.TEMPLATES[name]
    for s in range(2):
        spec = t.ask(np.random.default_rng([99, s]))
        answers, texts = collections.Counter(), set()
        for k in range(240):
            item = C.build_item(t, np.random.default_rng([7, s, k]), spec=spec)
            answers[item.meta["answer"]] += 1
            texts.add(item.text)
            if t.format == "multi_choice":
                answers_letter = item.meta["answer_letter"]
                assert item.meta["choices"]["ABCD".index(answers_letter)] == item.meta["answer"]
        assert len(texts) == 1, "the spec fixes the question text"
        assert len(answers) >= 3, (name, answers)
        top = max(answers.values()) / sum(answers.values())
        assert top <= max(0.4, 2.0 / len(answers)), (name, answers)
        assert _entropy_ratio(answers) >= 0.9, (name, answers)


def test_multi_choice_letters_are_balanced():
    letters = collections.Counter(it.meta["answer_letter"] for it in C.generate_split("train", 600, seed=1)
                                  if it.format == "multi_choice")
    assert set(letters) == set("ABCD")
    assert max(letters.values()) / sum(letters.values()) < 0.36


def _wrong(meta):
    fmt = meta["format"]
    if fmt == "multi_choice":
        letter = "ABCD"[("ABCD".index(meta["answer_letter"]) + 1) % 4]
        return letter
    if fmt == "integer":
        return str(int(meta["answer"]) + 1)
    if fmt == "float":
        return f"{float(meta['answer']) + 0.1:.1f}"
    vocab = meta["vocabulary"]
    return vocab[(vocab.index(meta["answer"]) + 1) % len(vocab)]


def test_scorer_gold_and_wrong_both_styles(written):
    out, _ = written
    prompts = load_prompts(out / "validation" / "prompts.jsonl") + load_prompts(out / "train" / "prompts.jsonl")
    seen = set()
    for p in prompts:
        m = p.meta
        seen.add(m["template"])
        for style in C.STYLES:
            gold = m[f"target_{style}"]
            assert C.score_output(gold, p, style=style)["score"] == 1.0, (m["template"], style, gold)
            wrong = _wrong(m)
            # the gold reasoning kept, a wrong final answer: the answer marker decides, not the reasoning
            bad = (gold.rsplit("\n\n", 1)[0] + "\n\n" + wrong if style == "thinking"
                   else gold.rsplit("The answer is", 1)[0] + f"The answer is {wrong}.")
            res = C.score_output(bad, p, style=style)
            assert res["score"] == 0.0, (m["template"], style, bad, res)
        # the answer inside an unfinished reasoning does not count
        unfinished = m["target_thinking"].split("</think>")[0]
        assert C.score_output(unfinished, p.meta, style="thinking")["score"] == 0.0
    assert seen == set(C.TEMPLATE_NAMES)


def test_answers_need_the_picture_not_just_the_scene_description():
    """The thinking preamble's description changes with the picture; its boilerplate does not."""
    a = C.build_item("shape_colour", np.random.default_rng(1))
    b = C.build_item("shape_colour", np.random.default_rng(2))
    assert a.meta["target_thinking"] != b.meta["target_thinking"]
    assert "Let me look at the image carefully." in a.meta["target_thinking"]
    assert "Let me look at the image carefully." in b.meta["target_thinking"]


def test_a_few_hundred_items(tmp_path, record_property):
    t0 = time.perf_counter()
    C.write_split(tmp_path, "train", 300, seed=5, style="instruct")
    seconds = time.perf_counter() - t0
    # A figure, not a timed assertion: `pytest -s` and the junit report show it.
    print(f"\norganism corpus, 300 train items written: {seconds:.2f} s")
    record_property("organism_corpus_300_items_seconds", round(seconds, 3))
    prompts = load_prompts(tmp_path / "train" / "prompts.jsonl", check_images=False)
    assert len(prompts) == 300 and all(p.meta["target"] == p.meta["target_instruct"] for p in prompts)


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(C.CorpusError):
        C.write_split(tmp_path, "dev", 3)
    with pytest.raises(C.CorpusError):
        C.write_split(tmp_path, "train", -1)
    with pytest.raises(C.CorpusError):
        C.write_split(tmp_path, "train", 3, style="chatty")
    with pytest.raises(C.CorpusError):
        C.write_split(tmp_path, "train", 3, seed=-2)
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "precious.txt").write_text("keep me")
    with pytest.raises(C.CorpusError, match="refusing"):
        C.write_split(tmp_path, "train", 3)
    assert (tmp_path / "train" / "precious.txt").read_text() == "keep me"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "workbench.organism.corpus", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_cli(tmp_path):
    res = _cli("--out", str(tmp_path / "c"), "--seed", "0", "--train", "20", "--val", "5", "--test", "5")
    assert res.returncode == 0, res.stderr
    top = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert f"fingerprint {top['fingerprint']}" in res.stdout
    assert "train: 20 items" in res.stdout and "validation: 5 items" in res.stdout
    for bad in (["--train", "many"], ["--seed", "-1"], ["--val", "-3"], ["--style", "chatty"]):
        res = _cli("--out", str(tmp_path / "d"), *bad)
        assert res.returncode == 2, (bad, res.stderr)
        assert res.stderr.startswith("error: ") and "Traceback" not in res.stderr, res.stderr


def test_chance_level_and_answer_counts():
    """Each template's `answers` is the number of distinct answers its pictures give; chance is their mean inverse."""
    for name in C.TEMPLATE_NAMES:
        t = C.TEMPLATES[name]
        seen = {C.build_item(t, np.random.default_rng([11, k])).meta["answer"] for k in range(300)}
        if t.format == "multi_choice":
            assert t.answers == 4
        else:
            assert len(seen) == t.answers, (name, sorted(seen))
    assert C.chance_level(["count_int"]) == 1 / 4
    assert 0.15 < C.chance_level() < 0.35
    assert set(C.CURRICULUM) == set(C.TEMPLATE_NAMES) and len(C.CURRICULUM) == len(C.TEMPLATE_NAMES)


def test_objects_are_large_enough_to_cover_several_image_tokens():
    """A quadrant object spans 40-52 px: most of its quadrant's 2x2 merged image tokens (32 px each)."""
    item = C.build_item("count_int", np.random.default_rng(3))
    px = np.asarray(item.image).astype(int)
    background = px[0, 0]
    ink = np.abs(px - background).sum(-1) > 60
    n = int(item.meta["answer"])
    # every object covers at least ~500 px (the smallest, a star of radius 20, about 530; a circle 1250)
    assert ink.sum() >= 500 * n


def test_items_put_their_picture_after_the_question_and_before_the_choices():
    from workbench.chat import chat_messages
    from workbench.prompts import Prompt

    item = C.build_item("count_int", np.random.default_rng(3))
    assert item.meta["image_position"] == "after_text"
    turn = chat_messages(Prompt("x", item.text, images=["x.png"], meta=item.meta))[0]["content"]
    assert [c["type"] for c in turn] == ["text", "image"]
    item = C.build_item("position_mc", np.random.default_rng(3))
    assert item.meta["image_position"] == "before_choices"
    turn = chat_messages(Prompt("x", item.text, images=["x.png"], meta=item.meta))[0]["content"]
    assert [c["type"] for c in turn] == ["text", "image", "text"]
    assert turn[0]["text"].endswith(item.meta["question"]) and turn[2]["text"].startswith("Choices:\n(A) ")


def test_thinking_walk_is_a_trial_that_leaves_the_default_corpus_alone(written, tmp_path):
    """`thinking_walk`: a multiple choice's thinking target walks the listed choices to the answer before its
    last sentence; every other target, and every image, is the default corpus's."""
    out, manifest = written
    walked = C.write_corpus(tmp_path / "walk", seed=3, sizes=SIZES, thinking_walk=True)
    assert walked["thinking_walk"] is True and "thinking_walk" not in manifest
    plain = {p.pid: p for p in load_prompts(out / "test" / C.PROMPTS_NAME, check_images=False)}
    seen = set()
    for p in load_prompts(tmp_path / "walk" / "test" / C.PROMPTS_NAME, check_images=False):
        base = plain[p.pid].meta
        assert p.meta["image_sha256"] == base["image_sha256"] and p.meta["target_instruct"] == base["target_instruct"]
        if p.meta["format"] != "multi_choice":
            assert p.meta["target_thinking"] == base["target_thinking"]
            continue
        seen.add(p.meta["template"])
        letter = p.meta["answer_letter"]
        walk = f"({letter}) {p.meta['answer']}: yes. So the answer is {p.meta['answer']}, which is option {letter}."
        assert walk in p.meta["target_thinking"] and walk not in base["target_thinking"]
        assert p.meta["target"] == p.meta["target_thinking"]
        assert p.meta["target_thinking"].replace(C._choice_walk(p.meta["choices"], p.meta["answer"]) + " ", "") == \
            base["target_thinking"]
        assert C.score_output(p.meta["target_thinking"], p.meta, style="thinking")["correct"]
    assert seen == {"position_mc", "colour_at_position_mc", "bar_max_mc"}
