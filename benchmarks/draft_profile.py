"""Where a draft step's time goes, kernel by kernel: the twin's single-token steps, its first pass and the
target's verify step of the same decode steps, from torch's profiler, split by what each kernel does.

    python benchmarks/draft_profile.py --size 8b --batches 1,16 --out results/draft-profile/<run id>   # GPU
    python benchmarks/draft_profile.py --size tiny --out /tmp/draft-profile                           # CPU

One spec engine in this process (vLLM's in-process engine core, the leg knobs of ``workbench.knobs``; by
default the setup E16 measured fastest: γ 4, synthetic α 1 (a cost measurement: every drafted token is kept),
``full_all`` drafter graphs, the int4 head, async scheduling), the shape stand-ins on a GPU or the tiny models
on CPU. For each batch size: a warm-up generate, then one profiled generate of ``--tokens`` tokens a request.
The plugin's step timer already brackets each step's target forward and the drafter's ``propose``, and marks
where the propose's γ − 1 single-token steps begin and end; here those marks also open profiler ranges
(``twin::step``, ``twin::target``, ``twin::draft``, ``twin::draft_loop``), and every kernel is put into the
innermost range whose host time holds its launch (a CUDA graph's kernels carry the graph launch's correlation).

Sections of a step: ``draft steps`` (the single-token steps; per step, so divided
by γ − 1), ``draft first pass`` (the propose less its single-token steps), ``target`` (the verify forward),
``step other`` (the rest of the step: sampling, the rejection sampler, input preparation). Each section's
kernel time is split by class (int4 GEMM, bf16 GEMM, attention, KV write, norm, rotary, activation,
sampling, copy, other), with the kernel count, the sum of kernel durations, the GPU span (first kernel's
start to last kernel's end: launch gaps and ramps included; kernels that overlap under programmatic
dependent launch make the sum exceed the span) and the host time of the section's ranges (a span near the
host time says the launches set the pace). Decode steps (no prompt in them, a draft verified) and, apart,
the steps that carry prompts: the draft's prefill and first draft, which a request's first token waits for;
medians over the profiled steps of each kind. On CPU the same split is made of the profiler's operator events
(their own time): it rehearses the code path, not the GPU.

Output in ``--out``: ``draft_profile.json`` (per batch: sections, classes, the top kernels by time),
``README.md`` (the tables), ``env.json``; ``--keep-trace`` keeps each batch's Chrome trace (gzip), and
``--resplit --out RUN_DIR`` splits those traces again (no engine) after the classes change.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# (class, name fragments), first match wins: "fused_add_rms_norm" is a norm, not a copy, and
# "reshape_and_cache_flash" a KV write, not attention
CLASSES = (
    # the own extension's other kernels (named w4a16_* like its GEMM): silu(gate) * up, and the large-M path's
    # dequantization of the weight to bf16 (its cuBLAS GEMM counts as bf16)
    ("activation", ("w4a16_silu_mul",)),
    ("int4 dequant", ("w4a16_dequant",)),
    ("int4 GEMM", ("marlin", "w4a16", "machete", "twin_gemv", "wna16", "twin_hybrid", "twin_cuda", "humming")),
    ("KV write", ("reshape_and_cache", "concat_and_cache", "cache_kernel", "kv_cache_update")),
    ("attention", ("flash", "fmha", "attn", "attention", "sdpa", "paged")),
    ("norm", ("rms_norm", "rmsnorm", "layer_norm", "layernorm", "rsqrt")),
    ("rotary", ("rotary", "rope")),
    ("activation", ("silu", "act_and_mul", "gelu", "sigmoid")),
    ("sampling", ("argmax", "argmin", "topk", "top_k", "sampl", "softmax", "rejection", "gumbel", "exponential",
                  "max_", "reduce_kernel")),
    ("bf16 GEMM", ("gemm", "onednn", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
                   "aten::linear", "aten::matmul", "gemv")),
    ("copy", ("memcpy", "memset", "copy", "fill", "index", "gather", "scatter", "cat", "elementwise",
              "aten::to", "aten::empty", "aten::zero")),
)
SECTIONS = ("draft steps", "draft first pass", "target", "step other")
RANGE_PREFIX = "twin::"


GEMMS = ("int4 GEMM", "bf16 GEMM")


def class_of(name: str) -> str:
    """A kernel's class by its name. Inductor's Triton kernels are named after the graph nodes around them (a
    norm whose input is a Marlin GEMM's output is ``triton_red_fused_fused_add_rms_norm_marlin_gemm_0``), so
    a ``triton_`` kernel is never a GEMM."""
    low = name.lower()
    triton = low.startswith("triton_")
    for cls, keys in CLASSES:
        if triton and cls in GEMMS:
            continue
        if any(k in low for k in keys):
            return cls
    return "other"


# --------------------------------------------------------------------------- ranges in the engine


class Ranges:
    """Profiler ranges opened and closed at the step timer's marks (vLLM and the plugin stay as they are; the
    step timer's class is patched in this process only)."""

    def __init__(self):
        self.open: dict[str, object] = {}

    def _enter(self, key: str, name: str) -> None:
        from torch.autograd.profiler import record_function

        self._exit(key)
        rf = record_function(RANGE_PREFIX + name)
        rf.__enter__()
        self.open[key] = rf

    def _exit(self, key: str) -> None:
        rf = self.open.pop(key, None)
        if rf is not None:
            rf.__exit__(None, None, None)

    def install(self) -> None:
        from vllm_patch import telemetry

        cls = telemetry.StepTimer
        orig_begin, orig_end, orig_span, orig_stamp = cls.begin, cls.end, cls.span, cls.stamp
        ranges = self

        def begin(timer, scheduler_output):
            orig_begin(timer, scheduler_output)
            cur = timer.current or {}
            kind = "prefill" if cur.get("prefill") else "decode"
            ranges._enter("step", f"step:{kind}:{cur.get('reqs', 0)}:{cur.get('spec_tokens', 0)}")

        def end(timer):
            ranges._exit("loop")
            ranges._exit("step")
            orig_end(timer)

        def span(timer, key):
            inner = orig_span(timer, key)

            class _Span:
                def __enter__(self_inner):
                    inner.__enter__()
                    ranges._enter(key, key)

                def __exit__(self_inner, *exc):
                    ranges._exit(key)
                    return inner.__exit__(*exc)
            return _Span()

        def stamp(timer, name):
            orig_stamp(timer, name)
            if name == "draft_loop_t0":
                ranges._enter("loop", "draft_loop")
            elif name == "draft_loop_t1":
                ranges._exit("loop")

        cls.begin, cls.end, cls.span, cls.stamp = begin, end, span, stamp


# --------------------------------------------------------------------------- the trace, split


def _own_times(ops: list[dict]) -> list[dict]:
    """CPU operator events with their own time (``own``: the duration less that of the operators nested in
    them), per thread."""
    out = []
    by_tid: dict = {}
    for e in ops:
        by_tid.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            item = {"name": e["name"], "ts": e["ts"], "dur": e["dur"], "own": e["dur"], "launch": e["ts"]}
            if stack:
                stack[-1]["own"] -= min(e["dur"], stack[-1]["own"])
            stack.append(item)
            out.append(item)
    return out


def trace_items(trace: dict, gpu: bool) -> tuple[list[dict], list[dict], list[float]]:
    """(twin ranges, work items, host times of CUDA-graph launches) of a Chrome trace. ``gpu``: each work item
    a kernel (a memcpy or memset too) with its launch's host time; else a CPU operator with its own time."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ranges = [{"name": e["name"][len(RANGE_PREFIX):], "ts": e["ts"], "end": e["ts"] + e["dur"]}
              for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith(RANGE_PREFIX)]
    launch_ts, graphs = {}, []
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launch_ts[e["args"]["correlation"]] = e["ts"]
            if "graphlaunch" in e.get("name", "").lower():
                graphs.append(e["ts"])
    if not gpu:
        return ranges, _own_times([e for e in events if e.get("cat") == "cpu_op"]), graphs
    kernels = []
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            ts = launch_ts.get(e.get("args", {}).get("correlation"))
            if ts is not None:
                kernels.append({"name": e["name"], "ts": e["ts"], "dur": e["dur"], "own": e["dur"], "launch": ts})
    return ranges, kernels, graphs


def _steps(ranges: list[dict], kind: str) -> list[dict]:
    """The steps of ``kind`` with their target, draft and draft-loop ranges: ``decode`` (no prompt tokens, a
    draft verified) or ``prefill`` (prompt tokens: the target's prefill, the draft's and its first draft)."""
    steps = []
    for r in sorted(ranges, key=lambda r: r["ts"]):
        if not r["name"].startswith("step:"):
            continue
        _, step_kind, reqs, spec = r["name"].split(":")
        if step_kind != kind or (kind == "decode" and int(spec) == 0):
            continue
        inner = {x["name"]: x for x in ranges if x is not r and r["ts"] <= x["ts"] and x["end"] <= r["end"]
                 and not x["name"].startswith("step:")}
        if "draft" in inner and "draft_loop" in inner and "target" in inner:
            steps.append({"range": r, "reqs": int(reqs), "spec_tokens": int(spec), **inner})
    return steps


def _section(step: dict, t: float) -> str | None:
    def inside(key):
        r = step.get(key)
        return r is not None and r["ts"] <= t < r["end"]
    if inside("draft_loop"):
        return "draft steps"
    if inside("draft"):
        return "draft first pass"
    if inside("target"):
        return "target"
    if inside("range"):
        return "step other"
    return None


def _host_us(step: dict) -> dict[str, float]:
    """Host time of each section of a step (its ranges' durations)."""
    dur = {k: step[k]["end"] - step[k]["ts"] for k in ("range", "target", "draft", "draft_loop")}
    return {"draft steps": dur["draft_loop"], "draft first pass": dur["draft"] - dur["draft_loop"],
            "target": dur["target"], "step other": dur["range"] - dur["target"] - dur["draft"]}


def _one_step(st: dict, items: list[dict], graphs: list[float], loop_steps: int, names: dict) -> dict:
    """One step's sections: work by class, count, sum, GPU span, host time (draft steps: per single-token step)."""
    lo, hi = st["range"]["ts"], st["range"]["end"]
    acc = {s: {"by_class_us": {}, "kernels": 0, "sum_us": 0.0, "first": None, "last": None} for s in SECTIONS}
    for it in items:
        sec = _section(st, it["launch"]) if lo <= it["launch"] < hi else None
        if sec is None:
            continue
        a = acc[sec]
        cls = class_of(it["name"])
        a["by_class_us"][cls] = a["by_class_us"].get(cls, 0.0) + it["own"]
        a["kernels"] += 1
        a["sum_us"] += it["own"]
        a["first"] = it["ts"] if a["first"] is None else min(a["first"], it["ts"])
        a["last"] = it["ts"] + it["dur"] if a["last"] is None else max(a["last"], it["ts"] + it["dur"])
        names.setdefault((sec, it["name"]), []).append(it["own"])
    host = _host_us(st)
    n_graphs = {sec: 0 for sec in SECTIONS}
    for ts in graphs:
        sec = _section(st, ts) if lo <= ts < hi else None
        if sec is not None:
            n_graphs[sec] += 1
    row = {}
    for sec, a in acc.items():
        div = loop_steps if sec == "draft steps" else 1
        # the rest of the step lies before and after the spans: a span from its first kernel to its last is not its own
        span = None if sec == "step other" else (a["last"] - a["first"]) if a["first"] is not None else 0.0
        row[sec] = {"by_class_us": {k: v / div for k, v in a["by_class_us"].items()}, "kernels": a["kernels"] / div,
                    "sum_us": a["sum_us"] / div, "span_us": None if span is None else span / div,
                    "host_us": host[sec] / div,
                    "graph_launches": n_graphs[sec] / div}
    return row


def _sections(steps: list[dict], items: list[dict], graphs: list[float], loop_steps: int, step_word: str) -> dict:
    """Medians over ``steps`` per section, and each section's top kernels by time."""
    names: dict[tuple[str, str], list[float]] = {}
    per_step = [_one_step(st, items, graphs, loop_steps, names) for st in steps]
    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None
    out = {}
    for sec in SECTIONS:
        rows = [p[sec] for p in per_step]
        classes = sorted({c for r in rows for c in r["by_class_us"]})
        out[sec] = {"per": "single-token draft step" if sec == "draft steps" else step_word,
                    **{k: med([r[k] for r in rows]) for k in ("sum_us", "span_us", "host_us", "kernels", "graph_launches")},
                    "by_class_us": {c: med([r["by_class_us"].get(c, 0.0) for r in rows]) for c in classes}}
        top = sorted(((nm, sum(v)) for (s, nm), v in names.items() if s == sec), key=lambda x: -x[1])[:12]
        div = max(len(steps), 1) * (loop_steps if sec == "draft steps" else 1)
        out[sec]["top"] = [{"name": nm[:160], "class": class_of(nm), "us_per": tot / div} for nm, tot in top]
    return out


def split(trace: dict, gamma: int, gpu: bool) -> dict:
    """The decode steps' sections (medians: work by class, count, GPU span, host time; the top kernels), and the
    same for the prefill steps (the draft's prefill and first draft, which the first token waits for)."""
    ranges, items, graphs = trace_items(trace, gpu)
    loop_steps = max(gamma - 1, 1)
    decode, prefill = _steps(ranges, "decode"), _steps(ranges, "prefill")
    out = {"on_gpu": gpu, "gamma": gamma, "unit": "kernel time (GPU)" if gpu else "operator own time (CPU)",
           "decode_steps": len(decode), "sections": _sections(decode, items, graphs, loop_steps, "decode step"),
           "prefill_steps": len(prefill), "prefill": _sections(prefill, items, graphs, loop_steps, "prefill step")}
    # a section that launched CUDA graphs but shows no kernel: the profiler did not trace the graphs' kernels
    out["untraced_graphs"] = sorted(sec for part in ("sections", "prefill") for sec, v in out[part].items()
                                    if gpu and (v["graph_launches"] or 0) > 0 and not v["kernels"])
    return out


# --------------------------------------------------------------------------- the run


def run(args) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from workbench import envcapture
    from workbench import ladder_engine as le
    from workbench.engine import cuda_present
    from workbench.knobs import Knobs

    cpu = args.size == "tiny" and not cuda_present()
    knobs = Knobs.from_leg_args(args)
    roles = le.bench_roles(args.size)
    report = args.out / "report"
    report.mkdir(parents=True, exist_ok=True)
    le.set_process_env(cpu, str(report), {**knobs.to_env(str(report)), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    extra, _ = knobs.spec_config_extra(max(args.batches), roles["target"])
    Ranges().install()
    llm, start_s = le.engine(roles["target"], roles["twin"], knobs.gamma, max(args.batches), cpu,
                             dummy=args.size != "tiny", engine_args=knobs.engine_args(on_cuda=not cpu),
                             spec_extra=extra)
    from vllm import SamplingParams

    from vllm_patch import engine_patches as ep

    engine_report = dict(ep.G.report.facts) if ep.G.report else {}
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    hi = le.vocab_hi(args.size)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if not cpu else [])
    result = {"size": args.size, "engine_start_s": start_s, "knobs": knobs.as_dict(), "tokens": args.tokens,
              "prompt_len": args.prompt_len, "engine_report": engine_report, "batches": {}}
    for b in args.batches:
        for w in range(args.warmup):
            llm.generate(le.prompts(b, hi, seed=50 + w, prompt_len=args.prompt_len), sp, use_tqdm=False)
        with profile(activities=activities) as prof:
            llm.generate(le.prompts(b, hi, seed=7, prompt_len=args.prompt_len), sp, use_tqdm=False)
            if not cpu:
                torch.cuda.synchronize()
        path = args.out / f"trace_b{b}.json"
        prof.export_chrome_trace(str(path))
        raw = path.read_bytes()
        if args.keep_trace:  # the exported bytes as they are, compressed
            with gzip.open(str(path) + ".gz", "wb") as f:
                f.write(raw)
        path.unlink()
        trace = json.loads(raw)
        result["batches"][str(b)] = split(trace, knobs.gamma, gpu=not cpu)
    le.free(llm)
    envcapture.write_env(args.out / "env.json", {"command": ["benchmarks/draft_profile.py", *args.argv]})
    (args.out / "draft_profile.json").write_text(json.dumps(result, indent=1))
    text = render(result)
    (args.out / "README.md").write_text(text)
    print(text)
    return result


def resplit(out: Path) -> dict:
    """Split the kept traces of a run folder again (the classes as this file has them now): its
    ``draft_profile.json`` and ``README.md`` rewritten, each batch from its ``trace_b<B>.json.gz``."""
    result = json.loads((out / "draft_profile.json").read_text())
    for b, old in result["batches"].items():
        path = out / f"trace_b{b}.json.gz"
        if not path.is_file():
            raise SystemExit(f"--resplit {out}: no {path.name} (the run kept no trace of batch {b}: --keep-trace)")
        with gzip.open(path, "rt") as f:
            result["batches"][b] = split(json.load(f), old["gamma"], gpu=old["on_gpu"])
    (out / "draft_profile.json").write_text(json.dumps(result, indent=1))
    (out / "README.md").write_text(render(result))
    return result


def render(result: dict) -> str:
    k = result["knobs"]
    lines = [f"# Draft step profile: {result['size']}, γ {k.get('gamma')}, acceptance {k.get('acceptance')}",
             "",
             f"Drafter: kernel `{result['engine_report'].get('draft_linear_kernel', k.get('draft_linear_kernel'))}`, "
             f"graphs `{result['engine_report'].get('draft_cudagraph_mode', k.get('draft_cudagraph_mode'))}`, "
             f"head `{k.get('draft_lm_head')}`, async scheduling {k.get('async_scheduling')}; "
             f"{result['tokens']} tokens a request, prompts of {result['prompt_len']} tokens. Synthetic acceptance "
             "is a cost measurement.", ""]
    for b, res in result["batches"].items():
        unit = "µs of kernel time" if res["on_gpu"] else "µs of operator own time (CPU rehearsal)"
        if res.get("untraced_graphs"):
            lines += [f"**The profiler traced no kernel of the CUDA graphs in: {', '.join(res['untraced_graphs'])}** "
                      "(their GPU time is missing below).", ""]
        for title, key, n in (("decode steps", "sections", res["decode_steps"]),
                              ("prefill steps", "prefill", res["prefill_steps"])):
            lines += [f"## Batch {b}, {title} ({n}; medians, {unit}; host: the ranges' host time)", ""]
            lines += _table(res[key])
        lines.append("Top kernels of a single-token draft step:")
        lines.append("")
        for t in res["sections"]["draft steps"]["top"]:
            lines.append(f"- {t['us_per']:.1f} µs · {t['class']} · `{t['name']}`")
        lines.append("")
    return "\n".join(lines)


def _table(sections: dict) -> list[str]:
    def f(x, fmt=".1f"):
        return "–" if x is None else format(x, fmt)
    classes = sorted({c for s in sections.values() for c in s["by_class_us"]},
                     key=lambda c: -sum(s["by_class_us"].get(c) or 0.0 for s in sections.values()))
    lines = ["| section | per | " + " | ".join(classes) + " | sum | GPU span | host | kernels | graph launches |",
             "|---" * (len(classes) + 7) + "|"]
    for sec, s in sections.items():
        cells = " | ".join(f(s["by_class_us"].get(c, 0.0)) for c in classes)
        lines.append(f"| {sec} | {s['per']} | {cells} | {f(s['sum_us'])} | {f(s['span_us'])} | {f(s['host_us'])} | "
                     f"{f(s['kernels'], '.0f')} | {f(s['graph_launches'], '.2g')} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    from workbench.knobs import Knobs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=("tiny", "8b", "32b"))
    ap.add_argument("--batches", default="1", help="comma-separated batch sizes, profiled one after another")
    ap.add_argument("--tokens", type=int, default=48, help="output tokens a request in the profiled generate")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--keep-trace", action="store_true", help="keep each batch's Chrome trace (trace_b<B>.json.gz)")
    ap.add_argument("--resplit", action="store_true",
                    help="no engine: split the traces kept in --out again and rewrite its tables")
    Knobs.add_leg_options(ap)
    ap.set_defaults(gamma=4, acceptance="alpha:1", trace=False, async_scheduling=True,
                    draft_cudagraph_mode="full_all", draft_lm_head="int4")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    args.argv = argv
    if args.resplit:
        if not (args.out / "draft_profile.json").is_file():
            ap.error(f"--resplit: {args.out} holds no draft_profile.json")
        print(render(resplit(args.out)))
        return 0
    try:
        args.batches = [int(x) for x in args.batches.split(",") if x.strip()]
        if not args.batches or min(args.batches) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--batches {args.batches!r}: comma-separated positive integers")
    if args.tokens < 2 * (args.gamma + 1):
        ap.error(f"--tokens {args.tokens}: at least 2 (γ + 1) = {2 * (args.gamma + 1)}, so decode steps are profiled")
    try:
        Knobs.from_leg_args(args)  # bad knobs are refused here, before any engine starts
    except ValueError as exc:
        ap.error(str(exc))
    if args.size != "tiny":
        from workbench.engine import cuda_present

        if not cuda_present():
            ap.error(f"--size {args.size}: the shape stand-ins run on a CUDA GPU; this host has none (--size tiny)")
    args.out.mkdir(parents=True, exist_ok=True)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
