"""Execution: legs as processes, resume, the lock, failures.

    execute(run_dir, stop_on_failure=False, leg_timeout=None, ...) -> {leg: status}

``execute`` holds the run's lock, starts each leg as its own process group that dies with the run,
records which leg process is running, and on resume records what it found (a lock left by a killed
run, an interrupted leg) and refuses to run beside a leg process that is still alive. File names and
leg status: ``workbench.runfolder``. Preparing a run (checks, then its folder): ``workbench.preparing``;
how one leg runs (its ``leg.json``, its command, the runner table): ``workbench.runners``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from workbench import childproc
from workbench.planning import PlannedLeg
from workbench.preparing import preflight_problems, prepare_run, resolve_models
from workbench.runfolder import (FAILURE, LEG_JSON, LEG_LOG, LEGS, RECORDS, RECORDS_PARTIAL, RUN_JSON, STATE_JSON,
                                 SUMMARY, RunFolderError, RunLock, archive_leg, failure_record, leg_status,
                                 process_alive, process_start_ticks, read_json, records_problem, write_failure,
                                 write_json_atomic)
from workbench.runners import (REPO_ROOT, RUNNERS, ProtocolError, Runner, _now, leg_command, leg_config,
                               runner_for)
from workbench.runners import experiment_runner as _experiment_runner

__all__ = ["ProtocolError", "RunInterrupted", "prepare_run", "execute", "resolve_models", "leg_config", "leg_command",
           "preflight_problems", "REPO_ROOT", "Runner", "RUNNERS", "runner_for"]

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
            return proc.wait(timeout=timeout), ""
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return None, f"leg timed out after {timeout:g} s"
        except BaseException:
            _kill_group(proc)
            raise


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
        written_by="workbench.execution",
        partial_records=RECORDS_PARTIAL if (folder / RECORDS_PARTIAL).is_file() else None,
        stderr_tail=_tail(folder / LEG_LOG)))
    return "failed"


# --- a run -------------------------------------------------------------------------------------

def _previous_process(state: dict[str, Any]) -> dict[str, Any] | None:
    lp = state.get("leg_process")
    return lp if isinstance(lp, dict) and lp.get("pid") else None


def execute(run_dir: str | Path, stop_on_failure: bool = False, leg_timeout: float | None = None,
            python: str = sys.executable, log: Callable[[str], None] | None = None,
            only: Iterable[str] | None = None, runner: list[str] | None = None) -> dict[str, str]:
    """Run every planned leg that is not complete yet; returns {leg name: status}.

    Finished legs are skipped, so calling this again resumes. A failed or interrupted leg is moved under
    attempts/ and rerun; its finished prompts are reused when its engine settings match. The run folder
    is locked while this runs; a second writer is refused with the holder's PID and start time.
    """
    rdir = Path(run_dir)
    if not (rdir / RUN_JSON).is_file():
        raise ProtocolError(f"{rdir} is not a prepared run folder ({RUN_JSON} missing)")
    try:
        cfg = read_json(rdir / RUN_JSON)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    legs = [PlannedLeg.from_dict(d) for d in cfg["legs"]]
    wanted = set(only) if only is not None else None
    if wanted is not None:
        unknown = sorted(wanted - {l.name for l in legs})
        if unknown:
            raise ProtocolError(f"unknown leg(s) {unknown} in {rdir}")
    try:
        lock = RunLock(rdir).acquire()
    except RunFolderError as exc:
        raise ProtocolError(str(exc)) from None
    try:
        return _execute_locked(rdir, cfg, legs, wanted, lock, stop_on_failure, leg_timeout, python, log, runner)
    finally:
        lock.release()


def _execute_locked(rdir, cfg, legs, wanted, lock, stop_on_failure, leg_timeout, python, log, runner):
    emit = log or (lambda s: print(s, flush=True))
    old_state: dict[str, Any] = {}
    if (rdir / STATE_JSON).is_file():
        try:
            old_state = read_json(rdir / STATE_JSON) or {}
        except ValueError:
            old_state = {"note": f"{STATE_JSON} was unreadable"}
    prev = _previous_process(old_state)
    if prev and process_alive(prev["pid"], prev.get("start_ticks")):
        raise ProtocolError(f"leg {prev.get('leg')} of an earlier run of {rdir} is still running as PID "
                            f"{prev['pid']} (started {prev.get('started')}); it would skew this run's timing. "
                            f"Stop it first (kill -- -{prev['pid']}) or wait for it")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    from workbench.leg import PARENT_ENV
    env[PARENT_ENV] = str(os.getpid())
    (rdir / LEGS).mkdir(exist_ok=True)
    statuses = {l.name: leg_status(rdir / LEGS / l.name) for l in legs}
    # A leg that says it is complete is trusted only once its records read back whole: a torn line
    # (a crash, a full disk) would otherwise pass here and fail every analysis after. Such a leg is
    # run again; the attempt is kept and its whole records are reused (``leg.json`` resume_from).
    damaged = {}
    for l in legs:
        if statuses[l.name] == "complete" and (wanted is None or l.name in wanted):
            why = records_problem(rdir / LEGS / l.name)
            if why:
                damaged[l.name] = why
                statuses[l.name] = "damaged"
    todo = [l for l in legs if statuses[l.name] != "complete" and (wanted is None or l.name in wanted)]
    history = list(old_state.get("history", []))
    if old_state or damaged:
        found = {"at": _now(), "previous_state": old_state.get("state"),
                 "legs_found": dict(statuses), "to_run": [l.name for l in todo]}
        if damaged:
            found["damaged_legs"] = damaged
        if old_state.get("state") == "running":
            found["note"] = "the previous run stopped without finishing (killed or crashed)"
        if lock.previous:
            found["lock_taken_over_from"] = lock.previous
        if prev:
            found["interrupted_leg"] = dict(prev, alive=False)
        history.append(found)
    state = {"state": "running", "started": _now(), "pid": os.getpid(), "legs": statuses, "history": history,
             "leg_process": None}
    write_json_atomic(rdir / STATE_JSON, state)
    emit(f"{cfg['experiment']} {cfg['run_id']}: {len(legs)} legs, {len(legs) - len(todo)} already complete, "
         f"{len(todo)} to run" + (f", {len(damaged)} damaged ({', '.join(damaged)}: records unreadable, run "
                                  f"again)" if damaged else "")
         + ("" if not history else f" (resumed; {STATE_JSON} records what was found)"))
    for name, why in damaged.items():
        emit(f"  damaged: {why}")
    try:
        with _signals_as_exceptions():
            return _run_legs(rdir, cfg, legs, todo, statuses, state, stop_on_failure, leg_timeout, env, python,
                             runner, emit)
    except RunInterrupted:
        raise  # recorded where it happened
    except BaseException as exc:
        _record_stop(rdir, state, statuses, exc)
        sig = _signum(exc)
        if sig is not None:
            raise RunInterrupted(sig, rdir) from None
        raise


def _signum(exc: BaseException) -> int | None:
    """The signal behind an exception: ours, or Python's own KeyboardInterrupt (SIGINT off the main thread)."""
    if isinstance(exc, _Signalled):
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


class _Signalled(BaseException):
    # raised from the signal handler: a BaseException, so no ``except Exception`` on the way swallows it
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _signals_as_exceptions:
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
        raise _Signalled(signum)

    def __exit__(self, *exc):
        for sig, prev in self.old.items():
            signal.signal(sig, prev)


def _record_stop(rdir: Path, state: dict[str, Any], statuses: dict[str, str], exc: BaseException) -> None:
    """The run stopped by a signal or an error (a full disk): say so in protocol.json where the disk lets us."""
    inflight = state.get("leg_process") or {}
    sig = _signum(exc)
    if sig is not None:
        state.update(state="interrupted", interrupted={"signal": signal.Signals(sig).name, "at": _now(),
                                                       "leg": inflight.get("leg")})
    else:
        state.update(state="error", error=f"{type(exc).__name__}: {exc}", at=_now())
    state.update(legs=statuses, leg_process=None, finished=_now())
    try:
        write_json_atomic(rdir / STATE_JSON, state)
    except OSError:
        pass  # the disk is still full: the error itself is reported by the caller


def _run_legs(rdir, cfg, legs, todo, statuses, state, stop_on_failure, leg_timeout, env, python, runner, emit):
    t_run = time.monotonic()
    durations: list[float] = []
    stopped = False
    for i, leg in enumerate(todo):
        folder = rdir / LEGS / leg.name
        earlier = archive_leg(folder) if folder.exists() else None
        folder.mkdir(parents=True)
        leg_runner = runner_for(leg, cfg.get("runner"))
        conf = leg_runner.leg_json(leg, cfg, rdir, folder, earlier)
        if conf is not None:
            write_json_atomic(folder / LEG_JSON, conf)
        cmd = leg_command(leg, cfg, rdir, python, runner)
        t0 = time.monotonic()

        def started(proc: subprocess.Popen, leg=leg) -> None:
            state["leg_process"] = {"leg": leg.name, "pid": proc.pid, "start_ticks": process_start_ticks(proc.pid),
                                    "started": _now()}
            write_json_atomic(rdir / STATE_JSON, state)

        try:
            rc, why = _run_one(cmd, folder, leg_timeout, env, started)
        except BaseException as exc:
            # the leg's process group is gone (_run_one); its folder gets a failure record
            sig = _signum(exc)
            why = (f"interrupted by {signal.Signals(sig).name} while the leg ran" if sig is not None
                   else f"the run stopped while the leg ran: {type(exc).__name__}: {exc}")
            try:
                statuses[leg.name] = _finalise(folder, leg, None, why)
            except OSError:
                pass  # a full disk: the run's own error says so
            if sig is not None:
                _record_stop(rdir, state, statuses, exc)
                raise RunInterrupted(sig, rdir, leg.name) from None
            raise
        dt = time.monotonic() - t0
        durations.append(dt)
        status = _finalise(folder, leg, rc, why)
        statuses[leg.name] = status
        state.update(legs=statuses, leg_process=None)
        write_json_atomic(rdir / STATE_JSON, state)
        left = len(todo) - i - 1
        eta = (sum(durations) / len(durations)) * left
        msg = (f"[{leg.index + 1}/{len(legs)}] {leg.name:<24} {leg.describe():<40} {status:<8} {dt:6.1f} s"
               f"  elapsed {_fmt_s(time.monotonic() - t_run)}  ETA {_fmt_s(eta) if left else '-'}")
        if status == "failed":
            err = read_json(folder / FAILURE).get("error", "")
            msg += f"\n      failure: {str(err).strip().splitlines()[-1] if str(err).strip() else '?'}" \
                   f" (see {folder / FAILURE})"
        emit(msg)
        if status == "failed" and stop_on_failure:
            stopped = True
            break
    finish = _experiment_runner(cfg.get("runner")).finish
    if finish is not None:
        finish(rdir)
    n_failed = sum(1 for s in statuses.values() if s == "failed")
    final = "stopped" if stopped else ("finished_with_failures" if n_failed else
                                       ("finished" if all(s == "complete" for s in statuses.values())
                                        else "partial"))
    write_json_atomic(rdir / STATE_JSON, dict(state, state=final, legs=statuses, finished=_now()))
    emit(f"{cfg['experiment']} {cfg['run_id']}: {final} in {_fmt_s(time.monotonic() - t_run)} "
         f"({sum(s == 'complete' for s in statuses.values())}/{len(legs)} legs complete)")
    return statuses
