"""Serving legs (E17): per-leg latency/throughput table, bracketed speedups, per-request rows.

A serving leg (``runner: serve``) drives ``vllm serve`` with ``vllm bench serve`` at a fixed
max concurrency and writes ``legs/<leg>/records.jsonl`` (one line per request, ``kind: serve``)
and ``legs/<leg>/summary.json`` (``runner: serve``, the client's throughput, the server's spec
counters). Those records are not prompt records (no ``tok_s``): ``workbench.results.load_run``
leaves them out of ``Run.records`` and this module reads them from the run folder itself.

Pure pandas/numpy over the files:

- ``leg_table``: per leg, TTFT/TPOT/ITL/E2EL mean, median, p90, p99 in ms (``np.percentile``
  of the successful requests' values, ITL pooled over every inter-token gap, as vLLM's bench
  does), output and request throughput (the client's), acceptance from the server counters
  and from the per-request trace sums (``metrics.acceptance_rate`` / ``acceptance_length``);
- ``paired_speedups``: per spec leg, against the bracketing vanilla legs *of its concurrency*
  (``metrics.bracketing_vanilla``: the nearest finished one before and after in run order, one
  side if only one exists): one pair per neighbouring vanilla leg, TPOT speedup = vanilla median
  TPOT / spec median TPOT and throughput ratio = spec / vanilla output throughput; the leg's
  value is the median over its pairs with quartiles and IQR (``metrics.median_iqr``, the
  pandas quantiles ``metrics.ratio_summary`` uses) and, where the requests are given, a 95 % bootstrap
  interval of the TPOT speedup and the TTFT ratio over requests (``metrics.median_ratio_ci``: the IQR over two
  vanilla legs measures the bracket's drift, not how much the cell's own requests vary);
- ``request_table``: one row per request (for distributions).

A record that lacks a field raises a ValueError naming the file and line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from . import metrics
from .results import leg_order, read_leg_records
from .placement import placement_key
from .runfolder import PLACEMENT, RECORDS, RUN_JSON, SUMMARY, leg_status, read_json

RUNNER = "serve"
# What every serving record must carry (the record schema of docs/run-folders.md, serving legs).
RECORD_FIELDS = ("pid", "request_index", "mode", "tier", "concurrency", "gamma", "ttft_s", "tpot_s", "itl_s",
                 "e2el_s", "output_tokens", "error", "spec")
SPEC_FIELDS = ("drafts", "draft_tokens", "accepted")
LATENCIES = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "p90", "p99")
LEG_COLUMNS = (["leg", "leg_index", "mode", "tier", "acceptance", "gamma", "concurrency", "n", "completed"]
               + [f"{m}_ms_{s}" for m in LATENCIES for s in STATS]
               + ["output_throughput", "request_throughput", "duration_s",
                  "acceptance_rate", "acceptance_length", "trace_acceptance_rate", "trace_acceptance_length",
                  "placement", "target_graphs", "draft_kernel", "draft_attention"]
               # the engine's time per step (medians, ms; the plugin's step timer): a prefill step's target
               # forward and the drafter's work after it (where a first token's time goes), a decode step's
               # target forward (the verification where drafts were made) and the drafter's propose
               + ["prefill_target_ms", "prefill_draft_ms", "step_target_ms", "step_draft_ms"]
               # Triton kernels compiled inside the cell's steps (a shape class met for the first time)
               + ["jit_compiles"]
               # what the cells sent (fresh: each request its own; repeat: the prompt set cycled, as legs did
               # before fresh requests existed) and the share of prompt tokens (images) vLLM's prefix
               # (multimodal) cache served over the cell: above zero, the cell measured cached prompts
               + ["serve_requests", "prefix_cache_hit_rate", "mm_cache_hit_rate"])
PAIR_METRICS = ("tpot_speedup", "throughput_ratio", "ttft_ratio")
# per-request column of request_table and whether the ratio is spec / vanilla (else vanilla / spec)
CI_METRICS = {"tpot_speedup": ("tpot_ms", False), "ttft_ratio": ("ttft_ms", True)}
DRIFT_METRICS = {"tpot": "tpot_ms_median", "ttft": "ttft_ms_median", "throughput": "output_throughput"}
SPEEDUP_COLUMNS = (["leg", "leg_index", "tier", "acceptance", "gamma", "concurrency"]
                   + [f"{m}{s}" for m in PAIR_METRICS for s in ("", "_q25", "_q75", "_iqr")]
                   + ["n_pairs", "vanilla_before", "vanilla_after"]
                   # how far the two vanilla legs of the bracket moved (after / before - 1): a ratio that differs
                   # from 1 by less than this is not told apart from the drift between legs
                   + [f"bracket_drift_{m}" for m in DRIFT_METRICS]
                   # S at the acceptance the cell drew (its acceptance length by the server's counters in
                   # place of the profile's expected tokens): a synthetic cell's requests draw their own
                   + ["S_predicted", "c", "c_source", "S_realised"]
                   # 95 % bootstrap interval over the cell's requests (spec and vanilla resampled)
                   + [f"{m}_ci_{e}" for m in CI_METRICS for e in ("lo", "hi")])
REQUEST_COLUMNS = ["leg", "leg_index", "mode", "tier", "gamma", "concurrency", "pid", "request_index", "ok",
                   "ttft_ms", "tpot_ms", "e2el_ms", "itl_ms_mean", "output_tokens",
                   "drafts", "draft_tokens", "accepted", "acceptance_rate", "acceptance_length"]


@dataclass(frozen=True)
class ServingLeg:
    name: str
    index: int                      # position in the run's leg order
    summary: dict[str, Any]
    records: list[dict[str, Any]]
    path: Path


def _placement(folder: Path) -> str | None:
    """The device the leg ran on (``workbench.placement``), or None where it was not recorded."""
    try:
        return placement_key(read_json(folder / PLACEMENT))
    except (OSError, ValueError):
        return None


# vLLM's engine-config line in a server's log names the CUDA-graph mode the target runs under
_GRAPH_MODE = re.compile(r"'cudagraph_mode': <CUDAGraphMode\.(\w+)")


def _target_graphs(leg: "ServingLeg") -> str | None:
    """The target's CUDA-graph mode on the leg's server: from the engine report (``target_cudagraph_mode``), or
    from vLLM's config line in ``server.log`` for legs run before the report had it. vLLM's batch-size γ schedule
    turns FULL_AND_PIECEWISE into PIECEWISE on its V1 runner, so a leg's TPOT beside vanilla's carries that."""
    report = leg.summary.get("engine_report")
    if isinstance(report, dict) and report.get("target_cudagraph_mode"):
        return str(report["target_cudagraph_mode"])
    try:
        with open(leg.path / "server.log", errors="replace") as log:
            for line in log:
                found = _GRAPH_MODE.search(line)
                if found:
                    return found.group(1)
    except OSError:
        pass
    return None


def _reported(leg: "ServingLeg", key: str) -> str | None:
    """A value of the leg's engine report (None for a vanilla leg or a report without it)."""
    report = leg.summary.get("engine_report")
    value = report.get(key) if isinstance(report, dict) else None
    return str(value) if value else None


def _summary(folder: Path) -> dict[str, Any] | None:
    try:
        info = read_json(folder / SUMMARY)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _leg_order(run_dir: Path) -> list[str]:
    cfg = read_json(run_dir / RUN_JSON)
    planned = [leg["name"] for leg in cfg.get("legs", []) if isinstance(leg, dict) and "name" in leg]
    return leg_order(run_dir, planned)


def is_serving_leg(folder: str | Path) -> bool:
    """A leg folder whose summary says ``runner: serve``."""
    info = _summary(Path(folder))
    return bool(info) and info.get("runner") == RUNNER


def _read_records(path: Path, leg: str) -> list[dict[str, Any]]:
    out = []
    for lineno, rec in read_leg_records(path, leg, RECORD_FIELDS, what="serving record"):
        spec = rec["spec"]   # null: a vanilla leg, or a spec leg run without the trace
        if spec is not None:
            lack = list(SPEC_FIELDS) if not isinstance(spec, dict) else [f for f in SPEC_FIELDS if f not in spec]
            if lack:
                raise ValueError(f"{path}:{lineno}: spec record's 'spec' lacks field(s) {lack}")
        out.append(rec)
    return out


def serving_legs(run_dir: str | Path) -> list[ServingLeg]:
    """The complete serving legs of a run folder, in run order (records read and checked)."""
    run_dir = Path(run_dir)
    if not (run_dir / RUN_JSON).is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder: {RUN_JSON} not found")
    out = []
    for index, name in enumerate(_leg_order(run_dir)):
        folder = run_dir / "legs" / name
        if leg_status(folder) != "complete" or not is_serving_leg(folder):
            continue
        summary = _summary(folder) or {}
        records = _read_records(folder / RECORDS, name)
        if isinstance(summary.get("cells"), list):
            # one server swept over concurrencies: one serving leg per cell, paired at its concurrency
            for cell in summary["cells"]:
                c = cell.get("concurrency")
                out.append(ServingLeg(name, index, {**summary, **cell},
                                      [r for r in records if r.get("concurrency") == c], folder))
        else:
            out.append(ServingLeg(name, index, summary, records, folder))
    return out


def has_serving(run_dir: str | Path) -> bool:
    """Whether the run folder has a complete serving leg (without reading records)."""
    run_dir = Path(run_dir)
    if not (run_dir / RUN_JSON).is_file():
        return False
    return any(leg_status(run_dir / "legs" / n) == "complete" and is_serving_leg(run_dir / "legs" / n)
               for n in _leg_order(run_dir))


# --------------------------------------------------------------------------- tables


def _stats_ms(values_s: np.ndarray) -> dict[str, float]:
    v = np.asarray(values_s, dtype=float) * 1000.0
    v = v[np.isfinite(v)]
    if not v.size:
        return dict.fromkeys(STATS, np.nan)
    return {"mean": float(v.mean()), "median": float(np.median(v)),
            "p90": float(np.percentile(v, 90)), "p99": float(np.percentile(v, 99))}


def _ok(rec: dict[str, Any]) -> bool:
    return not rec.get("error")


def _num(v: Any) -> float:
    return np.nan if v is None else float(v)


def _identity(leg: ServingLeg) -> dict[str, Any]:
    s, first = leg.summary, (leg.records[0] if leg.records else {})
    gamma = first.get("gamma", s.get("gamma"))
    tier = s.get("tier", first.get("tier"))
    spec = (s.get("knobs") or {}).get("acceptance") or first.get("acceptance")
    return {"leg": leg.name, "leg_index": leg.index, "mode": s.get("mode", first.get("mode")),
            "tier": tier, "gamma": gamma,
            # a synthetic leg's acceptance was drawn (a cost measurement): every row says so
            "acceptance": f"synthetic α ({spec})" if tier == "synthetic" else ("real" if tier != "vanilla" else ""),
            "concurrency": s.get("concurrency", first.get("concurrency"))}


def _step_medians(costs: Any) -> dict[str, float]:
    """The step timer's medians a leg table row shows (NaN where a leg has none: run before the timer was on,
    or a step kind that did not occur)."""
    def med(key: str) -> float:
        q = costs.get(key) if isinstance(costs, dict) else None
        return float(q["median"]) if isinstance(q, dict) and q.get("median") is not None else np.nan

    verify = med("verify_ms")
    jit = costs.get("jit_compiles") if isinstance(costs, dict) else None
    return {"prefill_target_ms": med("prefill_ms"), "prefill_draft_ms": med("prefill_propose_ms"),
            "step_target_ms": verify if np.isfinite(verify) else med("decode_ms"), "step_draft_ms": med("propose_ms"),
            "jit_compiles": float(jit) if jit is not None else np.nan}


def _cache_columns(summary: dict) -> dict[str, Any]:
    """What a leg's cells sent and the caches' hit rates over the cell (NaN where the leg predates them)."""
    caches = summary.get("caches") if isinstance(summary.get("caches"), dict) else {}
    return {"serve_requests": summary.get("serve_requests", "repeat"),
            "prefix_cache_hit_rate": _num(caches.get("prefix_cache_hit_rate")),
            "mm_cache_hit_rate": _num(caches.get("mm_cache_hit_rate"))}


def leg_table(legs: list[ServingLeg]) -> pd.DataFrame:
    """(a) One row per serving leg: request counts, latency statistics (ms), throughput, acceptance."""
    rows = []
    for leg in legs:
        ok = [r for r in leg.records if _ok(r)]
        row = _identity(leg)
        row.update(n=len(leg.records), completed=len(ok), placement=_placement(leg.path),
                   target_graphs=_target_graphs(leg),
                   # the draft's W4A16 kernel class (MarlinLinearKernel, TwinHybridLinearKernel, ...) and its decode
                   # attention (vllm, twin or mixed): legs that differ only in them are told apart by them
                   draft_kernel=_reported(leg, "draft_linear_kernel"),
                   draft_attention=_reported(leg, "draft_attention"),
                   **_step_medians(leg.summary.get("step_costs")), **_cache_columns(leg.summary))
        values = {"ttft": [_num(r["ttft_s"]) for r in ok],
                  "tpot": [_num(r["tpot_s"]) for r in ok if r["tpot_s"] is not None],
                  "itl": [float(x) for r in ok for x in (r["itl_s"] or [])],
                  "e2el": [_num(r["e2el_s"]) for r in ok]}
        for m in LATENCIES:
            row.update({f"{m}_ms_{s}": v for s, v in _stats_ms(np.array(values[m], dtype=float)).items()})
        s = leg.summary
        row.update(output_throughput=_num(s.get("output_throughput")),
                   request_throughput=_num(s.get("request_throughput")), duration_s=_num(s.get("duration_s")))
        server = s.get("spec") if isinstance(s.get("spec"), dict) else None
        if row["mode"] == "spec" and server:
            row["acceptance_rate"] = metrics.acceptance_rate(server.get("num_accepted_tokens", 0),
                                                             server.get("num_draft_tokens", 0))
            row["acceptance_length"] = metrics.acceptance_length(server.get("num_accepted_tokens", 0),
                                                                 server.get("num_drafts", 0))
        traced = [r["spec"] for r in ok if isinstance(r.get("spec"), dict)]
        if row["mode"] == "spec" and traced:
            acc = sum(float(t["accepted"]) for t in traced)
            row["trace_acceptance_rate"] = metrics.acceptance_rate(acc, sum(float(t["draft_tokens"]) for t in traced))
            row["trace_acceptance_length"] = metrics.acceptance_length(acc, sum(float(t["drafts"]) for t in traced))
        rows.append(row)
    out = pd.DataFrame(rows, columns=LEG_COLUMNS)
    for c in ("acceptance_rate", "acceptance_length", "trace_acceptance_rate", "trace_acceptance_length"):
        out[c] = pd.to_numeric(out[c], errors="coerce")
    return out


def paired_speedups(table: pd.DataFrame, predictions: dict | None = None,
                    requests: pd.DataFrame | None = None) -> pd.DataFrame:
    """(b) One row per spec leg of ``leg_table``: median over its pairs with the bracketing vanilla legs of its
    concurrency (each neighbouring vanilla leg one pair) of the TPOT speedup (vanilla median TPOT / spec
    median TPOT), the output-throughput ratio (spec / vanilla) and the TTFT ratio (spec median TTFT / vanilla
    median TTFT), with q25, q75 and IQR; with ``requests`` (``request_table``), the TPOT speedup's and TTFT
    ratio's 95 % bootstrap intervals over the requests (NaN without)."""
    rows = []
    predictions = predictions or {}
    t = table.sort_values("leg_index", kind="stable")
    for conc, part in t.groupby("concurrency", sort=True):
        order = list(part["leg"])
        vanilla = list(part.loc[part["tier"] == "vanilla", "leg"])
        by_leg = part.set_index("leg")
        brackets = metrics.bracketing_vanilla(order, vanilla)
        if "placement" in part.columns:
            metrics.check_placements(part.set_index("leg")["placement"].to_dict(),
                                     {leg: b for leg, b in brackets.items() if leg in set(part["leg"])})
        for leg in order:
            if by_leg.loc[leg, "tier"] not in metrics.SPEC_TIERS:
                continue
            before, after = brackets[leg]
            sides = [v for v in (before, after) if v is not None]
            spec = by_leg.loc[leg]
            pairs = {"tpot_speedup": [by_leg.loc[v, "tpot_ms_median"] / spec["tpot_ms_median"] for v in sides],
                     "throughput_ratio": [spec["output_throughput"] / by_leg.loc[v, "output_throughput"]
                                          for v in sides],
                     # the time to the first token, spec / vanilla (the draft's prefill is in the spec side's)
                     "ttft_ratio": [spec["ttft_ms_median"] / by_leg.loc[v, "ttft_ms_median"] for v in sides]}
            row = {"leg": leg, "leg_index": spec["leg_index"], "tier": spec["tier"],
                   "acceptance": spec["acceptance"], "gamma": spec["gamma"], "concurrency": conc}
            for m, vals in pairs.items():
                vals = [v for v in vals if np.isfinite(v)]
                st = metrics.median_iqr(vals)
                row.update({m: st["median"], f"{m}_q25": st["q25"], f"{m}_q75": st["q75"], f"{m}_iqr": st["iqr"]})
            row.update(n_pairs=len(sides), vanilla_before=before, vanilla_after=after)
            row.update({f"bracket_drift_{m}": (by_leg.loc[after, col] / by_leg.loc[before, col] - 1.0)
                        if before is not None and after is not None else np.nan
                        for m, col in DRIFT_METRICS.items()})
            predicted = predictions.get((leg, conc), {})
            row.update({k: v for k, v in predicted.items() if k != "expected_tokens"})
            row["S_realised"] = _realised(predicted, spec.get("acceptance_length"))
            row.update(_request_intervals(requests, conc, leg, sides))
            rows.append(row)
    out = pd.DataFrame(rows, columns=SPEEDUP_COLUMNS)
    return out.sort_values("leg_index", kind="stable").reset_index(drop=True)


def _realised(predicted: dict, acceptance_length: Any) -> float:
    """S_predicted scaled from the profile's expected tokens per step to the acceptance length the cell drew
    (NaN without a prediction or without drafts; a γ-0 cell, one token a step, keeps its prediction)."""
    s, tokens = predicted.get("S_predicted"), predicted.get("expected_tokens")
    if s is None or not tokens:
        return np.nan
    if tokens == 1.0:
        return float(s)
    drawn = _num(acceptance_length)
    return float(s) * drawn / float(tokens) if np.isfinite(drawn) else np.nan


def cell_groups(requests: pd.DataFrame, conc: Any, leg: str, sides: list[str], col: str
                ) -> tuple[np.ndarray, list[np.ndarray]]:
    """A cell's successful requests' ``col`` (``request_table``): the spec leg's, and each bracketing leg's."""
    cell = requests[(requests["concurrency"] == conc) & requests["ok"].astype(bool)]

    def values(name: str) -> np.ndarray:
        return cell.loc[cell["leg"] == name, col].to_numpy(dtype=float)

    return values(leg), [values(v) for v in sides]


def _request_intervals(requests: pd.DataFrame | None, conc: Any, leg: str, sides: list[str]) -> dict[str, float]:
    """The ``CI_METRICS`` intervals of one spec leg at one concurrency (NaN without requests)."""
    out = {f"{m}_ci_{e}": np.nan for m in CI_METRICS for e in ("lo", "hi")}
    if requests is None or requests.empty or not sides:
        return out
    for m, (col, spec_over_side) in CI_METRICS.items():
        lo, hi = metrics.median_ratio_ci(*cell_groups(requests, conc, leg, sides, col), spec_over_side)
        out.update({f"{m}_ci_lo": lo, f"{m}_ci_hi": hi})
    return out


def request_table(legs: list[ServingLeg]) -> pd.DataFrame:
    """(c) One row per request of every serving leg (latencies in ms; failed requests kept, ``ok`` False)."""
    rows = []
    for leg in legs:
        ident = _identity(leg)
        for r in leg.records:
            spec = r["spec"] if isinstance(r.get("spec"), dict) else {}
            itl = np.asarray(r["itl_s"] or [], dtype=float)
            row = {**ident, "pid": r["pid"], "request_index": r["request_index"], "ok": _ok(r),
                   "ttft_ms": _num(r["ttft_s"]) * 1000, "tpot_ms": _num(r["tpot_s"]) * 1000,
                   "e2el_ms": _num(r["e2el_s"]) * 1000, "itl_ms_mean": float(itl.mean()) * 1000 if itl.size else np.nan,
                   "output_tokens": r["output_tokens"]}
            for k in SPEC_FIELDS:
                row[k] = _num(spec.get(k))
            row["acceptance_rate"] = metrics.acceptance_rate(row["accepted"], row["draft_tokens"]) if spec else None
            row["acceptance_length"] = metrics.acceptance_length(row["accepted"], row["drafts"]) if spec else None
            rows.append(row)
    out = pd.DataFrame(rows, columns=REQUEST_COLUMNS)
    for c in ("acceptance_rate", "acceptance_length"):
        out[c] = pd.to_numeric(out[c], errors="coerce")
    return out


def load(run_dir: str | Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(leg_table, paired_speedups, request_table) of a run folder's serving legs."""
    from workbench.serving_predict import predicted_speedup

    legs = serving_legs(run_dir)
    table = leg_table(legs)
    predictions = {(l.name, l.summary.get("concurrency")): predicted_speedup(l.path, l.summary,
                                                                           int(l.summary.get("concurrency") or 1))
                   for l in legs}
    requests = request_table(legs)
    return table, paired_speedups(table, predictions, requests), requests
