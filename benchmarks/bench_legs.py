"""Side-by-side leg benchmarks on the tiny models (CPU), alternating A and B legs in one run.

    python benchmarks/bench_legs.py spec   # vanilla vs strict twin drafting: decode tok/s, engine start
    python benchmarks/bench_legs.py trace  # strict with vs without the acceptance trace: cost of tracing

Each leg is a fresh process (as in every experiment). Legs alternate
A, B, A, B, A so that drift of the machine shows up in the A legs; every B leg
is compared with the mean of the A legs on either side of it, prompt by
prompt, and the median ratio is printed. Numbers, not assertions: this machine
is noisy and shared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run_leg(out: Path, args: list[str]) -> tuple[dict, dict[str, dict]]:
    proc = subprocess.run([sys.executable, "-m", "workbench.leg", "--out", str(out), *args],
                          cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"leg failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    recs = {r["pid"]: r for r in map(json.loads, (out / "records.jsonl").read_text().splitlines())}
    return summary, recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["spec", "trace"])
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--pairs", type=int, default=2, help="number of B legs (A legs = pairs + 1)")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)

    from workbench.tiny import ensure_tiny_models

    m = ensure_tiny_models()
    common = ["--target", str(m["target"]), "--prompts", str(REPO / "data/tiny/prompts.jsonl"),
              "--max-tokens", str(args.max_tokens), "--ignore-eos", "--dtype", args.dtype,
              "--max-model-len", "1024"]
    spec = ["--draft", str(m["twin-int4"]), "--gamma", str(args.gamma)]
    if args.what == "spec":
        a_name, a_args = "vanilla", []
        b_name, b_args = f"strict_g{args.gamma}", spec
    else:
        a_name, a_args = "strict_no_trace", spec + ["--no-trace"]
        b_name, b_args = "strict_trace", spec + ["--trace"]

    seq = []
    for i in range(args.pairs):
        seq += [(a_name, a_args), (b_name, b_args)]
    seq.append((a_name, a_args))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, extra) in enumerate(seq):
            summary, recs = run_leg(Path(tmp) / f"{i}_{name}", common + extra)
            results.append((name, summary, recs))
            print(f"  leg {i} {name:<16} engine start {summary['engine_start_s']:5.1f}s  "
                  f"decode {summary['gen_tokens'] / summary['wall_s']:7.1f} tok/s", flush=True)

    print(f"\n{b_name} vs {a_name} (tiny models, {args.dtype}, CPU, {args.max_tokens} tokens/prompt)")
    ratios = []
    for i in range(1, len(results), 2):
        _, _, before = results[i - 1]
        name, summary, recs = results[i]
        _, _, after = results[i + 1]
        for pid, r in recs.items():
            ref = (before[pid]["tok_s"] + after[pid]["tok_s"]) / 2
            ratios.append(r["tok_s"] / ref)
    q = statistics.quantiles(ratios, n=4)
    a_rate = statistics.mean(s["gen_tokens"] / s["wall_s"] for n, s, _ in results if n == a_name)
    b_rate = statistics.mean(s["gen_tokens"] / s["wall_s"] for n, s, _ in results if n == b_name)
    print(f"  decode tok/s (mean of legs): {a_name} {a_rate:.1f}   {b_name} {b_rate:.1f}")
    print(f"  per-prompt ratio {b_name}/{a_name}: median {statistics.median(ratios):.3f} "
          f"(IQR {q[0]:.3f}-{q[2]:.3f}, n={len(ratios)})")
    starts = {n: [s["engine_start_s"] for m_, s, _ in results if m_ == n] for n in (a_name, b_name)}
    print(f"  engine start s: " + ", ".join(f"{n} {statistics.mean(v):.1f}" for n, v in starts.items()))
    if args.what == "spec":
        spec_s = [s for n, s, _ in results if n == b_name][0]["spec"]
        print(f"  acceptance rate {spec_s['acceptance_rate']:.3f}, acceptance length {spec_s['acceptance_length']:.2f}")
    else:
        print(f"  tracing cost: {100 * (1 - statistics.median(ratios)):.1f}% of decode rate (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
