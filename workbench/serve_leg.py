"""A serving leg: the patched engine behind vLLM's OpenAI server, driven by vLLM's own benchmark client.

    python -m workbench.serve_leg --config legs/<leg>/leg.json
    python -m workbench.serve_leg --dataset PROMPTS.jsonl requests.jsonl [--fresh TAG [--requests N]]
                                                 # the dataset, for runs by hand (fresh: each request its own)

The leg's ``leg.json`` is an ordinary leg's (``workbench.leg.LegConfig``: target, draft, knobs,
prompt set, ``max_num_seqs`` = the client's ``--max-concurrency`` and the server's
``--max-num-seqs``). The leg

1. checks what an offline leg checks (``workbench.leg.preflight``) and writes the prompt set as a
   ``custom_image`` dataset of vLLM's benchmark (``requests.jsonl``: images as data URLs, in order);
   each cell's requests go to ``c<N>/requests-sent.jsonl``, fresh ones by default (``workbench.serve_requests``:
   no request repeats another, so no cell measures a cached prompt);
2. starts ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs) on a free
   loopback port, its own process group, the plugin's knobs in its environment (the one knob table,
   ``Knobs.to_env``), and waits for ``/health``;
3. reads the server's Prometheus ``/metrics`` (the spec-decode counters), runs vLLM's benchmark
   client (``vllm.benchmarks.serve``, what ``vllm bench serve`` runs: chat endpoint, greedy, the leg's
   output length, ``--ignore-eos`` when the leg asks, its seed, request ids ``<leg>-<i>``), flushes the
   plugin's acceptance trace through the server's dev RPC route, reads ``/metrics`` again;
4. stops the server (SIGTERM to its group, then SIGKILL), whatever happened, and writes
   ``records.jsonl`` (per request: TTFT, TPOT, ITL list, E2E latency, output tokens and text, the
   acceptance trace's committed steps), ``summary.json`` (percentiles, throughput, the counters'
   difference, the client's own summary, the engine report) and ``bench.json`` (the client's file).

A failure leaves ``failure.json`` with the server log's tail and no ``summary.json``; the run's
``--resume`` then redoes the leg.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

from workbench import engine as engines
from workbench import leg as legmod
from workbench.serve_args import BENCH_JSON, PERCENTILES, client_args, server_command, server_env
from workbench.serve_client import BenchClient, ClientError
from workbench.serve_prime import prime_pass, shape_pass, vocab_size
from workbench.serve_requests import FRESH, bench_dataset, write_requests
from workbench.serve_server import (CACHE_COUNTERS, Server, ServeError, _free_port, _http,
                                    parse_metrics)
from workbench.runfolder import (FAILURE, LEG_JSON, RECORDS, SUMMARY, archive_leg, leg_status, write_summary,
                                 write_json_atomic, write_jsonl_atomic)

__all__ = ["run_serving_leg", "server_command", "client_args", "parse_metrics", "bench_dataset", "main"]

SERVER_LOG = "server.log"
SERVER_JSON = "server.json"
REQUESTS = "requests.jsonl"
CELL_REQUESTS = "requests-sent.jsonl"  # what a cell sent, in order (fresh: each request its own)
WARM_REQUESTS = "warmup-requests.jsonl"  # a cell's warm-up requests (derived, removed after the cell)
TIMINGS = "request_timings.jsonl"
CLIENT_LOG = "client.log"


# --------------------------------------------------------------------------- counters (the command and the
# client's arguments: workbench.serve_args; before the first cell: workbench.serve_prime)
def cache_delta(after: dict, before: dict) -> dict:
    """The prefix cache's queried and hit tokens and the multimodal cache's queried and hit items between two
    reads of ``/metrics``, with their hit rates (None where nothing was queried)."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in CACHE_COUNTERS.values()}
    for cache in ("prefix_cache", "mm_cache"):
        q = d[f"{cache}_queries"]
        d[f"{cache}_hit_rate"] = d[f"{cache}_hits"] / q if q > 0 else None
    return d


def _counter_delta(after: dict, before: dict) -> dict:
    """The counters' difference over the leg (the offline leg's rule) and the acceptance rate it gives."""
    d = legmod._counter_delta(after, before)
    d["acceptance_rate"] = legmod.acceptance_rate(d["num_accepted_tokens"], d["num_draft_tokens"])
    return d


# --------------------------------------------------------------------------- the leg
def _pct(values: list[float], scale: float = 1000.0) -> dict[str, float] | None:
    import numpy as np

    if not values:
        return None
    a = np.asarray(values, dtype=float) * scale
    out = {"mean": float(a.mean()), "median": float(np.median(a))}
    out.update({f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES})
    return out


def _latencies(path: Path, prefix: str, n: int) -> list[float]:
    """Each request's latency as the client measured it (the last call per id: the client's warm-up
    request repeats the first id)."""
    by_id: dict[str, float] = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        row = json.loads(line)
        by_id[str(row["request_id"])] = float(row["latency"])
    missing = [i for i in range(n) if f"{prefix}{i}" not in by_id]
    if missing:
        raise ServeError(f"{path}: no latency for request(s) {missing[:5]}")
    return [by_id[f"{prefix}{i}"] for i in range(n)]


def concurrencies(cfg: legmod.LegConfig) -> list[int]:
    """The client's concurrencies against this leg's one server, ascending (one: ``max_num_seqs``)."""
    return sorted(set(cfg.concurrencies)) if cfg.concurrencies else [cfg.max_num_seqs]


def cell_requests(n_prompts: int, concurrency: int) -> int:
    """Requests of one cell: the prompt set, cycled to at least two waves of the concurrency, so that the
    concurrency is reached and held (a cell of 13 prompts at concurrency 32 would never fill)."""
    return max(n_prompts, 2 * concurrency)


def _records(cfg: legmod.LegConfig, prompts: list, bench: dict, trace: dict[str, list], knobs: dict,
             latencies: list[float], prefix: str, concurrency: int) -> list[dict]:
    n = len(latencies)
    cols = {k: bench.get(k) for k in ("ttfts", "itls", "output_lens", "generated_texts", "errors")}
    for k, v in cols.items():
        if not isinstance(v, list) or len(v) != n:
            raise ServeError(f"{BENCH_JSON}: '{k}' should list {n} requests, got {type(v).__name__}"
                             f"{'' if not isinstance(v, list) else ' of ' + str(len(v))}")
    by_index: dict[int, list] = {}
    for rid, steps in trace.items():
        m = re.search(rf"{re.escape(prefix)}(\d+)$", rid) or re.search(rf"{re.escape(prefix)}(\d+)\D", rid)
        if m:
            by_index.setdefault(int(m.group(1)), []).extend(steps)
    rows = []
    for i in range(n):
        p = prompts[i % len(prompts)]
        ttft, itl, out_len = cols["ttfts"][i], cols["itls"][i] or [], int(cols["output_lens"][i] or 0)
        e2el = latencies[i]
        rec = {"kind": "serve", "pid": p.pid, "request_index": i, "request_id": f"{prefix}{i}",
               "experiment": cfg.experiment, "leg": cfg.leg, "run_id": cfg.run_id,
               "mode": cfg.mode, "tier": cfg.knobs.tier, "concurrency": concurrency, "gamma": cfg.knobs.gamma,
               "acceptance": cfg.knobs.acceptance if cfg.draft is not None else None,
               "n_images": p.n_images, "ttft_s": ttft, "itl_s": itl,
               # vLLM's client's definition: (latency - TTFT) / (output tokens - 1)
               "tpot_s": ((e2el - ttft) / (out_len - 1)) if out_len > 1 else None, "e2el_s": e2el,
               "output_tokens": out_len, "generated_text": cols["generated_texts"][i],
               "error": cols["errors"][i] or "", "knobs": knobs, "spec": None}
        if cfg.draft is not None and cfg.knobs.trace:
            steps = legmod.committed_steps(by_index.get(i, []), out_len)
            rec["spec"] = legmod.per_prompt_spec(steps, cfg.knobs.gamma)
        rows.append(rec)
    return rows


def cell_datasets(cfg: legmod.LegConfig, prompts: list, cell: Path, concurrency: int, n: int) -> tuple[Path, Path]:
    """The cell's warm-up requests (its concurrency's worth) and its ``n`` measured ones, request ``i`` from
    ``prompts[i % len(prompts)]``, fresh or repeated (``cfg.serve_requests``); fresh ones tagged by the cell,
    not the leg, so every leg of the run sends the same requests here."""
    warm, sent = cell / WARM_REQUESTS, cell / CELL_REQUESTS
    write_requests(prompts, warm, concurrency, cfg.serve_requests, f"c{concurrency}-warm-")
    write_requests(prompts, sent, n, cfg.serve_requests, f"c{concurrency}-")
    return warm, sent


def _run_client(cfg: legmod.LegConfig, server: Server, client: BenchClient, base_url: str, dataset: Path,
                warm: Path, cell: Path, n: int, prefix: str, concurrency: int,
                steps: "StepsTail | None" = None) -> tuple[dict, list, dict, dict]:
    """One cell: a warm-up at the cell's concurrency (``warm``: its own requests and ids, outside the
    counters), the counters before, vLLM's client at ``concurrency`` over ``dataset``, the counters after; the
    server's memory sampled meanwhile. Returns (bench.json, memory samples, counters before, after);
    ``after["steps"]``: the step timer's rows of the cell (the warm-up's left out)."""
    import threading

    (cell / BENCH_JSON).unlink(missing_ok=True)
    timing = cell / TIMINGS
    timing.unlink(missing_ok=True)
    timeout = max(600.0, 4.0 * n * cfg.max_tokens / max(concurrency, 1))  # ample: 4 s a token, serial
    try:
        # warm every cell: the first requests at a new batch size pay for graphs, allocator growth and
        # the scheduler's first steps; they run here, before the cell's counters are read
        client.run(client_args(cfg, base_url, warm, cell, concurrency, f"{prefix}warm-", concurrency,
                               save=False), cell / "warmup.log", None, timeout)
        warm.unlink(missing_ok=True)
        if steps is not None:
            steps.read_new()  # the warm-up's steps
        before = parse_metrics(_http(f"{base_url}/metrics"))
        stop_sampling, memory = threading.Event(), []
        sampler = threading.Thread(target=lambda: memory.extend(server.sample_memory(stop_sampling)),
                                   name="serve-memory", daemon=True)
        sampler.start()
        try:
            client.run(client_args(cfg, base_url, dataset, cell, n, prefix, concurrency), cell / CLIENT_LOG,
                       timing, timeout)
        finally:
            stop_sampling.set()
            sampler.join(timeout=10)
    except ClientError as exc:
        raise ServeError(f"vllm bench serve failed at concurrency {concurrency}: {exc}") from None
    if not (cell / BENCH_JSON).is_file():
        raise ServeError(f"vllm bench serve wrote no {BENCH_JSON} at concurrency {concurrency} "
                         f"(log: {cell / CLIENT_LOG})")
    traced = 0
    if cfg.knobs.trace and cfg.draft is not None:
        res = json.loads(_http(f"{base_url}/collective_rpc", json.dumps(
            {"method": "twin_spec_flush_trace"}).encode(), timeout=120))
        traced = sum(int(x or 0) for x in res.get("results", []))
    after = parse_metrics(_http(f"{base_url}/metrics"))
    rows = steps.read_new() if steps is not None else []
    return json.loads((cell / BENCH_JSON).read_text()), memory, before, dict(after, traced=traced, steps=rows)


def _flush_steps(base_url: str) -> list[Path]:
    """The step timer's files, written out through the dev RPC route (none: the timer is off)."""
    try:
        res = json.loads(_http(f"{base_url}/collective_rpc", json.dumps(
            {"method": "twin_spec_flush_steps"}).encode(), timeout=120))
    except Exception:  # noqa: BLE001 - timing is a measurement, never the leg's failure
        return []
    return [Path(p) for p in res.get("results", []) if p]


class StepsTail:
    """The step timer's rows written since the last call (rank 0's file of the server's engine)."""

    def __init__(self, base_url: str):
        self.base_url, self.offset = base_url, 0

    def read_new(self) -> list[dict]:
        paths = _flush_steps(self.base_url)
        if not paths:
            return []
        with paths[0].open() as f:
            f.seek(self.offset)
            text = f.read()
            self.offset = f.tell()
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def _cell_summary(cfg: legmod.LegConfig, rows: list[dict], bench: dict, before: dict, after: dict,
                  memory: list, concurrency: int) -> dict:
    ok = [r for r in rows if not r["error"]]
    return {
        "concurrency": concurrency, "n_requests": len(rows), "completed": len(ok),
        "duration_s": bench.get("duration"), "output_throughput": bench.get("output_throughput"),
        "request_throughput": bench.get("request_throughput"),
        "total_output_tokens": sum(r["output_tokens"] for r in ok),
        "percentiles": {"ttft_ms": _pct([r["ttft_s"] for r in ok]),
                        "tpot_ms": _pct([r["tpot_s"] for r in ok if r["tpot_s"] is not None]),
                        "itl_ms": _pct([x for r in ok for x in r["itl_s"]]),
                        "e2el_ms": _pct([r["e2el_s"] for r in ok])},
        "spec": _counter_delta(after, before) if cfg.draft is not None else None,
        # the prefix cache (tokens) and the multimodal cache (items) over the cell: fresh requests find
        # nothing cached; a hit rate above zero says the cell measured cached prompts
        "caches": cache_delta(after, before),
        "trace_steps_flushed": after.get("traced", 0),
        # the engine's time per step (the plugin's step timer): prefill steps (the target's forward, the
        # drafter's work after it: where a first token's time goes) and decode steps, ms quartiles
        "step_costs": legmod.step_costs_of(after["steps"], cfg.knobs.gamma if cfg.draft is not None else None)
        if after.get("steps") else None,
        "client": {k: v for k, v in bench.items() if k not in ("ttfts", "itls", "generated_texts", "errors",
                                                                "output_lens", "input_lens", "start_times")},
        # the server's resident memory (its whole process tree) while the client ran
        "rss_mb": memory,
    }


def _memory_plan(cfg: legmod.LegConfig, on_cuda: bool):
    if not on_cuda:
        return None
    from workbench.memory_plan import MemoryPlanError, plan_for_leg

    try:
        return plan_for_leg(cfg)
    except MemoryPlanError as exc:
        raise legmod.LegError(str(exc)) from None


def run_serving_leg(cfg: legmod.LegConfig) -> dict:
    """One server for the leg, the client swept over its concurrencies (``vllm bench sweep serve``'s way):
    one server start per configuration, each request record keeping its concurrency."""
    out = Path(cfg.out)
    if leg_status(out) == "complete" and not cfg.force:
        raise legmod.LegError(f"{out} already holds a finished leg ({SUMMARY}); use --force to redo it")
    prompts, _images, lengths = legmod.preflight(cfg, import_vllm=False)  # the server imports vLLM, not this
    if out.is_dir() and any((out / f).exists() for f in (RECORDS, SUMMARY, FAILURE)):
        print(f"[serve] earlier result moved to {archive_leg(out)}", file=sys.stderr, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / LEG_JSON, dict(cfg.to_file_dict(out), force=False))
    on_cuda = legmod._cuda_present()
    mem_plan = _memory_plan(cfg, on_cuda)
    vocab = vocab_size(cfg.target)  # the shape pass's token ids; read before any server starts
    concs = concurrencies(cfg)
    multi = cfg.concurrencies is not None
    dataset = out / REQUESTS
    bench_dataset(prompts, dataset)  # the prompt set, one request each as it is
    report_dir = Path(tempfile.mkdtemp(prefix="engine-", dir=out))
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    server = Server(server_command(cfg, port, on_cuda, mem_plan), server_env(cfg, report_dir, on_cuda),
                    out / SERVER_LOG)

    def _on_signal(signum, _frame):
        server.stop(grace=5.0)
        raise LegStopped(signum)

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    trace_tail = legmod.TraceTail(report_dir) if cfg.knobs.trace else None
    knobs, rows, cells = cfg.knobs.as_dict(), [], []
    client = None
    try:
        t0 = time.perf_counter()
        client = BenchClient(out / "client-worker.log")  # imports vLLM's client while the server starts
        server.start(base_url)
        steps = StepsTail(base_url)
        # which processes are this leg's server (a test, or a user, can check none outlives the leg)
        write_json_atomic(out / SERVER_JSON, {"pid": server.proc.pid if server.proc else None, "port": port,
                                              "base_url": base_url})
        start_s = time.perf_counter() - t0
        prime_pass(cfg, client, base_url, prompts, dataset, out)
        shapes = shape_pass(base_url, cfg.target, vocab, cfg.max_model_len, cfg.max_num_seqs)
        for c in concs:
            cell = out / f"c{c}" if multi else out
            cell.mkdir(exist_ok=True)
            n = cell_requests(len(prompts), c) if multi else len(prompts)
            prefix = f"{cfg.leg or 'leg'}-c{c}-" if multi else f"{cfg.leg or 'leg'}-"
            warm, sent = cell_datasets(cfg, prompts, cell, c, n)
            bench, memory, before, after = _run_client(cfg, server, client, base_url, sent, warm, cell, n, prefix,
                                                       c, steps)
            trace = trace_tail.read_new() if trace_tail is not None else {}
            cell_rows = _records(cfg, prompts, bench, trace, knobs, _latencies(cell / TIMINGS, prefix, n), prefix, c)
            failed = [r["request_id"] for r in cell_rows if r["error"]]
            if failed:
                raise ServeError(f"{len(failed)} of {len(cell_rows)} requests failed at concurrency {c} "
                                 f"({', '.join(failed[:5])}): "
                                 f"{next(r['error'] for r in cell_rows if r['error'])[:300]}")
            rows += cell_rows
            cells.append(_cell_summary(cfg, cell_rows, bench, before, after, memory, c))
            print(f"[serve {cfg.leg}] concurrency {c}: {n} requests, TPOT median "
                  f"{(cells[-1]['percentiles']['tpot_ms'] or {}).get('median', float('nan')):.2f} ms",
                  file=sys.stderr, flush=True)
        client.close()
    except BaseException:
        server_tail = server.log_tail()
        if client is not None:
            client.close(kill=True)
        server.stop()
        for s, h in old.items():
            signal.signal(s, h)
        raise _WithLog(server_tail) from sys.exc_info()[1]
    server.stop()
    for s, h in old.items():
        signal.signal(s, h)
    return _finish(cfg, out, rows, cells, multi, start_s, server, report_dir, knobs, lengths, mem_plan, shapes)


def _finish(cfg, out: Path, rows, cells, multi, start_s, server, report_dir, knobs, lengths, mem_plan,
            shapes) -> dict:
    head = cells[0] if not multi else {}
    summary = {
        "runner": "serve", "experiment": cfg.experiment, "leg": cfg.leg, "run_id": cfg.run_id, "mode": cfg.mode,
        "tier": cfg.knobs.tier, "gamma": cfg.knobs.gamma, "serve_requests": cfg.serve_requests,
        **({k: v for k, v in head.items() if k != "rss_mb"} if not multi else
           {"concurrency": [c["concurrency"] for c in cells], "cells": cells,
            "n_requests": sum(c["n_requests"] for c in cells), "completed": sum(c["completed"] for c in cells)}),
        "server": {"command": server.cmd[1:], "start_s": start_s, "log": SERVER_LOG,
                   "rss_mb": head.get("rss_mb") if not multi else [m for c in cells for m in c["rss_mb"]]},
        "engine_report": legmod.read_engine_reports(report_dir), "knobs": knobs, "prompt_lengths": lengths,
        "speculative": cfg.knobs.spec_config_extra(cfg.max_num_seqs, cfg.target)[1] if cfg.draft is not None else None,
        "memory_plan": mem_plan.to_dict() if mem_plan is not None else None,
        "shape_pass": shapes, "versions": engines.versions(),
    }
    write_jsonl_atomic(out / RECORDS, rows)
    write_summary(out, summary)
    return summary


class _WithLog(Exception):
    """Carries the server log's tail to the failure record."""

    def __init__(self, tail: str):
        super().__init__(tail)
        self.tail = tail


# --------------------------------------------------------------------------- entry points
class LegStopped(SystemExit):
    """The leg was stopped by a signal (the run's Ctrl-C, a kill): exits 128 + the signal's number, and its
    failure record names the signal (``LegStopped: stopped by SIGTERM``), not a bare exit status."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signal = signal.Signals(signum).name

    def __str__(self) -> str:
        return f"stopped by {self.signal} (exit status {self.code})"


def _dataset_main(argv: list[str]) -> int:
    """A prompt set as `vllm bench serve --dataset-name custom_image` reads it (for runs by hand): one request
    per prompt as it is, or ``--fresh TAG``: ``--requests N`` (default: one per prompt) each its own
    (``workbench.serve_requests``), so that a second client run against the same server finds nothing cached."""
    ap = argparse.ArgumentParser(prog="python -m workbench.serve_leg --dataset")
    ap.add_argument("prompts", help="prompt file (JSONL, workbench prompt schema)")
    ap.add_argument("out", help="the dataset to write (JSONL, vLLM's custom_image format)")
    ap.add_argument("--fresh", metavar="TAG", help="each request its own, tagged TAG (another TAG per client run)")
    ap.add_argument("--requests", type=int, help="with --fresh: how many (the prompts cycled; default one each)")
    args = ap.parse_args(argv)
    if args.requests is not None and (args.fresh is None or args.requests < 1):
        ap.error("--requests takes a count >= 1 and goes with --fresh")
    from workbench.prompts import PromptError, load_prompts

    try:
        prompts = load_prompts(args.prompts)
    except PromptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.fresh is None:
        bench_dataset(prompts, Path(args.out))
        n = len(prompts)
    else:
        n = args.requests or len(prompts)
        write_requests(prompts, Path(args.out), n, FRESH, args.fresh)
    print(f"{n} {'fresh ' if args.fresh is not None else ''}requests -> {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--dataset"]:
        return _dataset_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="the leg's leg.json")
    args = ap.parse_args(argv)
    legmod.die_with_parent()
    cfg = None
    try:
        cfg = legmod.load_leg_config(args.config)
        summary = run_serving_leg(cfg)
    except legmod.LegError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BaseException as exc:  # noqa: BLE001 - every failure leaves failure.json
        cause = exc.__cause__ if isinstance(exc, _WithLog) and exc.__cause__ is not None else exc
        out = Path(cfg.out) if cfg is not None else None
        if out is not None:
            legmod.write_failure(out, cause, cfg)
            tail = exc.tail if isinstance(exc, _WithLog) else ""
            if tail:
                rec = json.loads((out / FAILURE).read_text())
                rec["server_log_tail"] = tail
                write_json_atomic(out / FAILURE, rec)
        print(f"error: serving leg failed: {type(cause).__name__}: {cause}", file=sys.stderr)
        return 130 if isinstance(cause, KeyboardInterrupt) else (cause.code if isinstance(cause, SystemExit)
                                                                 and isinstance(cause.code, int) else 1)
    for s in summary.get("cells") or [summary]:
        tpot = (s["percentiles"]["tpot_ms"] or {}).get("median", float("nan"))
        print(f"[serve {cfg.leg}] {s['completed']}/{s['n_requests']} requests at concurrency {s['concurrency']}: "
              f"TPOT median {tpot:.1f} ms, {s['output_throughput']:.1f} tok/s"
              + (f", acceptance {s['spec']['acceptance_rate']:.3f}" if s['spec'] else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
