"""Runs: nothing lost, nothing stale, nothing left running (#10).

Legs here are the fake leg of test_protocol.py (no engine); the fake leg's "hang" mode starts a child
process in its own process group, as vLLM's engine core is on a GPU, and writes both PIDs to pids.txt.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from conftest import REPO
from test_protocol import FAKE_LEG, _prepare
from workbench import execution, protocol
from workbench.protocol import ProtocolError
from workbench.runfolder import (RunLock, leg_status, new_run_id, process_alive, process_start_ticks,
                                 write_json_atomic)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    leg = tmp_path / "fake_leg.py"
    leg.write_text(FAKE_LEG)
    calls = tmp_path / "calls.txt"
    calls.write_text("")
    monkeypatch.setenv("FAKE_LEG_CALLS", str(calls))
    monkeypatch.setenv("FAKE_LEG_REPO", str(REPO))
    monkeypatch.setenv("FAKE_LEG_REAL_PARENT_WATCH", "1")
    return [sys.executable, str(leg)], (lambda: [l for l in calls.read_text().splitlines() if l])


def _orchestrator(rdir: Path, runner: list[str], env: dict) -> subprocess.Popen:
    """`execute` in its own process, as `workbench run` runs it."""
    code = ("import sys; from workbench import protocol\n"
            f"protocol.execute({str(rdir)!r}, runner={runner!r})\n")
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_for(path: Path, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().endswith("\n"):
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} did not appear within {timeout} s")


def _gone(pids: list[int], timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(process_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if process_alive(p)]


def test_kill_9_of_the_run_stops_its_legs_and_a_resume_runs_alone(tmp_path, fake):
    runner, calls = fake
    rdir = _prepare(tmp_path)
    orch = _orchestrator(rdir, runner, {"FAKE_LEG_BAD": "strict_g6", "FAKE_LEG_MODE": "hang"})
    try:
        leg_pid, engine_pid = map(int, _wait_for(rdir / "legs" / "strict_g6" / "pids.txt").split())
        assert process_alive(leg_pid) and process_alive(engine_pid)
        state = json.loads((rdir / "protocol.json").read_text())
        assert state["leg_process"]["pid"] == leg_pid and state["leg_process"]["leg"] == "strict_g6"
        orch.send_signal(signal.SIGKILL)
        orch.wait(timeout=10)
        assert _gone([leg_pid, engine_pid]) == [], "a leg (or its engine process) outlived its run"
    finally:
        if orch.poll() is None:
            orch.kill()
    assert json.loads((rdir / "protocol.json").read_text())["state"] == "running"  # as the killed run left it
    # resume: nothing of the killed run is alive, so it runs; it records what it found
    st = protocol.execute(rdir, runner=runner, log=lambda s: None)
    assert all(s == "complete" for s in st.values())
    found = json.loads((rdir / "protocol.json").read_text())["history"][-1]
    assert found["previous_state"] == "running" and "stopped without finishing" in found["note"]
    assert found["lock_taken_over_from"]["pid"] == orch.pid and found["lock_taken_over_from"]["alive"] is False
    assert found["interrupted_leg"]["leg"] == "strict_g6" and found["interrupted_leg"]["pid"] == leg_pid
    assert found["legs_found"]["vanilla_1"] == "complete" and found["legs_found"]["strict_g6"] == "incomplete"
    assert found["to_run"] == ["strict_g6", "relaxed_lt0.693", "vanilla_2"]
    assert (rdir / "attempts" / "strict_g6.1" / "pids.txt").is_file(), "the interrupted attempt is kept"
    assert calls().count("vanilla_1") == 1


def test_a_second_writer_is_refused_with_the_holder(tmp_path, fake):
    runner, calls = fake
    rdir = _prepare(tmp_path)
    orch = _orchestrator(rdir, runner, {"FAKE_LEG_BAD": "vanilla_1", "FAKE_LEG_MODE": "hang"})
    try:
        leg_pid, engine_pid = map(int, _wait_for(rdir / "legs" / "vanilla_1" / "pids.txt").split())
        with pytest.raises(ProtocolError, match=rf"in use by PID {orch.pid} on .*, started 20\d\d-") as err:
            protocol.execute(rdir, runner=runner, log=lambda s: None)
        assert "wait for it to finish" in str(err.value)
        assert calls() == ["vanilla_1"], "the refused writer started no leg"
        orch.send_signal(signal.SIGTERM)  # an ordinary stop takes the legs along too
        orch.wait(timeout=10)
        assert _gone([leg_pid, engine_pid]) == []
    finally:
        if orch.poll() is None:
            orch.kill()


def test_resume_refuses_to_run_beside_a_leg_process_that_is_still_alive(tmp_path, fake):
    runner, calls = fake
    rdir = _prepare(tmp_path)
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_json_atomic(rdir / "protocol.json", {
            "state": "running", "legs": {}, "leg_process": {
                "leg": "strict_g6", "pid": orphan.pid, "start_ticks": process_start_ticks(orphan.pid),
                "started": "2026-11-29T10:00:00+00:00"}})
        with pytest.raises(ProtocolError, match=rf"leg strict_g6 .* still running as PID {orphan.pid}"):
            protocol.execute(rdir, runner=runner, log=lambda s: None)
        assert calls() == []
    finally:
        orphan.kill()
        orphan.wait()
    # the same PID recorded with another start time is another process: not an orphan of this run
    st = protocol.execute(rdir, runner=runner, log=lambda s: None)
    assert all(s == "complete" for s in st.values())


def test_stale_lock_is_taken_over_and_a_held_one_refused(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "run.lock").write_text(json.dumps({"pid": dead.pid, "start_ticks": 1, "host": "h",
                                                   "started": "2026-01-01T00:00:00+00:00"}))
    with RunLock(tmp_path) as lock:
        assert lock.previous["pid"] == dead.pid and lock.previous["alive"] is False
        code = ("import sys; from workbench.runfolder import RunLock, RunFolderError\n"
                f"try:\n    RunLock({str(tmp_path)!r}).acquire()\nexcept RunFolderError as e:\n"
                "    print(e); sys.exit(3)\n")
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 3 and f"PID {os.getpid()}" in proc.stdout
    assert (tmp_path / "run.lock").read_text() == "", "a released lock is empty, never deleted"
    with RunLock(tmp_path) as lock:
        assert lock.previous is None


def test_run_ids_do_not_collide_and_folders_are_never_reused(tmp_path):
    ids = {new_run_id() for _ in range(2000)}
    assert len(ids) == 2000
    taken = tmp_path / "results" / "E4" / "20260101T000000Z-00000000"
    taken.mkdir(parents=True)
    (taken / "notes.txt").write_text("someone's files")
    with pytest.raises(ProtocolError, match="already exists; a run never reuses a folder"):
        protocol.prepare_run("E4", "tiny", None, True, run_dir=taken,
                             model_paths={"target": "fake/target", "twin": "fake/twin"})
    assert sorted(p.name for p in taken.iterdir()) == ["notes.txt"]


def test_preflight_names_every_problem_and_creates_nothing(tmp_path, tiny_models):
    listcfg = tmp_path / "list-config-model"
    listcfg.mkdir()
    (listcfg / "config.json").write_text("[1, 2]")
    root = tmp_path / "results"
    with pytest.raises(ProtocolError) as err:
        protocol.prepare_run("E4", "tiny", None, True, root,
                             model_paths={"target": str(listcfg), "twin": str(tmp_path / "no-such-twin")},
                             dataset_sources={"mathvista": str(tmp_path / "no-such-data"), "imagenet": "x"})
    msg = str(err.value)
    assert "nothing was created" in msg
    assert "config.json holds a JSON list, not an object" in msg and str(listcfg) in msg
    assert "checkpoint not found" in msg and "no-such-twin" in msg
    assert "unknown data set(s) ['imagenet']" in msg
    assert "--data-source mathvista=" in msg and "no such file or folder" in msg
    assert not root.exists()
    # prompt lengths with the target's own tokenizer, before any leg: tiny prompts are 41-96 tokens
    with pytest.raises(ProtocolError) as err:
        protocol.prepare_run("E1", "tiny", ["max_model_len=42"], True, root)
    msg = str(err.value)
    assert "do not fit max_model_len=42" in msg and "tiny-002' (42 tokens)" in msg and "tiny-001" not in msg
    assert "leg(s) vanilla_1, strict_g6, vanilla_2" in msg
    # gamma against the context length
    with pytest.raises(ProtocolError, match=r"leg strict_g32: gamma=32 does not fit max_model_len=32"):
        protocol.prepare_run("E1", "tiny", ["gamma=32", "max_model_len=32"], True, root,
                             model_paths={"target": "fake/target", "twin": "fake/twin"})
    assert not root.exists()


@pytest.fixture
def read_only_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "results").mkdir()
    if os.geteuid() == 0:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro / "results")],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot make a read-only folder as root here: {proc.stderr.strip()}")
        yield ro / "results"
        subprocess.run(["umount", str(ro / "results")], check=False)
    else:
        (ro / "results").chmod(0o555)
        yield ro / "results"
        (ro / "results").chmod(0o755)


def test_read_only_results_root_is_a_clear_error(read_only_dir, capsys):
    from workbench.cli import main
    assert main(["run", "E4", "--profile", "tiny", "--results", str(read_only_dir),
                 "--model-path", "target=fake/target", "--model-path", "twin=fake/twin"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: E4 cannot start") and "is not writable" in err and "Traceback" not in err


def test_damaged_run_is_skipped_by_list_runs_and_the_explorer(tmp_path):
    from synthetic_runs import write_run
    from workbench.results import DamagedRunWarning, list_runs
    write_run(tmp_path, run_id="20260101T000000Z-0001", n_prompts=3)
    bad = write_run(tmp_path, run_id="20260101T000000Z-0002", n_prompts=3)
    (bad / "run.json").write_text('{"experiment": "E1", "legs": [')
    with pytest.warns(DamagedRunWarning, match="20260101T000000Z-0002"):
        runs = list_runs(tmp_path)
    assert list(runs["run_id"]) == ["20260101T000000Z-0001"]
    from workbench.widgets import Explorer
    with pytest.warns(DamagedRunWarning, match="skipping damaged run"):
        ex = Explorer(results_root=tmp_path)
    assert [o[0].rsplit("[", 1)[-1] for o in ex.run_dd.options] == ["20260101T000000Z-0001]"]
    from workbench.cli import main
    assert main(["export", str(bad)]) == 2


def test_export_removes_tables_whose_records_are_gone(tmp_path, capsys, monkeypatch):
    from synthetic_runs import write_run
    from workbench.cli import main
    monkeypatch.delenv("BROWSER_PATH", raising=False)
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no browser on PATH
    rdir = write_run(tmp_path, n_prompts=3)
    assert main(["export", str(rdir), "--formats", "html"]) == 0
    for t in ("speedup", "exactness", "prompt_speedups", "acceptance"):
        assert (rdir / "tables" / f"{t}.csv").is_file()
    assert (rdir / "figures" / "speedup_distribution.html").is_file()
    (rdir / "legs" / "strict_g6" / "records.jsonl").unlink()  # the only spec leg
    capsys.readouterr()
    assert main(["export", str(rdir), "--formats", "html"]) == 0
    out = capsys.readouterr().out
    for t in ("speedup", "exactness", "prompt_speedups", "acceptance"):
        assert not (rdir / "tables" / f"{t}.csv").exists(), t
        assert f"tables/{t}.csv" in out
    assert not (rdir / "figures" / "speedup_distribution.html").exists()
    assert "figures/speedup_distribution.html" in out and out.count("removed") == 1
    assert (rdir / "tables" / "legs_throughput.csv").is_file(), "tables the vanilla legs feed stay"


def test_export_without_a_browser_writes_html_and_warns_once(tmp_path, capsys, monkeypatch):
    from synthetic_runs import write_run
    from workbench.cli import main
    monkeypatch.delenv("BROWSER_PATH", raising=False)
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    rdir = write_run(tmp_path, n_prompts=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning from inside the export would fail here
        assert main(["export", str(rdir), "--formats", "png,pdf,html"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "apt-get install -y chromium" in err and "png/pdf figures skipped" in err
    assert sorted(p.suffix for p in (rdir / "figures").iterdir()) == [".html"] * len(list((rdir / "figures").iterdir()))
    assert (rdir / "figures" / "speedup_distribution.html").stat().st_size > 10000
    assert main(["export", str(rdir), "--formats", "gif"]) == 2


def test_a_failed_leg_keeps_its_partial_records_beside_failure_json(tmp_path, fake, monkeypatch):
    runner, calls = fake
    monkeypatch.setenv("FAKE_LEG_BAD", "strict_g6")
    monkeypatch.setenv("FAKE_LEG_MODE", "partial-crash")
    rdir = _prepare(tmp_path)
    st = protocol.execute(rdir, runner=runner, log=lambda s: None)
    folder = rdir / "legs" / "strict_g6"
    assert st["strict_g6"] == "failed" and leg_status(folder) == "failed"
    fail = json.loads((folder / "failure.json").read_text())
    assert fail["partial_records"] == "records.jsonl.partial" and "exited with code 4" in fail["error"]
    assert (folder / "records.jsonl.partial").is_file() and not (folder / "records.jsonl").exists()
    from workbench.results import load_run
    assert "strict_g6" not in set(load_run(rdir).records["leg"]), "partial records are evidence, not results"
    # the rerun is told where the earlier attempt is, to reuse its finished prompts where settings match
    monkeypatch.delenv("FAKE_LEG_BAD")
    protocol.execute(rdir, runner=runner, log=lambda s: None)
    cfg = json.loads((folder / "leg.json").read_text())
    # stored relative to the leg folder, so a moved run still finds it
    assert cfg["resume_from"] == "../../attempts/strict_g6.1"
    from workbench.leg import load_leg_config
    assert load_leg_config(folder / "leg.json").resume_from == str(rdir / "attempts" / "strict_g6.1")
    assert (rdir / "attempts" / "strict_g6.1" / "records.jsonl.partial").is_file()


def test_the_trampoline_arms_the_parent_death_signal():
    """Any leg command (score legs, fake legs) dies with the process that started it, by the kernel's signal."""
    code = ("import os, subprocess, sys, time\nfrom workbench import childproc\n"
            "p = subprocess.Popen(childproc.wrap(os.getpid(), [sys.executable, '-c', 'import time; time.sleep(60)']),"
            " start_new_session=True)\nprint(p.pid, flush=True)\ntime.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.5)  # the trampoline has exec'd the command by now
        assert process_alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _gone([child]) == []
    finally:
        if parent.poll() is None:
            parent.kill()
