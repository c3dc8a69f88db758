"""Start a command that dies with the process that started it.

    python -m workbench.childproc PARENT_PID -- COMMAND [ARGS...]

Asks the kernel for SIGTERM when PARENT_PID's thread dies (``prctl(PR_SET_PDEATHSIG)``, which
survives ``exec``), checks the parent did not die before that, then replaces itself with COMMAND.
Done in a separate program rather than in ``subprocess``'s ``preexec_fn``, which is not safe in a
process with threads (the protocol may run legs from several threads at once).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """True when the kernel will send ``sig`` to this process once its parent dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def wrap(parent: int, cmd: list[str]) -> list[str]:
    """``cmd`` behind this trampoline."""
    return [sys.executable, "-m", "workbench.childproc", str(parent), "--", *cmd]


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m workbench.childproc PARENT_PID -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    parent = int(argv[0])
    set_parent_death_signal()
    if os.getppid() != parent:  # the parent died before the signal was armed
        return 1
    os.execvp(argv[2], argv[2:])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
