"""Registry: experiments.yaml / profiles.yaml load, and every kind of bad input is named."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from workbench.analyses import ANALYSES
from workbench.registry import (KNOBS, RegistryError, check_knob, load_registry, parse_knob_text,
                                EXPERIMENTS_FILE, PROFILES_FILE)


@pytest.fixture(scope="module")
def raw():
    return yaml.safe_load(EXPERIMENTS_FILE.read_text()), yaml.safe_load(PROFILES_FILE.read_text())


def _load(tmp_path: Path, exps: dict, profs: dict):
    ep, pp = tmp_path / "e.yaml", tmp_path / "p.yaml"
    ep.write_text(yaml.safe_dump(exps))
    pp.write_text(yaml.safe_dump(profs))
    return load_registry(ep, pp)


def test_catalogue_has_e1_to_e18():
    reg = load_registry()
    assert reg.ids() == [f"E{i}" for i in range(1, 19)]
    assert reg.experiment("E17").runner == "serve" and reg.experiment("E18").runner == "serve"
    assert set(reg.profiles) == {"tiny", "organism", "organism-thinking", "8b-thinking", "8b-instruct", "32b",
                                 "8b-shape", "32b-shape"}
    assert reg.experiment("e4").id == "E4"
    e11 = reg.experiment("E11")
    assert e11.result_prefix == "og8_" and e11.sweep["gamma"] == [2, 3, 4, 6, 8]
    assert reg.experiment("E15").dataset == "mmvet" and reg.experiment("E15").result_prefix == "ogi2_"
    assert reg.profile("8b-instruct").roles["twin"] == "cyankiwi/Qwen3-VL-8B-Instruct-AWQ-4bit"
    assert reg.profile("tiny").engine["dtype"] == "bfloat16"


def test_every_experiment_names_registered_analyses():
    reg = load_registry()
    for e in reg.experiments.values():
        assert e.analyses, e.id
        for a in e.analyses:
            assert a in ANALYSES, f"{e.id}: analysis {a!r} has no recipe"


@pytest.mark.parametrize("mutate, message", [
    (lambda e, p: e["experiments"]["E2"].update(colour="red"), r"experiment E2: unknown field\(s\) \['colour'\]"),
    (lambda e, p: e["experiments"]["E2"]["legs"][0].update(gama=3), r"E2.legs\[0\] \(strict_g\{gamma\}\): unknown field"),
    (lambda e, p: e["experiments"]["E2"]["legs"][0].update(gamma="six"), r"E2.*gamma.*must be an integer 1..32, got 'six'"),
    (lambda e, p: e["experiments"]["E2"]["legs"][0].update(gamma=True), r"E2.*gamma.*must be an integer"),
    (lambda e, p: e["experiments"]["E2"]["legs"][0].update(gamma=0), r"E2.*gamma.*1..32, got 0"),
    (lambda e, p: e["experiments"]["E2"]["legs"][0].update(kind="fast"), r"E2.*kind: must be one of vanilla, spec, score"),
    (lambda e, p: e["experiments"]["E2"]["legs"][0].update(draft="teacher"), r"E2.*draft: unknown role 'teacher'"),
    (lambda e, p: e["experiments"]["E2"]["legs"][0].update(draft="twin@70b"), r"E2.*unknown profile '70b'"),
    (lambda e, p: e["experiments"]["E2"]["legs"][0].pop("draft"), r"E2.*a spec leg needs a 'draft' role"),
    (lambda e, p: e["experiments"]["E2"]["legs"][0].update(tier="loose"), r"E2.*tier: must be one of strict, relaxed"),
    (lambda e, p: e["experiments"]["E2"]["legs"][0].update(relax_logtau=0.5), r"E2.*strict leg cannot set relax_logtau"),
    (lambda e, p: e["experiments"]["E2"]["legs"][0].update(blind_mm="yes"), r"E2.*blind_mm.*true or false"),
    (lambda e, p: e["experiments"]["E2"]["legs"][0].update(named_only="yes"), r"E2.*named_only: expected true or false"),
    (lambda e, p: e["experiments"]["E2"]["legs"][0].update(name="strict_{gama}"), r"E2.*placeholder \{gama\}"),
    (lambda e, p: e["experiments"]["E2"]["sweep"].update(gamma=[]), r"E2.sweep.gamma: expected a non-empty list"),
    (lambda e, p: e["experiments"]["E2"]["sweep"].update(gamma=[2, 2]), r"E2.sweep.gamma: duplicate values"),
    (lambda e, p: e["experiments"]["E2"]["sweep"].update(colour=[1]), r"E2.sweep: cannot sweep 'colour'"),
    (lambda e, p: e["experiments"]["E2"]["sweep"].update(max_tokens=[8, 16]), r"E2.sweep.max_tokens: no leg name template mentions"),
    (lambda e, p: e["experiments"]["E2"].update(dataset="imagenet"), r"E2.dataset: unknown dataset 'imagenet'"),
    (lambda e, p: e["experiments"]["E2"].update(profiles=["70b"]), r"E2.profiles: unknown profile '70b'"),
    (lambda e, p: e["experiments"]["E2"]["smoke"].update(sweep={"relax_logtau": [0.5]}), r"E2.smoke.sweep.relax_logtau: the experiment does not sweep"),
    (lambda e, p: e["experiments"]["E5"]["smoke"].update(legs=["nope"]), r"E5.smoke.legs: unknown leg template 'nope'"),
    (lambda e, p: e["experiments"]["E5"]["legs"].append(dict(e["experiments"]["E5"]["legs"][0])), r"E5.legs: duplicate leg name"),
    (lambda e, p: e["experiments"]["E7"]["legs"][1].update(tier="strict"), r"E7.*a score leg takes no 'tier'"),
    (lambda e, p: e["experiments"]["E2"].update(bracket={"every": 0}), r"E2.bracket.every: must be an integer >= 1"),
    (lambda e, p: e["experiments"]["E2"].update(bracket=False), r"E2: bracket is false but no vanilla leg"),
    (lambda e, p: e["experiments"]["E2"].pop("title"), r"E2.title: expected a non-empty string"),
    (lambda e, p: e["experiments"]["E2"]["analyses"].append("speedup_vs_gama"),
     r"experiment E2.analyses: unknown analysis 'speedup_vs_gama'; analyses: exactness_table"),
    (lambda e, p: e["experiments"].update(X1=e["experiments"]["E1"]), r"experiment X1: id must look like E<number>"),
    (lambda e, p: e["defaults"].pop("gamma"), r"defaults must set every knob; missing \['gamma'\]"),
    (lambda e, p: e["defaults"].update(max_num_seqs=-1), r"defaults.max_num_seqs.*>= 1"),
    (lambda e, p: p["profiles"]["32b"]["roles"].pop("twin"), r"profile 32b.roles: missing role\(s\) \['twin'\]"),
    (lambda e, p: p["profiles"]["32b"]["roles"].update(oracle="x/y"), r"profile 32b.roles: unknown role 'oracle'"),
    (lambda e, p: p["profiles"]["tiny"]["roles"].update(twin="twin-int8"), r"profile tiny.roles.twin: 'twin-int8' is not a tiny model role"),
    (lambda e, p: p["profiles"]["32b"].update(device="tpu"), r"profile 32b.device: must be cpu or gpu"),
    (lambda e, p: p["profiles"]["32b"]["engine"].update(dtype="int3"), r"profile 32b.engine.dtype.*one of auto"),
    (lambda e, p: p["profiles"]["32b"]["engine"].update(gamma=4), r"profile 32b.engine: field 'gamma' not allowed"),
])
def test_bad_definitions_are_named(tmp_path, raw, mutate, message):
    exps, profs = copy.deepcopy(raw[0]), copy.deepcopy(raw[1])
    mutate(exps, profs)
    with pytest.raises(RegistryError, match=message):
        _load(tmp_path, exps, profs)


def test_a_named_only_leg_runs_when_named():
    """E18's twin_a1_hybrid (an A/B not worth a server in every run) is left out of the default plan and planned,
    with its kernel, when `-p legs=` names it."""
    from workbench.planning import plan

    default = [leg.name for leg in plan("E18", "8b-shape").legs]
    assert "twin_a1" in default and "twin_a1_hybrid" not in default
    named = {leg.name: leg for leg in plan("E18", "8b-shape", ["legs=twin_a1,twin_a1_hybrid,twin_a1_machete"]).legs}
    assert named["twin_a1_hybrid"].knobs["draft_linear_kernel"] == "own-cuda+marlin"
    assert named["twin_a1_machete"].knobs["draft_linear_kernel"] == "own-cuda+marlin+machete"
    assert "twin_a1_machete" not in default
    assert named["twin_a1"].knobs["draft_linear_kernel"] == "auto"
    attn = {leg.name: leg for leg in plan("E18", "8b-shape", ["legs=twin_a1_hybrid,twin_a1_attn"]).legs}
    assert attn["twin_a1_attn"].knobs["draft_attention"] == "twin" and "twin_a1_attn" not in default
    assert attn["twin_a1_hybrid"].knobs["draft_attention"] == "vllm"


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("experiments: [unclosed")
    with pytest.raises(RegistryError, match="not valid YAML"):
        load_registry(bad)
    with pytest.raises(RegistryError, match="registry file not found"):
        load_registry(tmp_path / "nope.yaml")


def test_unknown_experiment_and_profile():
    reg = load_registry()
    with pytest.raises(RegistryError, match=r"unknown experiment 'E99'; known: E1, E2"):
        reg.experiment("E99")
    with pytest.raises(RegistryError, match="unknown profile 'huge'"):
        reg.profile("huge")


def test_knob_checks_and_cli_parsing():
    assert check_knob("relax_logtau", 1, "x") == 1.0 and isinstance(check_knob("relax_logtau", 1, "x"), float)
    assert parse_knob_text("blind_mm", "on") is True and parse_knob_text("draft_cudagraph", "0") is False
    assert parse_knob_text("gamma", " 4 ") == 4
    with pytest.raises(RegistryError, match=r"'relax_logtau' must be a finite number >= 0, got -0.1"):
        check_knob("relax_logtau", -0.1, "x")
    with pytest.raises(RegistryError, match=r"'trace' must be true or false, got 'maybe'"):
        parse_knob_text("trace", "maybe")
    with pytest.raises(RegistryError, match="unknown knob 'tau'"):
        parse_knob_text("tau", "0.5")
    assert set(KNOBS) >= {"gamma", "relax_logtau", "blind_mm", "draft_cudagraph", "trace", "max_num_seqs",
                          "max_tokens"}
