"""The W4A16 GEMM benchmark's report (``benchmarks/int4_gemm.py``): its run folder's files and tables.

``markdown`` renders the tables printed at the end and written as ``README.md``: per model and scope
(decoder, layer set, GEMM) every kernel's median time (IQR) and effective bandwidth beside the byte floor,
the best swept ``twin-gemv`` configuration per GEMM and M (with the ``TUNED`` entries worth adding) and the
``--check`` errors, and per model the fastest int4 kernel of the layer set at each M beside the kernel the draft's
hybrids (``vllm_patch.twin_hybrid``) route that M to. ``write_results`` writes ``env.json``, ``kernels.csv``, ``sweep.csv`` and ``README.md``.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from int4_gemm_kernels import CHECK_TOLERANCE, GEMMS, KERNEL_ORDER


DENSE = ("cublas-bf16",)  # not an int4 kernel: the dense reference
BENCH_NAME = {"own": "own-cuda", "marlin": "marlin", "machete": "machete"}  # twin_hybrid.path -> kernel row


def fastest_per_m(rows, size: str) -> list[dict]:
    """Per M of ``size``'s layer set: the fastest int4 kernel's default row (no ``[variant]``), its µs, the
    runner-up's, and the layout ``own-cuda+marlin`` / ``own-cuda+marlin+machete`` take at that M."""
    import sys

    repo = str(Path(__file__).resolve().parents[1])
    if repo not in sys.path:
        sys.path.insert(0, repo)
    from vllm_patch import twin_hybrid

    sub = [r for r in rows if r["model"] == size and r["scope"] == "layer" and r["kernel"] not in DENSE
           and "[" not in r["kernel"]]
    out = []
    for m in sorted({r["m"] for r in sub}):
        ranked = sorted((r for r in sub if r["m"] == m), key=lambda r: r["us_median"])
        out.append({"m": m, "fastest": ranked[0]["kernel"], "us": ranked[0]["us_median"],
                    "next": ranked[1]["kernel"] if len(ranked) > 1 else "",
                    "next_us": ranked[1]["us_median"] if len(ranked) > 1 else None,
                    "hybrid": BENCH_NAME[twin_hybrid.path(m)],
                    "hybrid_machete": BENCH_NAME[twin_hybrid.path(m, True)]})
    return out


def _fastest_table(rows, size) -> list[str]:
    best = fastest_per_m(rows, size)
    if not best or not best[0]["next"]:  # one int4 kernel timed: nothing to pick between
        return []
    out = [f"## {size}: the fastest int4 kernel of the layer set per M, and the hybrids' choice", "",
           "| M | fastest | µs | next | µs | own-cuda+marlin takes | own-cuda+marlin+machete takes |",
           "|---|---|---|---|---|---|---|"]
    for r in best:
        nxt = "" if r["next_us"] is None else f"{r['next_us']:.1f}"
        out.append(f"| {r['m']} | {r['fastest']} | {r['us']:.1f} | {r['next']} | {nxt} | {r['hybrid']} | "
                   f"{r['hybrid_machete']} |")
    out += ["", "(own-cuda's row above 64 tokens is its large-M path: dequantized slices and cuBLAS.)", ""]
    return out


def markdown(rows, sweep_rows, ms, facts) -> str:
    out = [f"# W4A16 GEMM at decode batch sizes — {facts['gpu']}", "",
           f"Read: {facts['read_tbps']:.2f} TB/s (a reduction over 1 GiB); floor = int4 bytes / that. "
           f"Device copy: {facts['copy_tbps']:.2f} TB/s (read + write of 1 GiB, for reference). "
           f"Weights: {facts['flavour']}, group {facts['group']}. µs median (IQR) per call, "
           f"{facts['repeats']} interleaved repeats of a CUDA graph; TB/s = the kernel's own bytes / time.", ""]
    for k, v in facts.get("skipped", {}).items():
        out.append(f"- {k} skipped: {v}")
    out.append("")
    for size in dict.fromkeys(r["model"] for r in rows):
        for scope in ("decoder", "layer", "mlp", "gemm"):
            sub = [r for r in rows if r["model"] == size and r["scope"] == scope]
            if not sub:
                continue
            out += [f"## {size}: {scope}", ""]
            head = "| what | kernel | " + " | ".join(f"M={m} µs (IQR) · TB/s" for m in ms) + " |"
            out += [head, "|" + "---|" * (2 + len(ms))]
            keys = list(dict.fromkeys((r["gemm"], r["kernel"]) for r in sub))
            where = GEMMS + ("lm_head",)
            keys.sort(key=lambda t: (where.index(t[0]) if t[0] in where else -1,
                                     KERNEL_ORDER.index(t[1]) if t[1] in KERNEL_ORDER else 99))
            shown_floor = set()
            for g, kname in keys:
                if g not in shown_floor:
                    fl = {r["m"]: r for r in sub if r["gemm"] == g}
                    out.append(f"| {g} | *byte floor* | " + " | ".join(
                        f"{fl[m]['floor_us']:.1f}" if m in fl else "" for m in ms) + " |")
                    shown_floor.add(g)
                by_m = {r["m"]: r for r in sub if r["gemm"] == g and r["kernel"] == kname}
                cells = []
                for m in ms:
                    r = by_m.get(m)
                    cells.append("" if r is None else f"{r['us_median']:.1f} ({r['iqr_us']:.1f}) · {r['tbps']:.2f}")
                out.append(f"| {g} | {kname} | " + " | ".join(cells) + " |")
            out.append("")
        out += _fastest_table(rows, size)
    tuned = []
    if sweep_rows:
        out += ["## twin-gemv: best swept config per GEMM and M (sweep.csv has all)", "",
                "| model | gemm | M | heuristic µs | best µs | best config |", "|---|---|---|---|---|---|"]
        for r0 in rows:
            if r0["kernel"] != "twin-gemv" or r0["scope"] != "gemm":
                continue
            cand = [r for r in sweep_rows if (r["model"], r["gemm"], r["m"]) == (r0["model"], r0["gemm"], r0["m"])]
            if cand:
                best = min(cand, key=lambda r: r["us_median"])
                out.append(f"| {r0['model']} | {r0['gemm']} | {r0['m']} | {r0['us_median']:.1f} | "
                           f"{best['us_median']:.1f} | {best['kernel'][10:-1]} |")
                checked_ok = not best["check_rel_err"] or float(best["check_rel_err"]) <= CHECK_TOLERANCE
                if best["us_median"] < 0.97 * r0["us_median"] and "," not in best["kernel"] and checked_ok:
                    tuned.append(f"    ({r0['n']}, {r0['k'] // 8}, {r0['m']}): {best['config_repr']},")
        out.append("")
        if tuned:
            out += ["Swept configs more than 3 % faster than the heuristic, as "
                    "`vllm_patch.twin_gemv_kernel.TUNED` entries:", "", "```python", "TUNED.update({",
                    *tuned, "})", "```", ""]
    errs = [r for r in rows + [dict(r, kernel="twin-gemv (all swept configs)") for r in sweep_rows]
            if r["check_rel_err"]]
    if errs:
        worst = {}
        for r in errs:
            worst[r["kernel"]] = max(worst.get(r["kernel"], 0.0), float(r["check_rel_err"]))
        out += ["## --check: max relative error against the float32 dequantized reference", "",
                "| kernel | max rel. error |", "|---|---|"] + [f"| {k} | {v:.2e} |" for k, v in worst.items()]
    return "\n".join(out) + "\n"


def write_results(out: Path, env: dict, rows: list[dict], sweep_rows: list[dict], md: str) -> None:
    """``env.json``, ``kernels.csv``, ``sweep.csv`` (header and rows; empty where there are none), ``README.md``."""
    (out / "env.json").write_text(json.dumps(env, indent=2, default=str) + "\n")
    for name, data in (("kernels.csv", rows), ("sweep.csv", sweep_rows)):
        with open(out / name, "w", newline="") as fh:
            if data:
                w = csv.DictWriter(fh, fieldnames=list(data[0]))
                w.writeheader()
                w.writerows(data)
    (out / "README.md").write_text(md)
