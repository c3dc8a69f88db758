"""Where a leg ran: its node, its GPUs (index and UUID) or the CPU, the driver and CUDA versions.

Written by whoever starts the leg (the local executor, or a Ray task of the Ray executor) as
``legs/<leg>/placement.json`` before the leg's process starts; read back with the leg's records
(``workbench.results``), so an analysis can tell whether the legs of a bracket ran on one GPU.

    capture(executor, group=None, node_id=None) -> dict
    placement_key(record) -> str | None     "host/GPU-uuid,..." or "host/cpu" ("host/cpu:gpu1" under Ray)

Every probe is best-effort: without ``nvidia-smi`` a leg ran on the CPU (or the tool is missing),
and that is what is recorded. The key names the physical device, not the process or the Ray
instance: a bracket resumed on the same GPU after a restart is still on one placement.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from typing import Any

__all__ = ["capture", "placement_key", "gpu_probe", "niceness"]


def _visible() -> list[str] | None:
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [d.strip() for d in raw.split(",") if d.strip()]


def gpu_probe() -> dict[str, Any] | None:
    """``nvidia-smi``'s GPUs (index, uuid, name), driver and CUDA versions; None where it is not there."""
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        head = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if q.returncode != 0:
        return None
    gpus, driver = [], None
    for line in q.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4:
            gpus.append({"index": parts[0], "uuid": parts[1], "name": parts[2]})
            driver = parts[3]
    m = re.search(r"CUDA Version:\s*([0-9.]+)", head.stdout or "")
    return {"gpus": gpus, "driver_version": driver, "cuda_version": m.group(1) if m else None}


def _select(gpus: list[dict[str, Any]], visible: list[str] | None) -> list[dict[str, Any]]:
    """The GPUs CUDA_VISIBLE_DEVICES names (by index or UUID), in its order; all of them when unset."""
    if visible is None:
        return gpus
    out = []
    for v in visible:
        hit = next((g for g in gpus if v in (g["index"], g["uuid"])), None)
        if hit is not None:
            out.append(hit)
    return out


def capture(executor: str, group: int | None = None, node_id: str | None = None,
            probe: dict[str, Any] | None = None) -> dict[str, Any]:
    """Where a leg starts now: ``host``, ``node_id`` (Ray's, or None), ``device`` ``gpu`` | ``cpu``,
    ``gpus`` (index, uuid, name of each GPU the leg may use), ``cuda_visible_devices`` (as set: under Ray
    on a CPU host, the logical GPU the group holds), ``driver_version``, ``cuda_version``, ``executor``,
    ``group``, ``pid`` (the process that starts the leg), ``niceness`` (its scheduling niceness, which the leg's
    processes inherit: Ray starts its workers 15 steps nicer than its raylet unless told otherwise)."""
    probe = gpu_probe() if probe is None else probe
    visible = _visible()
    gpus = _select(probe["gpus"], visible) if probe and probe.get("gpus") else []
    return {"host": socket.gethostname(), "node_id": node_id, "device": "gpu" if gpus else "cpu",
            "gpus": gpus, "cuda_visible_devices": None if visible is None else ",".join(visible),
            "driver_version": (probe or {}).get("driver_version"), "cuda_version": (probe or {}).get("cuda_version"),
            "executor": executor, "group": group, "pid": os.getpid(), "niceness": niceness()}


def niceness() -> int:
    """This process's scheduling niceness (0 for a process started as usual)."""
    return os.getpriority(os.PRIO_PROCESS, 0)


def placement_key(record: dict[str, Any] | None) -> str | None:
    """The device a placement names, for comparing legs; None for a leg that recorded none (an older run)."""
    if not isinstance(record, dict) or not record.get("host"):
        return None
    if record.get("gpus"):
        return f"{record['host']}/" + ",".join(str(g.get("uuid") or g.get("index")) for g in record["gpus"])
    visible = record.get("cuda_visible_devices")
    return f"{record['host']}/cpu" + (f":gpu{visible}" if visible else "")
