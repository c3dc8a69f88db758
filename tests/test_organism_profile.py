"""The organism as a profile (#21): its drafters (int4 twin, dequantized twin, random draft) built from a trained
organism and cached, the `organism` prompt set, the profile's checks, and `workbench run E1 --profile organism`
end to end with the accuracy table.

A light organism (the training test's small shape, 16 steps on a ~100-item corpus) stands in for the trained
one so that no test pays the full training; the prompts are the real corpus's held-out split.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import REPO, workbench_cli
from workbench import registry as R
from workbench import tiny
from workbench.organism import corpus as C
from workbench.organism import models as M
from workbench.organism import train as T

SHAPE = tiny.VLShape(text_layers=2, text_hidden=64, text_intermediate=128, text_heads=2, text_kv_heads=1,
                     vision_depth=1, vision_hidden=32, vision_intermediate=64, vision_heads=1, vision_pos_side=8)
RECIPE = T.Recipe(batch_size=4, warmup_steps=2, lr=5e-3, eval_every=16, eval_batch=8, shape=SHAPE)


@pytest.fixture(scope="module")
def light(tmp_path_factory):
    """A light organism and its drafters, in a root of its own."""
    root = tmp_path_factory.mktemp("organism")
    corpus = root / "corpus"
    C.write_corpus(corpus, seed=5, sizes={"train": 90, "validation": 8, "test": 2})
    target = T.ensure_organism("instruct", 16, root=root, corpus_dir=corpus, recipe=RECIPE)
    steps, M.DISTILL_STEPS = M.DISTILL_STEPS, 8  # a light distillation too
    try:
        drafters = M.build_drafters(target, root / "instruct-drafters")
    finally:
        M.DISTILL_STEPS = steps
    return root, target, drafters


def test_small_vlm_is_a_distilled_cut_and_the_text_draft_its_text_tower(light):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, target, d = light
    small_cfg = json.loads((d["small-vlm"] / "config.json").read_text())
    assert small_cfg["text_config"]["num_hidden_layers"] == M.SMALL_TEXT_LAYERS < SHAPE.text_layers
    man = json.loads((d["small-vlm"].parent / "manifest.json").read_text())
    assert man["small-vlm"]["steps"] == 8 and 0.0 <= man["small-vlm"]["test_accuracy"] <= 1.0
    sm, tg = load_file(d["small-vlm"] / "model.safetensors"), load_file(target / "model.safetensors")
    name = "model.language_model.layers.0.mlp.down_proj.weight"
    assert sm[name].shape == tg[name].shape and not torch.equal(sm[name], tg[name])  # started there, then trained
    assert "model.language_model.layers.1.mlp.down_proj.weight" not in sm
    text_cfg = json.loads((d["text-draft"] / "config.json").read_text())
    assert text_cfg["architectures"] == ["Qwen3ForCausalLM"] and not (d["text-draft"] / "preprocessor_config.json").exists()
    tx = load_file(d["text-draft"] / "model.safetensors")
    assert torch.equal(tx["model.layers.0.mlp.down_proj.weight"], sm[name])
    model = AutoModelForCausalLM.from_pretrained(d["text-draft"], dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(d["text-draft"])("The answer is", return_tensors="pt")["input_ids"]
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3


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
    monkeypatch.setattr(M, "build_drafters", lambda t, o, log=None: calls.append(o) or real(t, o, log=log))
    monkeypatch.setattr(M, "DISTILL_STEPS", 8)
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
    assert prof.stand_in  # the organism stands in for the real profiles' roles


def test_organism_stands_in_for_pinned_experiments_and_e14_compares_its_two_variants():
    """E11 (8b-thinking), E12 (32b) and E15 (8b-instruct) plan under the organism; E14's legs resolve
    @8b-thinking to the thinking organism (profile organism-thinking) and @8b-instruct to the instruct one,
    under either organism profile; without that mapping E14 is refused, naming what each resolves to."""
    from workbench.planning import plan

    reg = R.load_registry()
    for exp in ("E11", "E12", "E15"):
        assert plan(exp, "organism", smoke=True).legs, exp
    assert reg.profile("organism-thinking").organism == "thinking"
    for name in ("organism", "organism-thinking"):
        legs = plan("E14", name, smoke=True).legs
        assert {l.model for l in legs} == {"target@8b-thinking", "target@8b-instruct"}
        variant = {ref: reg.role_profile(name, ref).organism for l in legs for ref in (l.model, l.draft) if ref}
        assert variant == {"target@8b-thinking": "thinking", "twin@8b-thinking": "thinking",
                           "target@8b-instruct": "instruct", "twin@8b-instruct": "instruct"}
    # a plain role stays the profile's own; a profile the mapping does not name is the profile itself
    assert reg.role_profile("organism", "twin").name == "organism"
    assert reg.role_profile("organism", "target@32b").name == "organism"
    assert reg.role_profile("organism-thinking", "target@32b").name == "organism-thinking"
    assert reg.role_profile("8b-instruct", "target@8b-thinking").name == "8b-thinking"  # not a stand-in
    assert plan("E14", "tiny", smoke=True).legs  # the tiny stand-in has no variants to tell apart

    text = R.PROFILES_FILE.read_text()
    unmapped = text.replace("    stand_ins: {8b-thinking: organism-thinking}\n", "", 1)
    assert unmapped != text
    import yaml
    reg2 = R.Registry(experiments=reg.experiments, defaults=reg.defaults, smoke_defaults=reg.smoke_defaults,
                      profiles=R._load_profiles(yaml.safe_load(unmapped), "profiles"))
    with pytest.raises(R.RegistryError, match=r"compares profiles 8b-instruct, 8b-thinking; .* "
                                              r"8b-instruct -> organism \(instruct\), 8b-thinking -> organism "):
        plan("E14", "organism", smoke=True, registry=reg2)


def test_stand_ins_checks(tmp_path):
    base = ("  o:\n    device: cpu\n    organism: instruct\n    stand_in: true\n    stand_ins: {real: o2}\n"
            "    roles: {target: target, twin: twin-int4}\n"
            "  o2:\n    device: cpu\n    organism: thinking\n    stand_in: true\n"
            "    roles: {target: target, twin: twin-int4}\n"
            "  real:\n    device: gpu\n    roles: {target: a, twin: b, small-vlm: c, text-draft: d}\n")
    assert _profiles(tmp_path, base)["o"].stand_ins == {"real": "o2"}
    with pytest.raises(R.RegistryError, match="'nowhere' is not a profile that a stand-in stands in for"):
        _profiles(tmp_path, base.replace("{real: o2}", "{nowhere: o2}"))
    with pytest.raises(R.RegistryError, match="'real' is not another stand-in profile"):
        _profiles(tmp_path, base.replace("{real: o2}", "{real: real}"))
    with pytest.raises(R.RegistryError, match="only a stand-in profile"):
        _profiles(tmp_path, base.replace("    stand_in: true\n    stand_ins", "    stand_ins", 1))
    tiny_o2 = base.replace("    organism: thinking\n    stand_in: true\n    roles: {target: target, twin: twin-int4}\n",
                           "    tiny: true\n    stand_in: true\n    roles: {target: target, twin: twin-int4, "
                           "small-vlm: small-vlm, text-draft: text-draft}\n")
    assert tiny_o2 != base
    with pytest.raises(R.RegistryError, match="not a stand-in of the same kind"):
        _profiles(tmp_path, tiny_o2)


def test_e14_under_the_organism_resolves_each_variants_models(tmp_path, monkeypatch):
    """Model resolution of E14 under the organism builds both variants and binds each leg's roles to its
    own; a plain --model-path role override no longer reaches a role the mapping sends elsewhere."""
    from workbench import preparing
    from workbench.planning import plan

    built = []

    def fake(variant):
        built.append(variant)
        return {role: tmp_path / variant / role for role in M.ROLES}

    monkeypatch.setattr(M, "ensure_organism_models", fake)
    p = plan("E14", "organism", smoke=True)
    models = preparing.resolve_models(p)
    assert sorted(set(built)) == ["instruct", "thinking"]
    assert models == {"target@8b-thinking": str(tmp_path / "thinking" / "target"),
                      "twin@8b-thinking": str(tmp_path / "thinking" / "twin-int4"),
                      "target@8b-instruct": str(tmp_path / "instruct" / "target"),
                      "twin@8b-instruct": str(tmp_path / "instruct" / "twin-int4")}
    models = preparing.resolve_models(p, {"twin": str(tmp_path / "mine")})
    assert models["twin@8b-instruct"] == str(tmp_path / "mine")
    assert models["twin@8b-thinking"] == str(tmp_path / "thinking" / "twin-int4")


def _run(*args, timeout=900):
    return subprocess.run(workbench_cli("run", *args), cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_a_leg_needing_an_unbound_role_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    """An organism profile that leaves small-vlm unbound: E6 is refused at model resolution, naming the role,
    before any organism is trained or built."""
    from workbench import preparing
    from workbench.planning import plan

    text = R.PROFILES_FILE.read_text()
    head, _, rest = text.partition("\n  organism:\n")
    body = head + "\n  organism:\n" + rest.replace("      small-vlm: small-vlm\n      text-draft: text-draft\n", "", 1)
    assert body != text
    (tmp_path / "profiles.yaml").write_text(body)
    reg = R.load_registry(profiles_path=tmp_path / "profiles.yaml")
    monkeypatch.setattr(M, "ensure_organism_models", lambda *a, **k: pytest.fail("built before the refusal"))
    with pytest.raises(R.RegistryError, match="profile organism binds no 'small-vlm' model"):
        preparing.resolve_models(plan("E6", "organism", smoke=True, registry=reg), registry=reg)


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


def test_organism_accuracy_scores_each_leg_by_its_own_targets_variant(tmp_path):
    """E14 under the organism runs both variants in one run: a leg is scored in its target's style (the
    organism manifest's variant), not the profile's: an unfinished thinking output that names the answer
    scores 0 on the thinking target's leg and 1 on the instruct target's."""
    from synthetic_runs import write_run
    from workbench.analyses import RunTables
    from workbench.results import load_run

    corpus = tmp_path / "corpus"
    C.write_corpus(corpus, seed=5, sizes={"train": 1, "validation": 1, "test": 3})
    items = [json.loads(x) for x in (corpus / "test" / C.PROMPTS_NAME).read_text().splitlines()]
    legs = [{"name": "vanilla_1", "tier": "vanilla"}, {"name": "vanilla_2", "tier": "vanilla"}]
    rdir = write_run(tmp_path / "results", legs=legs, n_prompts=3)
    cfg = json.loads((rdir / "run.json").read_text())
    cfg.update(profile="organism", dataset={"resolved": "organism"}, prompts_file="prompts.jsonl")
    (rdir / "run.json").write_text(json.dumps(cfg))
    prompts = []
    for i, item in enumerate(items):
        item["pid"] = f"p{i:06d}"
        item["images"] = [str(corpus / "test" / im) for im in item["images"]]
        prompts.append(item)
    (rdir / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    for leg, variant in (("vanilla_1", "thinking"), ("vanilla_2", "instruct")):
        (tmp_path / variant).mkdir()
        (tmp_path / variant / T.MANIFEST_NAME).write_text(json.dumps({"variant": variant}))
        path = rdir / "legs" / leg / "summary.json"
        summary = json.loads(path.read_text())
        summary["target"] = str(tmp_path / variant)
        path.write_text(json.dumps(summary))
        path = rdir / "legs" / leg / "records.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        for r, item in zip(rows, prompts):  # the answer named, the thinking never closed
            r["text"] = f"<think>\nThe answer is {item['meta'].get('answer_letter', item['meta']['answer'])}."
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    acc = RunTables(load_run(rdir), teacher=False)["organism_accuracy"].set_index("leg")["accuracy"]
    assert acc["vanilla_1"] == 0.0 and acc["vanilla_2"] == 1.0
