"""What the int4 fallback costs: its draft step beside the target's and the native kernel's, in one run.

    python benchmarks/int4_cost.py --out results/int4-cost/<run id>

Runs the cost ladder (``benchmarks/cost_ladder.py``, engine-side step timer) on
the tiny models once per int4 path this host has — ``native`` (vLLM's
``cpu_gemm_wna16``, AVX-512 kernel libraries only) and ``fallback`` (the
plugin's PyTorch path, forced) — with the same batches and gamma, and writes
``tables/int4_cost.csv``: per batch, the target's verification step, the
draft's forward on each path, their ratios, and the draft's weight bytes on
each path (the fallback holds dequantized bf16 weights).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    from vllm_patch.cpu_int4 import cpu_kernel_library, native_wna16_available

    paths = (["native"] if native_wna16_available() else []) + ["fallback"]
    library = cpu_kernel_library()
    for path in paths:
        env = {**os.environ, "VLLM_SPEC_INT4_FALLBACK": "1" if path == "fallback" else "0"}
        cmd = [sys.executable, str(REPO / "benchmarks" / "cost_ladder.py"), "--sizes", "tiny", "--batches",
               args.batches, "--gammas", str(args.gamma), "--repeats", str(args.repeats), "--tokens",
               str(args.tokens), "--out", str(args.out / path)]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)

    import pandas as pd

    from workbench.ladder import load, step_costs

    rows: dict[int, dict] = {}
    for path in paths:
        steps, walls = load(args.out / path)
        costs = step_costs(steps)
        costs = costs[(costs["draft_graphs"] != False) | costs["draft_graphs"].isna()]  # noqa: E712 (CPU: no graphs)
        report = next(json.loads(line)["engine_report"] for line in open(args.out / path / "walls.jsonl")
                      if '"engine_report"' in line and '"spec"' in line)
        for b, g in costs.groupby("batch"):
            row = rows.setdefault(int(b), {"batch": int(b)})
            row["target_verify_ms"] = float(g[g["role"] == "target verify"]["median_ms"].iloc[0])
            row[f"draft_forward_ms_{path}"] = float(g[g["role"] == "draft propose"]["median_ms"].iloc[0]) / args.gamma
            row[f"draft_weight_mb_{path}"] = round(report["weight_bytes"]["draft"] / 2**20, 3)
            row[f"kernel_{path}"] = next(k for k in report["linear_kernels"]["draft"] if "WNA16" in k)
    table = pd.DataFrame(sorted(rows.values(), key=lambda r: r["batch"]))
    if "native" in paths:
        table["fallback_over_native"] = table["draft_forward_ms_fallback"] / table["draft_forward_ms_native"]
    table["fallback_over_target_verify"] = table["draft_forward_ms_fallback"] / table["target_verify_ms"]
    table.insert(0, "kernel_library", library)
    (args.out / "tables").mkdir(exist_ok=True)
    table.to_csv(args.out / "tables" / "int4_cost.csv", index=False, float_format="%.4f")
    print(table.to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
