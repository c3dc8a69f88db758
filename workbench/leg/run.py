"""The generate loop: ``run_leg`` checks a leg's inputs, starts its engine, decodes every prompt, streams
its records and writes its summary."""

from __future__ import annotations

import functools
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

from .. import engine as engines  # "engine" is a local name in run_leg (the LLM's engine)
from ..metrics import acceptance_length, acceptance_rate
from ..runfolder import (FAILURE, LEG_JSON, RECORDS, RECORDS_PARTIAL, SUMMARY, append_jsonl, archive_leg,
                         leg_status, read_jsonl, read_jsonl_salvage, write_json_atomic, write_jsonl_atomic,
                         write_summary)
from .checks import check_inputs, preflight
from .config import LegConfig, LegError, load_leg_config
from .reports import (TraceTail, _counter_delta, _external_id, _knobs_in_effect, committed_steps, leg_step_costs,
                      per_prompt_spec, read_engine_reports, spec_counters)
from .setup import engine_args, prepare_process_env


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


def _open_leg(cfg: LegConfig) -> tuple[Path, list, list[list], list[dict], str | None, Path]:
    """Checks the leg's inputs, sets the process environment, makes room in the leg folder (an earlier result
    moves under attempts/ only now) and carries an earlier attempt's finished prompts into
    ``records.jsonl.partial``. Returns (out, prompts, images, carried records, resume note, partial file)."""
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
    partial = out / RECORDS_PARTIAL
    partial.unlink(missing_ok=True)
    if carried:
        append_jsonl(partial, carried)
    return out, prompts, images, carried, resume_note, partial


def _record(cfg: LegConfig, knobs_in_effect: dict[str, Any], engine_report: dict,
            trace_by_ext: dict[str, list[list]], p, res, t: float, t_queue: float | None) -> dict[str, Any]:
    """One prompt's record: its output, timing, the knobs in effect, and (traced spec legs) its acceptance trace."""
    tracing = cfg.draft is not None and cfg.knobs.trace
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


def _decode_one_at_a_time(llm, cfg: LegConfig, prompts: list, todo: list[int], inputs: list[dict], sp,
                          partial: Path, record: Callable[..., dict], collect_trace: Callable[[], None]) -> None:
    # One request at a time: t is that request's own wall time; each record is kept as it finishes.
    for j, (i, item) in enumerate(zip(todo, inputs)):
        ts = time.perf_counter()
        res = llm.generate([item], sp, use_tqdm=False)[0]
        t = time.perf_counter() - ts
        collect_trace()
        append_jsonl(partial, [record(prompts[i], res, t, None)])
        print(f"[leg {cfg.leg or cfg.mode}] {j + 1}/{len(todo)} {prompts[i].pid}: "
              f"{len(res.outputs[0].token_ids)} tokens in {t:.2f}s", file=sys.stderr, flush=True)


def _decode_together(llm, cfg: LegConfig, prompts: list, todo: list[int], inputs: list[dict], sp,
                     partial: Path, record: Callable[..., dict], collect_trace: Callable[[], None]) -> None:
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


def _leg_summary(cfg: LegConfig, records: list[dict], carried: list[dict], resume_note: str | None,
                 knobs_in_effect: dict[str, Any], report_dir: Path, engine_kwargs: dict[str, Any],
                 engine_start_s: float, wall_s: float, counters: dict, step_costs: dict | None) -> dict:
    """The leg's summary.json (before ``write_summary`` stamps it)."""
    spec_summary = None
    if cfg.draft is not None:
        spec_summary = dict(counters)
        d, dt, a = counters["num_drafts"], counters["num_draft_tokens"], counters["num_accepted_tokens"]
        spec_summary["acceptance_rate"] = acceptance_rate(a, dt)
        spec_summary["acceptance_length"] = acceptance_length(a, d)
    return {
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


def run_leg(cfg: LegConfig) -> dict:
    out, prompts, images, carried, resume_note, partial = _open_leg(cfg)
    done = {r["pid"] for r in carried}

    report_dir = Path(tempfile.mkdtemp(prefix="engine-", dir=out))
    # the plugin's step timer too: the target's and the drafter's time per engine step (summary "step_costs")
    engines.knob_env({**cfg.knobs.to_env(report_dir=str(report_dir)), "VLLM_SPEC_STEP_TIMING": "1"})

    from vllm import SamplingParams

    from ..chat import render_prompt

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

    record = functools.partial(_record, cfg, knobs_in_effect, engine_report, trace_by_ext)

    def collect_trace() -> None:
        if tracing:
            # The trace is written off the decode path; wait until it is complete.
            llm.collective_rpc("twin_spec_flush_trace")
            for rid, steps in trace.read_new().items():
                trace_by_ext.setdefault(_external_id(rid), []).extend(steps)

    before = spec_counters(llm)
    t_run = time.perf_counter()
    if cfg.max_num_seqs == 1:
        _decode_one_at_a_time(llm, cfg, prompts, todo, inputs, sp, partial, record, collect_trace)
    elif inputs:
        _decode_together(llm, cfg, prompts, todo, inputs, sp, partial, record, collect_trace)
    wall_s = time.perf_counter() - t_run
    counters = _counter_delta(spec_counters(llm), before)
    step_costs = leg_step_costs(llm, cfg.knobs.gamma if cfg.draft is not None else None)

    by_pid = {r["pid"]: r for r in read_jsonl(partial)}
    records = [by_pid[p.pid] for p in prompts]  # prompt order, carried prompts included
    write_jsonl_atomic(out / RECORDS, records)
    partial.unlink(missing_ok=True)
    summary = write_summary(out, _leg_summary(cfg, records, carried, resume_note, knobs_in_effect, report_dir,
                                              engine_kwargs, engine_start_s, wall_s, counters, step_costs))
    shutil.rmtree(report_dir, ignore_errors=True)
    return summary
