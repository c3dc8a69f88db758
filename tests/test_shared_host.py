"""Two runs on one host (workbench.hostruns): found before legs start, warned on a CPU, refused on a shared
GPU unless --allow-shared-host, recorded in protocol.json and marked in tables/summary.json."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench import cli, hostruns, placement
from workbench.runfolder import process_start_ticks

REPO = Path(__file__).resolve().parents[1]
GPU0 = {"index": "0", "uuid": "GPU-aaaa", "name": "H200"}
GPU1 = {"index": "1", "uuid": "GPU-bbbb", "name": "H200"}


@pytest.fixture
def host_dir(tmp_path, monkeypatch):
    d = tmp_path / "host"
    monkeypatch.setenv(hostruns.HOST_DIR_ENV, str(d))
    monkeypatch.setenv(hostruns.CHECK_ENV, "1")  # the suite turns the check off (conftest.py)
    return d


class _Detached:
    """A process that is not this one's child (another run's leg is not), killed by its PID at the end."""

    def __init__(self, *argv: str):
        # `python -c CODE ARGS`: ARGS stand in for a leg's command line in /proc/<pid>/cmdline
        quoted = " ".join(f"'{a}'" for a in [sys.executable, "-c", "import time; time.sleep(60)", *argv])
        out = subprocess.run(["sh", "-c", f"{quoted} >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
        self.pid = int(out.stdout.strip())

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        end = time.monotonic() + 5
        while process_start_ticks(self.pid) is not None and time.monotonic() < end:
            time.sleep(0.05)


def _sleeper(*argv: str) -> _Detached:
    return _Detached(*argv)


def _fake_run(root: Path, name: str, state: dict | None = None) -> Path:
    rdir = root / "E1" / name
    (rdir / "legs" / "vanilla_1").mkdir(parents=True)
    (rdir / "run.json").write_text(json.dumps({"experiment": "E1", "run_id": name, "device": "gpu"}))
    if state is not None:
        (rdir / "protocol.json").write_text(json.dumps(state))
    return rdir


def _register(host_dir: Path, proc: _Detached, rdir: Path, device: str = "gpu") -> Path:
    host_dir.mkdir(exist_ok=True)
    path = host_dir / f"{proc.pid}.json"
    path.write_text(json.dumps({"pid": proc.pid, "start_ticks": process_start_ticks(proc.pid),
                                "run_dir": str(rdir.resolve()), "experiment": "E1", "device": device}))
    return path


def test_a_leg_process_of_another_run_is_found_by_the_process_scan(tmp_path, host_dir):
    rdir = _fake_run(tmp_path / "results", "20261205T000000Z-0000aaaa")
    leg = _sleeper("-m", "workbench.leg", "--config", str(rdir / "legs" / "vanilla_1" / "leg.json"))
    try:
        time.sleep(0.3)
        found = {o.pid: o for o in hostruns.others()}
        assert leg.pid in found, found
        o = found[leg.pid]
        assert (o.run_dir, o.leg, o.found_by) == (str(rdir.resolve()), "vanilla_1", "process")
        assert o.gpus is None  # not known from a process: a GPU run beside it is refused
        assert leg.pid not in {o.pid for o in hostruns.others(own_run=rdir)}  # a run's own legs are not "others"
    finally:
        leg.kill()
    assert leg.pid not in {o.pid for o in hostruns.others()}


def test_a_gpu_run_beside_another_on_its_gpu_is_refused_before_anything_is_created(tmp_path, host_dir,
                                                                                    monkeypatch, capsys):
    other = _fake_run(tmp_path / "elsewhere", "20261205T000000Z-0000bbbb",
                      {"state": "running", "leg_process": {"leg": "strict_g4", "pid": 1},
                       "placement": {"device": "gpu", "gpus": [GPU0]}})
    proc = _sleeper()
    dead = _sleeper()
    dead.kill()
    try:
        _register(host_dir, proc, other)
        stale = _register(host_dir, dead, tmp_path / "gone")  # a run killed with -9: ignored, its file removed
        monkeypatch.setattr(placement, "capture", lambda *a, **k: {"device": "gpu", "gpus": [GPU0]})
        results = tmp_path / "results"
        t0 = time.monotonic()
        rc = cli.main(["run", "E1", "--profile", "8b-instruct", "--results", str(results), "--formats", "html"])
        err = capsys.readouterr().err
        assert rc == 2, err
        assert time.monotonic() - t0 < 10
        assert str(other.resolve()) in err and f"PID {proc.pid}" in err and "leg strict_g4" in err, err
        assert "GPU(s) 0" in err and "--allow-shared-host" in err, err
        assert not results.exists()  # nothing created
        assert not stale.exists()

        found = [o for o in hostruns.others() if o.pid == proc.pid]
        assert [o.gpus for o in found] == [["0"]]
        # the other run on another GPU: a warning naming it, no refusal
        why, lines = hostruns.decide(found, "gpu", {"device": "gpu", "gpus": [GPU1]}, allow=False)
        assert why is None and any(str(other.resolve()) in line for line in lines)
        # on its GPU with --allow-shared-host, or for a CPU profile (tiny: a rehearsal): a warning
        assert hostruns.decide(found, "gpu", {"device": "gpu", "gpus": [GPU0]}, allow=True)[0] is None
        assert hostruns.decide(found, "cpu", {"device": "gpu", "gpus": [GPU0]}, allow=False)[0] is None
    finally:
        proc.kill()


def _state(rdir: Path) -> dict:
    try:
        return json.loads((rdir / "protocol.json").read_text())
    except (OSError, ValueError):
        return {}


def _wait(what, cond, timeout: float, procs) -> None:
    end = time.monotonic() + timeout
    while not cond():
        for p in procs:
            assert p.poll() is None, f"a run ended before {what}: {p.args}"
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.vllm
def test_two_real_runs_on_one_cpu_host_warn_and_record_each_other(tmp_path, host_dir, tiny_models):
    """Run A (E1, tiny, smoke) is in its first leg when run B starts: B warns naming A's folder and PID and
    goes on (a CPU host); both protocol.json files record the other, and B's summary says disturbed."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "workbench.cli", "run", "E1", "--profile", "tiny", "--smoke", "-p", "n=2",
           "-p", "max_tokens=8", "--no-notebook", "--formats", "html"]
    a = subprocess.Popen([*cmd, "--results", str(tmp_path / "a")], cwd=REPO, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    b = None
    try:
        _wait("run A's first leg", lambda: list((tmp_path / "a").glob("E1/*/protocol.json"))
              and (_state(next((tmp_path / "a").glob("E1/*"))).get("leg_process")), 120, [a])
        rdir_a = next((tmp_path / "a").glob("E1/*")).resolve()
        b = subprocess.Popen([*cmd, "--results", str(tmp_path / "b")], cwd=REPO, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _wait("run B's folder", lambda: list((tmp_path / "b").glob("E1/*/run.json")), 60, [b])
        rdir_b = next((tmp_path / "b").glob("E1/*")).resolve()
        _wait("run B's first leg", lambda: _state(rdir_b).get("legs", {}).get("vanilla_1") == "complete", 150, [b])
        _wait("run A to record run B", lambda: any(e.get("run_dir") == str(rdir_b)
                                                   for e in _state(rdir_a).get("shared_host", [])), 150, [a])
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        out_a = a.communicate(timeout=60)
        out_b = b.communicate(timeout=60) if b is not None else ("", "")
    assert b.returncode == 143, out_b[1][-3000:]
    # B's warning, before its legs: A's folder and PID
    warn = out_b[1]
    assert "another run is active on this host" in warn and str(rdir_a) in warn and f"PID {a.pid}" in warn, warn
    seen_b = {e["run_dir"]: e for e in _state(rdir_b)["shared_host"] if e.get("run_dir")}
    assert seen_b[str(rdir_a)]["pid"] == a.pid and "vanilla_1" in seen_b[str(rdir_a)]["legs"], seen_b
    seen_a = {e["run_dir"]: e for e in _state(rdir_a)["shared_host"] if e.get("run_dir")}
    assert seen_a[str(rdir_b)]["pid"] == b.pid and seen_a[str(rdir_b)]["legs"], (seen_a, out_a[0][-2000:])
    # B's numbers are marked as disturbed, naming A
    ex = subprocess.run([sys.executable, "-m", "workbench.cli", "export", str(rdir_b), "--formats", "html"],
                        cwd=REPO, env=env, capture_output=True, text=True)
    summary = json.loads((rdir_b / "tables" / "summary.json").read_text())
    assert summary["disturbed"] is True and any(str(rdir_a) in s for s in summary["disturbed_by"]), (summary, ex.stderr)
    assert not list(host_dir.glob("*.json"))  # both runs took their registration with them
