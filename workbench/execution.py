"""Execution: legs as processes, resume, the lock, failures.

    execute(run_dir, stop_on_failure=False, leg_timeout=None, ...) -> {leg: status}

``execute`` holds the run's lock, starts each leg as its own process group that dies with the run,
records which leg process is running, and on resume records what it found (a lock left by a killed
run, an interrupted leg) and refuses to run beside a leg process that is still alive. File names and
leg status: ``workbench.runfolder``. Preparing a run (checks, then its folder): ``workbench.preparing``;
how one leg runs (its ``leg.json``, its command, the runner table): ``workbench.runners``; one leg as a
process (its folder, its process group, its status): ``workbench.legrun``. ``executor="ray"`` runs the
bracket groups as Ray tasks (``workbench.ray_executor``), with the same lock, state and records.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from workbench import hostruns
from workbench.legrun import (RunInterrupted, RunOptions, _fmt_s, clean_shm, failure_line, finish_run, leg_env,
                              run_leg, signals_as_exceptions, signum_of)
from workbench.planning import PlannedLeg
from workbench.preparing import preflight_problems, prepare_run, resolve_models
from workbench.runfolder import (LEGS, RUN_JSON, STATE_JSON, RunFolderError, RunLock, leg_status, process_alive,
                                 process_start_ticks, read_json, records_problem, write_json_atomic)
from workbench.runners import REPO_ROOT, RUNNERS, ProtocolError, Runner, _now, leg_command, leg_config, runner_for

__all__ = ["ProtocolError", "RunInterrupted", "RunOptions", "EXECUTORS", "prepare_run", "execute", "resolve_models",
           "leg_config", "leg_command", "preflight_problems", "REPO_ROOT", "Runner", "RUNNERS", "runner_for"]


def _previous_process(state: dict[str, Any]) -> dict[str, Any] | None:
    lp = state.get("leg_process")
    return lp if isinstance(lp, dict) and lp.get("pid") else None


EXECUTORS = ("local", "ray")


def execute(run_dir: str | Path, stop_on_failure: bool = False, leg_timeout: float | None = None,
            python: str = sys.executable, log: Callable[[str], None] | None = None,
            only: Iterable[str] | None = None, runner: list[str] | None = None, executor: str = "local",
            address: str | None = None, gpus: int | None = None, allow_shared_host: bool = False) -> dict[str, str]:
    """Run every planned leg that is not complete yet; returns {leg name: status}.

    Finished legs are skipped, so calling this again resumes. A failed or interrupted leg is moved under
    attempts/ and rerun; its finished prompts are reused when its engine settings match. The run folder
    is locked while this runs; a second writer is refused with the holder's PID and start time.
    ``executor="ray"``: the bracket groups run as Ray tasks (``workbench.ray_executor``; docs/ray.md).
    Another run active on this host (``workbench.hostruns``) is a warning on a CPU and a refusal on a GPU
    it may share, unless ``allow_shared_host``; either way protocol.json records it (``shared_host``).
    """
    if executor not in EXECUTORS:
        raise ProtocolError(f"unknown executor {executor!r}; executors: {', '.join(EXECUTORS)}")
    if executor == "ray":
        from workbench.ray_executor import require_ray
        require_ray()  # before the lock: a host without ray is told how to get it, nothing is touched
    if leg_timeout is not None and not 0 < float(leg_timeout) < float("inf"):
        raise ProtocolError(f"leg_timeout must be a finite number of seconds above 0, got {leg_timeout!r}")
    opts = RunOptions(stop_on_failure, leg_timeout, python, runner, executor, address, gpus, allow_shared_host)
    # absolute: a leg runs in the repository (paths in run.json are relative to it), whatever folder the run
    # was started from, so a run folder named relative to that folder (`--results results`) is found there too
    rdir = Path(run_dir).resolve()
    if not (rdir / RUN_JSON).is_file():
        raise ProtocolError(f"{run_dir} is not a prepared run folder ({RUN_JSON} missing)")
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
        return _execute_locked(rdir, cfg, legs, wanted, lock, opts, log)
    finally:
        lock.release()


def _execute_locked(rdir, cfg, legs, wanted, lock, opts: RunOptions, log):
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
    beside = shared_host_check(rdir, cfg, opts.executor, opts.allow_shared_host, log)  # a refusal raises here
    (rdir / LEGS).mkdir(exist_ok=True)
    shm_removed = clean_shm(rdir)  # what a leg killed with -9 (its run with it) left in /dev/shm
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
        if shm_removed:
            found["shm_removed"] = shm_removed
        history.append(found)
    state = {"state": "running", "started": _now(), "pid": os.getpid(), "legs": statuses, "history": history,
             "leg_process": None, "executor": {"name": opts.executor}}
    if old_state.get("shared_host"):  # the legs of an earlier attempt ran beside them
        state["shared_host"] = list(old_state["shared_host"])
    hostruns.note_seen(state, beside, None)
    write_json_atomic(rdir / STATE_JSON, state)
    registration = hostruns.Registration(rdir, cfg).add()  # the other runs of the host see this one
    emit(f"{cfg['experiment']} {cfg['run_id']}: {len(legs)} legs, {len(legs) - len(todo)} already complete, "
         f"{len(todo)} to run" + (f", {len(damaged)} damaged ({', '.join(damaged)}: records unreadable, run "
                                  f"again)" if damaged else "")
         + ("" if not history else f" (resumed; {STATE_JSON} records what was found)"))
    for name, why in damaged.items():
        emit(f"  damaged: {why}")
    try:
        with signals_as_exceptions():
            if opts.executor == "ray":
                from workbench.ray_executor import run_groups
                return run_groups(rdir, cfg, legs, todo, statuses, state, opts, emit)
            return _run_legs(rdir, cfg, legs, todo, statuses, state, opts, emit)
    except RunInterrupted:
        raise  # recorded where it happened
    except BaseException as exc:
        _record_stop(rdir, state, statuses, exc)
        sig = signum_of(exc)
        if sig is not None:
            raise RunInterrupted(sig, rdir) from None
        raise
    finally:
        registration.remove()


def shared_host_check(rdir: Path, cfg: dict[str, Any], executor: str, allow: bool,
                      log: Callable[[str], None] | None = None) -> list[hostruns.OtherRun]:
    """The other runs active on this host (``workbench.hostruns``): a ProtocolError when this run may share
    a GPU with one of them and ``allow`` is False; else a warning naming each (stderr, or ``log``)."""
    found = hostruns.others(rdir)
    if not found:
        return []
    from workbench import placement

    refusal, lines = hostruns.decide(found, cfg.get("device"), placement.capture(executor), allow)
    if refusal:
        raise ProtocolError(f"{rdir} not started: {refusal}")
    for line in lines:
        (log or (lambda s: print(s, file=sys.stderr, flush=True)))(line)
    return found


def _note_beside(rdir: Path, state: dict[str, Any], leg: str, emit: Callable[[str], None]) -> None:
    """Before and after each leg: a run that started meanwhile on this host is recorded against the leg."""
    new = hostruns.note_seen(state, hostruns.others(rdir), leg)
    for o in new:
        emit(f"warning: another run started on this host; the timings of both runs are disturbed: "
             f"{hostruns.describe(o)}")
    if state.get("shared_host"):
        write_json_atomic(rdir / STATE_JSON, state)




def _record_stop(rdir: Path, state: dict[str, Any], statuses: dict[str, str], exc: BaseException) -> None:
    """The run stopped by a signal or an error (a full disk): say so in protocol.json where the disk lets us."""
    inflight = state.get("leg_process") or {}
    sig = signum_of(exc)
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



def _run_legs(rdir, cfg, legs, todo, statuses, state, opts: RunOptions, emit):
    from workbench import placement

    t_run = time.monotonic()
    durations: list[float] = []
    stopped = False
    env = leg_env()
    where = placement.capture("local")
    state["placement"] = where
    for i, leg in enumerate(todo):
        def started(proc: subprocess.Popen, leg=leg) -> None:
            state["leg_process"] = {"leg": leg.name, "pid": proc.pid, "start_ticks": process_start_ticks(proc.pid),
                                    "started": _now()}
            write_json_atomic(rdir / STATE_JSON, state)

        _note_beside(rdir, state, leg.name, emit)
        try:
            status, dt = run_leg(rdir, cfg, leg, where, env, opts, started)
        except BaseException as exc:
            statuses[leg.name] = leg_status(rdir / LEGS / leg.name)
            sig = signum_of(exc)
            if sig is not None:
                _record_stop(rdir, state, statuses, exc)
                raise RunInterrupted(sig, rdir, leg.name) from None
            raise
        durations.append(dt)
        statuses[leg.name] = status
        state.update(legs=statuses, leg_process=None)
        _note_beside(rdir, state, leg.name, emit)
        write_json_atomic(rdir / STATE_JSON, state)
        left = len(todo) - i - 1
        eta = (sum(durations) / len(durations)) * left
        msg = (f"[{leg.index + 1}/{len(legs)}] {leg.name:<24} {leg.describe():<40} {status:<8} {dt:6.1f} s"
               f"  elapsed {_fmt_s(time.monotonic() - t_run)}  ETA {_fmt_s(eta) if left else '-'}")
        emit(msg + (failure_line(rdir / LEGS / leg.name) if status == "failed" else ""))
        if status == "failed" and opts.stop_on_failure:
            stopped = True
            break
    return finish_run(rdir, cfg, legs, statuses, state, stopped, t_run, emit)


