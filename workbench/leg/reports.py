"""What the engine reports: speculative counters, step costs, per-rank engine reports and the acceptance
trace, and the knobs in effect."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..metrics import acceptance_length, acceptance_rate
from .config import LegConfig


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
    # Triton kernels compiled inside the steps (a first input shape of its class): the steps that paid it
    # and the host time (absent from rows written before the step timer counted them)
    jit = [r for r in rows if r.get("jit_compiles")]
    out["jit_compiles"] = sum(int(r["jit_compiles"]) for r in jit)
    out["jit_steps"] = len(jit)
    out["jit_ms"] = round(sum(float(r.get("jit_ms") or 0.0) for r in jit), 3)
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
