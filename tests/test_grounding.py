"""Image-grounded tokens by the target's own definition (#21): its greedy choice changes with a blank picture.

On the tiny target in float32, teacher-forced on its own greedy output: positions line up with the output,
a prompt without pictures has none, and the labels are cached so a run folder re-opens without the model.
"""

from __future__ import annotations

import pytest

from workbench import grounding
from workbench.datasets import load_prompt_set


@pytest.fixture(scope="module")
def teacher(tiny_models):
    from workbench.teacher import TeacherForcer

    return TeacherForcer(str(tiny_models["target"]), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def prompts():
    return {p.pid: p for p in load_prompt_set("tiny")}


def test_grounded_positions_line_up_with_the_output(teacher, prompts):
    with_images = [p for p in prompts.values() if p.images]
    text_only = [p for p in prompts.values() if not p.images]
    assert with_images and text_only
    any_grounded = 0
    for p in with_images[:4]:
        gen = teacher.greedy(p, 12, min_new_tokens=12)
        # teacher forcing with the real pictures reproduces the greedy output position by position (one full
        # pass vs generate's cached steps: in float32 they may part only where the top two are a near-tie)
        lg = teacher.logits(p, gen)
        top2 = lg.topk(2, dim=-1).values
        assert all(a == b or float(t[0] - t[1]) < 1e-3 for a, b, t in zip(lg.argmax(-1).tolist(), gen, top2))
        g = teacher.image_grounded(p, gen)
        blank = teacher.forward(p, gen, blank=True)[0].argmax(-1).tolist()
        assert g == [b != x for b, x in zip(blank, gen)] and len(g) == 12
        any_grounded += sum(g)
    assert any_grounded > 0, "a blank picture changed none of the target's choices"
    p = text_only[0]
    gen = teacher.greedy(p, 6, min_new_tokens=6)
    assert teacher.image_grounded(p, gen) == [False] * 6


def test_labels_are_cached_for_a_copied_run(teacher, prompts, tiny_models, tmp_path):
    p = next(q for q in prompts.values() if q.images)
    gen = teacher.greedy(p, 8, min_new_tokens=8)
    cache = tmp_path / grounding.CACHE
    live = grounding.GroundedPositions(tiny_models["target"], prompts, cache=cache)
    labels = live.labels(p.pid, gen)
    assert set(labels) <= {grounding.GROUNDED, grounding.OTHER} and len(labels) == 8
    assert cache.is_file()
    offline = grounding.GroundedPositions(tmp_path / "no-model", prompts, cache=cache, cache_only=True)
    assert offline.cached(p.pid, gen) and offline.labels(p.pid, gen) == labels
    with pytest.raises(FileNotFoundError, match="image-grounded"):
        offline(p.pid, gen[:-1])


def test_token_classes_table_grounded_or_proxy(tiny_models, tmp_path, monkeypatch):
    """The committed tiny E1 run (traced strict leg): grounded by default for a small target, the vocabulary
    proxy when WORKBENCH_GROUNDED=0; the definition column says which."""
    import shutil
    from pathlib import Path

    from workbench.analyses import RunTables
    from workbench.results import load_run

    src = Path(__file__).resolve().parents[1] / "results" / "E1" / "20261201T195241Z-eb9fa688"
    run = tmp_path / "run"
    shutil.copytree(src, run)
    # its pictures are named relative to the checkout (as the demo's run folder names them)
    prompts_file = run / "prompts.jsonl"
    prompts_file.write_text(prompts_file.read_text().replace('"data/tiny/', f'"{src.parents[2]}/data/tiny/'))
    assert (run / grounding.CACHE).is_file()  # the run's own analysis made it: a copied run opens with it
    cached = RunTables(load_run(run))["token_classes"]
    (run / grounding.CACHE).unlink()
    monkeypatch.setenv("WORKBENCH_GROUNDED", "0")
    proxy = RunTables(load_run(run))["token_classes"]
    assert set(proxy["definition"]) == {"vocabulary proxy (metrics.IMAGE_WORDS)"}
    assert not (run / grounding.CACHE).exists()
    monkeypatch.delenv("WORKBENCH_GROUNDED")
    grounded = RunTables(load_run(run))["token_classes"]
    assert set(grounded["definition"]) == {"grounded: target's greedy choice changes with a blank picture"}
    assert set(grounded["token_class"]) <= {grounding.GROUNDED, grounding.OTHER}
    # every evaluated draft position is counted once, whichever definition labels it
    assert grounded["evaluated"].sum() == proxy["evaluated"].sum() and (run / grounding.CACHE).is_file()
    assert grounded.to_dict("records") == cached.to_dict("records")
