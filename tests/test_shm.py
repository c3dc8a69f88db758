"""/dev/shm hygiene (#38): a leg's leftovers are removed when it ends, and on resume after a kill -9.

No engine starts: the leg is the fake leg of test_protocol.py behind a wrapper that leaves /dev/shm
entries the way vLLM's do (``psm_*``, ``sem.mp-*``, a ``*-cpushm`` pair), every name carrying this test's
tag, so the counts below are this test's own whatever else the host runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from conftest import REPO
from test_protocol import FAKE_LEG, _prepare
from workbench import protocol, shm

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this host")

WRAPPER = textwrap.dedent('''
    import os, runpy, subprocess, sys, time
    tag, pid = os.environ["SHM_TAG"], os.getpid()
    root = os.environ.get("WORKBENCH_SHM_ROOT") or "/dev/shm"
    for name in (f"psm_{tag}_{pid}", f"sem.mp-{tag}{pid}", f"{tag}-{pid}-[0-1]-cpushm", f"{tag}-{pid}-[1-0]-cpushm"):
        with open(f"{root}/{name}", "wb") as fh:
            fh.write(b"x" * 4096)
    if os.environ.get("SHM_LIVE"):  # another process's segment, created while the leg runs and in use
        subprocess.Popen([sys.executable, "-c", "import os, sys, time; h = open(sys.argv[1], 'w'); "
                          "open(sys.argv[2], 'w').write(str(os.getpid())); time.sleep(60)", f"/dev/shm/psm_{tag}_live",
                          os.environ["SHM_LIVE"]], start_new_session=True)
        while not os.path.exists(os.environ["SHM_LIVE"]):
            time.sleep(0.02)
    if os.environ.get("SHM_HANG"):  # an engine still holding its segment when the run is killed
        held = open(f"{root}/psm_{tag}_{pid}", "rb")
        open(os.environ["SHM_HANG"], "w").write(str(pid))
        time.sleep(120)
    sys.argv = [os.environ["SHM_FAKE_LEG"]] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
''')


def _tagged(tag: str) -> list[str]:
    root = shm.shm_root()
    return sorted(n for n in os.listdir(root) if tag in n)


def _kill_run_mid_leg(rdir: Path, runner: list[str], hang: Path, env: dict[str, str], before_kill=lambda: None):
    """Execute ``rdir``'s protocol in a process of its own, kill it with -9 once the first leg wrote its PID
    to ``hang``, and wait for that leg to die of its parent's death. Returns ``before_kill()``."""
    code = ("from workbench import protocol\n"
            f"protocol.execute({str(rdir)!r}, runner={runner!r}, log=lambda s: None)\n")
    run = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 60
        while not hang.is_file():
            assert run.poll() is None and time.monotonic() < deadline, "the first leg never started"
            time.sleep(0.05)
        leg_pid = int(hang.read_text())
        seen = before_kill()
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=30)
    finally:
        if run.poll() is None:
            run.kill()
    deadline = time.monotonic() + 20  # the leg dies of its parent's death (the kernel's signal)
    while Path(f"/proc/{leg_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return seen


@pytest.fixture
def leg(tmp_path, monkeypatch):
    fake = tmp_path / "fake_leg.py"
    fake.write_text(FAKE_LEG)
    wrapper = tmp_path / "shm_leg.py"
    wrapper.write_text(WRAPPER)
    calls = tmp_path / "calls.txt"
    calls.write_text("")
    tag = f"wbtest{uuid.uuid4().hex[:8]}"
    for k, v in {"FAKE_LEG_CALLS": calls, "FAKE_LEG_REPO": REPO, "SHM_FAKE_LEG": fake, "SHM_TAG": tag}.items():
        monkeypatch.setenv(k, str(v))
    yield [sys.executable, str(wrapper)], tag
    for n in _tagged(tag):
        (shm.shm_root() / n).unlink(missing_ok=True)


def test_each_leg_removes_what_it_left_in_dev_shm_and_keeps_a_live_segment(tmp_path, leg, monkeypatch):
    runner, tag = leg
    ready = tmp_path / "live.ready"
    monkeypatch.setenv("SHM_LIVE", str(ready))
    rdir = _prepare(tmp_path)
    assert _tagged(tag) == []
    statuses = protocol.execute(rdir, runner=runner, log=lambda s: None)
    assert set(statuses.values()) == {"complete"}
    # 4 legs x 4 entries were made; only the live process's segment is left, in use, untouched
    assert _tagged(tag) == [f"psm_{tag}_live"]
    assert not list(rdir.glob(f"legs/*/{shm.SNAPSHOT}"))
    os.kill(int(ready.read_text()), signal.SIGTERM)


def test_resume_after_kill_9_removes_the_killed_legs_leftovers(tmp_path, leg, monkeypatch):
    runner, tag = leg
    # a folder of its own in place of /dev/shm: there another test worker's legs may clean the killed
    # leg's leftovers (garbage to them) before the resume this test checks
    root = tmp_path / "shm"
    root.mkdir()
    monkeypatch.setenv(shm.ROOT_ENV, str(root))
    rdir = _prepare(tmp_path)
    hang = tmp_path / "hang.pid"
    before_kill = _kill_run_mid_leg(rdir, runner, hang, {**os.environ, "SHM_HANG": str(hang)},
                                    lambda: _tagged(tag))
    assert len(before_kill) == 4
    assert _tagged(tag) == before_kill, "a kill -9 leaves the engine's segments"
    assert (rdir / "legs" / "vanilla_1" / shm.SNAPSHOT).is_file()
    statuses = protocol.execute(rdir, runner=runner, log=lambda s: None)
    assert set(statuses.values()) == {"complete"}
    assert _tagged(tag) == []
    state = json.loads((rdir / "protocol.json").read_text())
    assert sorted(state["history"][-1]["shm_removed"]["vanilla_1"]) == before_kill


def test_a_leftover_is_only_what_is_new_named_like_vllms_and_unused(tmp_path):
    root = tmp_path / "shm"
    root.mkdir()
    for n in ("psm_old", "unrelated"):
        (root / n).write_text("x")
    before = shm.entries(root)
    for n in ("psm_new", "sem.mp-abc", "x-[0-1]-cpushm", "notes.txt", "psm_held"):
        (root / n).write_text("x")
    with open(root / "psm_held"):
        assert shm.leftovers(before, root) == ["psm_new", "sem.mp-abc", "x-[0-1]-cpushm"]


def test_a_live_multiprocessing_semaphore_is_not_a_leftover():
    """glibc links a named semaphore to its ``sem.mp-*`` name after mapping it under a temporary one, so the
    users' maps never show that name: the check goes by inode (removing it broke a concurrent engine's start)."""
    import multiprocessing as mp

    before = shm.entries()
    lock = mp.get_context("spawn").Lock()
    new = [n for n in shm.entries() - before if n.startswith("sem.mp-")]
    assert new, "a spawn-context lock makes a named semaphore in /dev/shm"
    assert not set(new) & set(shm.leftovers(before))
    del lock


def _bind(path: Path, keep: bool):
    """A Unix socket bound at ``path`` as ZeroMQ's ipc:// does; closed (its file left) unless ``keep``."""
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen()
    if keep:
        return s
    s.close()
    return None


@pytest.fixture
def rpc_root():
    """A short folder of its own for the sockets: a Unix socket's path is at most 107 bytes, and pytest's
    temporary folders under a test worker are longer than vLLM's temp folder (where its sockets go)."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="wbrpc-", dir="/tmp" if Path("/tmp").is_dir() else None))
    assert len(str(root / str(uuid.uuid4()))) < 100
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_a_leftover_socket_is_new_uuid_named_and_bound_by_no_one(rpc_root):
    root = rpc_root
    old = str(uuid.uuid4())
    _bind(root / old, keep=False)
    before = shm.ipc_entries(root)
    assert before == {old}
    dead, live, plain = str(uuid.uuid4()), str(uuid.uuid4()), str(uuid.uuid4())
    _bind(root / dead, keep=False)
    held = _bind(root / live, keep=True)
    (root / plain).write_text("a file, not a socket")
    _bind(root / "not-a-uuid", keep=False)
    assert str(root / live) in shm.bound_sockets() and str(root / dead) not in shm.bound_sockets()
    assert shm.ipc_leftovers(before, root) == [dead]
    held.close()
    assert shm.ipc_leftovers(before, root) == sorted([dead, live])


def test_a_killed_engines_sockets_are_removed_on_resume_and_a_live_ones_kept(tmp_path, leg, monkeypatch, rpc_root):
    """vLLM's processes bind ipc:// sockets in VLLM_RPC_BASE_PATH; a kill -9 leaves their files. The leg here
    binds two (one closed, one held by a process that outlives the run) and is killed with its run."""
    runner, tag = leg
    rpc = rpc_root
    monkeypatch.setenv(shm.IPC_ENV, str(rpc))
    monkeypatch.setenv(shm.ROOT_ENV, str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    rdir = _prepare(tmp_path)
    hang, live_pid = tmp_path / "hang.pid", tmp_path / "live.pid"
    leg_code = textwrap.dedent(f"""
        import os, socket, subprocess, sys, time, uuid
        rpc = os.environ["{shm.IPC_ENV}"]
        s = socket.socket(socket.AF_UNIX); s.bind(os.path.join(rpc, str(uuid.uuid4()))); s.listen()
        live = os.path.join(rpc, str(uuid.uuid4()))
        subprocess.Popen([sys.executable, "-c", "import os, socket, sys, time; s = socket.socket(socket.AF_UNIX); "
                          "s.bind(sys.argv[1]); s.listen(); open(sys.argv[2], 'w').write(str(os.getpid())); "
                          "time.sleep(120)", live, {str(live_pid)!r}], start_new_session=True)
        while not os.path.exists({str(live_pid)!r}):
            time.sleep(0.02)
        open({str(hang)!r}, "w").write(str(os.getpid()))
        time.sleep(120)
    """)
    hanging = tmp_path / "hanging_leg.py"
    hanging.write_text(leg_code)
    try:
        _kill_run_mid_leg(rdir, [sys.executable, str(hanging)], hang, dict(os.environ))
        left = sorted(shm.ipc_entries(rpc))
        assert len(left) == 2, "a kill -9 leaves the killed process's socket file"
        statuses = protocol.execute(rdir, runner=runner, log=lambda s: None)
        assert set(statuses.values()) == {"complete"}
        kept = sorted(shm.ipc_entries(rpc))
        assert len(kept) == 1 and str(rpc / kept[0]) in shm.bound_sockets()
        state = json.loads((rdir / "protocol.json").read_text())
        assert state["history"][-1]["shm_removed"]["vanilla_1"] == sorted(set(left) - set(kept))
    finally:
        if live_pid.is_file():
            os.kill(int(live_pid.read_text()), signal.SIGKILL)
