"""The cost ladder's runner: one engine in this process, timed step by step by the plugin's step timer.

Used two ways, with one engine code path:

* by the protocol, for an experiment whose ``runner`` is ``ladder`` (E16): each planned leg is one
  engine in one process, ``python -m workbench.ladder_engine --config <run>/legs/<leg>/leg.json``;
  the leg folder gets ``steps.jsonl`` and ``walls.jsonl`` (raw rows) and ``summary.json``
  (``"status": "complete"``, ``"runner": "ladder"``), or ``failure.json``;
* by ``benchmarks/cost_ladder.py`` (its own command line and output folder, same rows).

What one engine does (``run_engine``): vLLM's in-process engine core (so the plugin's step timer
is read directly) with the target alone (vanilla) or with the twin drafting (spec); a warm-up;
then per batch and repeat one ``generate`` of ``batch`` random prompts, greedy, ``tokens`` output
tokens each, preceded by one of ``batch`` other random prompts with a single output token (the time to
the first token of a batch, ``first_wall_s``: the fixed per-request cost the timed wall carries).
A spec engine runs each batch with the drafter's CUDA graphs on and off, alternating, in the same engine
(the drafter's dispatch forced to eager), and where FULL drafter graphs were built also with their
single-token steps dispatched piecewise (``spec_cells``). Every timed step becomes one row of
``steps.jsonl`` tagged with its cell (the first-token ``generate``'s steps are not a cell's); every timed
``generate`` one row of ``walls.jsonl``, with its ``first_wall_s``.

Times are engine-side (``VLLM_SPEC_STEP_TIMING``: CUDA events around the target's forward, the
drafter's ``propose`` and its gamma-1 single-token steps; wall clock on CPU). With the relaxed gate opened wide
(``relax_logtau`` = 1e9) every drafted token passes: alpha = 1 with the twin really drafting.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from workbench import engine as engines
from workbench.runfolder import (LADDER_STEPS as STEPS, LADDER_WALLS as WALLS, failure_record, write_failure,
                                 write_summary)

RELAX_WIDE = "1e9"         # the relaxed gate opened wide: every drafted token passes (alpha = 1)
PROMPT_LEN = 128           # prompt tokens per request
MAX_MODEL_LEN = 2048
GPU_MEMORY_UTILIZATION = 0.80
# Graphs only for the batch shapes the ladder runs: decode b, verification b*(gamma+1), drafting.
CUDAGRAPH_CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128]
WARMUP_TOKENS = 8
FIRST_SEED = 1000          # prompts of the first-token generate: seed FIRST_SEED + rep, none of the timed ones'
SIZES = ("8b", "32b", "tiny")


def vocab_hi(size: str) -> int:
    """Upper bound (exclusive) of the random prompt token ids: inside every model's vocabulary."""
    return 400 if size == "tiny" else 150000


def bench_roles(size: str, shapes_root=None) -> dict[str, str]:
    """The target and the twin a benchmark engine of ``size`` loads: the tiny models (built on first use), or
    the shape stand-ins of ``8b`` / ``32b`` (``workbench.shapes``, random weights, under ``shapes_root``)."""
    if size == "tiny":
        from workbench.tiny import ensure_tiny_models

        m = ensure_tiny_models()
        return {"target": str(m["target"]), "twin": str(m["twin-int4"])}
    from workbench.shapes import build_shapes

    dirs = build_shapes(shapes_root) if shapes_root is not None else build_shapes()
    return {"target": str(dirs[f"{size}-target"]), "twin": str(dirs[f"{size}-twin"])}


def process_env(report_dir: str, knob_env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a ladder engine process, set before vLLM is imported (the plugin reads it).

    ``knob_env``: the leg's knobs as ``workbench.knobs.Knobs.to_env`` writes them; without it (the
    benchmark script) only the relaxed gate is set, opened wide.
    """
    env = {"VLLM_SPEC_STEP_TIMING": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.update(knob_env if knob_env is not None else {"VLLM_SPEC_RELAX_LOGTAU": RELAX_WIDE})
    env["VLLM_SPEC_REPORT_DIR"] = report_dir
    return env


def set_process_env(cpu: bool, report_dir: str, knob_env: dict[str, str] | None = None) -> None:
    engines.knob_env(process_env(report_dir, knob_env))
    if cpu:
        engines.in_process_cpu_env()


def engine(target: str, draft: str | None, gamma: int | None, max_seqs: int, cpu: bool, dummy: bool,
           dtype: str = "bfloat16", max_model_len: int = MAX_MODEL_LEN,
           gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION, engine_args: dict | None = None,
           tensor_parallel_size: int = 1, spec_extra: dict | None = None):
    """An offline ``LLM`` of the target (with the twin drafting ``gamma`` tokens when ``draft``); its start time.

    ``engine_args``: what the leg's knobs add (``Knobs.engine_args``: async scheduling), spec engines only.
    ``tensor_parallel_size`` > 1: vLLM's multiprocess executor, one worker process per rank.
    ``spec_extra``: the speculative_config fields of the acceptance and gamma_schedule knobs
    (``Knobs.spec_config_extra``).
    """
    kw: dict[str, Any] = dict(model=target, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_seqs,
                              seed=0, skip_tokenizer_init=True, limit_mm_per_prompt={"image": 0, "video": 0},
                              enable_prefix_caching=False, disable_log_stats=False)
    if dummy:
        kw["load_format"] = "dummy"
    if cpu:
        kw.update(engines.cpu_args())
    else:
        kw.update(gpu_memory_utilization=gpu_memory_utilization,
                  compilation_config={"cudagraph_capture_sizes": list(CUDAGRAPH_CAPTURE_SIZES)})
    if tensor_parallel_size > 1:
        kw.update(tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="mp")
    if draft is not None:
        kw["speculative_config"] = engines.spec_config(draft, gamma, spec_extra)
        kw.update(engine_args or {})
    return engines.build(kw)


def flush_steps(llm) -> str:
    """Write out the step timer's rows; the file that holds them. Rank 0's: under tensor parallelism the
    other ranks time nothing (``EngineState.set_parallel``), and the workers are other processes."""
    paths = [p for p in llm.collective_rpc("twin_spec_flush_steps") if p]
    if len(paths) != 1:
        raise RuntimeError(f"expected one step timer among the engine's workers, found {len(paths)} "
                           "(VLLM_SPEC_STEP_TIMING=1 and VLLM_SPEC_REPORT_DIR must be set before vLLM is imported)")
    return paths[0]


def prompts(b: int, hi: int, seed: int, prompt_len: int = PROMPT_LEN) -> list[dict]:
    import random

    rnd = random.Random(seed)
    return [{"prompt_token_ids": [rnd.randrange(10, hi) for _ in range(prompt_len)]} for _ in range(b)]


free = engines.free  # an engine's memory back before the next one


def read_new_rows(path: str, pos: int) -> tuple[list[dict], int]:
    """The JSON lines appended to ``path`` since byte ``pos``, and the new end position."""
    try:
        with open(path) as f:
            f.seek(pos)
            rows = [json.loads(line) for line in f if line.strip()]
            return rows, f.tell()
    except FileNotFoundError:
        return [], pos


class _CellTimer:
    """Times one cell's generate after another into the open steps and walls files; each cell reads only its own
    rows of the step timer's file (how far it has been read is kept here)."""

    def __init__(self, llm, *, size: str, hi: int, prompt_len: int, sp, first, extra: dict[str, Any],
                 steps_f, walls_f):
        self.llm, self.size, self.hi, self.prompt_len = llm, size, hi, prompt_len
        self.sp, self.first, self.extra = sp, first, extra
        self.steps_f, self.walls_f = steps_f, walls_f
        self.pos = 0  # how far the step timer's file has been read
        self.steps = self.walls = 0

    def timed(self, cell: dict, b: int, rep: int) -> None:
        llm, prompt_len = self.llm, self.prompt_len
        # The time to the first token of a batch, on prompts of its own: a prefix cache (off in these engines)
        # could otherwise make the timed generate's prefill cheaper than the one timed here.
        t0 = time.perf_counter()
        llm.generate(prompts(b, self.hi, seed=FIRST_SEED + rep, prompt_len=prompt_len), self.first, use_tqdm=False)
        first_wall = time.perf_counter() - t0
        # the warm-up's and the first-token generate's steps are not the cell's
        _, self.pos = read_new_rows(flush_steps(llm), self.pos)
        batch_prompts = prompts(b, self.hi, seed=rep, prompt_len=prompt_len)
        t0 = time.perf_counter()
        outs = llm.generate(batch_prompts, self.sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        rows, self.pos = read_new_rows(flush_steps(llm), self.pos)
        row_tag = {**self.extra, **cell, "size": self.size, "batch": b, "rep": rep}
        for r in rows:
            self.steps_f.write(json.dumps({**row_tag, **r}) + "\n")
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        self.walls_f.write(json.dumps({**row_tag, "wall_s": wall, "first_wall_s": first_wall,
                                       "out_tokens": n_out}) + "\n")
        self.steps_f.flush()
        self.walls_f.flush()
        self.steps += len(rows)
        self.walls += 1


def _engine_report(ep, tensor_parallel_size: int) -> dict[str, Any]:
    """What the engine reported: the workers' reports merged over ranks at tensor_parallel_size > 1 (this process
    built no drafter), else this process's."""
    if ep.G.steps is None:
        raise RuntimeError("the plugin's step timer is off in this engine (VLLM_SPEC_STEP_TIMING=1 and "
                           "VLLM_SPEC_REPORT_DIR must be set before vLLM is imported)")
    if tensor_parallel_size > 1:
        from workbench.leg import read_engine_reports

        return read_engine_reports(Path(ep.G.knobs.report_dir))
    return dict(ep.G.report.facts) if ep.G.report else {}


def run_engine(*, size: str, kind: str, target: str, draft: str | None, gamma: int | None,
               batches: list[int], repeats: int, tokens: int, cpu: bool, dummy: bool,
               steps_f, walls_f, prompt_len: int = PROMPT_LEN, dtype: str = "bfloat16",
               max_model_len: int = MAX_MODEL_LEN, gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
               tag: dict[str, Any] | None = None, log: Callable[[str], None] | None = None,
               engine_args: dict | None = None, eager: bool = True,
               tensor_parallel_size: int = 1) -> dict[str, Any]:
    """One engine's cells (every batch x repeat, each drafter dispatch of ``spec_cells``) -> rows in the open files.

    Every cell (batch, drafter graphs on/off) is warmed up with its own batch size before it is
    timed: a batch size's first propose carries one-time costs (190-230 ms on the H200) that would
    otherwise land in that cell's first repeat.

    Before each timed ``generate``, one of the same batch size and prompt length with one output token
    is timed apart (``first_wall_s`` in the walls row): the prefill, and in a spec engine the draft's
    prefill and first propose, which the timed wall also carries once per request. ``ladder.cost_ratio``
    takes it off to compare the decode alone with S(1, gamma, c).

    Returns what the engine reported: start time, the plugin's engine report, rows written.
    """
    from vllm import SamplingParams

    from vllm_patch import engine_patches as ep

    extra = dict(tag or {})
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    warm = SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True, detokenize=False)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    hi = vocab_hi(size)
    llm, start_s = engine(target, draft if kind == "spec" else None, gamma, max(batches), cpu, dummy, dtype=dtype,
                          max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                          engine_args=engine_args, tensor_parallel_size=tensor_parallel_size)
    report = _engine_report(ep, tensor_parallel_size)
    extra.update(ran_tags(report, extra))
    walls_f.write(json.dumps({"size": size, "kind": kind, "gamma": gamma, "engine_start_s": start_s,
                              "engine_report": report, **extra}) + "\n")
    cells = spec_cells(report, eager=eager) if kind == "spec" else [({"draft_graphs": None}, None)]
    timer = _CellTimer(llm, size=size, hi=hi, prompt_len=prompt_len, sp=sp, first=first, extra=extra,
                       steps_f=steps_f, walls_f=walls_f)

    def dispatch(mode) -> None:
        if kind == "spec":  # the twin drafter's own switch, reached like every engine worker
            llm.collective_rpc("twin_spec_set_draft_graphs", args=(mode,))

    try:
        for b in batches:
            for _, mode in cells:  # warm up this batch's cells, each dispatch mode
                dispatch(mode)
                llm.generate(prompts(b, hi, seed=99, prompt_len=prompt_len), warm, use_tqdm=False)
            for rep in range(repeats):
                for cell, mode in cells:  # alternating: graphs on, off, on, off, ...
                    dispatch(mode)
                    timer.timed({"kind": kind, "gamma": gamma, **cell}, b, rep)
    finally:
        dispatch("built")
    (log or (lambda s: print(s, file=sys.stderr, flush=True)))(
        f"[ladder] {size} {kind} gamma={gamma}: engine start {start_s:.1f}s, done")
    free(llm)
    return {"engine_start_s": start_s, "engine_report": report, "n_steps": timer.steps, "n_walls": timer.walls}


def ran_tags(report: dict[str, Any], tags: dict[str, Any]) -> dict[str, Any]:
    """The drafter tags of ``tags`` replaced by what the engine report says ran (``auto`` resolved:
    ``draft_linear_kernel`` "marlin" where vLLM built the draft's layers with MarlinLinearKernel,
    ``async_scheduling`` as vLLM's scheduler config has it); tags the report does not name stay."""
    from vllm_patch.draft_kernels import KERNEL_CLASSES

    out = {}
    built = report.get("draft_linear_kernel")
    names = {cls: name for name, cls in KERNEL_CLASSES.items()}
    if "draft_linear_kernel" in tags and built:
        out["draft_linear_kernel"] = names.get(built, built)
    if "async_scheduling" in tags and "async_scheduling" in report:
        out["async_scheduling"] = bool(report["async_scheduling"])
    for name in ("draft_lm_head", "draft_attention"):  # what ran: draft_attention "mixed" where layers kept vLLM's
        if name in tags and report.get(name):
            out[name] = report[name]
    return out


def spec_cells(report: dict[str, Any], eager: bool = True) -> list[tuple[dict[str, Any], Any]]:
    """The cells a spec engine measures side by side: ``(row tags, dispatch mode)`` per cell.

    The drafter graphs that were built (the engine report's ``draft_cudagraph_mode``); with FULL
    graphs built also their single-token steps dispatched piecewise (the piecewise drafter it
    replaces, in the same engine), and with FULL first passes built (``full_all``) also the first
    pass dispatched piecewise (``full``); with ``eager`` the dispatch forced to eager. A cell's rows carry
    ``draft_graphs`` (graphs on) and the ``draft_cudagraph_mode`` it ran (the eager cell keeps the
    built mode's label, so the analysis sets it beside that mode's graphs-on cell).
    """
    built = str(report.get("draft_cudagraph_mode") or "none")
    cells = [({"draft_graphs": True, "draft_cudagraph_mode": built}, "built")]
    if built == "full_all":  # FULL first passes built: also timed with the first pass piecewise
        cells.append(({"draft_graphs": True, "draft_cudagraph_mode": "full"}, "full"))
    if built in ("full", "full_all"):
        cells.append(({"draft_graphs": True, "draft_cudagraph_mode": "piecewise"}, "piecewise"))
    if eager:
        cells.append(({"draft_graphs": False, "draft_cudagraph_mode": built}, "none"))
    return cells


# --------------------------------------------------------------------------- a protocol leg


def drafter_tags(knobs) -> dict[str, Any]:
    """The drafter setup every row of a spec engine carries (the analysis tells setups apart by them)."""
    return {"draft_linear_kernel": knobs.draft_linear_kernel, "draft_cudagraph_mode": knobs.draft_cudagraph_mode,
            "async_scheduling": bool(knobs.async_scheduling), "draft_lm_head": knobs.draft_lm_head,
            "draft_attention": knobs.draft_attention}


def run_leg(conf: dict[str, Any]) -> dict[str, Any]:
    """Run one ladder leg into ``conf["out"]``: steps.jsonl, walls.jsonl, summary.json (or failure.json)."""
    from workbench.knobs import Knobs, tier_of

    out = Path(conf["out"])
    out.mkdir(parents=True, exist_ok=True)
    import torch

    cpu = not torch.cuda.is_available()
    if conf.get("device") == "gpu" and cpu:
        raise RuntimeError(f"leg {conf['leg']}: its profile runs on a CUDA GPU and this host has none")
    knobs = Knobs(**conf["knobs"])
    # the engine's report lands in the leg's folder, beside the rows that carry it (nothing left in the temp dir)
    report_dir = tempfile.mkdtemp(prefix="engine-", dir=out)
    set_process_env(cpu, report_dir, knobs.to_env(report_dir))
    partial = {name: out / (name + ".partial") for name in (STEPS, WALLS)}
    t0 = time.perf_counter()
    with partial[STEPS].open("w") as steps_f, partial[WALLS].open("w") as walls_f:
        info = run_engine(size=conf["size"], kind=conf["kind"], target=conf["target"], draft=conf.get("draft"),
                          gamma=conf.get("gamma"), batches=[int(b) for b in conf["batches"]],
                          repeats=int(conf["repeats"]), tokens=int(conf["tokens"]), cpu=cpu,
                          dummy=conf.get("load_format") == "dummy", steps_f=steps_f, walls_f=walls_f,
                          prompt_len=int(conf["prompt_len"]), dtype=conf["dtype"],
                          max_model_len=int(conf["max_model_len"]),
                          gpu_memory_utilization=float(conf["gpu_memory_utilization"]),
                          tag={"leg": conf["leg"], **drafter_tags(knobs)},
                          engine_args=knobs.engine_args(on_cuda=not cpu), eager=bool(conf.get("eager", True)),
                          tensor_parallel_size=int(conf.get("tensor_parallel_size", 1)))
    for name, path in partial.items():
        os.replace(path, out / name)
    import vllm_patch

    summary = {"runner": "ladder", "experiment": conf.get("experiment"),
               "run_id": conf.get("run_id"), "leg": conf["leg"], "mode": conf["kind"],
               "tier": tier_of(knobs),
               "gamma": conf.get("gamma"), "size": conf["size"], "target": conf["target"], "draft": conf.get("draft"),
               "knobs": knobs.as_dict(), "device": "cpu" if cpu else torch.cuda.get_device_name(0),
               "wall_s": time.perf_counter() - t0, "patch_fingerprint": vllm_patch.fingerprint(), **info}
    return write_summary(out, summary)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.ladder_engine", description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, required=True, help="legs/<leg>/leg.json written by the protocol")
    args = ap.parse_args(argv)
    conf = json.loads(args.config.read_text())
    out = Path(conf["out"])
    try:
        run_leg(conf)
    except BaseException as exc:
        write_failure(out, failure_record(exc, runner="ladder", leg=conf.get("leg"), mode=conf.get("kind"),
                                          gamma=conf.get("gamma")))
        if isinstance(exc, KeyboardInterrupt):
            raise
        print(f"[ladder] leg {conf.get('leg')} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
