"""Issue 19: the knob table produces its carriers.

A throwaway knob is added to the table alone (a fixture; no other file names it) and must reach the
leg's options and ``leg.json``, the engine's environment, the engine report's ``knobs``, the record
columns, the leg table and ``LEG_KEYS``. In this process the fixture puts it into the table's dicts;
processes started from here (the leg, its engine, a reader of the run folder) build it into their
table at import from ``VLLM_SPEC_TEST_KNOBS``, the table module's test-only hook.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, TINY_PROMPTS, run_leg_process

THROWAWAY = {"name": "probe_knob", "type": "int", "default": 3, "env": "VLLM_SPEC_PROBE_KNOB",
             "flag": "--probe-knob", "spec_only": True, "column": "record"}
NAME, ENV, FLAG = THROWAWAY["name"], THROWAWAY["env"], THROWAWAY["flag"]


@pytest.fixture
def throwaway_knob(monkeypatch):
    """The throwaway knob, in this process's table and (through the hook) in every process started from here."""
    import vllm_patch.knobs as vk
    import workbench.knobs as wk

    monkeypatch.setenv(vk.ENV_TEST_KNOBS, json.dumps([THROWAWAY]))
    knob = vk.knob_from_spec(THROWAWAY)
    monkeypatch.setitem(vk.SWITCHES, NAME, knob)
    monkeypatch.setitem(wk.KNOBS, NAME, knob)
    return knob


def test_the_carriers_take_a_knob_added_to_the_table(throwaway_knob):
    """Knobs, EngineKnobs, the leg options, the environment both ways and the column lists follow the table."""
    from vllm_patch.knobs import EngineKnobs, read_knobs
    from workbench.knobs import Knobs, column_knobs, leg_knob_names

    assert NAME in leg_knob_names() and NAME in column_knobs("record") and NAME in column_knobs("leg")
    assert Knobs().as_dict()[NAME] == 3 and EngineKnobs().as_dict()[NAME] == 3
    knobs = Knobs(gamma=2, probe_knob=7)
    env = knobs.to_env("report-dir")
    assert env[ENV] == "7"
    engine = read_knobs(env)
    assert engine.probe_knob == 7 and engine.as_dict()[NAME] == 7 and engine.tier == "strict"
    ap = argparse.ArgumentParser()
    Knobs.add_leg_options(ap)
    assert Knobs.from_leg_args(ap.parse_args(["--gamma", "2", FLAG, "7"])) == knobs
    # a planned leg carries every table knob; one it lacks is an error, not a silent default
    assert Knobs.from_planned(dict(Knobs().as_dict(), gamma=2, probe_knob=7)) == knobs
    with pytest.raises(KeyError, match=NAME):
        Knobs.from_planned({k: v for k, v in Knobs(gamma=2).as_dict().items() if k != NAME})


def test_tier_of_is_the_one_rule():
    from vllm_patch.knobs import EngineKnobs, tier_of
    from workbench.knobs import Knobs

    assert [tier_of(Knobs()), tier_of(Knobs(gamma=2)), tier_of(Knobs(gamma=2, relax_logtau=0.5))] == [
        "vanilla", "strict", "relaxed"]
    assert Knobs(gamma=2, relax_logtau=0.5).tier == "relaxed" and EngineKnobs(relax_logtau=0.5).tier == "relaxed"
    assert tier_of({"gamma": None}) == "vanilla" and tier_of({"gamma": 4, "relax_logtau": 0.0}) == "strict"
    assert EngineKnobs().tier == "strict"  # the engine's switches have no gamma: it runs a draft


def test_the_carriers_keep_their_dataclass_manners():
    from vllm_patch.knobs import EngineKnobs
    from workbench.knobs import Knobs

    k = Knobs(gamma=2)
    assert k == Knobs(gamma=2) and k != Knobs(gamma=3) and hash(k) == hash(Knobs(gamma=2))
    assert list(k.as_dict())[:5] == ["gamma", "acceptance", "gamma_schedule", "relax_logtau", "blind_mm"]
    assert k.trace is True
    assert EngineKnobs().trace is False and list(EngineKnobs().as_dict())[-1] == "report_dir"
    with pytest.raises(AttributeError):
        k.gamma = 3
    with pytest.raises(TypeError, match="no_such_knob"):
        Knobs(no_such_knob=1)
    with pytest.raises(ValueError, match="gamma"):
        Knobs(gamma=0)


@pytest.mark.vllm
def test_a_throwaway_knob_reaches_leg_json_engine_report_and_records(throwaway_knob, tiny_models, tmp_path):
    rdir = tmp_path / "run"
    (rdir / "legs").mkdir(parents=True)
    (rdir / "run.json").write_text(json.dumps({"experiment": "KT", "run_id": "r1", "legs": [{"name": "probe"}]}))
    out = rdir / "legs" / "probe"
    leg = run_leg_process(
        out, "--target", tiny_models["target"], "--draft", tiny_models["twin-dequant"], "--gamma", "2",
        "--leg", "probe", "--max-tokens", "8", "--ignore-eos", "--dtype", "float32", "--max-model-len", "512",
        "--n", "2", "--prompts", str(TINY_PROMPTS), FLAG, "7").ok()

    assert json.loads((out / "leg.json").read_text())["knobs"][NAME] == 7
    assert leg.summary["knobs_requested"][NAME] == 7
    # the engine read it from its environment (the report says what the engine parsed, not what was asked)
    assert leg.summary["engine_report"]["knobs"][NAME] == 7
    assert leg.summary["knobs"][NAME] == 7 and all(r["knobs"][NAME] == 7 for r in leg.records)

    # a fresh process reads the run folder: the knob is a record column, a leg column and a leg key
    reader = ("import json, sys\n"
              "from workbench.metrics import LEG_KEYS\n"
              "from workbench.results import load_run\n"
              "run = load_run(sys.argv[1])\n"
              f"print(json.dumps({{'records': run.records[{NAME!r}].tolist(), 'legs': run.legs[{NAME!r}].tolist(),"
              " 'leg_keys': LEG_KEYS}))\n")
    proc = subprocess.run([sys.executable, "-c", reader, str(rdir)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["records"] == [7, 7] and seen["legs"] == [7] and NAME in seen["leg_keys"]


def test_the_trace_without_a_report_folder_goes_to_spec_trace(tmp_path, monkeypatch):
    """#38: `VLLM_SPEC_TRACE=1 vllm serve ...` works as documented: the plugin names ./spec-trace."""
    from vllm_patch.knobs import default_report_dir, read_knobs

    monkeypatch.chdir(tmp_path)
    env = {"VLLM_SPEC_TRACE": "1"}
    assert default_report_dir(env) == str(tmp_path / "spec-trace")
    assert read_knobs(env).report_dir == str(tmp_path / "spec-trace")  # what the engine's processes inherit
    timed = {"VLLM_SPEC_STEP_TIMING": "1"}
    assert default_report_dir(timed) == str(tmp_path / "spec-trace") == timed["VLLM_SPEC_REPORT_DIR"]
    chosen = {"VLLM_SPEC_TRACE": "1", "VLLM_SPEC_REPORT_DIR": "elsewhere"}
    assert default_report_dir(chosen) is None and chosen["VLLM_SPEC_REPORT_DIR"] == "elsewhere"
    for quiet in ({}, {"VLLM_SPEC_TRACE": "0"}, {"VLLM_SPEC_TRACE": "maybe"}):
        assert default_report_dir(quiet) is None and "VLLM_SPEC_REPORT_DIR" not in quiet


def test_the_readmes_knob_table_states_each_knobs_default_and_option():
    """README's knob table is what a user reads before a run: each row's leg default and leg option are the
    table's (a default changed in code and not in the README fails here)."""
    import re

    from vllm_patch.knobs import SWITCHES
    from workbench.knobs import KNOBS, Knobs

    def shown(value) -> str:
        if value is None:
            return "none"
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, float) and value.is_integer():
            return str(int(value))
        return str(value)

    text = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| .*? \| `([^`]*)` \| `([^`]*)` \|", text, flags=re.M)
    table = {name: (default, option) for name, default, option in rows if name in KNOBS}
    assert set(SWITCHES) <= set(table), f"README's knob table lacks {sorted(set(SWITCHES) - set(table))}"
    leg = Knobs()  # a leg's defaults (the engine's own may differ: the trace is off in a bare engine)
    for name, (default, option) in table.items():
        knob = KNOBS[name]
        value = getattr(leg, name)
        assert default == shown(value), f"README says {name} defaults to {default}, a leg to {value!r}"
        assert option.replace("[no-]", "") == knob.flag, (name, option, knob.flag)
