"""Protocol: plan expansion + bracketing for every experiment, run folders, resume, failure records.

The execution-mechanics tests use FAKE_LEG below, a stand-in leg executable that writes the documented
files without an engine; the real end-to-end runs are in test_experiments_smoke.py / test_notebooks.py.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from workbench import planning, protocol
from workbench.protocol import ProtocolError
from workbench.registry import RegistryError, load_registry

REG = load_registry()
PROFILES_FOR = {e: (REG.experiment(e).profiles or ["8b-thinking"]) for e in REG.ids()}
# experiments made of workbench.leg legs (bracketed); the cost ladder (E16) is tested in test_cost_ladder.py
LEG_IDS = [e for e in REG.ids() if REG.experiment(e).runner == "legs"]


def _check_brackets(p):
    legs = p.legs
    names = [l.name for l in legs]
    assert len(set(names)) == len(names)
    assert [l.index for l in legs] == list(range(len(legs)))
    engine = [l for l in legs if l.kind != "score"]
    spec_pos = [i for i, l in enumerate(engine) if l.kind == "spec"]
    assert spec_pos, "every experiment has spec legs"
    assert engine[0].kind == "vanilla" and engine[-1].kind == "vanilla"
    every = p.experiment.bracket_every
    for i in spec_pos:
        before = next(l for l in reversed(engine[:i]) if l.kind == "vanilla")
        after = next(l for l in engine[i + 1:] if l.kind == "vanilla")
        for v in (before, after):
            assert planning._shape(v) == planning._shape(engine[i]), (engine[i].name, v.name)
    run = 0
    for l in engine:
        run = run + 1 if l.kind == "spec" else 0
        assert run <= every
    for s in (l for l in legs if l.kind == "score"):
        ref = next(l for l in legs if l.name == s.reference)
        assert ref.kind == "vanilla" and ref.index < s.index
    for l in legs:
        if l.kind == "spec" and l.tier == "strict":
            assert l.knobs["relax_logtau"] == 0.0
        if l.kind == "spec" and l.tier == "relaxed":
            assert l.knobs["relax_logtau"] > 0
        if l.kind == "vanilla":
            assert l.knobs["gamma"] is None and l.draft is None


@pytest.mark.parametrize("exp_id", LEG_IDS)
def test_full_plan_is_bracketed(exp_id):
    for prof in PROFILES_FOR[exp_id]:
        p = protocol.plan(exp_id, prof, smoke=False)
        _check_brackets(p)
        e = p.experiment
        n_spec = sum(l.kind == "spec" for l in p.legs)
        expected = 0
        for t in e.legs:
            if t.kind != "spec":
                continue
            k = 1
            for key, vals in e.sweep.items():
                if key in protocol.template_fields(t.name):
                    k *= len(vals)
            expected += k
        assert n_spec == expected
        assert all(not l.notes for l in p.legs), "GPU profiles carry no CPU notes"


@pytest.mark.parametrize("exp_id", LEG_IDS)
def test_tiny_smoke_plan_is_small(exp_id):
    p = protocol.plan(exp_id, "tiny")
    assert p.smoke is True, "tiny defaults to smoke size"
    _check_brackets(p)
    engine = [l for l in p.legs if l.kind != "score"]
    assert 3 <= len(engine) <= 6
    for l in p.legs:
        assert l.knobs["n"] <= 3 and l.knobs["max_tokens"] <= 32
        assert l.knobs["dtype"] == "bfloat16"
        if l.kind == "spec":
            assert "not applicable on CPU" in l.notes["draft_cudagraph"]


def test_specific_expansions():
    e2 = protocol.plan("E2", "8b-thinking", smoke=False)
    assert [l.name for l in e2.legs] == ["vanilla_1", "strict_g2", "strict_g3", "vanilla_2", "strict_g4",
                                         "strict_g6", "vanilla_3", "strict_g8", "vanilla_4"]
    assert all(l.knobs["draft_cudagraph"] is False for l in e2.legs if l.kind == "spec")
    e11 = protocol.plan("E11", "8b-thinking", smoke=False)
    assert [l.name for l in e11.legs[:4]] == ["vanilla_1", "strict_g2", "relaxed_g2", "vanilla_2"]
    e8 = protocol.plan("E8", "8b-thinking", smoke=False)
    assert [(l.name, l.knobs["max_num_seqs"]) for l in e8.legs[:4]] == [
        ("vanilla_1", 1), ("strict_c1", 1), ("vanilla_2", 1), ("vanilla_3", 2)]
    e14 = protocol.plan("E14", "8b-instruct", smoke=False)
    assert {l.model for l in e14.legs} == {"target@8b-thinking", "target@8b-instruct"}
    e10 = protocol.plan("E10", "tiny")
    assert [l.name for l in e10.legs] == ["vanilla_1", "strict_graphs_off", "strict_graphs_on", "vanilla_2"]
    e7 = protocol.plan("E7", "tiny")
    assert e7.legs[-1].kind == "score" and e7.legs[-1].reference == "vanilla_1"
    assert protocol.plan("E15", "tiny").datasets == ["mmvet", "tiny"]
    assert protocol.plan("E15", "8b-instruct", smoke=False).datasets == ["mmvet"]


def test_overrides():
    p = protocol.plan("E2", "tiny", ["gamma=4"])
    assert [l.name for l in p.legs if l.kind == "spec"] == ["strict_g4"]
    p = protocol.plan("E4", "tiny", ["relax_logtau=0.288,0.693", "max_tokens=8"])
    spec = [l for l in p.legs if l.kind == "spec"]
    assert [(l.name, l.knobs["relax_logtau"]) for l in spec] == [
        ("strict_g6", 0.0), ("relaxed_lt0.288", 0.288), ("relaxed_lt0.693", 0.693)]
    assert all(l.knobs["max_tokens"] == 8 for l in p.legs)
    p = protocol.plan("E1", "tiny", {"gamma": 3})
    assert p.legs[1].name == "strict_g3" and p.legs[1].knobs["gamma"] == 3
    # strict means x = 0 whatever the override says
    p = protocol.plan("E11", "tiny", ["relax_logtau=1.0"])
    assert {l.name: l.knobs["relax_logtau"] for l in p.legs if l.kind == "spec"} == {"strict_g4": 0.0,
                                                                                    "relaxed_g4": 1.0}
    assert protocol.plan("E1", "tiny", ["dataset=mmvet"]).datasets == ["mmvet"]
    assert protocol.plan("E1", "tiny", smoke=False).legs[0].knobs["n"] == 20


@pytest.mark.parametrize("items, message", [
    (["gamma"], r"bad override 'gamma': expected name=value"),
    (["gama=4"], r"unknown parameter 'gama'"),
    (["gamma=four"], r"'gamma' must be an integer 1..32, got 'four'"),
    (["gamma=2,4"], r"a list of values needs a swept parameter; E1 sweeps nothing"),
    (["dataset=coco"], r"unknown dataset 'coco'"),
    (["draft=oracle"], r"unknown role 'oracle'"),
    (["gamma=4", "gamma=5"], r"'gamma' given twice"),
])
def test_bad_overrides(items, message):
    with pytest.raises(RegistryError, match=message):
        protocol.plan("E1", "tiny", items)


def test_profile_restrictions():
    with pytest.raises(RegistryError, match=r"E12 runs under profile\(s\) 32b"):
        protocol.plan("E12", "8b-thinking")
    assert protocol.plan("E12").profile.name == "32b"
    assert protocol.plan("E12", "tiny").profile.name == "tiny"


# --- execution mechanics with a fake leg -------------------------------------------------------

FAKE_LEG = textwrap.dedent('''
    """FAKE leg for protocol-mechanics tests: reads leg.json, writes the documented leg files, no engine."""
    import argparse, json, os, subprocess, sys, time
    ap = argparse.ArgumentParser()
    for a in ("--config", "--model", "--reference", "--prompts", "--max-model-len", "--dtype", "--experiment",
              "--leg", "--run-id", "--out"):
        ap.add_argument(a)
    a = ap.parse_args()
    if a.config:
        c = json.load(open(a.config))
        here = os.path.dirname(os.path.abspath(a.config))  # leg.json paths are relative to its folder
        c["out"], c["prompts"] = (os.path.normpath(os.path.join(here, c[k])) for k in ("out", "prompts"))
        leg, out, prompts, n, spec = c["leg"], c["out"], c["prompts"], c["n"], c["draft"] is not None
        knobs, experiment, run_id = c["knobs"], c["experiment"], c["run_id"]
    else:  # score leg
        leg, out, prompts, n, spec, knobs = a.leg, a.out, a.prompts, 99, False, {}
        experiment, run_id = a.experiment, a.run_id
    if os.environ.get("FAKE_LEG_REAL_PARENT_WATCH"):
        sys.path.insert(0, os.environ["FAKE_LEG_REPO"])
        from workbench.leg import die_with_parent
        die_with_parent()
    with open(os.environ["FAKE_LEG_CALLS"], "a") as fh:
        fh.write(leg + "\\n")
    mode = os.environ.get("FAKE_LEG_MODE", "") if leg in os.environ.get("FAKE_LEG_BAD", "").split(",") else ""
    if mode == "crash":
        print("Traceback: engine exploded in a fake way", file=sys.stderr)
        sys.exit(3)
    if mode == "failure":
        json.dump({"status": "failed", "error": "fake leg refused", "traceback": "..."},
                  open(os.path.join(out, "failure.json"), "w"))
        sys.exit(1)
    if mode == "partial-crash":
        open(os.path.join(out, "records.jsonl.partial"), "w").write(json.dumps({"pid": "p0"}) + "\\n")
        sys.exit(4)
    if mode == "hang":
        # an "engine core" child in the leg's process group, as vLLM starts on a GPU
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open(os.path.join(out, "pids.txt"), "w").write(f"{os.getpid()} {child.pid}\\n")
        time.sleep(120)
    pids = [json.loads(l)["pid"] for l in open(prompts) if l.strip()][: int(n)]
    recs = []
    for i, pid in enumerate(pids):
        tok_s = (150.0 if spec else 100.0) + i
        recs.append({"pid": pid, "mode": "spec" if spec else "vanilla",
                     "tier": ("relaxed" if knobs.get("relax_logtau") else "strict") if spec else "vanilla",
                     "gamma": knobs["gamma"] if spec else None, "in_len": 10, "gen_len": 8, "t": 8 / tok_s,
                     "tok_s": tok_s, "gen_ids": [1, 2, 3, 4, 5, 6, 7, 8], "text": "x",
                     "experiment": experiment, "leg": leg, "run_id": run_id,
                     "knobs": {"relax_logtau": float(knobs.get("relax_logtau") or 0)},
                     "spec": {"drafts": 4, "draft_tokens": 16, "accepted": 8, "accepted_per_pos": [4, 2, 1, 1],
                              "acceptance_length": 3.0} if spec else None, "trace": None})
    with open(os.path.join(out, "records.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\\n" for r in recs)
    summary = {"status": "complete", "experiment": experiment, "leg": leg, "run_id": run_id,
               "mode": "spec" if spec else "vanilla", "n_prompts": len(recs), "knobs": {}, "spec": {}}
    json.dump(summary, open(os.path.join(out, "summary.json"), "w"))
    if mode == "late-crash":
        sys.exit(5)
''')


@pytest.fixture
def fake(tmp_path, monkeypatch):
    leg = tmp_path / "fake_leg.py"
    leg.write_text(FAKE_LEG)
    calls = tmp_path / "calls.txt"
    calls.write_text("")
    monkeypatch.setenv("FAKE_LEG_CALLS", str(calls))

    def read_calls():
        return [l for l in calls.read_text().splitlines() if l]
    return [sys.executable, str(leg)], read_calls


def _prepare(tmp_path, exp="E4", overrides=None):
    # explicit model paths: the fake leg never opens them, and no tiny model has to be built
    return protocol.prepare_run(exp, "tiny", overrides, True, tmp_path / "results",
                                model_paths={"target": "fake/target", "twin": "fake/twin"})


def test_prepare_run_writes_folder(tmp_path):
    rdir = _prepare(tmp_path)
    assert rdir.parent == tmp_path / "results" / "E4"
    cfg = json.loads((rdir / "run.json").read_text())
    assert cfg["experiment"] == "E4" and cfg["profile"] == "tiny" and cfg["smoke"] is True
    assert [l["name"] for l in cfg["legs"]] == ["vanilla_1", "strict_g6", "relaxed_lt0.693", "vanilla_2"]
    assert cfg["models"] == {"target": "fake/target", "twin": "fake/twin"}
    assert cfg["dataset"]["resolved"] == "tiny" and len(cfg["dataset"]["pids"]) == 2
    assert cfg["dataset"]["note"].startswith("mathvista requested")
    env = json.loads((rdir / "env.json").read_text())
    assert env["packages"]["torch"] and "commit" in env["git"] and env["cpu"]["cores"] >= 1
    assert env["patch"]["fingerprint"]
    assert len((rdir / "prompts.jsonl").read_text().splitlines()) == 2
    # reuse: same folder comes back; another configuration is refused
    assert protocol.prepare_run("E4", "tiny", None, True, run_dir=rdir) == rdir
    with pytest.raises(ProtocolError, match="different configuration: experiment"):
        protocol.prepare_run("E1", "tiny", None, True, run_dir=rdir)
    with pytest.raises(ProtocolError, match="--model-path: role\\(s\\) \\['small-vlm'\\] are not used by E4"):
        protocol.prepare_run("E4", "tiny", None, True, tmp_path / "r2", model_paths={"small-vlm": "x"})
    assert not (tmp_path / "r2").exists(), "a run that cannot start leaves nothing behind"


def test_a_run_started_outside_the_repository_finds_its_folder_and_checkpoints(tmp_path, fake, monkeypatch,
                                                                                 tiny_models):
    """Legs run in the repository (run.json's paths are relative to it); a run started in another folder with
    the default relative results root, and a checkpoint named relative to that folder, still runs every leg
    (every leg failed with FileNotFoundError on its leg.json, and a relative --model-path named no folder)."""
    runner, calls = fake
    here = tmp_path / "elsewhere"
    here.mkdir()
    (here / "mytwin").symlink_to(tiny_models["twin-int4"])
    monkeypatch.chdir(here)
    rdir = protocol.prepare_run("E4", "tiny", None, True, "results",
                                model_paths={"target": "fake/target", "twin": "mytwin"})
    assert not rdir.is_absolute()
    cfg = json.loads((rdir / "run.json").read_text())
    assert cfg["models"] == {"target": "fake/target", "twin": str(here / "mytwin")}  # a hub id stays as given
    st = protocol.execute(rdir, runner=runner)
    assert set(st.values()) == {"complete"} and len(calls()) == 4
    # a resume from the same folder with the same relative name is the same checkpoint
    assert protocol.prepare_run("E4", "tiny", None, True, run_dir=rdir,
                                model_paths={"target": "fake/target", "twin": "mytwin"}) == rdir


def test_execute_resume_and_analysis(tmp_path, fake):
    runner, calls = fake
    rdir = _prepare(tmp_path)
    lines: list[str] = []
    st = protocol.execute(rdir, runner=runner, log=lines.append)
    assert st == {"vanilla_1": "complete", "strict_g6": "complete", "relaxed_lt0.693": "complete",
                  "vanilla_2": "complete"}
    assert calls() == ["vanilla_1", "strict_g6", "relaxed_lt0.693", "vanilla_2"]
    legs_lines = [l for l in lines if l.startswith("[")]
    assert len(legs_lines) == 4 and "ETA" in legs_lines[0] and "elapsed" in legs_lines[0]
    state = json.loads((rdir / "protocol.json").read_text())
    assert state["state"] == "finished"
    # resume: nothing left to do
    protocol.execute(rdir, runner=runner, log=lines.append)
    assert len(calls()) == 4
    # one leg lost: only that one reruns
    import shutil
    shutil.rmtree(rdir / "legs" / "strict_g6")
    protocol.execute(rdir, runner=runner, log=lines.append)
    assert calls()[4:] == ["strict_g6"]
    res = protocol.analyze_run(rdir, figures=True)
    summ = json.loads((rdir / "tables" / "summary.json").read_text())
    assert summ["n_complete"] == 4 and summ["n_failed"] == 0
    speed = {r["leg"]: r["speedup"] for r in summ["speedup"]}
    assert speed["strict_g6"] == pytest.approx(1.5, rel=0.02)
    assert {r["leg"]: r["match_rate"] for r in summ["exactness"]} == {"strict_g6": 1.0, "relaxed_lt0.693": 1.0}
    assert {r["leg"]: r["acceptance_rate"] for r in summ["acceptance"]}["strict_g6"] == pytest.approx(0.5)
    assert set(res["_figures"]) <= {"acceptance_vs_tau", "speedup_distribution", "exactness_table"}
    assert "speedup_distribution" in res["_figures"]
    assert (rdir / "tables" / "speedup.csv").is_file()


@pytest.mark.parametrize("mode, error", [
    ("crash", "leg process exited with code 3 without writing summary.json"),
    ("failure", "fake leg refused"),
    ("late-crash", "leg process exited with code 5"),
])
def test_failed_leg_leaves_failure_and_run_continues(tmp_path, fake, monkeypatch, mode, error):
    runner, calls = fake
    monkeypatch.setenv("FAKE_LEG_BAD", "strict_g6")
    monkeypatch.setenv("FAKE_LEG_MODE", mode)
    rdir = _prepare(tmp_path)
    st = protocol.execute(rdir, runner=runner, log=lambda s: None)
    assert st["strict_g6"] == "failed" and st["vanilla_2"] == "complete"
    fail = json.loads((rdir / "legs" / "strict_g6" / "failure.json").read_text())
    assert fail["status"] == "failed" and error in fail["error"]
    folder = rdir / "legs" / "strict_g6"
    assert not (folder / "summary.json").exists(), "a failed leg never keeps a summary that looks complete"
    if mode == "crash":
        assert fail["returncode"] == 3 and "engine exploded" in fail["stderr_tail"]
    if mode == "late-crash":
        assert (folder / "summary.rejected.json").is_file()
    assert json.loads((rdir / "protocol.json").read_text())["state"] == "finished_with_failures"
    from workbench.results import load_run
    run = load_run(rdir)
    assert dict(zip(run.legs["leg"], run.legs["status"]))["strict_g6"] == "failed"
    # the fault goes away: resume reruns only the failed leg and keeps the old attempt
    monkeypatch.delenv("FAKE_LEG_BAD")
    st = protocol.execute(rdir, runner=runner, log=lambda s: None)
    assert all(s == "complete" for s in st.values())
    assert calls()[-1] == "strict_g6" and len(calls()) == 5
    assert (rdir / "attempts" / "strict_g6.1" / "failure.json").is_file()


def test_stop_on_failure_and_timeout(tmp_path, fake, monkeypatch):
    runner, calls = fake
    monkeypatch.setenv("FAKE_LEG_BAD", "strict_g6")
    monkeypatch.setenv("FAKE_LEG_MODE", "crash")
    rdir = _prepare(tmp_path)
    st = protocol.execute(rdir, runner=runner, stop_on_failure=True, log=lambda s: None)
    assert calls() == ["vanilla_1", "strict_g6"]
    assert st["relaxed_lt0.693"] == "pending"
    assert json.loads((rdir / "protocol.json").read_text())["state"] == "stopped"
    monkeypatch.setenv("FAKE_LEG_MODE", "hang")
    st = protocol.execute(rdir, runner=runner, leg_timeout=2, only=["strict_g6"], log=lambda s: None)
    fail = json.loads((rdir / "legs" / "strict_g6" / "failure.json").read_text())
    assert st["strict_g6"] == "failed" and "timed out after 2 s" in fail["error"]


def test_execute_refuses_unprepared_folder(tmp_path):
    with pytest.raises(ProtocolError, match="not a prepared run folder"):
        protocol.execute(tmp_path)


def test_leg_config_is_what_the_leg_command_line_would_build(tmp_path):
    """The protocol hands a leg one leg.json; the same leg by hand on the command line is the same config."""
    from workbench.leg import LegConfig, build_parser, config_from_args
    rdir = _prepare(tmp_path, "E5")
    cfg = json.loads((rdir / "run.json").read_text())
    legs = {d["name"]: protocol.PlannedLeg.from_dict(d) for d in cfg["legs"]}
    out = rdir / "legs" / "strict_blind"
    assert protocol.leg_command(legs["strict_blind"], cfg, rdir, python="py") == [
        "py", "-m", "workbench.leg", "--config", str(out / "leg.json")]
    blind = protocol.leg_config(legs["strict_blind"], cfg, rdir)
    by_hand = config_from_args(build_parser().parse_args([
        "--target", "fake/target", "--draft", "fake/twin", "--gamma", "6", "--prompts", str(rdir / "prompts.jsonl"),
        "--n", "2", "--max-tokens", "16", "--max-model-len", str(blind.max_model_len), "--max-num-seqs", "1",
        "--dtype", "bfloat16", "--blind-mm", "--trace", "--experiment", "E5", "--leg", "strict_blind",
        "--run-id", cfg["run_id"], "--out", str(out)]))
    assert blind == by_hand
    assert LegConfig.from_dict(json.loads(json.dumps(blind.to_dict()))) == blind
    assert blind.gpu_memory_utilization is None, "on CPU the leg chooses its own KV-cache share"
    assert blind.knobs.relax_logtau == 0.0 and blind.knobs.draft_cudagraph is True
    van = protocol.leg_config(legs["vanilla_1"], cfg, rdir)
    assert van.draft is None and van.knobs.gamma is None and not van.knobs.blind_mm


def test_runners_are_one_table_with_one_dispatch_point(tmp_path):
    """A leg's runner comes from ``execution.RUNNERS`` through ``runner_for``: engine legs, score legs, ladder,
    serving legs."""
    from workbench import execution

    assert set(execution.RUNNERS) == {"leg", "score", "ladder", "serve"}
    rdir = _prepare(tmp_path, "E5")
    cfg = json.loads((rdir / "run.json").read_text())
    leg = protocol.PlannedLeg.from_dict(cfg["legs"][0])
    assert execution.runner_for(leg, "legs") is execution.RUNNERS["leg"]
    assert execution.runner_for(leg, None) is execution.RUNNERS["leg"]
    assert execution.runner_for(leg, "ladder") is execution.RUNNERS["ladder"]
    score = protocol.PlannedLeg.from_dict(dict(cfg["legs"][0], kind="score", reference=leg.name))
    assert execution.runner_for(score, "legs") is execution.RUNNERS["score"]
    assert execution.runner_for(leg, "serve") is execution.RUNNERS["serve"]
    # a serving leg's leg.json is an engine leg's: the same LegConfig
    assert execution.RUNNERS["serve"].leg_json is execution.RUNNERS["leg"].leg_json
    assert protocol.leg_command(leg, dict(cfg, runner="serve"), rdir, python="py")[:3] == [
        "py", "-m", "workbench.serve_leg"]
    with pytest.raises(ProtocolError, match="unknown runner 'nope'"):
        execution.runner_for(leg, "nope")
    # the command is the runner's module and arguments; a fake runner command replaces `python -m <module>`
    assert protocol.leg_command(leg, dict(cfg, runner="ladder"), rdir, python="py")[:3] == [
        "py", "-m", "workbench.ladder_engine"]
    assert protocol.leg_command(score, cfg, rdir, runner=["fake"])[:3] == ["fake", "--model", cfg["models"][leg.model]]
    assert execution.RUNNERS["score"].leg_json(score, cfg, rdir, rdir / "legs" / "x", None) is None
    assert not execution.RUNNERS["ladder"].reads_prompts and execution.RUNNERS["ladder"].gpu_profile_needs_cuda
    from workbench.registry import RUNNERS as CATALOGUE_RUNNERS
    for name in CATALOGUE_RUNNERS:  # every runner the catalogue accepts has an entry
        assert execution.runner_for(leg, name).name in execution.RUNNERS


def test_score_leg_agrees_with_itself(tmp_path):
    """The scoring leg on the tiny target scoring its own greedy output: agreement 1.0 at every position."""
    import torch
    from workbench import score
    from workbench.datasets import load_prompt_set
    from workbench.prompts import save_prompts
    from workbench.tiny import ensure_tiny_models

    models = ensure_tiny_models()
    prompts = load_prompt_set("tiny", n=2)
    save_prompts(prompts, tmp_path / "prompts.jsonl")
    from workbench.teacher import TeacherForcer

    teacher = TeacherForcer(str(models["target"]), dtype="float32")
    refs = []
    for p in prompts:
        inp = teacher._encode(p)
        with torch.no_grad():
            out = teacher.model.generate(**inp, max_new_tokens=10, do_sample=False)
        refs.append({"pid": p.pid, "gen_ids": out[0, inp["input_ids"].shape[1]:].tolist(),
                     "in_len": int(inp["input_ids"].shape[1])})
    (tmp_path / "ref.jsonl").write_text("".join(json.dumps(r) + "\n" for r in refs))
    rc = score.main(["--model", str(models["target"]), "--reference", str(tmp_path / "ref.jsonl"),
                     "--prompts", str(tmp_path / "prompts.jsonl"), "--out", str(tmp_path / "leg"),
                     "--dtype", "float32", "--leg", "score_target"])
    assert rc == 0
    recs = [json.loads(l) for l in (tmp_path / "leg" / "records.jsonl").read_text().splitlines()]
    assert [r["agreement"] for r in recs] == [1.0, 1.0]
    assert all(r["in_len"] == r["in_len_reference"] for r in recs)
    summ = json.loads((tmp_path / "leg" / "summary.json").read_text())
    assert summ["status"] == "complete" and summ["pooled_agreement"] == 1.0
    # a reference that does not exist is a recorded failure, not a crash
    rc = score.main(["--model", str(models["target"]), "--reference", str(tmp_path / "none.jsonl"),
                     "--prompts", str(tmp_path / "prompts.jsonl"), "--out", str(tmp_path / "leg2")])
    assert rc == 1 and "reference records not found" in json.loads(
        (tmp_path / "leg2" / "failure.json").read_text())["error"]
