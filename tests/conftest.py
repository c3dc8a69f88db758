"""Shared fixtures: the tiny models, the shared data copies, and a leg runner."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import leg_zygote

REPO = Path(__file__).resolve().parents[1]
TINY_PROMPTS = REPO / "data" / "tiny" / "prompts.jsonl"


# The suite runs runs side by side on purpose (pytest-xdist), and other suites may share the host: a run
# here looks for no other run (workbench.hostruns), except in tests/test_shared_host.py, which turns it on.
os.environ.setdefault("WORKBENCH_SHARED_HOST_CHECK", "0")


def shared_data_dir() -> Path:
    return Path(os.environ.get("WORKBENCH_SHARED_DATA", REPO.parent / "shared" / "data"))


# The modules that take longest (minutes each on a 2-core CPU host), longest first. They run first so that
# `make test` (pytest-xdist, one module per worker at a time: --dist loadfile) does not end with one worker
# alone on a long module; the other modules follow in their usual order. Order within a module is kept.
# The longest engine work is split over several modules (tensor parallelism, serving, the smoke runs) so
# that the two workers share it; the tensor-parallel modules (three processes a leg) alternate with others.
SLOW_MODULES = ("test_tensor_parallel.py", "test_serving.py", "test_experiments_smoke.py",
                "test_tensor_parallel_legs.py", "test_experiments_smoke_e9_e15.py", "test_serving_load.py",
                "test_tensor_parallel_ladder.py", "test_cli_run.py", "test_serving_synthetic.py",
                "test_ray_engine.py", "test_organism_profile.py", "test_serve.py", "test_leg_stream.py",
                "test_shared_host.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_MODULES)))


_IPC_BEFORE: set[str] = set()
_SHM_BEFORE: set[str] = set()


def pytest_sessionstart(session):
    from workbench import shm

    _IPC_BEFORE.update(shm.ipc_entries(shm.ipc_root()))
    _SHM_BEFORE.update(shm.entries(shm.shm_root()))


def pytest_sessionfinish(session, exitstatus):
    leg_zygote.stop()
    # the ipc:// socket files of the engines the tests started outside a run's legs (ZeroMQ leaves them even
    # on a clean exit; a run's legs remove theirs, workbench.shm): new since this session began and bound by
    # no live process
    from workbench import shm

    shm.clean_ipc(_IPC_BEFORE, shm.ipc_root())
    # and the /dev/shm segments of those engines (vLLM's CPU communicator's pairs at TP 2, the multiprocessing
    # segments of the engines the kill tests kill): new since this session began, vLLM-named, mapped by no one
    shm.clean_shm(_SHM_BEFORE, shm.shm_root())


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, but a worker is handed its next module only when the last test of its current one
    is all it has left (xdist's own rule: two left). A worker that starts a long module's second-to-last test
    would otherwise hold the next long module in its queue while the other worker runs out of work."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class OneAhead(LoadFileScheduling):
        def _reschedule(self, node):
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    return OneAhead(config, log)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = shared_data_dir()
    if not path.is_dir():
        pytest.skip(f"shared data copies not found at {path} (set WORKBENCH_SHARED_DATA)")
    return path


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    from workbench.tiny import ensure_tiny_models

    return ensure_tiny_models()


@pytest.fixture(scope="session")
def tiny_prompts() -> Path:
    return TINY_PROMPTS


class LegResult:
    def __init__(self, out: Path, proc: subprocess.CompletedProcess):
        self.out = out
        self.returncode = proc.returncode
        self.stderr = proc.stderr
        self.records = []
        self.summary = None
        self.failure = None
        if (out / "records.jsonl").exists():
            self.records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines() if line]
        if (out / "summary.json").exists():
            self.summary = json.loads((out / "summary.json").read_text())
        if (out / "failure.json").exists():
            self.failure = json.loads((out / "failure.json").read_text())

    def by_pid(self) -> dict[str, dict]:
        return {r["pid"]: r for r in self.records}

    def ok(self) -> "LegResult":
        assert self.returncode == 0, f"leg failed ({self.returncode}):\n{self.stderr[-4000:]}"
        return self


def run_leg_process(out: Path, *args: str, env: dict | None = None, timeout: int = 600) -> LegResult:
    """``python -m workbench.leg --out OUT ARGS``, forked from this process's leg zygote where it can stand for a
    fresh process (tests/leg_zygote.py says when)."""
    leg_zygote.start()
    cmd = leg_zygote.command("workbench.leg", ["--out", out, *args])
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    return LegResult(out, proc)


def workbench_cli(*args) -> list[str]:
    """``python -m workbench.cli ARGS``, forked from this process's leg zygote with the legs it starts where they
    can be (tests/leg_zygote.py): for runs whose process tree no test looks at."""
    leg_zygote.start()
    return leg_zygote.command("workbench.cli", list(args))


@pytest.fixture
def run_leg(tmp_path):
    counter = {"n": 0}

    def _run(*args: str, env: dict | None = None, out: Path | None = None) -> LegResult:
        counter["n"] += 1
        return run_leg_process(out or tmp_path / f"leg{counter['n']}", *args, env=env)

    return _run
