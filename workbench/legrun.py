"""One leg as a process, for every executor: its folder, its process group, its status; the run's close.

    run_leg(run_dir, cfg, leg, where, env, opts, started) -> (status, seconds)

A leg starts in a fresh ``legs/<leg>/`` (an earlier attempt moved under attempts/) with its ``leg.json``
and ``placement.json``, as its own process group behind the parent-death trampoline
(``workbench.childproc``), so that it and its engine processes die with the process that started it:
the ``workbench run`` process under the local executor, a Ray worker under the Ray executor. Its
status is decided from what is on disk; ``failure.json`` is written where the leg could not.
SIGINT and SIGTERM become an exception while legs run (``signals_as_exceptions``), so a stop is
recorded instead of leaving a raw traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from workbench import childproc, shm
from workbench.planning import PlannedLeg
from workbench.runfolder import (FAILURE, LEG_JSON, LEG_LOG, LEGS, PLACEMENT, RECORDS, RECORDS_PARTIAL, STATE_JSON,
                                 SUMMARY, archive_leg, failure_record, leg_status, read_json, write_failure,
                                 write_json_atomic)
from workbench.runners import REPO_ROOT, _now, leg_command, runner_for
from workbench.runners import experiment_runner as _experiment_runner

__all__ = ["RunOptions", "RunInterrupted", "run_leg", "start_leg_folder", "leg_env", "finish_run", "failure_line",
           "signals_as_exceptions", "signum_of", "Signalled"]


@dataclass(frozen=True)
class RunOptions:
    """How ``execute`` runs the legs: ``executor`` ``local`` (one leg after another, here) or ``ray`` (each
    bracket group a Ray task on a GPU of its own; ``address`` a cluster's, None: a local instance with
    ``gpus`` logical GPUs); the rest as ``execute`` takes them."""

    stop_on_failure: bool = False
    leg_timeout: float | None = None
    python: str = sys.executable
    runner: list[str] | None = None
    executor: str = "local"
    address: str | None = None
    gpus: int | None = None
    allow_shared_host: bool = False




def _fmt_s(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def _tail(path: Path, n_chars: int = 4000) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - n_chars))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _run_one(cmd: list[str], folder: Path, timeout: float | None, env: dict[str, str],
             on_start: Callable[[subprocess.Popen], None]) -> tuple[int | None, str]:
    log = folder / LEG_LOG
    with log.open("ab") as fh:
        fh.write(("$ " + " ".join(cmd) + "\n").encode())
        fh.flush()
        # Own session and process group: the leg's engine processes can be stopped as one. The
        # trampoline arms the kernel's parent-death signal: if this process dies, the leg is told.
        proc = subprocess.Popen(childproc.wrap(os.getpid(), cmd), stdout=fh, stderr=subprocess.STDOUT,
                                cwd=str(REPO_ROOT), env=env, start_new_session=True)
        try:
            on_start(proc)
            rc = _wait(proc, timeout)
            if rc is None:
                _kill_group(proc)
                return None, f"leg timed out after {timeout:g} s"
            _wait_group_gone(proc.pid)  # engine workers exit after the leg: /dev/shm is cleaned after them
            return rc, ""
        except BaseException:
            _kill_group(proc)
            raise


def _wait(proc: subprocess.Popen, timeout: float | None) -> int | None:
    """The leg's exit status, or None once ``timeout`` passed. Waits in short slices: an exception sent to this
    thread from outside (a Ray task's cancellation) lands within half a second, not when the leg ends."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
        try:
            return proc.wait(timeout=max(left, 0.0))
        except subprocess.TimeoutExpired:
            if deadline is not None and time.monotonic() >= deadline:
                return None


def _wait_group_gone(pgid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)


def _kill_group(proc: subprocess.Popen) -> None:
    # vLLM spawns engine-core workers; the whole group goes, not only the leg's main process.
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _finalise(folder: Path, leg: PlannedLeg, rc: int | None, why: str) -> str:
    """Decide the leg's status from what is on disk; write failure.json where the leg could not."""
    status = leg_status(folder)
    if status == "complete" and rc == 0:
        return status
    if status == "failed":
        return status
    if status == "complete":  # a summary says complete but the process failed: do not trust it
        os.replace(folder / SUMMARY, folder / "summary.rejected.json")
        if (folder / RECORDS).is_file():
            os.replace(folder / RECORDS, folder / RECORDS_PARTIAL)
    err = why or (f"leg process exited with code {rc} without writing summary.json" if rc
                  else "leg process exited 0 but left no complete summary.json + records.jsonl")
    write_failure(folder, failure_record(
        error=err, returncode=rc, leg=leg.name, mode=leg.kind, tier=leg.tier, gamma=leg.knobs.get("gamma"),
        written_by="workbench.legrun",
        partial_records=RECORDS_PARTIAL if (folder / RECORDS_PARTIAL).is_file() else None,
        stderr_tail=_tail(folder / LEG_LOG)))
    return "failed"


# --- a run -------------------------------------------------------------------------------------

def leg_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the legs this process starts: the repository on the path, this process as the
    parent each leg dies with (``workbench.leg.die_with_parent``)."""
    from workbench.leg import PARENT_ENV

    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env[PARENT_ENV] = str(os.getpid())
    return env



def start_leg_folder(rdir: Path, cfg: dict[str, Any], leg: PlannedLeg, where: dict[str, Any]) -> Path:
    """A fresh ``legs/<leg>/`` (an earlier attempt moved under attempts/) with its ``leg.json`` and
    ``placement.json`` (``where``: ``workbench.placement.capture``)."""
    folder = rdir / LEGS / leg.name
    earlier = archive_leg(folder) if folder.exists() else None
    folder.mkdir(parents=True)
    shm.snapshot(folder)  # before the engine starts: what /dev/shm held (workbench.shm)
    conf = runner_for(leg, cfg.get("runner")).leg_json(leg, cfg, rdir, folder, earlier)
    if conf is not None:
        write_json_atomic(folder / LEG_JSON, conf)
    write_json_atomic(folder / PLACEMENT, where)
    return folder


def run_leg(rdir: Path, cfg: dict[str, Any], leg: PlannedLeg, where: dict[str, Any], env: dict[str, str],
            opts: RunOptions, started: Callable[[subprocess.Popen], None]) -> tuple[str, float]:
    """One leg, start to status (``complete`` | ``failed``) and seconds; the one path for every executor.

    Stopped by a signal or an error while it runs, the leg's process group is taken down and its folder
    gets a failure record; the exception goes on to the caller."""
    folder = start_leg_folder(rdir, cfg, leg, where)
    cmd = leg_command(leg, cfg, rdir, opts.python, opts.runner)
    t0 = time.monotonic()
    try:
        rc, why = _run_one(cmd, folder, opts.leg_timeout, env, started)
    except BaseException as exc:
        shm.clean_after(folder)  # the leg's process group is gone (_run_one)
        sig = signum_of(exc)
        why = (f"interrupted by {signal.Signals(sig).name} while the leg ran" if sig is not None
               else f"the run stopped while the leg ran: {type(exc).__name__}: {exc}")
        try:
            _finalise(folder, leg, None, why)
        except OSError:
            pass  # a full disk: the run's own error says so
        raise
    dt = time.monotonic() - t0
    shm.clean_after(folder)
    return _finalise(folder, leg, rc, why), dt


def clean_shm(rdir: Path) -> dict[str, list[str]]:
    """Leg -> the /dev/shm entries its killed engine left, removed (legs whose snapshot is still there)."""
    out = {}
    for snap in sorted((rdir / LEGS).glob(f"*/{shm.SNAPSHOT}")):
        removed = shm.clean_after(snap.parent)
        if removed:
            out[snap.parent.name] = removed
    return out


def failure_line(folder: Path) -> str:
    err = str(read_json(folder / FAILURE).get("error", "")).strip()
    return f"\n      failure: {err.splitlines()[-1] if err else '?'} (see {folder / FAILURE})"



def finish_run(rdir: Path, cfg: dict[str, Any], legs: list[PlannedLeg], statuses: dict[str, str],
               state: dict[str, Any], stopped: bool, t_run: float, emit: Callable[[str], None]) -> dict[str, str]:
    """Once the legs ran: the runner's last step, the final state in protocol.json, one closing line."""
    finish = _experiment_runner(cfg.get("runner")).finish
    if finish is not None:
        finish(rdir)
    n_failed = sum(1 for s in statuses.values() if s == "failed")
    final = "stopped" if stopped else ("finished_with_failures" if n_failed else
                                       ("finished" if all(s == "complete" for s in statuses.values())
                                        else "partial"))
    write_json_atomic(rdir / STATE_JSON, dict(state, state=final, legs=statuses, leg_process=None, finished=_now()))
    emit(f"{cfg['experiment']} {cfg['run_id']}: {final} in {_fmt_s(time.monotonic() - t_run)} "
         f"({sum(s == 'complete' for s in statuses.values())}/{len(legs)} legs complete)")
    return statuses



def signum_of(exc: BaseException) -> int | None:
    """The signal behind an exception: ours, or Python's own KeyboardInterrupt (SIGINT off the main thread)."""
    if isinstance(exc, Signalled):
        return exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return int(signal.SIGINT)
    return None


class RunInterrupted(Exception):
    """The run was stopped by SIGINT or SIGTERM; the state and the leg in flight are recorded."""

    def __init__(self, signum: int, run_dir: Path, leg: str | None = None):
        self.signum, self.run_dir, self.leg = signum, run_dir, leg
        self.signal = signal.Signals(signum).name
        super().__init__(f"{self.signal} received")


class Signalled(BaseException):
    # raised from the signal handler: a BaseException, so no ``except Exception`` on the way swallows it
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class signals_as_exceptions:
    """SIGINT and SIGTERM become an exception in the main thread while legs run, so the run records
    the stop (and its leg's process group is taken down) instead of dying with a raw traceback or
    without a word. Off the main thread (a notebook's worker) signals cannot be caught: no change.
    A SIGINT that was ignored when this started (a background job) stays ignored."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self):
        self.old = {}
        import threading
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.SIGNALS:
            prev = signal.getsignal(sig)
            if prev == signal.SIG_IGN:
                continue
            self.old[sig] = prev
            signal.signal(sig, self._raise)
        return self

    def _raise(self, signum, frame):
        # A second Ctrl-C while the leg's processes are being stopped must not cut that short.
        for sig in self.old:
            signal.signal(sig, signal.SIG_IGN)
        raise Signalled(signum)

    def __exit__(self, *exc):
        for sig, prev in self.old.items():
            signal.signal(sig, prev)

