"""A fork server for the suite's leg processes: `python -m workbench.leg` without its `import vllm`.

A leg process spends about 10 s of CPU importing torch, vLLM and transformers before its engine starts
(the engine itself starts in about 3 s on the tiny models). The suite runs a few hundred legs on two cores,
so this module keeps one *zygote* per test process: a process that imported those libraries once, under the
environment a CPU leg sets before it imports them (``workbench.leg.setup.prepare_process_env``), and forks a
child per leg. The child takes the requesting process's stdin/stdout/stderr, working directory, environment
and arguments, and runs ``workbench.leg``'s own ``main``: the leg's code, checks, engine and files are the
ones a fresh process runs.

A leg reaches the zygote through a *client*, ``python tests/leg_zygote.py MODULE ARGS...`` in place of
``python -m MODULE ARGS...``. The client is the process its starter knows (its PID, exit status, process
group): it forwards SIGTERM/SIGINT/SIGHUP to the leg's process group, exits with the leg's status (or dies of
its signal), and a leg whose client is gone (killed with SIGKILL, say) kills its own group. The client turns
into the plain command (``exec``) whenever the zygote cannot stand for a fresh process:

* no zygote (``WORKBENCH_TEST_ZYGOTE=0``, a CUDA host, or it is not running), or a module other than
  ``workbench.leg`` and ``workbench.cli`` (a run's own process, whose legs then go through the zygote too);
* an environment that differs from the zygote's in anything but the plugin's knobs (``VLLM_SPEC_*``: the
  plugin is not imported in the zygote), the suite's own variables and the leg's parent: a variable read at
  import (``VLLM_SPEC_CPU_ISA`` picks vLLM's kernel library, which the zygote already loaded) would not apply;
* a leg with ``--cpu-threads`` other than 1 or ``--no-in-process`` (the zygote's OpenMP runtime took the
  in-process leg's one thread at import).

The worker processes a tensor-parallel leg spawns are fresh interpreters as from any leg: ``__main__`` reads
as ``python -m workbench.leg``'s to multiprocessing.

What differs from a fresh process: the leg's parent is the zygote (``WORKBENCH_PARENT_PID`` names it, so the
leg's die-with-parent rule holds), and its command line in /proc is the zygote's. Tests of the process tree
(kill -9 of a run, the host's run scan) start their legs the ordinary way.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = "WORKBENCH_TEST_ZYGOTE"  # the zygote's socket; "0" turns the zygote off
LOG_ENV = "WORKBENCH_TEST_ZYGOTE_LOG"  # a file the zygote appends its log to (each leg it forks or refuses)
PARENT_ENV = "WORKBENCH_PARENT_PID"  # workbench.leg.PARENT_ENV (not imported: the client stays light)
# what the zygote runs: module -> (where its main is, the file `python -m` runs, what __main__'s spec names)
MODULES = {"workbench.leg": ("workbench.leg.command", "workbench/leg/__main__.py", "workbench.leg.__main__"),
           # a run's own process (its legs go through the zygote as well)
           "workbench.cli": ("workbench.cli", "workbench/cli.py", "workbench.cli")}
# variables that may differ between the zygote and a leg: read after the fork, never at import
FREE_PREFIXES = ("VLLM_SPEC_", "WORKBENCH_", "PYTEST_")
FREE = (PARENT_ENV, "COLUMNS", "LINES")  # (the terminal's size: text wrapping, read when text is written)
IMPORT_TIME = ("VLLM_SPEC_CPU_ISA",)  # ...except this one: it picks the kernel library vLLM loads at import
# what a leg imports before its engine starts (so before the plugin patches vLLM), and a run's tables and figures
WARM = ("torch", "vllm", "vllm.v1.sample.rejection_sampler", "vllm.entrypoints.llm", "transformers",
        "transformers.models.auto.processing_auto", "transformers.models.auto.tokenization_auto", "pandas",
        "plotly.graph_objects")
MSG = 1 << 20


# --------------------------------------------------------------------------- the client


def command(module: str, args: list) -> list[str]:
    """The leg's command line through the zygote (``python -m module args`` when it is off)."""
    if os.environ.get(ENV, "") in ("", "0"):
        return [sys.executable, "-m", module, *map(str, args)]
    return [sys.executable, str(Path(__file__).resolve()), module, *map(str, args)]


@contextlib.contextmanager
def protocol_legs():
    """While it is open, the legs that ``protocol.execute`` starts from this process (``workbench.legrun``) go
    through the zygote: ``python tests/leg_zygote.py MODULE ...`` in place of ``python -m MODULE ...``."""
    from workbench import legrun

    start()
    real = legrun.leg_command

    def through_zygote(leg, cfg, run_dir, python=sys.executable, runner=None):
        cmd = real(leg, cfg, run_dir, python, runner)
        if runner is None and python == sys.executable and cmd[1:2] == ["-m"]:
            return command(cmd[2], cmd[3:])
        return cmd

    legrun.leg_command = through_zygote
    try:
        yield
    finally:
        legrun.leg_command = real


def _plain(module: str, args: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


def client(module: str, args: list[str]) -> int:
    path = os.environ.get(ENV, "")
    if module not in MODULES or path in ("", "0"):
        _plain(module, args)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
        req = {"module": module, "args": args, "env": dict(os.environ), "cwd": os.getcwd()}
        socket.send_fds(conn, [json.dumps(req).encode()], [0, 1, 2])
        answer = json.loads(conn.recv(MSG) or b"{}")
    except OSError:
        answer = {}
    if "pid" not in answer:  # refused (the reason is in the zygote's log) or no zygote: a fresh process
        conn.close()
        _plain(module, args)
    leg = int(answer["pid"])

    def forward(signum, _frame):
        try:
            os.killpg(leg, signum)
        except ProcessLookupError:
            pass

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, forward)
    raw = conn.recv(MSG)
    if not raw:  # the zygote died: so did the leg (its parent-death signal)
        return 1
    status = json.loads(raw)["status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    return os.waitstatus_to_exitcode(status)


# --------------------------------------------------------------------------- the zygote


def _leg_defaults() -> dict[str, str]:
    """What a CPU leg puts in its environment before it imports torch or vLLM (asked of the leg's own code, in
    a throwaway process: importing the workbench here would import the plugin's knob table)."""
    code = ("import json, os\nfrom workbench.leg import LegConfig\nfrom workbench.leg.setup import prepare_process_env\n"
            "before = dict(os.environ)\nprepare_process_env(LegConfig(target='', prompts='', out='', max_tokens=1))\n"
            "print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def _dirs(value: str | None, existing: bool = False) -> list[str]:
    """The folders of a search-path variable (``existing``: only those there are)."""
    return [d for d in (value or "").split(os.pathsep) if d and (not existing or os.path.isdir(d))]


def _value(args: list[str], name: str) -> str | None:
    """The value of option ``name`` (or of an abbreviation argparse would take for it) in ``args``."""
    for i, a in enumerate(args):
        opt, eq, val = a.partition("=")
        if len(opt) > 3 and name.startswith(opt):
            return val if eq else (args[i + 1] if i + 1 < len(args) else "")
    return None


def _leg_settings(args: list[str]) -> dict:
    cfg_path = _value(args, "--config")
    if cfg_path is not None:
        try:
            cfg = json.loads(Path(cfg_path).read_text())
        except (OSError, ValueError):
            return {}  # the leg reports its own bad config
        return {"cpu_threads": cfg.get("cpu_threads"), "in_process": cfg.get("in_process")}
    no_in = any(len(a) > 6 and "--no-in-process".startswith(a) for a in args)
    return {"cpu_threads": _value(args, "--cpu-threads"), "in_process": False if no_in else None}


def refusal(req: dict, base: dict, imported: dict, defaults: dict, path: list[str] | None = None) -> str | None:
    """Why request ``req`` needs a fresh process, or None, for a zygote started under environment ``base`` that
    set the leg's ``defaults`` and then stood in ``imported`` (``path``: its ``sys.path``)."""
    if req.get("module") not in MODULES:
        return f"module {req.get('module')}"
    env = req["env"]
    for key in sorted(set(env) | set(base) | set(defaults)):
        if key in defaults:
            if env.get(key, defaults[key]) != defaults[key]:
                return f"{key}={env.get(key)!r} (imported with {defaults[key]!r})"
        elif key in IMPORT_TIME or not (key.startswith(FREE_PREFIXES) or key in FREE):
            if key == "PYTHONPATH" and set(_dirs(env.get(key))) <= set(sys.path if path is None else path):
                continue
            if key == "LD_LIBRARY_PATH" and _dirs(env.get(key), True) == _dirs(base.get(key), True):
                continue  # (OpenCV's import names a folder that need not exist)
            # as the zygote started, or as importing the same libraries left it (vLLM names torch's cache)
            if env.get(key) not in (base.get(key), imported.get(key)):
                return f"{key}={env.get(key)!r} (the zygote's: {base.get(key)!r})"
    settings = _leg_settings(req["args"]) if req["module"] == "workbench.leg" else {}
    if str(settings.get("cpu_threads") or 1) != "1" or settings.get("in_process") is False:
        return "a leg whose own process sets no or other OpenMP threads than the zygote took (1)"
    return None


class Zygote:
    """The server: imports once, forks a leg per request."""

    def __init__(self, path: str):
        self.path = path
        self.base = dict(os.environ)
        self.defaults = _leg_defaults()
        os.environ.update(self.defaults)
        for name in WARM:
            __import__(name)
        self.imported = dict(os.environ)
        # the plugin and the workbench are imported by each leg, under its own environment
        assert not [m for m in sys.modules if m.split(".")[0] == "vllm_patch"
                    or (m.startswith("workbench") and m not in ("workbench", "workbench.childproc"))]
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(16)
        self.legs: dict[int, socket.socket] = {}

    def refusal(self, req: dict) -> str | None:
        return refusal(req, self.base, self.imported, self.defaults)

    def serve(self) -> tuple | None:
        """Answers requests until its parent goes; returns (request, fds, client pid) in a forked child."""
        parent = os.getppid()
        while os.getppid() == parent:
            ready, _, _ = select.select([self.listener], [], [], 0.2)
            self._reap()
            if not ready:
                continue
            conn, _ = self.listener.accept()
            try:
                data, fds, _flags, _addr = socket.recv_fds(conn, MSG, 3)
                req = json.loads(data)
            except (OSError, ValueError):
                conn.close()
                continue
            why = self.refusal(req)
            if why is not None:
                self.log(f"fresh process ({why}): {req['module']} {' '.join(req['args'][:4])}")
                conn.send(json.dumps({"refused": why}).encode())
                conn.close()
                for fd in fds:
                    os.close(fd)
                continue
            client_pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                self.listener.close()
                for c in self.legs.values():
                    c.close()
                conn.close()
                return req, fds, client_pid
            for fd in fds:
                os.close(fd)
            self.log(f"forked {pid}: {req['module']} {' '.join(req['args'][:4])}")
            conn.send(json.dumps({"pid": pid}).encode())
            self.legs[pid] = conn
        return None

    def _reap(self) -> None:
        while self.legs:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.legs.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(json.dumps({"status": status}).encode())
                except OSError:
                    pass
                conn.close()

    def log(self, line: str) -> None:
        print(f"[zygote {os.getpid()}] {line}", file=sys.stderr, flush=True)


def _watch_client(pid: int) -> None:
    """The leg's process group goes when its client is gone (the client forwards signals while it lives)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        os.killpg(0, signal.SIGKILL)
        return

    def wait() -> None:
        select.select([fd], [], [])
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=wait, name="leg-client-watch", daemon=True).start()


def run_leg(req: dict, fds: list[int], client_pid: int) -> int:
    """In the forked child: become the leg (its session, stdio, directory, environment) and run its main."""
    from workbench.childproc import set_parent_death_signal

    os.setsid()
    set_parent_death_signal(signal.SIGKILL)  # the zygote's end is the leg's end; die_with_parent may change it
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(req["cwd"])
    env = dict(req["env"])
    if PARENT_ENV in env:
        env[PARENT_ENV] = str(os.getppid())
    os.environ.clear()
    os.environ.update(env)
    _watch_client(client_pid)
    where, script, spec = MODULES[req["module"]]
    sys.argv = [str(REPO / script), *req["args"]]
    # what `python -m MODULE` makes of __main__, for the processes the leg spawns (multiprocessing reads it)
    sys.modules["__main__"].__spec__ = importlib.machinery.ModuleSpec(spec, None)
    main = __import__(where, fromlist=["main"]).main
    if req["module"] == "workbench.leg":
        return main(req["args"])
    with protocol_legs():  # a run forked here starts its legs here too
        return main(req["args"])


def exit_without_teardown(run) -> None:
    """Runs ``run()`` and ends the process as Python's exit would (its status, non-daemon threads joined, atexit
    handlers, stdio flushed), but without tearing down the modules: in a child of the zygote that teardown
    writes to every page it shares with the zygote (about 2.5 s of CPU; a fresh leg pays about as much)."""
    import atexit

    try:
        code = run()
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:
        code = signal.SIGINT
    except BaseException:  # noqa: BLE001 - printed as Python prints it
        sys.excepthook(*sys.exc_info())
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code is signal.SIGINT:  # died of the signal, as an uncaught KeyboardInterrupt does
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit((code or 0) & 0xFF)


def serve_main(path: str, ready_fd: int) -> int:
    from workbench.childproc import set_parent_death_signal

    set_parent_death_signal(signal.SIGTERM)
    zygote = Zygote(path)
    os.write(ready_fd, b"ready\n")
    os.close(ready_fd)
    child = zygote.serve()
    if child is None:
        return 0
    exit_without_teardown(lambda: run_leg(*child))
    return 1  # not reached


# --------------------------------------------------------------------------- its starter


class Handle:
    """The zygote of this test process (``start``): its socket in ``WORKBENCH_TEST_ZYGOTE`` while it runs."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="leg-zygote-")
        self.path = os.path.join(self.dir, "zygote.sock")
        self.log = open(os.environ.get(LOG_ENV) or os.path.join(self.dir, "zygote.log"), "a")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        env.pop(ENV, None)
        read_fd, write_fd = os.pipe()
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", self.path,
                                      str(write_fd)], cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, pass_fds=(write_fd,))
        os.close(write_fd)
        with os.fdopen(read_fd) as ready:
            up = select.select([ready], [], [], 600)[0] and ready.readline().strip() == "ready"
        if not up:
            self.stop()
            raise RuntimeError(f"the leg zygote did not start: {Path(self.log.name).read_text()[-2000:]}")
        os.environ[ENV] = self.path

    def stop(self) -> None:
        if os.environ.get(ENV) == self.path:
            del os.environ[ENV]
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


_HANDLE: list[Handle] = []


def start() -> None:
    """Start this process's zygote once (a no-op where it is turned off, on a CUDA host, or running). From the
    main thread only: the zygote dies with the thread that started it (its parent-death signal)."""
    import glob

    if _HANDLE or os.environ.get(ENV) or threading.current_thread() is not threading.main_thread():
        return  # running (this process's, or the one that forked this process), off, or not the main thread
    if glob.glob("/dev/nvidia[0-9]*") or os.environ.get("CUDA_VISIBLE_DEVICES"):
        os.environ[ENV] = "0"  # CUDA legs stay fresh processes
        return
    try:
        _HANDLE.append(Handle())
    except (OSError, RuntimeError) as exc:
        print(f"leg zygote off: {exc}", file=sys.stderr)
        os.environ[ENV] = "0"


def stop() -> None:
    while _HANDLE:
        _HANDLE.pop().stop()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        sys.exit(serve_main(sys.argv[2], int(sys.argv[3])))
    sys.exit(client(sys.argv[1], sys.argv[2:]))
