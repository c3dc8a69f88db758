"""What a leg's engine leaves in ``/dev/shm`` and in vLLM's socket folder, removed when the leg ends (or on
resume after a kill -9).

    snapshot(leg_folder)      before the leg starts: the names in /dev/shm and the socket folder ->
                              leg_folder/shm-before.json
    clean_after(leg_folder)   after it ended: remove its leftovers, drop the snapshot; returns the names removed

vLLM and Python's multiprocessing name their segments ``psm_*`` (shared_memory), ``sem.mp-*`` (semaphores)
and ``*-cpushm`` (vLLM's CPU shared-memory communicator at tensor_parallel_size > 1, a pair of 4 MiB
files). A process killed with -9 never unlinks them, and the CPU communicator's pairs outlive even a leg
that ends normally, so /dev/shm fills over many legs. A leftover is an entry that

* was not there when the leg started (the snapshot, kept in the leg's folder so a resume after a kill -9
  still knows it),
* has one of those names and belongs to this user,
* and no live process maps or holds open (``/proc/<pid>/maps`` and ``/proc/<pid>/fd``): another run's
  segments that are in use are never touched.

vLLM's processes talk over ZeroMQ ``ipc://`` sockets, files named by a UUID in ``VLLM_RPC_BASE_PATH`` (the
temp folder by default); a process killed with -9 leaves them, and a host that runs many legs collects
thousands. A leftover socket is a UUID-named socket file new since the snapshot, this user's, that no live
process has bound (``/proc/net/unix``).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import stat
import tempfile
from pathlib import Path

from workbench.runfolder import write_json_atomic

__all__ = ["SHM", "SNAPSHOT", "PATTERNS", "shm_root", "entries", "in_use", "leftovers", "ipc_root", "ipc_entries",
           "bound_sockets", "ipc_leftovers", "clean_shm", "clean_ipc", "snapshot", "clean_after"]

SHM = Path("/dev/shm")
ROOT_ENV = "WORKBENCH_SHM_ROOT"  # another folder in place of /dev/shm (the suite's kill test: see shm_root)
SNAPSHOT = "shm-before.json"
PATTERNS = ("psm_*", "sem.mp-*", "*cpushm*")
IPC_ENV = "VLLM_RPC_BASE_PATH"  # where vLLM puts its ipc:// sockets (vllm.utils.network_utils)
UUID_NAME = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def shm_root() -> Path:
    """``/dev/shm``, or the folder ``WORKBENCH_SHM_ROOT`` names (read at each call). The suite's kill test
    plants its leftovers in a folder of its own: in /dev/shm another leg's cleanup on the same host (a second
    test worker) may remove them, as garbage, between the kill and the resume the test checks."""
    return Path(os.environ.get(ROOT_ENV) or SHM)


def entries(root: Path = SHM) -> set[str]:
    try:
        return {p.name for p in root.iterdir()}
    except OSError:  # no /dev/shm (not Linux): nothing to clean
        return set()


def in_use(root: Path = SHM) -> set[int]:
    """Inodes under ``root`` that a live process maps or holds open.

    By inode, not by name: glibc creates a named semaphore under a temporary name, maps it and links it to
    its final name (``sem.mp-*``), so the maps of the processes using it show the temporary name, deleted;
    the inode is the same file's."""
    prefix = str(root).rstrip("/") + "/"
    used: set[int] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for line in (proc / "maps").read_text().splitlines():
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith(prefix):
                    used.add(int(parts[4]))
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd).startswith(prefix):
                    used.add(os.stat(fd).st_ino)
        except (OSError, ValueError):  # the process ended meanwhile, or is not ours to read
            continue
    return used


def leftovers(before: set[str], root: Path = SHM) -> list[str]:
    """Entries new since ``before`` that vLLM's or multiprocessing's naming marks, owned by this user and
    used by no live process."""
    new = [n for n in sorted(entries(root) - before) if any(fnmatch.fnmatch(n, p) for p in PATTERNS)]
    if not new:
        return []
    uid = os.getuid()
    mine = {}
    for n in new:
        try:
            st = (root / n).lstat()
        except OSError:
            continue
        if st.st_uid == uid:
            mine[n] = st.st_ino
    used = in_use(root) if mine else set()
    return [n for n, ino in mine.items() if ino not in used]


def ipc_root() -> Path:
    """The folder vLLM names its ``ipc://`` sockets in: ``VLLM_RPC_BASE_PATH``, else the temp folder."""
    return Path(os.environ.get(IPC_ENV) or tempfile.gettempdir())


def ipc_entries(root: Path) -> set[str]:
    """The UUID-named entries of ``root`` (vLLM's socket names; what else is there is never looked at)."""
    try:
        return {n for n in os.listdir(root) if UUID_NAME.fullmatch(n)}
    except OSError:
        return set()


def bound_sockets() -> set[str]:
    """The paths of the Unix sockets a live process has bound (``/proc/net/unix``, this network namespace)."""
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return set()
    return {parts[7] for parts in (line.split(None, 7) for line in lines) if len(parts) == 8}


def ipc_leftovers(before: set[str], root: Path) -> list[str]:
    """UUID-named sockets new since ``before``, owned by this user, that no live process has bound."""
    new = sorted(ipc_entries(root) - before)
    if not new:
        return []
    uid, bound, out = os.getuid(), bound_sockets(), []
    for n in new:
        try:
            st = (root / n).lstat()
        except OSError:
            continue
        if stat.S_ISSOCK(st.st_mode) and st.st_uid == uid and str(root / n) not in bound:
            out.append(n)
    return out


def snapshot(leg_folder: str | Path, root: Path | None = None) -> None:
    """Record what /dev/shm and the socket folder hold before the leg's engine starts (in the leg's folder,
    for a resume)."""
    root, ipc = root or shm_root(), ipc_root()
    write_json_atomic(Path(leg_folder) / SNAPSHOT, {"root": str(root), "names": sorted(entries(root)),
                                                    "ipc_root": str(ipc), "ipc_names": sorted(ipc_entries(ipc))})


def _remove(root: Path, names: list[str]) -> list[str]:
    removed = []
    for n in names:
        try:
            (root / n).unlink()
            removed.append(n)
        except OSError:
            pass
    return removed


def clean_shm(before: set[str], root: Path = SHM) -> list[str]:
    """Remove the /dev/shm leftovers new since ``before`` (:func:`leftovers`); returns the names removed."""
    return _remove(root, leftovers(before, root))


def clean_ipc(before: set[str], root: Path) -> list[str]:
    """Remove the leftover sockets of ``root`` new since ``before`` (``ipc_leftovers``); returns their names."""
    return _remove(root, ipc_leftovers(before, root))


def clean_after(leg_folder: str | Path) -> list[str]:
    """Remove what the leg left in /dev/shm and the socket folder (its processes are gone); returns the names
    removed."""
    path = Path(leg_folder) / SNAPSHOT
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    root = Path(data.get("root") or shm_root())
    removed = clean_shm(set(data.get("names") or []), root)
    if "ipc_root" in data:  # snapshots written before sockets were cleaned have none
        removed += clean_ipc(set(data.get("ipc_names") or []), Path(data["ipc_root"]))
    path.unlink(missing_ok=True)
    return removed
