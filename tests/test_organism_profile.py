"""The organism as a profile (#21): its drafters (int4 twin, dequantized twin, random draft) built from a trained
organism and cached, the `organism` prompt set, the profile's checks, and `workbench run E1 --profile organism`
end to end with the accuracy table.

A light organism (the training test's small shape, 16 steps on a ~100-item corpus) stands in for the trained
one so that no test pays the full training; the prompts are the real corpus's held-out split.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO
from workbench import registry as R
from workbench import tiny
from workbench.organism import corpus as C
from workbench.organism import models as M
from workbench.organism import train as T

SHAPE = tiny.VLShape(text_layers=1, text_hidden=64, text_intermediate=128, text_heads=2, text_kv_heads=1,
                     vision_depth=1, vision_hidden=32, vision_intermediate=64, vision_heads=1, vision_pos_side=8)
RECIPE = T.Recipe(batch_size=4, warmup_steps=2, lr=5e-3, eval_every=16, eval_batch=8, shape=SHAPE)


@pytest.fixture(scope="module")
def light(tmp_path_factory):
    """A light organism and its drafters, in a root of its own."""
    root = tmp_path_factory.mktemp("organism")
    corpus = root / "corpus"
    C.write_corpus(corpus, seed=5, sizes={"train": 90, "validation": 8, "test": 2})
    target = T.ensure_organism("instruct", 16, root=root, corpus_dir=corpus, recipe=RECIPE)
    drafters = M.build_drafters(target, root / "instruct-drafters")
    return root, target, drafters


def test_drafters_are_the_targets_int4_twin_and_a_random_draft(light):
    import torch
    from safetensors.torch import load_file

    _, target, d = light
    cfg = json.loads((d["twin-int4"] / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["format"] == "pack-quantized" and q["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    assert any("visual" in name for name in q["ignore"]) and "lm_head" in q["ignore"]
    tw, dq, rd = (load_file(d[r] / "model.safetensors") for r in ("twin-int4", "twin-dequant", "random-draft"))
    tg = load_file(target / "model.safetensors")
    name = "model.language_model.layers.0.mlp.down_proj.weight"
    assert name + "_packed" in tw and tw[name + "_packed"].dtype == torch.int32
    # the dequantized twin is close to the target (int4 rounding), the random draft is not
    err = (dq[name] - tg[name]).abs().max() / tg[name].abs().max()
    assert 0 < float(err) < 0.2
    assert float((rd[name] - tg[name]).abs().max()) > float((dq[name] - tg[name]).abs().max())
    # the vision tower is kept as the target's
    vname = next(k for k in tg if k.startswith("model.visual.") and k.endswith("weight"))
    assert torch.equal(dq[vname], tg[vname])
    man = json.loads((d["twin-int4"].parent / "manifest.json").read_text())
    assert man["quantization"]["method"].startswith("RTN")


def test_drafters_are_cached_and_follow_a_retrained_target(light, monkeypatch):
    root, target, d = light
    calls = []
    real = M.build_drafters
    monkeypatch.setattr(M, "build_drafters", lambda t, o: calls.append(o) or real(t, o))
    monkeypatch.setattr(T, "ensure_organism", lambda variant, steps, root, log=None: target)
    before = (d["twin-int4"] / "model.safetensors").stat().st_mtime_ns
    roles = M.ensure_organism_models("instruct", root=root)
    assert calls == [] and set(roles) == set(R.ORGANISM_ROLES)
    assert (roles["twin-int4"] / "model.safetensors").stat().st_mtime_ns == before
    man = json.loads((target / T.MANIFEST_NAME).read_text())
    man["steps"] += 1  # the target changed: its drafters are rebuilt
    (target / T.MANIFEST_NAME).write_text(json.dumps(man))
    M.ensure_organism_models("instruct", root=root)
    assert len(calls) == 1


def test_organism_prompt_set_is_the_held_out_split():
    from workbench.datasets import load_prompt_set
    from workbench.prompts import PromptError

    test = load_prompt_set("organism", n=5)
    assert [p.pid for p in test] == [f"organism-test-{i:05d}" for i in range(5)]
    assert all(p.images and p.meta["answer"] and p.meta["split"] == "test" for p in test)
    val = load_prompt_set("organism", split="validation", n=2)
    assert val[0].meta["split"] == "validation"
    with pytest.raises(PromptError, match="unknown split 'dev'"):
        load_prompt_set("organism", split="dev")


def _profiles(tmp_path, body: str):
    path = tmp_path / "profiles.yaml"
    path.write_text("version: 1\nprofiles:\n" + body)
    import yaml
    return R._load_profiles(yaml.safe_load(path.read_text()), str(path))


def test_profile_checks(tmp_path):
    reg = R.load_registry()
    prof = reg.profile("organism")
    assert prof.organism == "instruct" and prof.roles["twin"] == "twin-int4" and prof.device == "cpu"
    ok = "  o:\n    device: cpu\n    organism: instruct\n    roles: {target: target, twin: twin-int4}\n"
    assert _profiles(tmp_path, ok)["o"].organism == "instruct"
    with pytest.raises(R.RegistryError, match="organism: must be one of instruct, thinking"):
        _profiles(tmp_path, ok.replace("organism: instruct", "organism: chatty"))
    with pytest.raises(R.RegistryError, match="'twin-awq' is not an organism model role"):
        _profiles(tmp_path, ok.replace("twin: twin-int4", "twin: twin-awq"))
    with pytest.raises(R.RegistryError, match=r"missing role\(s\) \['twin'\]"):
        _profiles(tmp_path, ok.replace(", twin: twin-int4", ""))
    with pytest.raises(R.RegistryError, match="neither tiny"):
        _profiles(tmp_path, ok.replace("device: cpu", "device: cpu\n    tiny: true"))


def _run(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "workbench.cli", "run", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.vllm
def test_a_leg_needing_an_unbound_role_is_refused_before_anything_is_built(tmp_path):
    res = _run("E6", "--profile", "organism", "--smoke", "--results", str(tmp_path), "--no-notebook")
    assert res.returncode != 0
    assert "profile organism binds no 'small-vlm' model" in res.stderr + res.stdout
    assert not any(tmp_path.iterdir())  # no run folder


@pytest.mark.vllm
def test_e1_under_the_organism_profile(light, tmp_path):
    _, target, d = light
    res = _run("E1", "--profile", "organism", "--smoke", "-p", "n=4", "--model-path", f"target={target}",
               "--model-path", f"twin={d['twin-int4']}", "--results", str(tmp_path), "--no-notebook",
               "--formats", "html")
    assert res.returncode == 0, res.stderr[-4000:]
    run = next((tmp_path / "E1").iterdir())
    summary = json.loads((run / "tables" / "summary.json").read_text())
    assert json.loads((run / "run.json").read_text())["profile"] == "organism"
    (ex,) = summary["exactness"]
    assert ex["rule_ok"] and ex["n"] == 4
    acc = {r["leg"]: r for r in summary["organism_accuracy"]}
    assert set(acc) == {"vanilla_1", "strict_g6", "vanilla_2"}
    assert all(r["n"] == 4 and 0.0 <= r["accuracy"] <= 1.0 for r in acc.values())
    chance = acc["vanilla_1"]["chance"]
    assert 0.0 < chance < 0.5  # guessing among each question's possible answers
    # strict decoding is the target's: where every output equals vanilla's (bf16: near-ties may part them on
    # some CPU kinds, which the exactness rule allows), the same answers, so the same accuracy
    if ex["n_exact"] == ex["n"]:
        assert acc["strict_g6"]["accuracy"] == acc["vanilla_1"]["accuracy"]
    # the token-class split by the grounded definition (the target's choice changes with a blank picture)
    classes = summary["token_classes"]
    assert {r["definition"] for r in classes} == {"grounded: target's greedy choice changes with a blank picture"}
    assert {r["leg"] for r in classes} == {"strict_g6"} and sum(r["evaluated"] for r in classes) > 0
    assert (run / "grounded.json").is_file()
    recs = [json.loads(x) for x in (run / "legs" / "vanilla_1" / "records.jsonl").read_text().splitlines()]
    assert {r["dataset"] for r in recs} == {"organism"} and all(r["n_images"] == 1 for r in recs)
