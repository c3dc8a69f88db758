"""vLLM's benchmark client for a serving leg, imported once and run once per cell.

``vllm bench serve`` started as a process per cell costs a vLLM import (10-30 s) each time: at four
concurrencies that is as long as the cells themselves. A leg instead starts one *client worker*
(``python -m workbench.serve_client``) beside its server, so the import overlaps the server's start,
and sends it one job per cell: the arguments of ``vllm bench serve``, the cell's log file and its
request-timings file. The worker runs vLLM's own parser and ``main`` for each job (what ``vllm bench
serve`` runs) and answers one JSON line per job on a protocol descriptor of its own, so what vLLM's
client prints lands in the cell's ``client.log`` and never in the protocol.

Each request's own end-to-end latency is kept (``request_timings.jsonl``): the client's detailed file
lists TTFT and ITLs per request but not the latency its TPOT and E2EL percentiles are computed from.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import traceback
from pathlib import Path

__all__ = ["BenchClient", "ClientError", "run_bench_argv", "main"]

_TIMING: list[Path | None] = [None]  # the current job's request-timings file (the worker's one job at a time)


class ClientError(RuntimeError):
    """The benchmark client failed or died."""


def _record_request_timings(backend: str) -> None:
    """Wrap the client's request function (vLLM's table of request functions): each call appends one
    JSON line to the current job's timings file."""
    from vllm.benchmarks.lib import endpoint_request_func as erf

    inner = erf.ASYNC_REQUEST_FUNCS[backend]
    if getattr(inner, "_workbench_timed", False):
        return

    async def timed(request_func_input, session, pbar=None):
        out = await inner(request_func_input, session, pbar)
        path = _TIMING[0]
        if path is not None:
            with path.open("a") as f:
                f.write(json.dumps({"request_id": request_func_input.request_id, "latency": out.latency,
                                    "ttft": out.ttft, "output_tokens": out.output_tokens,
                                    "success": out.success}) + "\n")
        return out

    timed._workbench_timed = True
    erf.ASYNC_REQUEST_FUNCS[backend] = timed


def _parser():
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    return parser


def run_bench_argv(argv: list[str], timing: Path | None = None, parser=None) -> None:
    """One ``vllm bench serve`` run in this process (its parser, its ``main``)."""
    from vllm.benchmarks.serve import main as bench_main

    args = (parser or _parser()).parse_args(argv)
    _TIMING[0] = timing
    if timing is not None:
        _record_request_timings(args.backend)
    try:
        bench_main(args)
    finally:
        _TIMING[0] = None


def _worker(proto_fd: int) -> int:
    """Read jobs (JSON lines on stdin), run each, answer ``{"rc": .., "error": ..}`` on ``proto_fd``."""
    from workbench.childproc import set_parent_death_signal
    import signal

    set_parent_death_signal(signal.SIGTERM)
    proto = os.fdopen(proto_fd, "w", buffering=1)
    try:
        parser = _parser()
    except BaseException as exc:  # noqa: BLE001 - the driver gets the reason
        proto.write(json.dumps({"ready": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        return 1
    proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        rc, error = 0, ""
        with open(job["log"], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            try:
                run_bench_argv(job["argv"], Path(job["timing"]) if job.get("timing") else None, parser)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - a failed cell is the driver's to report
                rc, error = 1, f"{type(exc).__name__}: {exc}"
                traceback.print_exc(file=log)
        proto.write(json.dumps({"rc": rc, "error": error}) + "\n")
    return 0


class BenchClient:
    """The driver's side: one worker process, one job at a time, each with a timeout."""

    def __init__(self, log: Path):
        self.log = Path(log)
        read_fd, write_fd = os.pipe()
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "workbench.serve_client", "--worker", str(write_fd)],
            stdin=subprocess.PIPE, stdout=self._log_file, stderr=subprocess.STDOUT, text=True,
            pass_fds=(write_fd,), env={**os.environ, "PYTHONUNBUFFERED": "1"})
        os.close(write_fd)
        self._answers: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(os.fdopen(read_fd),), name="bench-client",
                                        daemon=True)
        self._reader.start()
        self._ready: bool | None = None

    def _read(self, f) -> None:
        for line in f:
            try:
                self._answers.put(json.loads(line))
            except ValueError:
                continue
        self._answers.put(None)  # the worker is gone

    def _answer(self, timeout: float, what: str) -> dict:
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            self.close(kill=True)
            raise ClientError(f"the benchmark client gave no answer to {what} in {timeout:.0f} s "
                              f"(log: {self.log})") from None
        if answer is None:
            rc = self.proc.wait(timeout=10)
            raise ClientError(f"the benchmark client died (status {rc}) during {what}; log: {self.log}: "
                              + self.tail())
        return answer

    def wait_ready(self, timeout: float = 600.0) -> None:
        if self._ready is None:
            answer = self._answer(timeout, "its start (importing vLLM's benchmark)")
            self._ready = bool(answer.get("ready"))
            if not self._ready:
                raise ClientError(f"the benchmark client could not start: {answer.get('error')}")

    def run(self, argv: list[str], log: Path, timing: Path | None, timeout: float) -> None:
        """One ``vllm bench serve`` run; raises ClientError (with the cell log's last line) on failure."""
        self.wait_ready()
        self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log),
                                          "timing": str(timing) if timing else None}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer(timeout, f"a cell (log: {log})")
        if answer.get("rc"):
            last = [ln for ln in Path(log).read_text(errors="replace").splitlines() if ln.strip()]
            raise ClientError(f"{answer.get('error') or 'failed'} (log: {log})"
                              + (f": {last[-1]}" if last and last[-1] not in str(answer.get("error")) else ""))

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def close(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                try:
                    self.proc.stdin.close()
                    self.proc.wait(timeout=30)
                except (OSError, subprocess.TimeoutExpired):
                    self.proc.kill()
            self.proc.wait(timeout=30)
        self._log_file.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"] and len(argv) == 2:
        return _worker(int(argv[1]))
    # by hand: the arguments of `vllm bench serve`, with the per-request timings file from the environment
    timing = os.environ.get("WORKBENCH_SERVE_TIMING")
    run_bench_argv(argv, Path(timing) if timing else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
