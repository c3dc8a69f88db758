"""Where a request's first token waits: the engine host's timeline from a request's arrival to the release of
its first token, a vanilla engine beside a spec one, with every blocking host call timed at its call site.

    python benchmarks/ttft_probe.py --size 8b --out results/ttft-probe/<run id>      # GPU, shape stand-ins
    python benchmarks/ttft_probe.py --size tiny --out /tmp/probe                      # CPU rehearsal

Behind ``vllm serve`` the twin's TTFT at concurrency 1 was about 2x vanilla's (8B shape, H100,
``results/E18/20261206T041415Z-c8756c97``): the draft's prefill and first draft, plus about one whole
speculative step more, though ``early_output`` copies the first token before the drafter runs. With async
scheduling vLLM's engine core hands a step's output to the client only after it has scheduled and launched
the next step (``EngineCore.step_with_batch_queue``, a queue of two), so anything in that next launch that
waits for the GPU delays the first token by the time the GPU needs to get there. This probe finds that
wait: one engine per process (vLLM's in-process engine core, the leg knobs of ``workbench.knobs``), a
warm-up, then ``--requests`` single requests one after another (concurrency 1, ``--tokens`` output tokens,
random prompts of ``--prompt-len`` tokens), and for each request the host's events between its arrival and
its first token's release:

* ``schedule``, ``execute_model``, ``sample_tokens``: the engine core's calls, host time;
* ``result``: the wait on a step's output (``AsyncOutputFuture.result``; a plain future on CPU);
* blocking calls: ``torch.cuda.Event.synchronize``, ``Stream.synchronize``, ``torch.cuda.synchronize`` and
  ``.item()`` / ``.tolist()`` / ``.cpu()`` of a CUDA tensor, each with its call site (the nearest frames in
  vLLM or the plugin), kept when longer than ``--min-ms``;
* on CUDA, every other operation that synchronizes (a blocking device-to-host copy, ``nonzero``, ...), from
  torch's sync debug mode (``torch.cuda.set_sync_debug_mode``), as ``sync-op`` events with their call site
  (no duration: the time it waited lands in the enclosing phase).

With ``--profile`` the step that carries each timed request's prefill has its ``sample_tokens`` (where the
spec engine launches the draft's prefill and first draft) run under cProfile: ``profile_<kind>.txt`` (the top
functions by own time) and, in the probe's JSON, that host time split by code area (the plugin, vLLM's
spec-decode, attention and other code, torch's compiled (Inductor) code, CUDA-graph replay, the rest of torch,
C calls), per request. It answers how much of the draft's host time is launch work and Python, and where; the
profiler's own cost inflates Python-heavy areas, so compare areas, not totals, with the unprofiled timeline.

Output: ``probe_vanilla.json`` and ``probe_spec.json`` (raw events of the timed requests and a summary),
``summary.json`` (both, and the spec engine's extra time to the first token split by phase), printed as a
table. Host times on CPU (no async scheduling there) rehearse the code path, not the GPU's answer.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PHASES = ("schedule", "execute_model", "sample_tokens", "result")
BLOCKING_TENSOR_METHODS = ("item", "tolist", "cpu")


class Timeline:
    """Host events of one engine: (kind, start, duration, detail), and each request's arrival and release."""

    def __init__(self, min_ms: float):
        self.min_s = min_ms / 1e3
        self.events: list[tuple[str, float, float, str]] = []
        self.arrival: dict[str, float] = {}
        self.release: dict[str, float] = {}
        self.on = False

    def add(self, kind: str, t0: float, t1: float, detail: str = "") -> None:
        if self.on:
            self.events.append((kind, t0, t1 - t0, detail))

    def timed(self, kind: str, fn, detail=None):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                if kind in PHASES or t1 - t0 >= self.min_s:
                    self.add(kind, t0, t1, detail(args) if detail else "")
        return wrapper


def call_site(skip: int = 2, depth: int = 3) -> str:
    """The nearest frames of vLLM or the plugin above a blocking call: ``file:line function`` joined by ' < '."""
    frames = traceback.extract_stack()[:-skip]
    keep = [f for f in reversed(frames) if ("vllm" in f.filename or "vllm_patch" in f.filename)]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in keep[:depth]) or "?"


def install_blocking_probes(tl: Timeline) -> None:
    """Time the host calls that wait for the GPU (on a CPU host none of them waits: the list stays short)."""
    import torch

    def wrap_sync(owner, name):
        setattr(owner, name, tl.timed(f"sync:{name}", getattr(owner, name), detail=lambda _args: call_site()))

    if torch.cuda.is_available():
        wrap_sync(torch.cuda.Event, "synchronize")
        wrap_sync(torch.cuda.Stream, "synchronize")
        wrap_sync(torch.cuda, "synchronize")
    for name in BLOCKING_TENSOR_METHODS:
        orig = getattr(torch.Tensor, name)

        def wrapper(self, *args, _orig=orig, _name=name, **kwargs):
            if not (tl.on and self.is_cuda):
                return _orig(self, *args, **kwargs)
            t0 = time.perf_counter()
            out = _orig(self, *args, **kwargs)
            t1 = time.perf_counter()
            if t1 - t0 >= tl.min_s:
                tl.add(f"sync:{_name}", t0, t1, call_site())
            return out
        setattr(torch.Tensor, name, wrapper)


class SyncOps:
    """torch's sync debug mode while the timeline is on: each synchronizing CUDA operation is a ``sync-op`` event."""

    def __init__(self, tl: Timeline):
        self.tl = tl
        self._show = None

    def __enter__(self):
        import warnings

        import torch

        if not torch.cuda.is_available():
            return self
        self._show = warnings.showwarning
        warnings.filterwarnings("always", message=".*synchroniz.*")

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                t = time.perf_counter()
                self.tl.add("sync-op", t, t, call_site(skip=3))
            else:
                self._show(message, category, filename, lineno, file, line)
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        import warnings

        import torch

        if self._show is not None:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = self._show
        return False


AREAS = (  # (area, substrings of a function's file name), first match wins
    ("plugin", ("vllm_patch",)),
    ("vllm spec-decode", ("vllm/v1/spec_decode",)),
    ("vllm attention", ("vllm/v1/attention", "vllm/attention")),
    ("cuda-graph replay", ("torch/cuda/graphs.py", "cuda_graph.py", "cudagraph")),
    ("compiled code (Inductor)", ("torchinductor", "torch/_inductor")),
    ("vllm other", ("vllm/",)),
    ("torch other", ("torch/",)),
    ("C calls", ("~",)),
)


def area_of(filename: str) -> str:
    for area, keys in AREAS:
        if any(k in filename for k in keys):
            return area
    return "other"


def short_paths(text: str) -> str:
    """File names in a profile's text without the host's directories: from the package (``vllm/...``,
    ``torch/...``, ``vllm_patch/...``) on, or the standard library module's name."""
    import re

    text = re.sub(r"/\S*?/(?:lib/python3\.\d+/site-packages|site-packages|lib/python3\.\d+)/", "", text)
    return text.replace(str(REPO) + os.sep, "")


class PrefillProfile:
    """cProfile of the ``sample_tokens`` call of the step that carries each timed request's prefill."""

    def __init__(self):
        import cProfile

        self.prof = cProfile.Profile()
        self.pending = False  # a timed request arrived: its prefill step's sample_tokens is the next one
        self.calls = 0

    def wrap(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not self.pending:
                return fn(*args, **kwargs)
            self.pending = False
            self.calls += 1
            self.prof.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                self.prof.disable()
        return wrapper

    def summary(self, path: Path) -> dict:
        """Own time by code area, ms per profiled call, and the top functions into ``path``."""
        import io
        import pstats

        stats = pstats.Stats(self.prof)
        by_area: dict[str, float] = {}
        for (filename, _line, _name), (_cc, _nc, tottime, _ct, _callers) in stats.stats.items():
            area = area_of(filename)
            by_area[area] = by_area.get(area, 0.0) + tottime
        n = max(self.calls, 1)
        buf = io.StringIO()
        pstats.Stats(self.prof, stream=buf).sort_stats("tottime").print_stats(40)
        path.write_text(short_paths(buf.getvalue()))
        return {"calls": self.calls, "ms_per_call": sum(by_area.values()) * 1e3 / n,
                "by_area_ms_per_call": {k: v * 1e3 / n for k, v in sorted(by_area.items(), key=lambda x: -x[1])}}


def install_engine_probes(llm, tl: Timeline, prof: PrefillProfile | None = None) -> None:
    """Wrap the in-process engine core's calls on its instances (vLLM's classes stay as they are)."""
    core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
    core.scheduler.schedule = tl.timed(
        "schedule", core.scheduler.schedule)
    ex = core.model_executor
    ex.execute_model = tl.timed("execute_model", ex.execute_model)
    ex.sample_tokens = tl.timed("sample_tokens", prof.wrap(ex.sample_tokens) if prof else ex.sample_tokens)
    orig_add = core.add_request

    def add_request(request, *args, **kwargs):
        if tl.on:
            tl.arrival.setdefault(request.request_id, time.perf_counter())
            if prof is not None:
                prof.pending = True
        return orig_add(request, *args, **kwargs)
    core.add_request = add_request
    orig_step = core.step_fn

    def step_fn(*args, **kwargs):
        outputs, executed = orig_step(*args, **kwargs)
        now = time.perf_counter()
        for eco in (outputs or {}).values():
            for out in eco.outputs:
                if tl.on and out.new_token_ids and out.request_id not in tl.release:
                    tl.release[out.request_id] = now
        return outputs, executed
    core.step_fn = step_fn
    try:
        from vllm.v1.executor import uniproc_executor as ue

        ue.AsyncOutputFuture.result = tl.timed("result", ue.AsyncOutputFuture.result)
    except (ImportError, AttributeError):
        pass


def request_windows(tl: Timeline) -> list[dict]:
    """Per timed request: arrival -> first token released, and the host time of each event kind inside it."""
    rows = []
    for rid, t_arr in tl.arrival.items():
        t_rel = tl.release.get(rid)
        if t_rel is None:
            continue
        inside = [e for e in tl.events if t_arr <= e[1] < t_rel]
        by_kind: dict[str, float] = {}
        sites: dict[str, float] = {}
        sync_ops: dict[str, int] = {}
        for kind, _t0, dur, detail in inside:
            by_kind[kind] = by_kind.get(kind, 0.0) + dur * 1e3
            if kind == "sync-op":
                sync_ops[detail] = sync_ops.get(detail, 0) + 1
            elif kind.startswith("sync:"):
                sites[f"{kind} {detail}"] = sites.get(f"{kind} {detail}", 0.0) + dur * 1e3
        rows.append({"request_id": rid, "ttft_host_ms": (t_rel - t_arr) * 1e3, "ms_by_kind": by_kind,
                     "blocking_sites_ms": sites, "sync_ops": sync_ops,
                     "events": [[k, round((t0 - t_arr) * 1e3, 3), round(d * 1e3, 3), s] for k, t0, d, s in inside]})
    return rows


def summarize(rows: list[dict]) -> dict:
    if not rows:
        raise SystemExit("no timed request released a first token: nothing to summarize")
    kinds = sorted({k for r in rows for k in r["ms_by_kind"]})
    sites = sorted({s for r in rows for s in r["blocking_sites_ms"]})
    ops = sorted({s for r in rows for s in r["sync_ops"]})
    med = statistics.median
    return {"requests": len(rows),
            "ttft_host_ms": {"median": med(r["ttft_host_ms"] for r in rows),
                             "min": min(r["ttft_host_ms"] for r in rows), "max": max(r["ttft_host_ms"] for r in rows)},
            "median_ms_by_kind": {k: med(r["ms_by_kind"].get(k, 0.0) for r in rows) for k in kinds},
            "median_blocking_sites_ms": {s: med(r["blocking_sites_ms"].get(s, 0.0) for r in rows) for s in sites},
            "median_sync_ops": {s: med(r["sync_ops"].get(s, 0) for r in rows) for s in ops}}


def _knobs(args):
    from workbench.knobs import Knobs, leg_knob_names

    return Knobs(**{name: getattr(args, name) for name in leg_knob_names()})


def run_one(args, kind: str) -> dict:
    """One engine in this process: warm-up, then ``--requests`` timed single requests."""
    import random

    from workbench import ladder_engine as le
    from workbench.engine import cuda_present

    cpu = args.size == "tiny" and not cuda_present()
    knobs = _knobs(args)
    roles = le.bench_roles(args.size)
    report = args.out / f"report_{kind}"
    report.mkdir(parents=True, exist_ok=True)
    env = {**knobs.to_env(str(report)), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    le.set_process_env(cpu, str(report), env)
    extra = {}
    if kind == "spec":
        extra, _ = knobs.spec_config_extra(1, roles["target"])
    tl = Timeline(args.min_ms)
    install_blocking_probes(tl)
    llm, start_s = le.engine(roles["target"], roles["twin"] if kind == "spec" else None, knobs.gamma, 1, cpu,
                             dummy=args.size != "tiny", engine_args=knobs.engine_args(on_cuda=not cpu)
                             if kind == "spec" else None, spec_extra=extra)
    prof = PrefillProfile() if args.profile else None
    install_engine_probes(llm, tl, prof)
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    hi = le.vocab_hi(args.size)
    rnd = random.Random(7)

    def one() -> None:
        llm.generate([{"prompt_token_ids": [rnd.randrange(10, hi) for _ in range(args.prompt_len)]}], sp,
                     use_tqdm=False)
    for _ in range(args.warmup):
        one()
    tl.on = True
    with SyncOps(tl):
        for _ in range(args.requests):
            one()
    tl.on = False
    rows = request_windows(tl)
    out = {"kind": kind, "size": args.size, "engine_start_s": start_s, "knobs": knobs.as_dict(),
           "summary": summarize(rows), "requests": rows}
    if prof is not None:
        out["profile"] = prof.summary(args.out / f"profile_{kind}.txt")
    (args.out / f"probe_{kind}.json").write_text(json.dumps(out, indent=1))
    if kind == "vanilla":
        from workbench import envcapture

        envcapture.write_env(args.out / "env.json", {"command": sys.argv[1:]})
    le.free(llm)
    return out


def compare(out: Path) -> dict:
    """``summary.json``: both engines' medians and the spec engine's extra time by event kind."""
    raw = {k: json.loads((out / f"probe_{k}.json").read_text()) for k in ("vanilla", "spec")}
    van, spec = raw["vanilla"]["summary"], raw["spec"]["summary"]
    profiles = {k: r.get("profile") for k, r in raw.items()}
    kinds = sorted(set(van["median_ms_by_kind"]) | set(spec["median_ms_by_kind"]))
    extra = {k: spec["median_ms_by_kind"].get(k, 0.0) - van["median_ms_by_kind"].get(k, 0.0) for k in kinds}
    summary = {"vanilla": van, "spec": spec,
               "ttft_ratio": spec["ttft_host_ms"]["median"] / van["ttft_host_ms"]["median"],
               "extra_ms_by_kind": extra}
    if all(profiles.values()):
        summary["profile"] = profiles
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"time to first token, host (median of {spec['requests']}): vanilla {van['ttft_host_ms']['median']:.2f} ms, "
          f"spec {spec['ttft_host_ms']['median']:.2f} ms ({summary['ttft_ratio']:.2f}x)")
    print(f"{'event':<22}{'vanilla ms':>12}{'spec ms':>12}{'extra':>10}")
    for k in kinds:
        print(f"{k:<22}{van['median_ms_by_kind'].get(k, 0.0):>12.2f}{spec['median_ms_by_kind'].get(k, 0.0):>12.2f}"
              f"{extra[k]:>10.2f}")
    for s, ms in sorted(spec["median_blocking_sites_ms"].items(), key=lambda x: -x[1])[:8]:
        print(f"  spec blocking {ms:8.2f} ms  {s}")
    for s, n in sorted(spec["median_sync_ops"].items(), key=lambda x: -x[1])[:8]:
        print(f"  spec synchronizing op {n:g}x  {s}")
    if "profile" in summary:
        print(f"prefill step's sample_tokens under cProfile, own time ms per request "
              f"(vanilla {profiles['vanilla']['ms_per_call']:.2f}, spec {profiles['spec']['ms_per_call']:.2f}):")
        for area, ms in profiles["spec"]["by_area_ms_per_call"].items():
            print(f"  {area:<26}{profiles['vanilla']['by_area_ms_per_call'].get(area, 0.0):>10.2f}{ms:>10.2f}")
    return summary


def main(argv: list[str] | None = None) -> int:
    from workbench.knobs import Knobs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=("tiny", "8b", "32b"))
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8, help="output tokens per request")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--min-ms", type=float, default=0.2, help="blocking calls shorter than this are not kept")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the prefill step's sample_tokens of each timed request (profile_<kind>.txt)")
    ap.add_argument("--only", choices=("vanilla", "spec"), help=argparse.SUPPRESS)
    Knobs.add_leg_options(ap)
    ap.set_defaults(gamma=4, acceptance="alpha:1", trace=False, async_scheduling=True)
    args = ap.parse_args(argv)
    try:
        _knobs(args)  # bad knobs are refused here, before any engine starts
    except ValueError as exc:
        ap.error(str(exc))
    if args.requests < 1 or args.tokens < 2:
        ap.error("--requests must be >= 1 and --tokens >= 2 (the step after the first token is what is probed)")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only:
        run_one(args, args.only)
        return 0
    from workbench.childproc import wrap

    for kind in ("vanilla", "spec"):  # one engine per process: a second engine in one process lacks the memory
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--only", kind]
        # the engine process dies with this one: a killed probe leaves no engine holding the GPU
        rc = subprocess.run(wrap(os.getpid(), cmd), cwd=REPO, check=False).returncode
        if rc != 0:
            print(f"[probe] {kind} engine failed (exit {rc})", file=sys.stderr)
            return rc
    compare(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
