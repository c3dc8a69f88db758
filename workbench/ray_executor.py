"""The Ray executor: each bracket group of a run is one Ray task holding a GPU set of its own.

    workbench run EXP --executor ray [--address auto|HOST:PORT] [--gpus N]

The driver (the ``workbench run`` process) holds the run's lock and is the one writer of ``run.json``
and ``protocol.json``; it submits one task per unfinished bracket group (``workbench.groups``) with
``num_gpus`` = the group's tensor-parallel size, and Ray runs the groups as its GPUs allow. A task
runs its group's legs in run order on its node, into the shared run folder, by the same function the
local executor uses (``execution.run_leg``: ``leg.json``, ``placement.json``, the leg's process
behind the parent-death trampoline, ``failure.json`` where the leg could not write one). A task
writes only inside its own group's leg folders; so the run folder must be on a file system every
node sees at the same path (docs/ray.md).

A task that dies (its worker killed, its node lost) fails its group: the driver writes
``failure.json`` into each of the group's legs that is not complete, naming the node, while the
other groups go on. With no ``--address`` the run starts a local Ray instance (``--gpus`` logical
GPUs; on a CPU host that is how groups are rehearsed side by side) and stops it when it ends.
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from workbench import childproc, placement
from workbench.legrun import (RunOptions, Signalled, _fmt_s, failure_line, finish_run, leg_env, run_leg,
                              signum_of)
from workbench.groups import BracketGroup, bracket_groups
from workbench.planning import PlannedLeg
from workbench.runfolder import (LEGS, PLACEMENT, RUN_JSON, STATE_JSON, archive_leg, failure_record, leg_status,
                                 read_json, write_failure, write_json_atomic)
from workbench.runners import REPO_ROOT, ProtocolError, _now

__all__ = ["require_ray", "run_groups", "group_task", "RAY_VERSION"]

RAY_VERSION = "2.60.0"  # the version pyproject's [ray] extra and scripts/setup_env.sh install


def require_ray():
    """The ``ray`` module, or a ProtocolError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ProtocolError(f"--executor ray needs the ray package, which is not installed here: "
                            f"pip install '.[ray]' (ray=={RAY_VERSION}), or scripts/setup_env.sh") from None
    return ray


# --- the task: one group on one node ------------------------------------------------------------

def _completed_elsewhere(rdir: Path, done: list[str], here: str | None) -> list[str]:
    """The group's finished legs that ran on another device than this task's (a bracket is on one GPU)."""
    out = []
    for name in done:
        try:
            key = placement.placement_key(read_json(rdir / LEGS / name / PLACEMENT))
        except (OSError, ValueError):
            key = None
        if key is not None and here is not None and key != here:
            out.append(name)
    return out


def _as_nice_as(driver_nice: int | None) -> int:
    """Bring this task's niceness back to the driver's where Ray started the worker nicer (Ray's default is
    15 steps above its raylet's). Lowering it needs CAP_SYS_NICE on a cluster started without
    ``RAY_worker_niceness=0``; where that is refused the legs keep Ray's and ``placement.json`` says so.
    Returns the niceness Ray gave the worker."""
    given = placement.niceness()
    if driver_nice is not None and given > driver_nice:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, driver_nice)
        except OSError:
            pass
    return given


def group_task(run_dir: str, cfg: dict[str, Any], group: dict[str, Any], todo: list[str], opts: RunOptions,
               token: str, driver_omp: str | None, driver_nice: int | None = None) -> dict[str, Any]:
    """Run one bracket group's unfinished legs in order (a Ray task; also callable as a plain function).

    When the group's finished legs ran on another device than this task's, the whole group runs again
    here (those legs moved under attempts/): a bracket's legs are always on one placement. The legs run
    at the driver's niceness where this process may take it (``_as_nice_as``)."""
    import ray

    rdir = Path(run_dir)
    given = _as_nice_as(driver_nice)
    where = placement.capture("ray", group=group["group"], node_id=ray.get_runtime_context().get_node_id())
    where.update(token=token, niceness_from_ray=given)
    if not (rdir / RUN_JSON).is_file():
        raise ProtocolError(f"run folder {rdir} is not visible on node {where['host']}: the Ray executor needs "
                            "the results folder on a file system every node sees at the same path")
    legs = [PlannedLeg.from_dict(d) for d in cfg["legs"] if d["name"] in group["legs"]]
    done = [l.name for l in legs if l.name not in todo]
    moved = _completed_elsewhere(rdir, done, placement.placement_key(where))
    if moved:
        for name in done:
            archive_leg(rdir / LEGS / name)
        todo = [l.name for l in legs]
    opts = dataclasses.replace(opts, python=sys.executable)  # this node's interpreter, not the driver's path
    env = leg_env()
    if driver_omp is None:
        env.pop("OMP_NUM_THREADS", None)  # set by Ray for its workers, not by whoever started the run
    else:
        env["OMP_NUM_THREADS"] = driver_omp
    statuses, seconds = {}, {}
    for leg in legs:
        if leg.name in todo:
            statuses[leg.name], seconds[leg.name] = run_leg(rdir, cfg, leg, where, env, opts, lambda proc: None)
    return {"statuses": statuses, "seconds": seconds, "placement": where, "moved": moved}


# --- the driver ---------------------------------------------------------------------------------

def _start_ray(ray, address: str | None, gpus: int | None) -> subprocess.Popen | None:
    """Connect to ``address``, or start a local instance; for a local one, the reaper that stops its
    processes (and everything under them) if this run dies without ``ray.shutdown`` (``workbench.reaper``)."""
    if address:
        ray.init(address=address, log_to_driver=False, include_dashboard=False)
        return None
    if gpus is None:
        probe = placement.gpu_probe()
        gpus = max(1, len(probe["gpus"]) if probe else 0)
    before = set(_own_children())
    # Kept small: the tasks hold GPUs, not CPUs, and nothing large goes through the object store.
    # address="local": always an instance of this run's own, never a cluster `ray start` left on the host
    # worker_niceness 0: the workers (and the legs they start) as nice as this driver, not Ray's default 15
    ray.init(address="local", num_cpus=1, num_gpus=gpus, include_dashboard=False, log_to_driver=False,
             object_store_memory=80 * 2**20, _system_config={"worker_niceness": 0})
    roots = [str(p) for p in _own_children() if p not in before]
    return subprocess.Popen(childproc.wrap(os.getpid(), [sys.executable, "-m", "workbench.reaper", *roots]),
                            env=leg_env(), cwd=str(REPO_ROOT), start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


class _deferred_signals:
    """While the driver waits on Ray, SIGINT / SIGTERM are noted in ``caught`` and raised by the loop
    (an exception raised inside Ray's wait comes out mangled as a SystemError)."""

    def __init__(self, caught: list[int]):
        self.caught, self.old = caught, {}

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                prev = signal.getsignal(sig)
                if prev not in (signal.SIG_IGN, None):
                    self.old[sig] = prev
                    signal.signal(sig, lambda signum, frame: self.caught.append(signum))
        return self

    def __exit__(self, *exc):
        for sig, prev in self.old.items():
            # once stopping, a second Ctrl-C must not cut the groups' cancellation short
            signal.signal(sig, signal.SIG_IGN if self.caught else prev)


def _keeping_signal_handlers(start: Callable[[], Any]) -> Any:
    """``start()`` with the run's SIGINT / SIGTERM handlers put back after it: ``ray.init`` installs its own,
    which would exit without recording the stop (``legrun.signals_as_exceptions``)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return start()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return start()
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def _own_children() -> list[int]:
    from workbench.reaper import children_of

    return children_of(os.getpid())


def _stop_ray(ray, reaper: subprocess.Popen | None) -> None:
    ray.shutdown()
    if reaper is not None:  # what ray.shutdown left of the local instance goes now
        reaper.terminate()
        try:
            reaper.wait(timeout=30)
        except subprocess.TimeoutExpired:
            reaper.kill()
            reaper.wait()


def _where_text(where: dict[str, Any] | None) -> str:
    if not where:
        return "(placement not known)"
    node = f" (node {where['node_id'][:12]})" if where.get("node_id") else ""
    if where.get("gpus"):
        gpus = ", ".join(f"GPU {g['index']} {g['uuid']}" for g in where["gpus"])
    else:
        vis = where.get("cuda_visible_devices")
        gpus = "cpu" + (f" (logical GPU {vis})" if vis else "")
    return f"{where['host']}{node} {gpus}"


class _Board:
    """The driver's view of the groups: protocol.json's ``groups``, the progress lines, the ETA."""

    def __init__(self, rdir: Path, state: dict[str, Any], groups: list[BracketGroup], pending: list[BracketGroup],
                 token: str, emit: Callable[[str], None]):
        self.rdir, self.state, self.token, self.emit = rdir, state, token, emit
        self.n = len(groups)
        self.rows = {g.index: dict(g.to_dict(), status="pending" if g in pending else "complete",
                                   placement=None) for g in groups}
        state["groups"] = list(self.rows.values())
        self.t0 = time.monotonic()
        self.started: dict[int, float] = {}
        self.durations: list[float] = []
        self.left = len(pending)
        self.most_at_once = 1

    def save(self) -> None:
        write_json_atomic(self.rdir / STATE_JSON, self.state)

    def poll_starts(self, running: list[BracketGroup], todo: set[str]) -> None:
        """A task announces itself by the placement.json it writes into its group's first leg to run."""
        for g in running:
            if g.index in self.started:
                continue
            first = next((n for n in g.legs if n in todo), g.legs[0])
            try:
                where = read_json(self.rdir / LEGS / first / PLACEMENT)
            except (OSError, ValueError):
                continue
            if isinstance(where, dict) and where.get("token") == self.token:
                self.start(g, where)

    def start(self, g: BracketGroup, where: dict[str, Any]) -> None:
        self.started[g.index] = time.monotonic()
        self.most_at_once = max(self.most_at_once, len(self.started) - len(self.durations))
        self.rows[g.index].update(status="running", placement=where, started=_now())
        self.save()
        self.emit(f"group {g.index + 1}/{self.n} started on {_where_text(where)}: {', '.join(g.legs)}")
        nice, mine = where.get("niceness"), placement.niceness()
        if isinstance(nice, int) and nice > mine:
            self.emit(f"  warning: group {g.index + 1}'s legs run at niceness {nice}, this driver at {mine}: on a "
                      f"busy host their timings lose against a local run's; start the cluster's nodes with "
                      f"RAY_worker_niceness=0 (docs/ray.md)")

    def finish(self, g: BracketGroup, statuses: dict[str, str], where: dict[str, Any] | None,
               error: str | None) -> None:
        dt = time.monotonic() - self.started.get(g.index, self.t0)
        self.durations.append(dt)
        self.left -= 1
        ok = sum(statuses.get(n) == "complete" for n in g.legs)
        row = self.rows[g.index]
        row.update(status="complete" if ok == len(g.legs) else "failed", finished=_now(), elapsed_s=round(dt, 1))
        if where:
            row["placement"] = where
        if error:
            row["error"] = error
        self.save()
        eta = (sum(self.durations) / len(self.durations)) * math.ceil(self.left / self.most_at_once)
        msg = (f"group {g.index + 1}/{self.n} finished on {_where_text(row['placement'])}: {ok}/{len(g.legs)} legs "
               f"complete in {_fmt_s(dt)}  elapsed {_fmt_s(time.monotonic() - self.t0)}  "
               f"ETA {_fmt_s(eta) if self.left else '-'}")
        for n in g.legs:
            if statuses.get(n) == "failed":
                msg += f"\n  {n}:" + failure_line(self.rdir / LEGS / n).replace("\n      ", " ")
        self.emit(msg)


def _fail_group(rdir: Path, g: BracketGroup, why: str, where: dict[str, Any] | None) -> None:
    """``failure.json`` in each leg of ``g`` that is not complete, naming the node; finished legs stay."""
    node = _where_text(where) if where else "a node that never reported (the task did not start its first leg)"
    for name in g.legs:
        folder = rdir / LEGS / name
        if leg_status(folder) in ("complete", "failed"):
            continue
        write_failure(folder, failure_record(error=f"{why}; the group's task ran on {node}", leg=name,
                                             group=g.index, node=(where or {}).get("host"),
                                             node_id=(where or {}).get("node_id"),
                                             written_by="workbench.ray_executor"))


def _settle(ray, rdir: Path, g: BracketGroup, ref, board: _Board, statuses: dict[str, str]) -> bool:
    """A finished task's outcome into its legs and the board; True when a leg of the group failed."""
    try:
        res, error = ray.get(ref), None
    except ray.exceptions.RayError as exc:
        res = None
        text = [line for line in str(exc).strip().splitlines() if line.strip()]
        error = f"the group's Ray task died: {type(exc).__name__}: {text[-1] if text else ''}"[:2000]
    where = (res or {}).get("placement") or board.rows[g.index].get("placement")
    if res is None:
        _fail_group(rdir, g, error, where)
    elif res.get("moved"):
        board.emit(f"group {g.index + 1}/{board.n}: its finished legs {', '.join(res['moved'])} ran on another "
                   f"device; the whole group ran again here (earlier attempts under attempts/)")
    for name in g.legs:
        statuses[name] = leg_status(rdir / LEGS / name)
    board.state["legs"] = statuses
    if g.index not in board.started and where:
        board.start(g, where)
    board.finish(g, statuses, where, error)
    return any(statuses[n] != "complete" for n in g.legs)


def run_groups(rdir: Path, cfg: dict[str, Any], legs: list[PlannedLeg], todo: list[PlannedLeg],
               statuses: dict[str, str], state: dict[str, Any], opts: RunOptions,
               emit: Callable[[str], None]) -> dict[str, str]:
    """The run's unfinished bracket groups as Ray tasks; legs and protocol.json as the local executor has them."""
    ray = require_ray()
    t_run = time.monotonic()
    names = {l.name for l in todo}
    groups = bracket_groups(legs)
    pending = [g for g in groups if any(n in names for n in g.legs)]
    token = secrets.token_hex(8)
    board = _Board(rdir, state, groups, pending, token, emit)
    t_start = time.monotonic()
    reaper = _keeping_signal_handlers(lambda: _start_ray(ray, opts.address, opts.gpus))
    state["executor"] = {"name": "ray", "address": opts.address or "local instance", "ray": ray.__version__,
                         "start_s": round(time.monotonic() - t_start, 2),
                         "cluster": {k: v for k, v in ray.cluster_resources().items() if k in ("GPU", "CPU")}}
    board.save()
    refs: dict[Any, BracketGroup] = {}
    stopped = False
    try:
        have = ray.cluster_resources().get("GPU", 0)
        too_big = [g for g in pending if g.tp > have]
        if too_big:
            raise ProtocolError(f"group(s) {[g.index + 1 for g in too_big]} need {max(g.tp for g in too_big)} GPUs "
                                f"each (tensor_parallel_size); the Ray cluster has {have:g}")
        task = ray.remote(num_cpus=0, max_retries=0)(group_task)
        emit(f"{len(pending)} bracket group(s) to run on Ray ({state['executor']['address']}, "
             f"{have:g} GPU(s)); {len(groups) - len(pending)} already complete")
        for g in pending:
            todo_g = [n for n in g.legs if n in names]
            refs[task.options(num_gpus=g.tp, name=f"{cfg['experiment']}-group{g.index + 1}").remote(
                str(rdir), cfg, g.to_dict(), todo_g, opts, token, os.environ.get("OMP_NUM_THREADS"),
                placement.niceness())] = g
        caught: list[int] = []
        with _deferred_signals(caught):
            while refs:
                ready, _ = ray.wait(list(refs), num_returns=1, timeout=0.5)
                if caught:
                    raise Signalled(caught[0])
                board.poll_starts(list(refs.values()), names)
                for ref in ready:
                    failed = _settle(ray, rdir, refs.pop(ref), ref, board, statuses)
                    if failed and opts.stop_on_failure and refs:
                        stopped = True
                        _cancel(ray, rdir, refs, board, statuses,
                                "cancelled: another group failed (--stop-on-failure)")
    except BaseException as exc:
        sig = signum_of(exc)
        _cancel(ray, rdir, refs, board, statuses,
                f"interrupted by {signal.Signals(sig).name} while the group ran" if sig is not None
                else f"the run stopped while the group ran: {type(exc).__name__}: {exc}")
        raise
    finally:
        _stop_ray(ray, reaper)
    return finish_run(rdir, cfg, legs, statuses, state, stopped, t_run, emit)


def _cancel(ray, rdir: Path, refs: dict, board: _Board, statuses: dict[str, str], why: str) -> None:
    """Stop the groups still running, then fail them. First as Ctrl-C in the task (its leg's process group is
    taken down and the leg gets its failure record, as a local run does); a task still running after that
    loses its worker (and, through the parent-death signal, its leg)."""
    for force in (False, True):
        for ref in list(refs):
            try:
                ray.cancel(ref, force=force)
            except Exception:  # the task finished meanwhile; its outcome is settled below all the same
                pass
        if refs and not ray.wait(list(refs), num_returns=len(refs), timeout=10 if not force else 20)[1]:
            break
    for ref, g in list(refs.items()):
        refs.pop(ref)
        _fail_group(rdir, g, why, board.rows[g.index].get("placement"))
        for name in g.legs:
            statuses[name] = leg_status(rdir / LEGS / name)
        board.rows[g.index].update(status="failed", error=why)
    board.state["legs"] = statuses
    try:
        board.save()
    except OSError:
        pass
