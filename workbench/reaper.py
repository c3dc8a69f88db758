"""Stop a process tree when the process that owns it dies, however it dies.

    python -m workbench.reaper ROOT_PID [ROOT_PID ...]      (started behind ``workbench.childproc``)

A local Ray instance's own processes (GCS server, raylet, its agents) are children of the run
that started it, and some of them outlive a run killed with -9. This watcher is started by that
run behind the parent-death trampoline: every second it notes the processes under the given roots
(PID and start time, so a reused PID is never touched); when the run dies (the kernel's parent-death
SIGTERM) or asks it to stop, it sends SIGTERM, then SIGKILL, to those still alive, and exits.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from workbench.runfolder import process_start_ticks

POLL_S = 1.0


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as fh:
                ppid = int(fh.read().rsplit(")", 1)[-1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out.setdefault(ppid, []).append(int(name))
    return out


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` now."""
    return _children().get(pid, [])


def tree(roots: list[int]) -> dict[int, int | None]:
    """PID -> start ticks of the roots and every process under them now (this process left out)."""
    kids = _children()
    seen: dict[int, int | None] = {}
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid in seen or pid == os.getpid():
            continue
        ticks = process_start_ticks(pid)
        if ticks is None:
            continue
        seen[pid] = ticks
        todo += kids.get(pid, [])
    return seen


def _session_members(leaders: set[int]) -> dict[int, int | None]:
    """Processes in the sessions these PIDs led (a leg's engine processes stay in the leg's session even
    when the leg was killed first and they were handed to init)."""
    out: dict[int, int | None] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as fh:
                sid = int(fh.read().rsplit(")", 1)[-1].split()[3])
        except (OSError, ValueError, IndexError):
            continue
        if sid in leaders and int(name) != os.getpid():
            out[int(name)] = process_start_ticks(int(name))
    return out


def reap(known: dict[int, int | None], grace_s: float = 5.0) -> None:
    """SIGTERM to each known process still alive (same start time) and to the sessions known processes led,
    SIGKILL to those left after ``grace_s``."""
    for pid, ticks in _session_members(set(known)).items():
        known.setdefault(pid, ticks)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p, t in known.items() if t is not None and process_start_ticks(p) == t]
        for pid in alive:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if process_start_ticks(p) == known[p]]
            time.sleep(0.1)


def _grow(known: dict[int, int | None]) -> None:
    """Add the processes now under the known ones that are still the same processes (a reused PID is not)."""
    alive = [p for p, t in known.items() if process_start_ticks(p) == t]
    for pid, ticks in tree(alive).items():
        known.setdefault(pid, ticks)


class _Stop(Exception):
    pass


def main(argv: list[str]) -> int:
    known = tree([int(a) for a in argv])

    def stop(signum, frame):
        raise _Stop

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the run's to handle; it stops this after
    try:
        while True:
            _grow(known)
            time.sleep(POLL_S)
    except _Stop:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _grow(known)
        reap(known)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
