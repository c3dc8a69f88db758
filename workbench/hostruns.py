"""Other runs on this host: found before a run's legs start, recorded, refused on a shared GPU.

Two runs on one host disturb each other's timings (CPU cores, memory bandwidth, and on a GPU the
device itself). Each executing run registers itself in a host-wide folder (``host_dir()``: one small
JSON file per run, removed when the run ends; a file whose process is dead is ignored); a process scan
finds what no registration covers: a leg started by hand (``python -m workbench.leg``), a ``vllm serve``
or a vLLM engine process left by a killed run.

    others(own_run) -> [OtherRun]          every other run or engine process alive on this host now
    decide(others, device, where, allow)   -> (refusal or None, warning lines)
    Registration(run_dir, cfg).add() / .remove()

Policy (``decide``): a run of a GPU profile (8b, 32b, the shape profiles) on a GPU host is refused
unless ``allow_shared_host`` when another run holds one of its GPUs or the other run's GPUs are not known;
any other case (GPUs known and disjoint, a CPU host, a CPU profile such as tiny, which is a rehearsal and
the test suite's) goes ahead with a warning. Either way the run's ``protocol.json``
records ``shared_host`` (who, which of its legs ran beside them), and ``tables/summary.json`` says
``disturbed``.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from workbench.runfolder import (LEG_JSON, LEGS, RUN_JSON, STATE_JSON, process_alive, process_start_ticks,
                                 read_json)

__all__ = ["HOST_DIR_ENV", "CHECK_ENV", "host_dir", "OtherRun", "Registration", "others", "decide", "describe", "note_seen"]

HOST_DIR_ENV = "WORKBENCH_HOST_RUNS"
# "0": look for no other run (the test suite sets it: its modules run runs side by side on purpose)
CHECK_ENV = "WORKBENCH_SHARED_HOST_CHECK"
# the processes of a leg: the module a runner starts (workbench.runners.RUNNERS)
LEG_MODULES = ("workbench.leg", "workbench.serve_leg", "workbench.ladder_engine")


def host_dir() -> Path:
    """Where runs register (``$WORKBENCH_HOST_RUNS``, else ``workbench-runs`` in the system's temp folder)."""
    return Path(os.environ.get(HOST_DIR_ENV) or Path(tempfile.gettempdir()) / "workbench-runs")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class OtherRun:
    """Another run (or a vLLM process of no run) alive on this host."""

    pid: int
    run_dir: str | None = None          # None: a vLLM process outside any workbench run folder
    experiment: str | None = None
    leg: str | None = None              # the leg running now, where known
    device: str | None = None           # gpu | cpu, where known
    gpus: list[str] | None = None       # GPU indices or UUIDs it holds; None: not known
    found_by: str = "registration"      # registration | process
    command: str | None = None          # a process found by the scan: its command line (shortened)

    def key(self) -> str:
        return self.run_dir or f"pid {self.pid}"

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


# --- registration --------------------------------------------------------------------------------

@dataclass
class Registration:
    """This run, announced to the other runs of the host while it executes (best effort)."""

    run_dir: Path
    cfg: dict[str, Any]
    path: Path | None = field(default=None, init=False)

    def add(self) -> "Registration":
        folder = host_dir()
        try:
            if not folder.is_dir():
                folder.mkdir(parents=True, exist_ok=True)
                os.chmod(folder, 0o1777)  # every user's runs register here; each removes only its own
            pid = os.getpid()
            entry = {"pid": pid, "start_ticks": process_start_ticks(pid), "run_dir": str(Path(self.run_dir).resolve()),
                     "experiment": self.cfg.get("experiment"), "run_id": self.cfg.get("run_id"),
                     "device": self.cfg.get("device"), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                     "user": os.getuid(), "started": _now()}
            path = folder / f"{pid}.json"
            tmp = folder / f".{pid}.json.tmp"
            tmp.write_text(json.dumps(entry) + "\n")
            os.replace(tmp, path)
            self.path = path
        except OSError:
            self.path = None  # a host folder we cannot write: the other runs' process scan still sees our legs
        return self

    def remove(self) -> None:
        if self.path is not None:
            try:
                self.path.unlink()
            except OSError:
                pass
            self.path = None


# --- finding the others ---------------------------------------------------------------------------

def _registered(own_pid: int) -> list[OtherRun]:
    out = []
    try:
        files = sorted(host_dir().glob("*.json"))
    except OSError:
        return out
    for f in files:
        try:
            entry = json.loads(f.read_text())
            pid = int(entry["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pid == own_pid:
            continue
        if not process_alive(pid, entry.get("start_ticks")):
            try:  # a run killed with -9 left it; the sticky folder lets only its owner remove it
                f.unlink()
            except OSError:
                pass
            continue
        other = OtherRun(pid=pid, run_dir=entry.get("run_dir"), experiment=entry.get("experiment"),
                         device=entry.get("device"))
        visible = entry.get("cuda_visible_devices")
        _from_protocol(other, visible)
        out.append(other)
    return out


def _from_protocol(other: OtherRun, visible: str | None) -> None:
    """The leg running now and the GPUs held, from the other run's protocol.json (best effort)."""
    try:
        state = read_json(Path(other.run_dir) / STATE_JSON) or {}
    except (OSError, ValueError, TypeError):
        state = {}
    lp = (state.get("leg_process") if isinstance(state, dict) else None) or {}
    other.leg = lp.get("leg") if isinstance(lp, dict) else None
    groups = state.get("groups") if isinstance(state, dict) else None
    groups = list(groups.values()) if isinstance(groups, dict) else (groups or [])
    places = ([state.get("placement")] if isinstance(state, dict) else []) + [
        g.get("placement") for g in groups if isinstance(g, dict)]
    gpus = [g.get("index") or g.get("uuid") for p in places if isinstance(p, dict) for g in p.get("gpus") or []]
    if gpus:
        other.gpus = sorted(set(map(str, gpus)))
    elif other.device == "cpu" or any(isinstance(p, dict) and p.get("device") == "cpu" for p in places):
        other.gpus = []
    elif visible:
        other.gpus = [v.strip() for v in visible.split(",") if v.strip()]


def _proc_table() -> dict[int, tuple[int, list[str]]]:
    """{pid: (parent pid, argv)} of every process whose command line can be read."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = [a.decode("utf-8", "replace") for a in fh.read().split(b"\0") if a]
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
                ppid = int(fh.read().rsplit(")", 1)[-1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        table[pid] = (ppid, argv)
    return table


def _leg_module(argv: list[str]) -> str | None:
    for i, a in enumerate(argv[:-1]):
        if a == "-m" and argv[i + 1] in LEG_MODULES:
            return argv[i + 1]
    return None


def _is_vllm(argv: list[str]) -> bool:
    if argv and argv[0].startswith("VLLM::"):            # vLLM's engine core names its process so
        return True
    return ((len(argv) >= 2 and Path(argv[0]).name == "vllm" and argv[1] == "serve")
            or (len(argv) >= 3 and argv[1] == "-m" and argv[2].startswith("vllm.entrypoints")))


def _run_of(argv: list[str]) -> tuple[str | None, str | None]:
    """(run folder, leg) named by a leg command's ``--config RUN/legs/LEG/leg.json`` or ``--out RUN/legs/LEG``."""
    for a in argv:
        if f"/{LEGS}/" not in a:
            continue
        p = Path(a)
        if p.name == LEG_JSON:
            p = p.parent
        if p.parent.name == LEGS and (p.parent.parent / RUN_JSON).is_file():
            return str(p.parent.parent.resolve()), p.name
    return None, None


def _descendants(table: dict[int, tuple[int, list[str]]], root: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


def _scanned(own_pid: int, own_run: str | None) -> list[OtherRun]:
    """Leg, server and engine processes of other runs (or of none), grouped by run folder."""
    try:
        table = _proc_table()
    except OSError:
        return []
    mine = _descendants(table, own_pid) | {own_pid}
    found: dict[str, OtherRun] = {}
    for pid, (_, argv) in sorted(table.items()):
        if pid in mine or not (_leg_module(argv) or _is_vllm(argv)):
            continue
        run, leg, top, p = None, None, pid, pid
        for _ in range(64):  # the leg above a server or engine process names its run
            run, leg = _run_of(table[p][1]) if p in table else (None, None)
            if run or p not in table:
                break
            if _leg_module(table[p][1]) or _is_vllm(table[p][1]):
                top = p
            p = table[p][0]
        if run is not None and run == own_run:
            continue
        key = run or f"pid {top}"
        if key not in found:
            found[key] = OtherRun(pid=top, run_dir=run, leg=leg, found_by="process",
                                  command=" ".join(table[top][1])[:160])
    return list(found.values())


def others(own_run: str | Path | None = None) -> list[OtherRun]:
    """Every other run registered on this host whose process is alive, and every workbench leg, ``vllm serve``
    or vLLM engine process that is not this process's (nor of ``own_run``) and not of a registered run."""
    if os.environ.get(CHECK_ENV, "1") == "0":
        return []
    own_pid = os.getpid()
    own = str(Path(own_run).resolve()) if own_run is not None else None
    regs = [o for o in _registered(own_pid) if o.run_dir != own]
    known = {o.run_dir for o in regs}
    scanned = [o for o in _scanned(own_pid, own) if o.run_dir is None or o.run_dir not in known]
    return regs + scanned


# --- what to do about them ------------------------------------------------------------------------

def describe(o: OtherRun) -> str:
    if o.run_dir:
        who = f"run {o.run_dir} (PID {o.pid}" + (f", leg {o.leg}" if o.leg else "") + ")"
    else:
        who = f"a vLLM or workbench leg process outside any run folder (PID {o.pid}: {o.command})"
    if o.gpus:
        who += f" on GPU(s) {','.join(o.gpus)}"
    elif o.gpus == [] or o.device == "cpu":
        who += " on the CPU"
    return who


def decide(found: list[OtherRun], device: str | None, where: dict[str, Any], allow: bool
           ) -> tuple[str | None, list[str]]:
    """(refusal message or None, warning lines) for a run of a ``device`` profile (run.json ``device``) placed
    at ``where`` (``workbench.placement.capture``) beside ``found``: a GPU profile's run is refused on a GPU
    another run holds (or may hold) unless ``allow``; else (a CPU profile, tiny included, even on a GPU
    host: a rehearsal, not a measurement) a warning."""
    if not found:
        return None, []
    gpus = where.get("gpus") or []
    mine = {str(g.get(k)) for g in gpus for k in ("index", "uuid") if g.get(k) is not None}

    def contends(o: OtherRun) -> bool:
        return o.gpus is None or not mine or bool(mine & set(o.gpus))

    lines = [f"  - {describe(o)}" for o in found]
    if device == "gpu" and where.get("device") == "gpu" and not allow and any(contends(o) for o in found):
        held = ",".join(str(g.get("index")) for g in gpus) or "all"
        return (f"another run is active on this host and may use this run's GPU(s) ({held}); the timings of "
                f"both runs would be disturbed:\n" + "\n".join(lines) + "\n  wait for it or stop it, give this run "
                f"other GPUs (CUDA_VISIBLE_DEVICES), or pass --allow-shared-host (notebook: allow_shared_host=True) "
                f"to run anyway, marked as disturbed"), lines
    head = ("warning: another run is active on this host; the timings of both runs are disturbed (recorded as "
            "shared_host in this run's protocol.json; its tables/summary.json says disturbed):")
    return None, [head] + lines


def note_seen(state: dict[str, Any], found: list[OtherRun], leg: str | None) -> list[OtherRun]:
    """Record in ``state["shared_host"]`` each other run seen (and the leg of this run it ran beside);
    returns those not recorded before."""
    seen = state.setdefault("shared_host", [])
    by_key = {e.get("key"): e for e in seen}
    new = []
    for o in found:
        e = by_key.get(o.key())
        if e is None:
            e = dict(o.to_dict(), key=o.key(), first_seen=_now(), legs=[])
            seen.append(e)
            by_key[e["key"]] = e
            new.append(o)
        if leg is not None and leg not in e["legs"]:
            e["legs"].append(leg)
    return new
