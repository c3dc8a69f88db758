"""The Ray executor (#39): bracket groups, placement records, one writer, faults, on a local Ray instance.

The legs here are test_protocol.py's fake leg (no engine) on a local instance with two logical GPUs;
tests/test_ray_engine.py runs E2 on the tiny models the same way. Placement and the bracket check
are pure and need no Ray.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from conftest import REPO
from test_run_safety import fake  # noqa: F401  (the fake leg as a fixture, watching its real parent)
from workbench import protocol
from workbench.groups import bracket_groups
from workbench.metrics import PlacementError, bracketed_speedup
from workbench.placement import capture, placement_key
from workbench.planning import PlannedLeg, plan
from workbench.protocol import ProtocolError
from workbench.reaper import tree
from workbench.runfolder import RunLock, process_start_ticks

MODELS = {"target": "fake/target", "twin": "fake/twin"}
TWO_BRACKETS = ["relax_logtau=0.288,0.693"]  # E4 smoke: strict + two relaxed legs, two brackets at most two each


def _names(p):
    return [l.name for l in p.legs]


# --- groups and placement (pure) ---------------------------------------------------------------

def test_bracket_groups_keep_each_bracket_with_its_vanilla_legs():
    shared = plan("E4", "tiny", TWO_BRACKETS, True)
    assert _names(shared) == ["vanilla_1", "strict_g6", "relaxed_lt0.288", "vanilla_2", "relaxed_lt0.693",
                              "vanilla_3"]
    # vanilla_2 brackets both sides: it cannot run on two GPUs, so the chain is one group
    assert [g.legs for g in bracket_groups(shared.legs)] == [tuple(_names(shared))]
    own = plan("E4", "tiny", TWO_BRACKETS, True, own_brackets=True)
    assert _names(own) == ["vanilla_1", "strict_g6", "relaxed_lt0.288", "vanilla_2", "vanilla_3",
                           "relaxed_lt0.693", "vanilla_4"]
    assert own.config()["brackets"] == "own" and shared.config()["brackets"] == "shared"
    groups = bracket_groups(own.legs)
    assert [g.legs for g in groups] == [("vanilla_1", "strict_g6", "relaxed_lt0.288", "vanilla_2"),
                                        ("vanilla_3", "relaxed_lt0.693", "vanilla_4")]
    assert [g.tp for g in groups] == [1, 1]
    # a score leg goes with the vanilla leg it scores; a leg's tensor-parallel size sizes its group
    legs = [PlannedLeg(0, "vanilla_1", "vanilla", "vanilla", "target", knobs={"tensor_parallel_size": 2}),
            PlannedLeg(1, "strict_g4", "spec", "strict", "target", "twin"),
            PlannedLeg(2, "vanilla_2", "vanilla", "vanilla", "target"),
            PlannedLeg(3, "vanilla_3", "vanilla", "vanilla", "target"),
            PlannedLeg(4, "score_twin", "score", "score", "twin", reference="vanilla_1")]
    assert [(g.legs, g.tp) for g in bracket_groups(legs)] == [
        (("vanilla_1", "strict_g4", "vanilla_2", "score_twin"), 2), (("vanilla_3",), 1)]


def test_placement_names_the_device_gpu_or_cpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cpu = capture("local", probe={})
    assert cpu["device"] == "cpu" and cpu["gpus"] == [] and placement_key(cpu) == f"{cpu['host']}/cpu"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # a logical GPU a Ray task holds on a CPU host
    assert placement_key(capture("ray", probe={})).endswith("/cpu:gpu1")
    probe = {"gpus": [{"index": "0", "uuid": "GPU-aaa", "name": "H200"}, {"index": "1", "uuid": "GPU-bbb",
                                                                         "name": "H200"}],
             "driver_version": "580.1", "cuda_version": "13.0"}
    gpu = capture("ray", group=2, node_id="n1", probe=probe)
    assert [g["uuid"] for g in gpu["gpus"]] == ["GPU-bbb"] and gpu["driver_version"] == "580.1"
    assert placement_key(gpu) == f"{gpu['host']}/GPU-bbb" and gpu["node_id"] == "n1" and gpu["group"] == 2
    assert placement_key(None) is None and placement_key({"note": "old"}) is None


def test_a_leg_under_a_logical_gpu_on_a_cpu_host_runs_as_a_cpu_leg(monkeypatch, tmp_path):
    """The logical GPU a Ray task holds on a CPU host (CUDA_VISIBLE_DEVICES) is no CUDA device: the leg runs its
    engine in its own process with one OpenMP thread, as every CPU leg does."""
    import glob

    from workbench.leg import LegConfig, _cuda_present, _in_process

    if glob.glob("/dev/nvidia[0-9]*"):
        pytest.skip("a CUDA host")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert not _cuda_present()
    assert _in_process(LegConfig(target="t", prompts="p", out=str(tmp_path), max_tokens=1))


def _records(where: dict[str, str | None]) -> pd.DataFrame:
    rows = []
    for i, (leg, tier) in enumerate([("vanilla_1", "vanilla"), ("strict_g6", "strict"), ("vanilla_2", "vanilla")]):
        for pid in ("p0", "p1"):
            rows.append({"leg": leg, "leg_index": i, "pid": pid, "tier": tier, "mode": tier if tier == "vanilla"
                         else "spec", "tok_s": 100.0 if tier == "vanilla" else 150.0, "placement": where[leg]})
    return pd.DataFrame(rows)


NICER_TASK = """
import os, sys
from workbench import placement
from workbench.ray_executor import _as_nice_as
os.nice(5)                       # a worker of a cluster started with Ray's default niceness
before = placement.niceness()
_as_nice_as(before - 5)          # the driver's
print(before, placement.niceness(), os.geteuid())
"""


def test_a_task_takes_the_drivers_niceness_where_it_may_and_a_nicer_group_is_warned_about(tmp_path):
    out = subprocess.run([sys.executable, "-c", NICER_TASK], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    before, after, uid = (int(x) for x in out.stdout.split())
    # lowering niceness needs CAP_SYS_NICE: root takes the driver's, anyone else keeps Ray's (placement says so)
    assert after == (before - 5 if uid == 0 else before)
    from workbench.ray_executor import _Board
    g = bracket_groups(plan("E4", "tiny", TWO_BRACKETS, True, own_brackets=True).legs)
    lines: list[str] = []
    board = _Board(tmp_path, {}, g, g, "t", lines.append)
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    board.start(g[0], {"host": "h", "gpus": [], "niceness": mine})
    assert not any("warning" in l for l in lines)
    board.start(g[0], {"host": "h", "gpus": [], "niceness": mine + 15})
    assert f"run at niceness {mine + 15}, this driver at {mine}" in lines[-1] and "RAY_worker_niceness=0" in lines[-1]


def test_a_bracket_on_two_devices_is_refused_and_one_device_is_paired():
    one = {"vanilla_1": "h/GPU-a", "strict_g6": "h/GPU-a", "vanilla_2": "h/GPU-a"}
    assert bracketed_speedup(_records(one))["speedup"].tolist() == [1.5]
    older = {"vanilla_1": None, "strict_g6": None, "vanilla_2": None}  # runs before placements were recorded
    assert bracketed_speedup(_records(older))["speedup"].tolist() == [1.5]
    with pytest.raises(PlacementError, match=r"strict_g6 and its bracketing legs ran on different devices "
                                             r"\(strict_g6 on h/GPU-a, vanilla_1 on h/GPU-a, vanilla_2 on h/GPU-b\)"):
        bracketed_speedup(_records(dict(one, vanilla_2="h/GPU-b")))


# --- runs on a local Ray instance (fake legs) ---------------------------------------------------

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="ray is not installed (pip install '.[ray]')")


def _prepare(tmp_path) -> Path:
    return protocol.prepare_run("E4", "tiny", TWO_BRACKETS, True, tmp_path / "results", model_paths=MODELS,
                                own_brackets=True)


def _placements(rdir: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in (rdir / "legs").glob("*/placement.json")}


def _wait_for(path: Path, timeout: float = 90, line: bool = True) -> str:
    """``path``'s text once it is there (``line``: once its first line is whole)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and (path.read_text().endswith("\n") or not line):
            return path.read_text()
        time.sleep(0.1)
    raise AssertionError(f"{path} did not appear within {timeout} s")


@needs_ray
def test_a_second_writer_is_refused_before_ray_starts(tmp_path, fake):
    runner, _ = fake
    rdir = _prepare(tmp_path)
    with RunLock(rdir):
        with pytest.raises(ProtocolError, match="is in use by PID"):
            protocol.execute(rdir, runner=runner, executor="ray", gpus=2, log=lambda s: None)
    assert not (rdir / "legs").exists()


def _ray_driver(rdir: Path, runner: list[str], env: dict) -> subprocess.Popen:
    code = (f"from workbench import protocol; protocol.execute({str(rdir)!r}, runner={runner!r}, "
            f"executor='ray', gpus=2)")
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@needs_ray
def test_kill_9_of_a_ray_run_leaves_no_process_and_resume_runs_only_the_unfinished_group(tmp_path, fake):
    runner, calls = fake
    rdir = _prepare(tmp_path)
    driver = _ray_driver(rdir, runner, {"FAKE_LEG_BAD": "strict_g6", "FAKE_LEG_MODE": "hang"})
    try:
        leg_pid, engine_pid = map(int, _wait_for(rdir / "legs" / "strict_g6" / "pids.txt").split())
        _wait_for(rdir / "legs" / "vanilla_4" / "summary.json", line=False)  # the other group is done
        time.sleep(1.5)  # the reaper has seen every process of the instance
        procs = tree([driver.pid])
        assert leg_pid in procs and engine_pid in procs and len(procs) > 5
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            left = [p for p, t in procs.items() if p != driver.pid and process_start_ticks(p) == t]
            if not left:
                break
            time.sleep(0.2)
        assert not left, [Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ") for p in left]
    finally:
        if driver.poll() is None:
            driver.kill()
    before = calls()
    st = protocol.execute(rdir, runner=runner, executor="ray", gpus=2, log=lambda s: None)
    assert set(st.values()) == {"complete"}
    again = calls()[len(before):]
    assert sorted(again) == ["relaxed_lt0.288", "strict_g6", "vanilla_2"], "only the unfinished group's legs"
    found = json.loads((rdir / "protocol.json").read_text())["history"][-1]
    assert found["previous_state"] == "running" and found["lock_taken_over_from"]["pid"] == driver.pid
    assert (rdir / "attempts" / "strict_g6.1" / "pids.txt").is_file(), "the interrupted attempt is kept"


@needs_ray
def test_a_group_whose_task_dies_fails_naming_its_node_while_the_other_group_finishes(tmp_path, fake, monkeypatch):
    runner, calls = fake
    rdir = _prepare(tmp_path)
    monkeypatch.setenv("FAKE_LEG_BAD", "strict_g6")
    monkeypatch.setenv("FAKE_LEG_MODE", "hang")

    def kill_the_task():  # the Ray worker running group 1 dies, as on a lost node
        _wait_for(rdir / "legs" / "strict_g6" / "pids.txt")
        _wait_for(rdir / "legs" / "vanilla_4" / "summary.json", line=False)
        worker = json.loads((rdir / "legs" / "strict_g6" / "placement.json").read_text())["pid"]
        os.kill(worker, signal.SIGKILL)

    killer = threading.Thread(target=kill_the_task, daemon=True)
    killer.start()
    st = protocol.execute(rdir, runner=runner, executor="ray", gpus=2, log=lambda s: None)
    killer.join(timeout=5)
    assert st == {"vanilla_1": "complete", "strict_g6": "failed", "relaxed_lt0.288": "failed", "vanilla_2": "failed",
                  "vanilla_3": "complete", "relaxed_lt0.693": "complete", "vanilla_4": "complete"}
    fail = json.loads((rdir / "legs" / "relaxed_lt0.288" / "failure.json").read_text())
    host = _placements(rdir)["vanilla_1"]["host"]
    assert "Ray task died" in fail["error"] and fail["node"] == host and host in fail["error"]
    assert not (rdir / "legs" / "vanilla_1" / "failure.json").exists(), "a finished leg is never touched"
    state = json.loads((rdir / "protocol.json").read_text())
    assert state["state"] == "finished_with_failures"
    assert [g["status"] for g in state["groups"]] == ["failed", "complete"]
    logical = [g["placement"]["cuda_visible_devices"] for g in state["groups"]]
    assert sorted(logical) == ["0", "1"], "two logical GPUs: the groups ran side by side"
    monkeypatch.delenv("FAKE_LEG_BAD")
    before = calls()
    lines: list[str] = []
    st = protocol.execute(rdir, runner=runner, executor="ray", gpus=2, log=lines.append)
    assert set(st.values()) == {"complete"}
    assert sorted(calls()[len(before):]) == ["relaxed_lt0.288", "strict_g6", "vanilla_2"]
    assert len([l for l in lines if " started on " in l]) == 1
    assert any(" finished on " in l and "ETA" in l and "elapsed" in l for l in lines)
    _check_complete_run(rdir, st)


def _check_complete_run(rdir: Path, st: dict[str, str]) -> None:
    """Every leg placed, each group on one device, and the analysis pairs legs within their group."""
    state = json.loads((rdir / "protocol.json").read_text())
    assert state["state"] == "finished" and state["executor"]["name"] == "ray"
    assert [g["legs"] for g in state["groups"]] == [["vanilla_1", "strict_g6", "relaxed_lt0.288", "vanilla_2"],
                                                    ["vanilla_3", "relaxed_lt0.693", "vanilla_4"]]
    where = _placements(rdir)
    assert set(where) == set(st)
    assert all(w["executor"] == "ray" and w["node_id"] and w["device"] == "cpu" for w in where.values())
    # Ray starts its workers 15 steps nicer than the driver unless told otherwise; the legs run at the driver's
    # (a local instance is started with worker_niceness 0, so the task needs no privilege to undo it)
    assert {(w["niceness"], w["niceness_from_ray"]) for w in where.values()} == {(os.getpriority(os.PRIO_PROCESS, 0),) * 2}
    by_group = {g["group"]: {placement_key(where[n]) for n in g["legs"]} for g in state["groups"]}
    assert all(len(keys) == 1 for keys in by_group.values()), by_group  # a bracket on one device
    from workbench.results import load_run
    sp = bracketed_speedup(load_run(rdir).records).set_index("leg")
    assert sp.loc["relaxed_lt0.693", "vanilla_before"] == "vanilla_3"
    assert sp.loc["relaxed_lt0.288", "vanilla_after"] == "vanilla_2"
    assert (rdir / "run.lock").read_text() == ""


RAY_BLOCKER = """
import sys
class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "ray":
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None
sys.meta_path.insert(0, _Blocker())
"""


def test_without_ray_nothing_needs_it_and_the_ray_executor_says_how_to_get_it(tmp_path):
    code = RAY_BLOCKER + (
        "import workbench.demo, workbench.protocol, workbench.execution, workbench.cli\n"
        "assert 'ray' not in sys.modules\n"
        "from workbench.cli import main\n"
        f"rc = main(['run', 'E4', '--profile', 'tiny', '--executor', 'ray', '--results', {str(tmp_path / 'r')!r},"
        " '--model-path', 'target=fake/target', '--model-path', 'twin=fake/twin', '--no-notebook'])\n"
        "assert rc == 2, rc\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "--executor ray needs the ray package" in res.stderr and "pip install '.[ray]'" in res.stderr
    assert not (tmp_path / "r").exists(), "refused before a run folder is made"


@needs_ray
def test_sigterm_of_a_ray_run_stops_its_groups_and_records_the_stop(tmp_path, fake):
    runner, _ = fake
    rdir = _prepare(tmp_path)
    driver = _ray_driver(rdir, runner, {"FAKE_LEG_BAD": "strict_g6", "FAKE_LEG_MODE": "hang"})
    try:
        leg_pid, engine_pid = map(int, _wait_for(rdir / "legs" / "strict_g6" / "pids.txt").split())
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=90)
    finally:
        if driver.poll() is None:
            driver.kill()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(process_start_ticks(p) for p in (leg_pid, engine_pid)):
        time.sleep(0.2)
    assert not any(process_start_ticks(p) for p in (leg_pid, engine_pid)), "a leg outlived its stopped run"
    state = json.loads((rdir / "protocol.json").read_text())
    assert state["state"] == "interrupted" and state["interrupted"]["signal"] == "SIGTERM"
    assert json.loads((rdir / "legs" / "strict_g6" / "failure.json").read_text())["status"] == "failed"
    assert json.loads((rdir / "legs" / "vanilla_1" / "summary.json").read_text())["status"] == "complete"
    assert state["legs"]["vanilla_1"] == "complete"


@needs_ray
def test_a_group_resumed_on_another_device_runs_whole_there(tmp_path, fake, monkeypatch):
    """Finished legs of an unfinished group that ran elsewhere (here: locally, not on a Ray GPU) are moved
    under attempts/ and the whole group runs again, so its bracket is on one device; finished groups stay."""
    runner, calls = fake
    rdir = _prepare(tmp_path)
    monkeypatch.setenv("FAKE_LEG_BAD", "relaxed_lt0.288")
    monkeypatch.setenv("FAKE_LEG_MODE", "crash")
    st = protocol.execute(rdir, runner=runner, log=lambda s: None)  # the local executor
    assert st["relaxed_lt0.288"] == "failed" and st["vanilla_1"] == "complete" and st["vanilla_4"] == "complete"
    monkeypatch.delenv("FAKE_LEG_BAD")
    before, lines = calls(), []
    st = protocol.execute(rdir, runner=runner, executor="ray", gpus=1, log=lines.append)
    assert set(st.values()) == {"complete"}
    assert sorted(calls()[len(before):]) == ["relaxed_lt0.288", "strict_g6", "vanilla_1", "vanilla_2"]
    assert any("ran on another device; the whole group ran again here" in l for l in lines), lines
    assert (rdir / "attempts" / "vanilla_1.1" / "summary.json").is_file(), "the earlier legs are kept"
    where = _placements(rdir)
    assert {where[n]["executor"] for n in ("vanilla_1", "strict_g6", "relaxed_lt0.288", "vanilla_2")} == {"ray"}
    assert {where[n]["executor"] for n in ("vanilla_3", "relaxed_lt0.693", "vanilla_4")} == {"local"}
    from workbench.results import load_run
    assert len(bracketed_speedup(load_run(rdir).records)) == 3
