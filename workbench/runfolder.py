"""The run-folder contract: file names, leg status, atomic writes, the run lock.

Both the writers (``workbench.leg``, ``workbench.execution``) and the reader
(``workbench.results``) use this module, so a file name or the meaning of
"complete" is defined once.

    results/<experiment>/<run id>/
      run.json  env.json  prompts.jsonl  protocol.json  run.lock
      legs/<leg>/  leg.json  placement.json  records.jsonl | records.jsonl.partial  summary.json | failure.json  leg.log
                   (a cost-ladder leg, ``runner: ladder`` in its summary: steps.jsonl + walls.jsonl, no records)
      steps.jsonl  walls.jsonl   cost-ladder runs only: every complete leg's rows, in run order
      attempts/<leg>.<k>/   earlier attempts of a leg (failed, interrupted, or replaced with --force)
      tables/  figures/  notebook.ipynb
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import socket
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

RUN_JSON = "run.json"
ENV_JSON = "env.json"
STATE_JSON = "protocol.json"
PROMPTS = "prompts.jsonl"
LOCK = "run.lock"
LEGS = "legs"
ATTEMPTS = "attempts"

LEG_JSON = "leg.json"
RECORDS = "records.jsonl"
RECORDS_PARTIAL = "records.jsonl.partial"
SUMMARY = "summary.json"
FAILURE = "failure.json"
LEG_LOG = "leg.log"
# Where a leg ran (node, GPUs, driver and CUDA versions): written before its process starts (``workbench.placement``).
PLACEMENT = "placement.json"
# Inside a run folder being built (``.<run id>.preparing``): who builds it, so a killed preparation's
# leftovers can be told from one in progress.
PREPARER = "preparer.json"
PREPARING_SUFFIX = ".preparing"
# A cost-ladder leg (``workbench.ladder_engine``) has timed engine steps instead of per-prompt records.
LADDER_STEPS = "steps.jsonl"
LADDER_WALLS = "walls.jsonl"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=-]*$")


class RunFolderError(RuntimeError):
    """The run folder cannot be used as asked (locked, unwritable, ...); the message says why."""


# --- names -------------------------------------------------------------------------------------

def check_name(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValueError(f"invalid {kind} {value!r}: use letters, digits and . _ + = - "
                         "(no path separators, not starting with a dot)")
    return value


def new_run_id(now: datetime | None = None) -> str:
    """UTC time plus a random suffix, e.g. ``20261129T101500Z-3f2a9c1e``.

    The time prefix sorts ids chronologically; 32 random bits keep two runs started in the
    same second apart (and the folder is created exclusively, so a clash is refused anyway).
    """
    now = now or datetime.now(timezone.utc)
    if now.tzinfo is None:
        raise ValueError("new_run_id needs a timezone-aware datetime (UTC)")
    return f"{now.astimezone(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}-{secrets.token_hex(4)}"


def leg_dir(run_dir: str | Path, leg_name: str) -> Path:
    return Path(run_dir) / LEGS / check_name("leg name", leg_name)


def run_dir_of_leg(folder: str | Path) -> Path | None:
    """The run folder a leg folder belongs to, or None for a stand-alone leg folder."""
    folder = Path(folder)
    if folder.parent.name == LEGS and (folder.parent.parent / RUN_JSON).is_file():
        return folder.parent.parent
    return None


# --- JSON --------------------------------------------------------------------------------------

def read_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write to ``<name>.tmp`` and rename: a reader sees the old file or the new one, never half.

    On any failure (a full disk, say) the temporary file is removed and the OSError names ``path``:
    the kernel's error for a failed ``write`` carries no file name, and a 0-byte ``.tmp`` beside
    the old file would be the only trace of what was being written.
    """
    # serialised first: a bad value leaves no file
    write_text_atomic(path, json.dumps(data, indent=1, default=str) + "\n")


def write_jsonl_atomic(path: str | Path, rows: Iterable[dict]) -> None:
    """Whole JSON lines written aside and renamed (``write_text_atomic``): the file is complete or absent."""
    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def write_text_atomic(path: str | Path, text: str) -> None:
    """``text`` to ``<name>.tmp``, then renamed over ``path`` (see ``write_json_atomic``)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise _named(exc, path) from None


def _named(exc: OSError, path: Path) -> OSError:
    """The same error, naming the file the caller meant (not its temporary twin, not nothing)."""
    if exc.filename not in (None, str(path.with_name(path.name + ".tmp"))):
        return exc
    out = type(exc)(exc.errno, exc.strerror or str(exc), str(path)) if exc.errno else OSError(
        exc.errno, str(exc), str(path))
    return out


def write_summary(folder: str | Path, summary: dict[str, Any]) -> dict[str, Any]:
    """``summary.json`` of a finished leg (any runner): ``"status": "complete"`` first, then ``summary``."""
    data = {"status": "complete", **{k: v for k, v in summary.items() if k != "status"}}
    write_json_atomic(Path(folder) / SUMMARY, data)
    return data


def failure_record(exc: BaseException | None = None, error: str | None = None, *, with_traceback: bool = True,
                   **fields: Any) -> dict[str, Any]:
    """The body of a ``failure.json``: ``"status": "failed"``, ``error`` (from ``exc`` when not given),
    the traceback being handled (with ``exc``), then ``fields`` in order."""
    import traceback

    if error is None and exc is not None:
        error = f"{type(exc).__name__}: {exc}"
    data: dict[str, Any] = {"status": "failed", "error": error}
    if exc is not None and with_traceback:
        data["traceback"] = traceback.format_exc()
    data.update(fields)
    return data


def write_failure(folder: str | Path, record: dict[str, Any]) -> dict[str, Any]:
    """``failure.json`` of a leg that did not finish (``record``: ``failure_record``); the folder is made."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / FAILURE, record)
    return record


def append_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    """Append whole lines and hand them to the kernel: a killed process loses at most the line being written.

    No fsync: it would cost milliseconds per prompt, and what it guards against (the machine losing
    power) loses the run anyway.
    """
    path = Path(path)
    text = "".join(json.dumps(row) + "\n" for row in rows)
    try:
        with path.open("a", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as exc:
        raise _named(exc, path) from None


def read_jsonl(path: str | Path, tolerate_torn_tail: bool = False) -> list[dict]:
    """Records of a JSONL file; ``tolerate_torn_tail`` drops an unfinished last line (a partial file)."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if tolerate_torn_tail and lineno == len(lines):
                break
            raise ValueError(f"{path}:{lineno}: not valid JSON ({exc})") from None
    return out


def read_jsonl_salvage(path: str | Path) -> tuple[list[dict], list[int]]:
    """The records of a damaged JSONL file that are whole, and the line numbers that are not.

    For repair only (resume reuses what is whole and decodes the rest again); results never read
    a file this way.
    """
    good, bad = [], []
    with Path(path).open(encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                bad.append(lineno)
                continue
            if isinstance(rec, dict):
                good.append(rec)
            else:
                bad.append(lineno)
    return good, bad


def records_problem(folder: str | Path) -> str | None:
    """Why a complete leg's ``records.jsonl`` cannot be read (``<file>:<line>: ...``), or None.

    ``leg_status`` looks at which files exist (cheap, for listings); this reads every line, and is
    what resume and export use before they trust a leg that says it is complete.
    """
    folder = Path(folder)
    path = folder / RECORDS
    if not path.is_file():
        return None
    try:
        recs = read_jsonl(path)
    except (OSError, UnicodeDecodeError) as exc:
        return f"{path}: unreadable ({exc})"
    except ValueError as exc:
        return str(exc)
    for i, rec in enumerate(recs, 1):
        if not isinstance(rec, dict) or "pid" not in rec:
            return f"{path}:{i}: not a record (a JSON object with a pid)"
    try:
        n = read_json(folder / SUMMARY).get("n_prompts")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(n, int) and len(recs) != n:
        return f"{path}: {len(recs)} records but {SUMMARY} says n_prompts={n}"
    return None


# --- leg status --------------------------------------------------------------------------------

def leg_status(folder: str | Path) -> str:
    """``complete`` | ``failed`` | ``incomplete`` | ``pending``, from the files alone.

    complete: summary.json says "complete" and records.jsonl exists (a cost-ladder leg: its summary says
    ``"runner": "ladder"`` and steps.jsonl + walls.jsonl exist); failed: failure.json (its
    partial records, if any, stay in records.jsonl.partial); incomplete: a folder with neither
    (interrupted, or still running); pending: no folder.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return "pending"
    if (folder / FAILURE).is_file():
        return "failed"
    summary = folder / SUMMARY
    ladder_rows = (folder / LADDER_STEPS).is_file() and (folder / LADDER_WALLS).is_file()
    if summary.is_file() and ((folder / RECORDS).is_file() or ladder_rows):
        try:
            info = read_json(summary)
        except (OSError, ValueError):
            return "incomplete"
        if not (isinstance(info, dict) and info.get("status") == "complete"):
            return "incomplete"
        if not (folder / RECORDS).is_file() and info.get("runner") != "ladder":
            return "incomplete"
        return "complete"
    return "incomplete"


def archive_leg(folder: str | Path) -> Path:
    """Move a leg folder aside, keeping it as evidence; returns where it went.

    In a run folder: ``<run>/attempts/<leg>.<k>``. A stand-alone leg folder keeps its earlier
    attempts inside itself: ``<leg>/attempts/<k>``.
    """
    folder = Path(folder)
    rdir = run_dir_of_leg(folder)
    if rdir is not None:
        attempts = rdir / ATTEMPTS
        attempts.mkdir(exist_ok=True)
        k = 1
        while (attempts / f"{folder.name}.{k}").exists():
            k += 1
        dest = attempts / f"{folder.name}.{k}"
        os.replace(folder, dest)
        return dest
    attempts = folder / ATTEMPTS
    attempts.mkdir(exist_ok=True)
    k = 1
    while (attempts / str(k)).exists():
        k += 1
    dest = attempts / str(k)
    dest.mkdir()
    for item in folder.iterdir():
        if item.name != ATTEMPTS:
            os.replace(item, dest / item.name)
    return dest


# --- processes ---------------------------------------------------------------------------------

def process_start_ticks(pid: int) -> int | None:
    """Start time of a process (clock ticks since boot), or None if there is no such process.

    PID and start time together name a process: a PID reused after a reboot or wrap-around
    has another start time.
    """
    try:
        with open(f"/proc/{int(pid)}/stat", encoding="ascii", errors="replace") as fh:
            stat = fh.read()
    except (OSError, ValueError):
        return None
    # the command name (field 2) may hold spaces or ')': fields after the last ')' are fixed
    rest = stat.rsplit(")", 1)[-1].split()
    try:
        if rest[0] == "Z":       # a zombie has exited
            return None
        return int(rest[19])
    except (IndexError, ValueError):
        return None


def process_alive(pid: int | None, start_ticks: int | None = None) -> bool:
    if not pid:
        return False
    ticks = process_start_ticks(pid)
    if ticks is None:
        return False
    return start_ticks is None or ticks == start_ticks


def process_identity(pid: int | None = None) -> dict[str, Any]:
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "start_ticks": process_start_ticks(pid), "host": socket.gethostname(),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def remove_stale_preparing(exp_dir: str | Path) -> list[Path]:
    """Remove ``.<run id>.preparing`` folders under ``exp_dir`` whose preparing process is dead.

    A preparation killed with -9 cannot clean up after itself. Its folder names the process that
    built it (``preparer.json``: PID and start time); only a folder whose process is gone is removed,
    so a preparation running beside this one is left alone. A folder without the file (written right
    after the folder is made) counts as stale once it is a minute old. Errors (a read-only results
    root) leave things as they are: this is tidying, never a reason to fail.
    """
    removed: list[Path] = []
    exp_dir = Path(exp_dir)
    try:
        candidates = [p for p in exp_dir.iterdir()
                      if p.is_dir() and p.name.startswith(".") and p.name.endswith(PREPARING_SUFFIX)]
    except OSError:
        return removed
    for folder in candidates:
        try:
            who = read_json(folder / PREPARER) if (folder / PREPARER).is_file() else None
            if isinstance(who, dict):
                if process_alive(who.get("pid"), who.get("start_ticks")):
                    continue
            elif datetime.now().timestamp() - folder.stat().st_mtime < 60:
                continue
            shutil.rmtree(folder)
            removed.append(folder)
        except (OSError, ValueError):
            continue
    return removed


# --- the run lock ------------------------------------------------------------------------------

class RunLock:
    """One writer per run folder: ``<run>/run.lock`` held with ``flock`` for as long as the run goes.

    The kernel drops an flock when its holder dies by any signal, so a lock left by a killed run is
    taken over at once; the file keeps the holder's PID and start time, which is how the next run
    learns that it took over (``previous``) and how a refused writer learns who holds it. The file is
    never deleted (deleting a lock file races with a writer that has it open); releasing empties it.
    """

    def __init__(self, run_dir: str | Path, purpose: str = "run"):
        self.path = Path(run_dir) / LOCK
        self.purpose = purpose
        self.previous: dict[str, Any] | None = None   # a dead holder's record, when one was taken over
        self.holder: dict[str, Any] | None = None
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError as exc:
            raise RunFolderError(f"cannot lock {self.path.parent}: not writable ({exc.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_lock(fd)
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            who = (f"PID {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
                   f" ({holder.get('purpose', 'run')})") if holder else "another process"
            raise RunFolderError(f"{self.path.parent} is in use by {who}; wait for it to finish "
                                 f"or stop that process first") from None
        stale = _read_lock(fd)
        if stale:
            self.previous = dict(stale, alive=process_alive(stale.get("pid"), stale.get("start_ticks")))
        ident = dict(process_identity(), purpose=self.purpose)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(ident) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        self.holder = ident
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def lock_holder(run_dir: str | Path) -> dict[str, Any] | None:
    """Who holds the run's lock now (a run in progress), or None; changes nothing.

    Probes with a shared, non-blocking flock on a read-only descriptor: unlike taking the lock, this
    leaves the file (and what it says about a killed holder, which resume records) as it is.
    """
    path = Path(run_dir) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                return _read_lock(fd) or {"pid": None}
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def partial_state(run_dir: str | Path, legs: dict[str, str]) -> dict[str, Any]:
    """``{"partial": bool, "partial_reason": str | None}``: tables made while the run still runs, or with
    planned legs that are not complete, are partial and must say so."""
    holder = lock_holder(run_dir)
    reasons = []
    if holder is not None:
        reasons.append(f"the run is still running (PID {holder.get('pid')}, started {holder.get('started')})")
    missing = {k: v for k, v in legs.items() if v != "complete"}
    if missing:
        reasons.append(f"{len(legs) - len(missing)}/{len(legs)} legs complete; not complete: "
                       + ", ".join(f"{k} ({v})" for k, v in missing.items()))
    return {"partial": bool(reasons), "partial_reason": "; ".join(reasons) or None}


def disturbed_state(run_dir: str | Path) -> dict[str, Any]:
    """``{"disturbed": bool, "disturbed_by": [...]}``: another run was active on the host while legs of this
    one ran (protocol.json ``shared_host``, ``workbench.hostruns``), so its timings are not clean."""
    try:
        seen = (read_json(Path(run_dir) / STATE_JSON) or {}).get("shared_host") or []
    except (OSError, ValueError, AttributeError):
        seen = []
    by = [f"{e.get('run_dir') or e.get('command') or 'a vLLM process'} (PID {e.get('pid')}"
          + (f"; legs {', '.join(e['legs'])}" if e.get("legs") else "") + ")" for e in seen if isinstance(e, dict)]
    return {"disturbed": bool(by), "disturbed_by": by}


def _read_lock(fd: int) -> dict[str, Any] | None:
    try:
        raw = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        return json.loads(raw) if raw else None
    except (OSError, ValueError):
        return {"pid": None, "note": "unreadable lock file"}

