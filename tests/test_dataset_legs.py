"""Real prompt data through a real leg: MM-Vet and MathVista samples drafted by the tiny int4 twin."""

from __future__ import annotations

import pytest

from conftest import run_leg_process

pytestmark = pytest.mark.vllm

COMMON = ["--max-tokens", "16", "--dtype", "bfloat16", "--max-model-len", "2048", "--ignore-eos"]


def _strict_vs_vanilla(tmp_path, tiny_models, prompts_file):
    van = run_leg_process(tmp_path / "vanilla", "--target", tiny_models["target"], "--prompts", prompts_file,
                          *COMMON).ok()
    spec = run_leg_process(tmp_path / "strict", "--target", tiny_models["target"], "--draft",
                           tiny_models["twin-int4"], "--gamma", "4", "--prompts", prompts_file, *COMMON).ok()
    return van, spec


def _assert_rule(van, spec, tiny_models, sample):
    """bf16: the one exactness rule (workbench.exactness), not token equality."""
    from workbench.exactness import TeacherGaps, classify

    verdict = classify({r["pid"]: r["gen_ids"] for r in van.records}, {r["pid"]: r["gen_ids"] for r in spec.records},
                       "bfloat16", TeacherGaps(tiny_models["target"], {p.pid: p for p in sample}))
    print(f"\nstrict vs vanilla (bf16): {verdict.describe()}")
    verdict.check()


def test_mmvet_sample_leg(shared_data, tiny_models, tmp_path):
    from workbench.datasets import load_prompt_set
    from workbench.prompts import save_prompts

    prompts = load_prompt_set("mmvet", source=shared_data / "mm-vet")
    assert len(prompts) == 218
    sample = prompts[::73]  # three prompts spread over the set
    path = save_prompts(sample, tmp_path / "mmvet.jsonl")
    van, spec = _strict_vs_vanilla(tmp_path, tiny_models, path)
    assert [r["pid"] for r in spec.records] == [p.pid for p in sample]
    assert all(r["n_images"] >= 1 for r in spec.records)
    _assert_rule(van, spec, tiny_models, sample)
    assert spec.summary["spec"]["num_drafts"] > 0


def test_mathvista_sample_leg_with_stand_in_images(shared_data, tiny_models, tmp_path):
    from workbench.datasets import load_prompt_set
    from workbench.prompts import save_prompts

    prompts = load_prompt_set("mathvista", source=shared_data / "mathvista", pid_list="mathvista_testmini_seed20",
                              stand_in_images=True, stand_in_max_side=320)
    assert len(prompts) == 20
    assert all(p.meta["image_is_stand_in"] for p in prompts)
    sample = prompts[:3]
    path = save_prompts(sample, tmp_path / "mathvista.jsonl")
    van, spec = _strict_vs_vanilla(tmp_path, tiny_models, path)
    _assert_rule(van, spec, tiny_models, sample)
    assert spec.summary["spec"]["num_accepted_tokens"] > 0
    assert all(r["image_is_stand_in"] and r["dataset"] == "mathvista" for r in spec.records)
