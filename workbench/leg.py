"""One leg: one process, one engine, one configuration, every prompt decoded greedily.

    python -m workbench.leg --config legs/<leg>/leg.json          (what the protocol runs)
    python -m workbench.leg --target DIR [--draft DIR --gamma N] --prompts FILE.jsonl \
        --max-tokens N --out DIR [--relax-logtau X] [--blind-mm] [--no-draft-cudagraph]
        [--draft-cudagraph-mode M] [--draft-linear-kernel K] [--async-scheduling] ...

Both routes build the same ``LegConfig``. Every input that can be checked
before an engine starts is checked first (``preflight``). Records stream into
``records.jsonl.partial`` as prompts finish and are renamed ``records.jsonl``
when the leg completes, next to ``summary.json``; a failure writes
``failure.json`` and keeps the partial records beside it. A finished leg is
never changed by a later command that fails; ``--force`` moves it under
``attempts/`` only once the new leg's inputs have passed the checks. See
docs/architecture.md for the formats.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from . import engine as engines  # "engine" is a local name in run_leg (the LLM's engine)
from .childproc import set_parent_death_signal
from .engine import in_process_cpu_env  # noqa: F401  (re-exported: the thread settings of a CPU leg)
from .knobs import KNOBS, Knobs
from .metrics import acceptance_length, acceptance_rate
from .runfolder import (FAILURE, LEG_JSON, RECORDS, RECORDS_PARTIAL, SUMMARY, append_jsonl, archive_leg,
                        failure_record, leg_status, read_json, read_jsonl, read_jsonl_salvage, run_dir_of_leg,
                        write_json_atomic, write_jsonl_atomic, write_summary)
from .runfolder import write_failure as write_failure_file

# Set by the protocol for the legs it starts: the leg stops when that process dies.
PARENT_ENV = "WORKBENCH_PARENT_PID"


# Knobs of the table that are LegConfig fields of the same name (the speculative ones live in Knobs).
WORKLOAD_KNOBS = ("n", "max_tokens", "max_model_len", "max_num_seqs", "dtype", "gpu_memory_utilization",
                  "tensor_parallel_size")


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
    # a serving leg's client concurrencies against its one server (max_num_seqs = the largest); None: one
    # cell at max_num_seqs
    concurrencies: list[int] | None = None
    # vLLM's tensor parallelism: target and draft sharded over this many worker processes (one per rank)
    tensor_parallel_size: int = 1
    max_num_batched_tokens: int | None = None
    dtype: str = "auto"
    gpu_memory_utilization: float | None = None
    enforce_eager: bool | None = None
    # vLLM's attention backend by name (e.g. TRITON_ATTN, FLASH_ATTN); None: vLLM's choice
    attention_backend: str | None = None
    # KV cache size in bytes on a GPU (vLLM's kv_cache_memory_bytes): skips vLLM's start-up memory
    # profile, which refuses to start while another process on the same GPU frees memory.
    kv_cache_memory_bytes: int | None = None
    # vLLM's load_format: "dummy" (random weights) under the shape profiles (cost ladder, serving ladder)
    load_format: str = "auto"
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
    # a failed earlier attempt of this leg: its finished prompts are reused when the engine settings match
    resume_from: str | None = None

    # Fields that do not change what the engine computes or how fast: identity and bookkeeping.
    _NOT_ENGINE = ("out", "pids", "n", "experiment", "leg", "run_id", "force", "resume_from")

    def __post_init__(self):
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise LegError(f"kv_cache_memory_bytes must be a positive number of bytes, got {self.kv_cache_memory_bytes}")
        for name in WORKLOAD_KNOBS:  # the knob table's checks; None: the leg's or vLLM's default
            value = getattr(self, name)
            if value is not None:
                try:
                    KNOBS[name].validate(value)
                except ValueError as exc:
                    raise LegError(str(exc)) from None

    @property
    def mode(self) -> str:
        return "vanilla" if self.draft is None else "spec"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["knobs"] = self.knobs.as_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "leg config") -> "LegConfig":
        if not isinstance(d, dict):
            raise LegError(f"{where}: expected a JSON object, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise LegError(f"{where}: unknown field(s) {unknown}; fields: {sorted(names)}")
        missing = [k for k in ("target", "prompts", "out", "max_tokens") if d.get(k) is None]
        if missing:
            raise LegError(f"{where}: missing field(s) {missing}")
        kw = dict(d)
        knobs = kw.pop("knobs", None) or {}
        if not isinstance(knobs, dict):
            raise LegError(f"{where}: 'knobs' must be an object")
        try:
            kw["knobs"] = Knobs(**knobs)
        except TypeError as exc:
            raise LegError(f"{where}: knobs: {exc}") from None
        return cls(**kw)

    # Paths that leg.json stores relative to its own folder when they lie in the same run folder, so a
    # copied or moved run folder still names its own prompts and attempts (and can reuse them).
    _RUN_PATHS = ("prompts", "out", "resume_from")

    def to_file_dict(self, folder: str | Path) -> dict[str, Any]:
        """``to_dict`` as leg.json in ``folder`` stores it: paths inside the run folder made relative."""
        d = self.to_dict()
        folder = Path(folder).resolve()
        rdir = run_dir_of_leg(folder)
        if rdir is None:
            return d
        for key in self._RUN_PATHS:
            value = d.get(key)
            if value:
                p = Path(value).resolve()
                if p == rdir or rdir in p.parents:
                    d[key] = os.path.relpath(p, folder)
        return d

    def engine_settings(self) -> dict[str, Any]:
        """What must match for records of two attempts to belong in one leg."""
        return {k: v for k, v in self.to_dict().items() if k not in self._NOT_ENGINE}


def load_leg_config(path: str | Path) -> LegConfig:
    """A leg.json: relative paths in it are relative to its own folder (see ``LegConfig.to_file_dict``)."""
    path = Path(path)
    d = read_json(path)
    if isinstance(d, dict):
        d = dict(d)
        for key in LegConfig._RUN_PATHS:
            value = d.get(key)
            if isinstance(value, str) and value and not os.path.isabs(value):
                d[key] = os.path.normpath(path.parent.resolve() / value)
    return LegConfig.from_dict(d, str(path))


# --------------------------------------------------------------------------- #
# Checks that need no engine                                                   #
# --------------------------------------------------------------------------- #
def read_model_config(path: str, role: str) -> dict:
    p = Path(path)
    if not p.exists():
        raise LegError(f"{role} checkpoint not found: {path}")
    cfg = p / "config.json"
    if not cfg.is_file():
        raise LegError(f"{role} checkpoint {path} has no config.json (not a model folder?)")
    try:
        data = json.loads(cfg.read_text())
    except json.JSONDecodeError as exc:
        raise LegError(f"{role} checkpoint {path}: config.json is not valid JSON: {exc}") from None
    except OSError as exc:
        raise LegError(f"{role} checkpoint {path}: cannot read config.json ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise LegError(f"{role} checkpoint {path}: config.json holds a JSON {type(data).__name__}, "
                       "not an object (a model config is a JSON object)")
    return data


def _vocab_size(cfg: dict) -> int | None:
    for c in (cfg.get("text_config") or {}, cfg):
        if isinstance(c, dict) and isinstance(c.get("vocab_size"), int):
            return c["vocab_size"]
    return None


def is_local(path: str) -> bool:
    # A Hugging Face id looks like "org/name" and does not exist locally.
    return os.path.isabs(path) or path.startswith(".") or os.path.exists(path)


def spec_len_limit() -> int:
    """vLLM 0.27.1's rejection sampler takes at most this many drafted tokens per step."""
    from vllm.v1.sample.rejection_sampler import MAX_SPEC_LEN

    return int(MAX_SPEC_LEN)


def gamma_problem(gamma: int | None, max_model_len: int, limit: int | None = None) -> str | None:
    """Why ``gamma`` cannot run on this engine, or None."""
    if gamma is None:
        return None
    if limit is not None and gamma > limit:
        return (f"gamma={gamma} is larger than vLLM's limit of {limit} drafted tokens per step "
                f"(rejection sampler MAX_SPEC_LEN); use gamma <= {limit}")
    if gamma >= max_model_len:
        return f"gamma={gamma} does not fit max_model_len={max_model_len}; use gamma < {max_model_len}"
    return None


def model_problems(target: str, draft: str | None, weights: bool = True) -> list[str]:
    """Checkpoint folders, configs, quantization configs and (``weights``: not under load_format dummy) the
    weight files' headers (``workbench.checkpoints``; local paths only, a hub id is resolved by the engine)."""
    from .checkpoints import file_problems

    problems: list[str] = []
    tcfg = dcfg = None
    for role, path in (("target", target), ("draft", draft)):
        if path is None or not is_local(path):
            continue
        try:
            cfg = read_model_config(path, role)
        except LegError as exc:
            problems.append(str(exc))
            continue
        bad = file_problems(path, cfg, weights)
        if bad:
            problems += [f"{role} checkpoint: {msg}" for msg in bad]
            continue
        if role == "target":
            tcfg = cfg
        else:
            dcfg = cfg
    if tcfg is not None and dcfg is not None:
        tv, dv = _vocab_size(tcfg), _vocab_size(dcfg)
        if tv is not None and dv is not None and dv > tv:
            problems.append(f"draft vocabulary ({dv} tokens, {draft}) is larger than the target's ({tv} tokens, "
                            f"{target}): drafted ids could fall outside the target's vocabulary")
    return problems


_PROCESSOR_LOCK = threading.Lock()


def _processor(target: str) -> tuple[Any, Any]:
    """(processor or None, tokenizer) of a checkpoint."""
    # transformers' lazy imports are not thread-safe: the protocol may check two runs at once.
    with _PROCESSOR_LOCK:
        from transformers import AutoProcessor, AutoTokenizer

        try:
            proc = AutoProcessor.from_pretrained(target)
            tok = getattr(proc, "tokenizer", None)
        except (OSError, ValueError, KeyError):
            proc, tok = None, None
        if tok is None:  # a text-only model has no processor
            tok, proc = AutoTokenizer.from_pretrained(target), None
    return proc, tok


def prompt_lengths(target: str, prompts: list, images: list[list] | None = None) -> list[int]:
    """Prompt tokens (image tokens included) as the engine will count them: the target's own processor."""
    from .chat import load_images, render_prompt

    proc, tok = _processor(target)
    out = []
    for i, p in enumerate(prompts):
        imgs = images[i] if images is not None else (load_images(p) if p.images else [])
        if proc is not None and imgs:
            enc = proc(text=[render_prompt(tok, p)], images=imgs)
            out.append(len(enc["input_ids"][0]))
        else:
            out.append(len(tok(render_prompt(tok, p, with_images=proc is not None and bool(imgs)),
                               add_special_tokens=False)["input_ids"]))
    return out


def length_problems(prompts: list, lengths: list[int], max_model_len: int, model: str) -> list[str]:
    # vLLM refuses a prompt of max_model_len tokens or more (no room for one output token).
    long = [(p.pid, n) for p, n in zip(prompts, lengths) if n >= max_model_len]
    if not long:
        return []
    shown = ", ".join(f"{pid!r} ({n} tokens)" for pid, n in long[:10])
    more = f" and {len(long) - 10} more" if len(long) > 10 else ""
    return [f"{len(long)} prompt(s) do not fit max_model_len={max_model_len} with the tokenizer of {model}: "
            f"{shown}{more}; raise max_model_len or leave those prompts out"]


def tensor_parallel_problems(tp: int, models: dict[str, str | None], on_cuda: bool) -> list[str]:
    """Why ``tp`` cannot run these models (label -> checkpoint; a hub id is not checked) on this host
    (``workbench.parallel``): the one check of a leg and of a run's preflight."""
    from .parallel import host_devices, tp_problems

    configs = {label: read_model_config(path, label) if path is not None and is_local(path) else None
               for label, path in models.items()}
    devices, kind = host_devices(on_cuda)
    return tp_problems(tp, configs, devices, kind)


def check_inputs(cfg: LegConfig) -> tuple[list, list[list]]:
    """The leg's own input, checked before torch or vLLM is imported (a typo fails in about a second):
    the draft / gamma pair, the checkpoints' configs, gamma against max_model_len, the prompts and their
    images (every image decodes). Returns the prompts and their images."""
    if cfg.draft is not None and cfg.knobs.gamma is None:
        raise LegError("a draft model needs --gamma (number of speculative tokens)")
    if cfg.draft is None and cfg.knobs.gamma is not None:
        raise LegError("--gamma given without --draft")
    problems = model_problems(cfg.target, cfg.draft, weights=cfg.load_format != "dummy")
    bad_gamma = gamma_problem(cfg.knobs.gamma, cfg.max_model_len)
    if bad_gamma:
        problems.append(bad_gamma)
    if problems:
        raise LegError("; ".join(problems))
    from .chat import load_images
    from .prompts import load_prompts

    prompts = load_prompts(cfg.prompts, pids=cfg.pids, n=cfg.n)
    if not prompts:
        raise LegError(f"no prompts selected from {cfg.prompts}")
    return prompts, [load_images(p) for p in prompts]


def preflight(cfg: LegConfig, checked: tuple[list, list[list]] | None = None) -> tuple[list, list[list], list[int]]:
    """Everything that can be wrong before an engine starts; returns prompts, their images, their lengths.
    ``checked``: what ``check_inputs`` returned, when the caller ran it first."""
    prompts, images = checked if checked is not None else check_inputs(cfg)
    import vllm_patch

    vllm_patch.check_vllm_version()
    from importlib.metadata import entry_points

    if not any(ep.name == "twin_spec" for ep in entry_points(group="vllm.general_plugins")):
        raise LegError(
            "the vllm_patch plugin is not installed (no 'twin_spec' entry point in "
            "vllm.general_plugins): run `pip install -e .` in the workbench checkout"
        )
    problems = []
    if cfg.tensor_parallel_size > 1:
        models = {"target": cfg.target, **({"draft": cfg.draft} if cfg.draft is not None else {})}
        problems += tensor_parallel_problems(cfg.tensor_parallel_size, models, _cuda_present())
    from .combinations import combination_problems

    roles = {"target": cfg.target, **({"draft": cfg.draft} if cfg.draft is not None else {})}
    problems += combination_problems([(cfg.leg or "this leg", cfg.dtype, roles)], {},
                                     "gpu" if _cuda_present() else "cpu")
    bad_gamma = gamma_problem(cfg.knobs.gamma, cfg.max_model_len, spec_len_limit())
    if bad_gamma:
        problems.append(bad_gamma)
    if problems:
        raise LegError("; ".join(problems))
    lengths = prompt_lengths(cfg.target, prompts, images)
    problems = length_problems(prompts, lengths, cfg.max_model_len, cfg.target)
    if problems:
        raise LegError("; ".join(problems))
    return prompts, images, lengths


# --------------------------------------------------------------------------- #
# Engine                                                                       #
# --------------------------------------------------------------------------- #
def engine_args(cfg: LegConfig) -> dict[str, Any]:
    """The leg's engine arguments (of ``vllm.LLM``, built by ``workbench.engine.build``; in its summary)."""
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
    if cfg.tensor_parallel_size > 1:
        # one worker process per rank (vLLM's multiprocess executor; on CPU its shared-memory communicator)
        kw["tensor_parallel_size"] = cfg.tensor_parallel_size
        kw["distributed_executor_backend"] = "mp"
    elif _in_process(cfg):
        # Engine core and worker in the leg's own process: on CPU this cuts
        # engine start from ~30 s to ~6 s (no process spawns, no re-imports).
        kw["distributed_executor_backend"] = "uni"
    if cfg.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if cfg.load_format != "auto":
        kw["load_format"] = cfg.load_format
    if cfg.attention_backend:
        kw["attention_backend"] = cfg.attention_backend
    if cfg.kv_cache_memory_bytes is not None and on_cuda:
        kw["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
    elif on_cuda:
        from workbench.memory_plan import MemoryPlanError, plan_for_leg
        try:
            plan = plan_for_leg(cfg)
        except MemoryPlanError as exc:
            raise LegError(str(exc)) from None
        if plan is not None:  # the KV cache sized up front, and the share that covers it (workbench.memory_plan)
            kw["kv_cache_memory_bytes"] = plan.kv_cache_memory_bytes
            kw["gpu_memory_utilization"] = plan.gpu_memory_utilization
    if "gpu_memory_utilization" not in kw and cfg.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    elif "gpu_memory_utilization" not in kw and not on_cuda:
        # On CPU this is the share of host memory for the KV cache.
        kw["gpu_memory_utilization"] = 0.05
    # torch.compile on CPU costs far more start time than it saves on tiny models.
    kw["enforce_eager"] = (not on_cuda) if cfg.enforce_eager is None else cfg.enforce_eager
    if cfg.draft is not None:
        kw["speculative_config"] = engines.spec_config(cfg.draft, cfg.knobs.gamma,
                                                       cfg.knobs.spec_config_extra(cfg.max_num_seqs, cfg.target)[0])
        kw.update(cfg.knobs.engine_args(on_cuda))  # async scheduling, asked explicitly (CUDA only)
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
        engines.in_process_env(cpu=not _cuda_present(), threads=cfg.cpu_threads)
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    # A forked engine core inherits whatever threads the leg started (tokenizer
    # pools): on CUDA it hung allocating pinned buffers. Spawn a clean process.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if os.environ.get("VLLM_SPEC_CPU_ISA"):
        # Before anything loads vLLM's CPU kernel library (the plugin repeats
        # this at engine start, where it is too late if a check imported it).
        from vllm_patch.cpu_int4 import apply_cpu_isa

        apply_cpu_isa()


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


def _quartiles(values: list[float]) -> dict[str, Any] | None:
    import statistics

    if not values:
        return None
    q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3
    return {"median": round(statistics.median(values), 4), "q1": round(q[0], 4), "q3": round(q[2], 4),
            "n": len(values)}


def step_costs_of(rows: list[dict], gamma: int | None) -> dict[str, Any]:
    """Median and quartiles (ms) of the step timer's rows, decode steps only (prefill steps left out).

    ``decode_ms``: the target's forward in a step with no drafts to verify (a vanilla engine's decode step);
    ``verify_ms``: the target's forward in a step that verifies drafts (gamma + 1 tokens per request);
    ``propose_ms``: the drafter's propose in those steps; ``draft_step_ms``: propose / gamma (the first
    pass over gamma + 1 tokens and gamma - 1 single-token steps, averaged); ``draft_loop_ms``: the
    gamma - 1 single-token steps of the propose; ``prefill_ms`` / ``prefill_propose_ms``: the target's
    forward and the drafter's propose in the prefill steps.
    """
    prefill = [r for r in rows if r.get("prefill") and r.get("target_ms") is not None]
    decode = [r for r in rows if not r.get("prefill") and r.get("target_ms") is not None]
    verify = [r for r in decode if r.get("spec_tokens")]
    plain = [r for r in decode if not r.get("spec_tokens")]
    out: dict[str, Any] = {"steps": len(rows), "decode_steps": len(decode),
                           "decode_ms": _quartiles([r["target_ms"] for r in plain]),
                           "verify_ms": _quartiles([r["target_ms"] for r in verify])}
    proposes = [r["draft_ms"] for r in verify if r.get("draft_ms") is not None]
    out["propose_ms"] = _quartiles(proposes)
    out["draft_step_ms"] = _quartiles([v / gamma for v in proposes]) if gamma else None
    out["draft_loop_ms"] = _quartiles([r["draft_loop_ms"] for r in verify if r.get("draft_loop_ms") is not None])
    # the prefill steps: the target's forward over the prompt, and the drafter's propose that follows it
    # (the draft's own prefill and its first gamma tokens)
    out["prefill_ms"] = _quartiles([r["target_ms"] for r in prefill])
    out["prefill_propose_ms"] = _quartiles([r["draft_ms"] for r in prefill if r.get("draft_ms") is not None])
    return out


def leg_step_costs(llm, gamma: int | None) -> dict[str, Any] | None:
    """The step timer's summary for this leg's engine (rank 0's file), or a reason why there is none."""
    try:
        paths = [p for p in llm.collective_rpc("twin_spec_flush_steps") if p]
        if not paths:
            return {"unavailable": "the plugin's step timer is off in this engine"}
        rows = [json.loads(line) for line in Path(paths[0]).read_text().splitlines() if line.strip()]
        return step_costs_of(rows, gamma)
    except Exception as exc:  # noqa: BLE001 - timing is a measurement, never the leg's failure
        return {"unavailable": f"{type(exc).__name__}: {exc}"}


def _counter_delta(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in _SPEC_METRICS.values()}
    a, b = after["accepted_per_pos"], before["accepted_per_pos"]
    n = max(len(a), len(b))
    a, b = a + [0] * (n - len(a)), b + [0] * (n - len(b))
    d["accepted_per_pos"] = [x - y for x, y in zip(a, b)]
    return d


# Engine-report facts that differ between the ranks of one tensor-parallel engine by construction: the
# process, its rank, and what its shard holds (weight bytes are per rank).
PER_RANK_FACTS = ("pid", "tp_rank", "weight_bytes")


class RankDisagreement(RuntimeError):
    """The workers of one tensor-parallel engine report different builds (a knob, a kernel, a drafter)."""


def merge_rank_reports(reports: list[dict]) -> dict:
    """One engine report from its workers' (one per tensor-parallel rank): the facts every rank shares,
    rank 0's per-rank facts, ``tp_ranks`` (how many reported) and ``rank_pids``. Ranks that disagree on
    anything else are an error naming the fact: the engine did not run one configuration."""
    if len(reports) <= 1:
        return dict(reports[0]) if reports else {}
    by_rank = sorted(reports, key=lambda r: int(r.get("tp_rank", 0)))
    ranks = [int(r.get("tp_rank", 0)) for r in by_rank]
    if len(set(ranks)) != len(ranks):
        raise RankDisagreement(f"engine reports of {len(ranks)} workers name ranks {ranks}: a rank twice")
    base = by_rank[0]
    for other in by_rank[1:]:
        for key in sorted(set(base) | set(other)):
            if key in PER_RANK_FACTS or key.startswith("build_facts_error"):
                continue
            if base.get(key) != other.get(key):
                raise RankDisagreement(
                    f"tensor-parallel ranks disagree on {key!r}: rank {ranks[0]} reports {base.get(key)!r}, "
                    f"rank {other.get('tp_rank')} reports {other.get(key)!r}")
    return {**base, "tp_ranks": len(by_rank), "rank_pids": [r.get("pid") for r in by_rank]}


def read_engine_reports(report_dir: Path) -> dict:
    """The engine's report: its workers' (merged over tensor-parallel ranks, ``merge_rank_reports``), or the
    front end's when no worker wrote one (a vanilla leg before its KV cache existed)."""
    reports = []
    for path in sorted(report_dir.glob("engine-*.json")):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    # A worker's report says what was built (drafter, kernels, its rank); the front end's only what it parsed.
    workers = [r for r in reports if "tp_rank" in r or "drafter" in r or "attention_backend" in r]
    if workers:
        return merge_rank_reports(workers)
    return (reports or [{}])[0]


def read_trace(report_dir: Path) -> dict[str, list[list]]:
    """internal request id -> [[drafted, accepted, margins, invalid, ties], ...] in step order."""
    return TraceTail(report_dir).read_new()


def _external_id(internal: str) -> str:
    # vLLM appends "-<8 random chars>" to the id the caller gave.
    return internal.rsplit("-", 1)[0]


def committed_steps(steps: list[list], n_tokens: int) -> list[list]:
    """The verification steps whose tokens the engine kept: those until the output was complete.

    The prefill gives the first token and each step ``accepted + 1`` more (the last one trimmed to
    the output length). Under async scheduling the engine has already scheduled, drafted and verified
    one more step when it learns a request has finished; vLLM's scheduler drops that step's output and
    counts none of its drafts, and so must the per-prompt statistics, or they exceed vLLM's counters.
    """
    kept, emitted = [], 1
    for step in steps:
        if emitted >= n_tokens:
            break
        kept.append(step)
        emitted += step[1] + 1
    return kept


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
        "acceptance_rate": acceptance_rate(accepted, draft_tokens),
        "acceptance_length": acceptance_length(accepted, drafts),
        # placeholder ids vLLM passed for drafts it invalidated: rejected, no margin
        "invalid_draft_ids": sum(s[3] for s in steps),
    }


class TraceTail:
    """Reads the engine's acceptance trace files incrementally (whole lines only)."""

    def __init__(self, report_dir: Path):
        self.report_dir = Path(report_dir)
        self._offsets: dict[Path, int] = {}

    def read_new(self) -> dict[str, list[list]]:
        """internal request id -> [[drafted, accepted, margins, invalid, ties], ...] for steps not read before.

        ``ties``: drafted positions written as margin 0 that the target did not pick (see the tie rule in
        ``vllm_patch.engine_patches.TraceWriter``)."""
        per_req: dict[str, list[list]] = {}
        for path in sorted(self.report_dir.glob("trace-*.jsonl")):
            with path.open("rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[path] = self._offsets.get(path, 0) + end
            for line in data[:end].decode("utf-8").splitlines():
                if not line.strip():
                    continue
                step = json.loads(line)
                invalid, ties = step.get("invalid", {}), step.get("ties", {})
                for rid, k, a, margins in step["r"]:
                    per_req.setdefault(rid, []).append([k, a, margins, invalid.get(rid, 0), ties.get(rid, [])])
        return per_req


def _knobs_in_effect(cfg: LegConfig, engine_report: dict) -> dict[str, Any]:
    tp = engine_report.get("tensor_parallel_size", 1)  # what the workers ran with (1: no rank reported one)
    if cfg.draft is None:
        return {"gamma": None, "tensor_parallel_size": tp}
    knobs = dict(engine_report.get("knobs", {}))
    knobs["tensor_parallel_size"] = tp
    knobs.pop("report_dir", None)
    knobs["gamma"] = engine_report.get("num_speculative_tokens")
    # What was built, not what was asked; whether the switch can act on this host is its own field.
    knobs["draft_cudagraph"] = engine_report.get("draft_cudagraph", knobs.get("draft_cudagraph"))
    knobs["draft_cudagraph_applies"] = engine_report.get("draft_cudagraph_applies")
    knobs["draft_vision"] = engine_report.get("draft_vision")
    # issue 18: the graph mode built, the draft's W4A16 kernel and vLLM's async setting, as the engine ran them
    for name in ("draft_cudagraph_mode", "draft_linear_kernel", "async_scheduling", "draft_lm_head"):
        knobs[name + "_requested"] = knobs.get(name)
        knobs[name] = engine_report.get(name, knobs.get(name))
        knobs[name + "_applies"] = engine_report.get(name + "_applies")
    knobs["draft_linear_kernels"] = engine_report.get("draft_mp_kernels")
    knobs["draft_linear_kernel_fallback_layers"] = engine_report.get("draft_linear_kernel_fallback_layers")
    knobs["draft_lm_head_kernel"] = engine_report.get("draft_lm_head_kernel")
    return knobs


def _resumable_records(cfg: LegConfig, wanted: list[str]) -> tuple[list[dict], str | None]:
    """Finished prompts of an earlier failed attempt, when its engine settings equal this leg's."""
    if not cfg.resume_from:
        return [], None
    prev = Path(cfg.resume_from)
    try:
        old = load_leg_config(prev / LEG_JSON)
    except (OSError, ValueError) as exc:
        return [], f"not reused: {prev / LEG_JSON} unreadable ({exc})"
    if old.engine_settings() != cfg.engine_settings():
        diff = sorted(k for k, v in cfg.engine_settings().items() if old.engine_settings().get(k) != v)
        return [], f"not reused: engine settings differ ({', '.join(diff)})"
    src = prev / RECORDS_PARTIAL if (prev / RECORDS_PARTIAL).is_file() else prev / RECORDS
    if not src.is_file():
        return [], "not reused: no records"
    want = set(wanted)
    # A torn last line (the prompt being written when the leg died) or a damaged line elsewhere: the
    # whole records are reused and those prompts are decoded again.
    good, bad = read_jsonl_salvage(src)
    seen: set[str] = set()
    recs = []
    for r in good:
        if r.get("pid") in want and r["pid"] not in seen:
            seen.add(r["pid"])
            recs.append(r)
    for r in recs:
        r["resumed_from"] = str(prev)
    note = f"reused {len(recs)} prompt(s) from {prev}"
    if bad:
        note += f"; {len(bad)} damaged line(s) in {src.name} (line {', '.join(map(str, bad[:5]))}) decoded again"
    return recs, note


def run_leg(cfg: LegConfig) -> dict:
    out = Path(cfg.out)
    finished = leg_status(out) == "complete"
    if finished and not cfg.force:
        raise LegError(f"{out} already holds a finished leg ({SUMMARY}); use --force to redo it")
    checked = check_inputs(cfg)  # bad input fails before torch or vLLM is imported
    prepare_process_env(cfg)
    prompts, images, lengths = preflight(cfg, checked)
    # The inputs are good: only now may an earlier result make room.
    if out.is_dir() and any((out / f).exists() for f in (RECORDS, RECORDS_PARTIAL, SUMMARY, FAILURE)):
        archived = archive_leg(out)
        print(f"[leg] earlier result moved to {archived}", file=sys.stderr, flush=True)
        if cfg.resume_from and Path(cfg.resume_from).resolve() == out.resolve():
            cfg.resume_from = str(archived)  # "resume this folder": its earlier attempt is now there
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / LEG_JSON, dict(cfg.to_file_dict(out), force=False))

    carried, resume_note = _resumable_records(cfg, [p.pid for p in prompts])
    done = {r["pid"] for r in carried}
    partial = out / RECORDS_PARTIAL
    partial.unlink(missing_ok=True)
    if carried:
        append_jsonl(partial, carried)

    report_dir = Path(tempfile.mkdtemp(prefix="engine-", dir=out))
    # the plugin's step timer too: the target's and the drafter's time per engine step (summary "step_costs")
    engines.knob_env({**cfg.knobs.to_env(report_dir=str(report_dir)), "VLLM_SPEC_STEP_TIMING": "1"})

    from vllm import SamplingParams

    from .chat import render_prompt

    engine_kwargs = engine_args(cfg)
    llm, engine_start_s = engines.build(engine_kwargs)
    tokenizer = llm.get_tokenizer()
    engine_report = read_engine_reports(report_dir)
    knobs_in_effect = _knobs_in_effect(cfg, engine_report)
    tracing = cfg.draft is not None and cfg.knobs.trace
    trace = TraceTail(report_dir)
    trace_by_ext: dict[str, list[list]] = {}

    todo = [i for i, p in enumerate(prompts) if p.pid not in done]
    inputs = []
    for i in todo:
        item: dict[str, Any] = {"prompt": render_prompt(tokenizer, prompts[i])}
        if images[i]:
            item["multi_modal_data"] = {"image": images[i]}
        inputs.append(item)
    sp = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, ignore_eos=cfg.ignore_eos, seed=cfg.seed)

    def record(p, res, t: float, t_queue: float | None) -> dict[str, Any]:
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
        if tracing:
            traced = trace_by_ext.get(res.request_id, [])
            steps = committed_steps(traced, len(res.outputs[0].token_ids))
            rec["spec"] = per_prompt_spec(steps, cfg.knobs.gamma)
            rec["trace"] = {
                **({"steps_after_finish": len(traced) - len(steps)} if len(traced) > len(steps) else {}),
                "steps": [{"drafted": k, "accepted": a, "margins": m, **({"invalid": bad} if bad else {}),
                           **({"ties": tied} if tied else {})}
                          for k, a, m, bad, tied in steps]
            }
        return rec

    def collect_trace() -> None:
        if tracing:
            # The trace is written off the decode path; wait until it is complete.
            llm.collective_rpc("twin_spec_flush_trace")
            for rid, steps in trace.read_new().items():
                trace_by_ext.setdefault(_external_id(rid), []).extend(steps)

    before = spec_counters(llm)
    t_run = time.perf_counter()
    if cfg.max_num_seqs == 1:
        # One request at a time: t is that request's own wall time; each record is kept as it finishes.
        for j, (i, item) in enumerate(zip(todo, inputs)):
            ts = time.perf_counter()
            res = llm.generate([item], sp, use_tqdm=False)[0]
            t = time.perf_counter() - ts
            collect_trace()
            append_jsonl(partial, [record(prompts[i], res, t, None)])
            print(f"[leg {cfg.leg or cfg.mode}] {j + 1}/{len(todo)} {prompts[i].pid}: "
                  f"{len(res.outputs[0].token_ids)} tokens in {t:.2f}s", file=sys.stderr, flush=True)
    elif inputs:
        # Several requests at once: they are queued together and the engine is stepped here (what
        # LLM.generate does inside), so each prompt's record is appended the moment its request
        # finishes. A leg killed half-way keeps the finished prompts for resume, as at concurrency 1.
        ts = time.perf_counter()
        rids = llm.enqueue(inputs, sp, use_tqdm=False)
        # enqueue may hand back vLLM's internal ids ("<ours>-<suffix>"); outputs carry ours
        index_of = {_external_id(str(rid)): i for rid, i in zip(rids, todo)}
        n_done = 0
        engine = llm.llm_engine
        while engine.has_unfinished_requests():
            finished = [o for o in engine.step() if getattr(o, "finished", False)]
            if not finished:
                continue
            # One trace flush per engine step that finishes requests (at most one per prompt, as at
            # concurrency 1): their per-step acceptance must be on disk before their records are.
            collect_trace()
            rows = []
            for res in finished:
                i = index_of[_external_id(str(res.request_id))]
                # Engine-core timestamps (one monotonic clock): the request's service
                # time from first scheduled to last token; waiting for a free slot
                # under the concurrency limit is kept apart (t_queue).
                m = getattr(res, "metrics", None)
                sched, last, queued = (getattr(m, k, 0.0) or 0.0 for k in ("scheduled_ts", "last_token_ts", "queued_ts"))
                if sched > 0 and last > sched:
                    rows.append(record(prompts[i], res, last - sched, max(sched - queued, 0.0) if queued > 0 else None))
                else:
                    rows.append(record(prompts[i], res, time.perf_counter() - ts, None))
            append_jsonl(partial, rows)
            n_done += len(rows)
            print(f"[leg {cfg.leg or cfg.mode}] {n_done}/{len(todo)} done "
                  f"({', '.join(r['pid'] for r in rows)})", file=sys.stderr, flush=True)
    wall_s = time.perf_counter() - t_run
    counters = _counter_delta(spec_counters(llm), before)
    step_costs = leg_step_costs(llm, cfg.knobs.gamma if cfg.draft is not None else None)

    by_pid = {r["pid"]: r for r in read_jsonl(partial)}
    records = [by_pid[p.pid] for p in prompts]  # prompt order, carried prompts included
    write_jsonl_atomic(out / RECORDS, records)
    partial.unlink(missing_ok=True)
    spec_summary = None
    if cfg.draft is not None:
        spec_summary = dict(counters)
        d, dt, a = counters["num_drafts"], counters["num_draft_tokens"], counters["num_accepted_tokens"]
        spec_summary["acceptance_rate"] = acceptance_rate(a, dt)
        spec_summary["acceptance_length"] = acceptance_length(a, d)
    summary = {
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
        "n_resumed": len(carried),
        "resume": resume_note,
        "max_tokens": cfg.max_tokens,
        "knobs_requested": cfg.knobs.as_dict(),
        "knobs": knobs_in_effect,
        "engine_report": read_engine_reports(report_dir),
        "engine_args": {k: v for k, v in engine_kwargs.items()},
        "versions": engines.versions(),
        "host": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        "engine_start_s": round(engine_start_s, 3),
        "wall_s": round(wall_s, 3),
        "gen_tokens": sum(r["gen_len"] for r in records),
        # engine-wide counters cover the prompts decoded by this process (not the resumed ones)
        "spec": spec_summary,
        "step_costs": step_costs,
    }
    summary = write_summary(out, summary)
    shutil.rmtree(report_dir, ignore_errors=True)
    return summary


def write_failure(out: Path, exc: BaseException, cfg: LegConfig | None = None) -> None:
    """failure.json; records of prompts that finished stay in records.jsonl.partial beside it."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in (RECORDS, RECORDS + ".tmp", SUMMARY):
        (out / stale).unlink(missing_ok=True)
    for d in glob.glob(str(out / "engine-*")):
        shutil.rmtree(d, ignore_errors=True)
    partial = out / RECORDS_PARTIAL
    n_done = len(read_jsonl(partial, tolerate_torn_tail=True)) if partial.is_file() else 0
    write_failure_file(out, failure_record(
        exc,
        leg=cfg.leg if cfg else None,
        experiment=cfg.experiment if cfg else None,
        run_id=cfg.run_id if cfg else None,
        mode=cfg.mode if cfg else None,
        tier=cfg.knobs.tier if cfg else None,
        gamma=cfg.knobs.gamma if cfg else None,
        n_prompts_done=n_done,
        partial_records=RECORDS_PARTIAL if n_done else None,
    ))


# --------------------------------------------------------------------------- #
# Dying with the run                                                           #
# --------------------------------------------------------------------------- #
def _stop_own_group(*_: Any) -> None:
    # The leg leads its process group (the protocol starts it in a new session): engine-core and
    # worker processes are in it too, and go with it.
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(143)


def die_with_parent() -> None:
    """When the process that started this leg dies, by any signal, the leg and its engine stop.

    Three layers: the kernel's parent-death signal (prctl PR_SET_PDEATHSIG), a SIGTERM handler that
    takes the leg's whole process group down, and a watchdog thread for the window before prctl and
    for a main thread stuck in native code.
    """
    raw = os.environ.get(PARENT_ENV)
    if not raw:
        return  # started by hand: the terminal owns it
    parent = int(raw)
    signal.signal(signal.SIGTERM, _stop_own_group)
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:
        _stop_own_group()

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                _stop_own_group()
            time.sleep(0.5)

    threading.Thread(target=watch, name="leg-parent-watch", daemon=True).start()


# --------------------------------------------------------------------------- #
# Command line                                                                 #
# --------------------------------------------------------------------------- #
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m workbench.leg", description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="leg.json written by the protocol (replaces every other option but --force)")
    ap.add_argument("--target", help="target checkpoint (folder or HF id)")
    ap.add_argument("--draft", help="draft checkpoint; omit for a vanilla leg")
    ap.add_argument("--prompts", help="prompt file (JSONL, workbench prompt schema)")
    ap.add_argument("--pids", help="comma-separated prompt ids to run, in this order")
    for name in WORKLOAD_KNOBS:  # from the knob table; defaults are LegConfig's (None: a required option)
        k, f = KNOBS[name], LegConfig.__dataclass_fields__[name]
        ap.add_argument(k.flag, dest=name, type=k.type, default=None if f.default is MISSING else f.default,
                        help=k.help)
    ap.add_argument("--max-num-batched-tokens", type=int)
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--attention-backend", help="vLLM attention backend, e.g. TRITON_ATTN (default: vLLM's choice)")
    ap.add_argument("--kv-cache-memory-bytes", type=int,
                    help="GPU only: KV cache size in bytes; skips vLLM's memory profile so legs can share a GPU")
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--limit-images", type=int, default=4, help="max images per prompt")
    Knobs.add_leg_options(ap)
    ap.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=None,
                    help="run engine core and worker inside the leg process (default: on CPU)")
    ap.add_argument("--cpu-threads", type=int, default=1,
                    help="OpenMP threads of an in-process CPU engine (unless OMP_NUM_THREADS is set)")
    ap.add_argument("--ignore-eos", action="store_true", help="always decode max_tokens tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experiment")
    ap.add_argument("--leg")
    ap.add_argument("--run-id")
    ap.add_argument("--out", help="leg folder")
    ap.add_argument("--force", action="store_true",
                    help="redo a finished leg (it is moved under attempts/ once the new inputs pass the checks)")
    ap.add_argument("--resume-from", help="an earlier failed attempt of this leg: reuse its finished prompts")
    return ap


def config_from_args(args: argparse.Namespace) -> LegConfig:
    if args.config:
        cfg = load_leg_config(args.config)
        if args.force:
            cfg.force = True
        return cfg
    missing = [f"--{n.replace('_', '-')}" for n in ("target", "prompts", "max_tokens", "out")
               if getattr(args, n) is None]
    if missing:
        raise LegError(f"missing option(s) {', '.join(missing)} (or give --config leg.json)")
    return LegConfig(
        target=args.target,
        draft=args.draft,
        prompts=args.prompts,
        out=args.out,
        max_tokens=args.max_tokens,
        knobs=Knobs.from_leg_args(args),
        pids=[p for p in args.pids.split(",") if p] if args.pids else None,
        n=args.n,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        tensor_parallel_size=args.tensor_parallel_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
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
        resume_from=args.resume_from,
    )


def _out_of(args: argparse.Namespace) -> Path | None:
    if args.out:
        return Path(args.out)
    if args.config:
        try:
            # read raw: a config that fails its checks still names the folder its failure goes to
            return Path(args.config).parent / read_json(args.config)["out"]
        except (OSError, ValueError, KeyError, TypeError):
            return Path(args.config).parent
    return None


def is_environment_error(exc: BaseException) -> bool:
    """A failure of the host's install (vLLM, the plugin, a kernel op, a switch), not of the leg's input."""
    import vllm_patch

    # an Int4FallbackError can only come from a loaded cpu_int4 (importing it here would import torch)
    int4 = sys.modules.get("vllm_patch.cpu_int4")
    kinds = (ImportError, vllm_patch.VersionMismatch) + ((int4.Int4FallbackError,) if int4 is not None else ())
    text = str(exc)  # a kernel op missing from vLLM's library; the plugin not registered
    return (isinstance(exc, kinds)
            or "_OpNamespace" in text or "plugin is not installed" in text)


def report_failure(out: Path | None, exc: BaseException, cfg: LegConfig | None) -> str:
    """failure.json where it may go; a finished leg is never touched. Returns the message printed."""
    msg = f"leg failed: {type(exc).__name__}: {exc}"
    if is_environment_error(exc):
        msg += "\n  this looks like the host, not the leg: run `workbench doctor` to see what this host can run"
    if out is None:
        return msg
    if leg_status(out) == "complete":
        # The failure came before --force moved the finished leg aside: it stays as it was.
        return msg + f"\n  the finished leg in {out} is unchanged"
    try:
        write_failure(out, exc, cfg)
    except OSError as err:
        msg += f"\n  could not write {out / FAILURE}: {err.strerror or err}"
    return msg


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    die_with_parent()
    cfg = None
    out = _out_of(args)
    try:
        cfg = config_from_args(args)
        out = Path(cfg.out)
        summary = run_leg(cfg)  # sets the process environment before torch or vLLM is imported
    except Exception as exc:
        print(report_failure(out, exc, cfg), file=sys.stderr)
        return 2
    spec = summary.get("spec") or {}
    line = (
        f"leg {summary['leg'] or summary['mode']}: {summary['n_prompts']} prompts, "
        f"{summary['gen_tokens']} tokens in {summary['wall_s']:.2f}s "
        f"(engine start {summary['engine_start_s']:.1f}s)"
    )
    if spec:
        line += f", acceptance length {spec.get('acceptance_length')}"
    if summary.get("resume"):
        line += f"; {summary['resume']}"
    print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
