"""The process side of a serving leg: ``vllm serve`` in its own process group, its health, its
Prometheus counters, its memory, and its stop (SIGTERM, then SIGKILL to everything it started)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HEALTH_TIMEOUT_S = float(os.environ.get("WORKBENCH_SERVE_START_TIMEOUT", "900"))
_COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "num_drafts",
    "vllm:spec_decode_num_draft_tokens_total": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "num_accepted_tokens",
}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
# the caches that make a repeated request cheap: prefix cache (tokens), multimodal cache (items)
CACHE_COUNTERS = {
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:mm_cache_queries_total": "mm_cache_queries",
    "vllm:mm_cache_hits_total": "mm_cache_hits",
}


class ServeError(RuntimeError):
    """The server or the client failed; the message names which and points to the log."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, data: bytes | None = None, timeout: float = 10.0) -> str:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def parse_metrics(text: str) -> dict[str, Any]:
    """The spec-decode and cache counters of a Prometheus ``/metrics`` page, summed over label sets."""
    out: dict[str, Any] = {v: 0 for v in (*_COUNTERS.values(), *CACHE_COUNTERS.values())}
    per_pos: dict[int, int] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name in _COUNTERS:
            out[_COUNTERS[name]] += int(value)
        elif name in CACHE_COUNTERS:
            out[CACHE_COUNTERS[name]] += int(value)
        elif name == _PER_POS:
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0) + int(value)
    out["accepted_per_pos"] = [per_pos[i] for i in sorted(per_pos)]
    return out


class Server:
    """The leg's server: its own process group, stopped on exit, on a signal and on error."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path):
        self.cmd, self.env, self.log_path = cmd, env, log
        self.proc: subprocess.Popen | None = None

    def start(self, base_url: str, timeout: float = HEALTH_TIMEOUT_S) -> None:
        from workbench import childproc

        log = self.log_path.open("w")
        # In the leg's own process group (a run that stops the leg's group stops the server with it),
        # behind the parent-death trampoline (a leg killed alone takes its server down too).
        self.proc = subprocess.Popen(childproc.wrap(os.getpid(), self.cmd), env=self.env, stdout=log,
                                     stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise ServeError(f"the server exited with status {self.proc.returncode} before it was healthy "
                                 f"(log: {self.log_path})")
            try:
                _http(f"{base_url}/health", timeout=5)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise ServeError(f"the server was not healthy within {timeout:.0f} s (log: {self.log_path})")
            time.sleep(1.0)

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM to the server (it shuts its engine core down), then SIGKILL to it and every process
        it started that is still there."""
        p = self.proc
        if p is None:
            return
        family = descendants(p.pid)
        try:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=grace)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
        for pid in [p.pid, *family, *descendants(p.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None

    def rss_mb(self) -> float | None:
        """Resident memory of the server and every process it started, in MiB (None once stopped)."""
        if self.proc is None:
            return None
        total = 0
        for pid in (self.proc.pid, *descendants(self.proc.pid)):
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            except (OSError, ValueError):
                continue
        return total / 1024.0

    def sample_memory(self, stop, every: float = 0.5) -> list[list[float]]:
        """``[[seconds, MiB], ...]`` until ``stop`` (a threading.Event) is set; runs in a thread."""
        rows, t0 = [], time.monotonic()
        while not stop.is_set():
            mb = self.rss_mb()
            if mb is not None:
                rows.append([round(time.monotonic() - t0, 2), round(mb, 1)])
            stop.wait(every)
        return rows

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux ``/proc``), children first."""
    out, todo = [], [pid]
    while todo:
        cur = todo.pop()
        for task in Path(f"/proc/{cur}/task").glob("*/children") if Path(f"/proc/{cur}/task").is_dir() else []:
            try:
                kids = [int(x) for x in task.read_text().split()]
            except (OSError, ValueError):
                continue
            out.extend(kids)
            todo.extend(kids)
    return out
