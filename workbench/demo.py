"""The quick-start job: vanilla vs strict twin drafting on the tiny embedded models.

    python -m workbench.demo [--gamma 6] [--max-tokens 64] [--dtype bfloat16] [--results results]

Builds the tiny Qwen3-VL and its int4 twin (once), then runs three legs in
fresh processes -- vanilla, strict (int4 twin drafting), vanilla -- on the
built-in prompt set, and prints the comparison: exact match of the strict
tier, acceptance, and per-prompt speedup against the bracketing vanilla legs.
On the tiny models the draft costs about as much as the target, so the
speedup printed here says nothing about real checkpoints; exactness and
acceptance do.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run_leg(out: Path, args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "workbench.leg", "--out", str(out), *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"leg {out.name} failed; see {out / 'failure.json'}")
    summary = json.loads((out / "summary.json").read_text())
    summary["_process_s"] = time.perf_counter() - t0
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16: the int4 twin's CPU kernel has no float32 path")
    ap.add_argument("--results", default=str(REPO / "results"))
    args = ap.parse_args(argv)

    import pandas as pd

    from .metrics import bracketed_speedup, exactness
    from .results import load_run, new_run_id, run_dir
    from .tiny import ensure_tiny_models

    print("building the tiny models (first run only) ...", flush=True)
    models = ensure_tiny_models()
    run_id = new_run_id()
    rdir = run_dir(args.results, "demo", run_id)
    legs = ["vanilla_1", f"strict_g{args.gamma}", "vanilla_2"]
    (rdir / "legs").mkdir(parents=True, exist_ok=True)
    (rdir / "run.json").write_text(json.dumps({
        "experiment": "demo", "run_id": run_id, "profile": "tiny", "legs": legs,
        "gamma": args.gamma, "max_tokens": args.max_tokens, "dtype": args.dtype,
    }, indent=1))
    common = ["--target", str(models["target"]), "--prompts", str(REPO / "data" / "tiny" / "prompts.jsonl"),
              "--max-tokens", str(args.max_tokens), "--dtype", args.dtype, "--max-model-len", "1024",
              "--experiment", "demo", "--run-id", run_id]
    summaries = {}
    for leg in legs:
        extra = ["--leg", leg]
        if leg.startswith("strict"):
            extra += ["--draft", str(models["twin-int4"]), "--gamma", str(args.gamma)]
        print(f"running leg {leg} ...", flush=True)
        summaries[leg] = _run_leg(rdir / "legs" / leg, common + extra)

    run = load_run(rdir)
    rec = run.records
    strict = legs[1]
    ex = pd.concat([exactness(rec, "vanilla_1", strict), exactness(rec, "vanilla_2", strict)])
    sp = bracketed_speedup(rec, legs)
    spec = summaries[strict]["spec"]
    print()
    print(f"run folder: {rdir}")
    print(f"{'leg':<12}{'engine start s':>16}{'decode s':>10}{'tokens':>8}{'tok/s':>8}")
    for leg in legs:
        s = summaries[leg]
        print(f"{leg:<12}{s['engine_start_s']:>16.1f}{s['wall_s']:>10.2f}{s['gen_tokens']:>8}"
              f"{s['gen_tokens'] / s['wall_s']:>8.1f}")
    n_match = int(ex[ex["ref_leg"] == "vanilla_1"]["exact"].sum())
    n = int((ex["ref_leg"] == "vanilla_1").sum())
    print()
    print(f"strict tier (int4 twin, gamma={args.gamma}) vs vanilla: exact token match on {n_match}/{n} prompts")
    print(f"acceptance: rate {spec['acceptance_rate']:.3f}, length {spec['acceptance_length']:.2f}, "
          f"per position {[round(a / spec['num_drafts'], 2) for a in spec['accepted_per_pos']]}")
    row = sp[sp["leg"] == strict].iloc[0]
    print(f"speedup (median over prompts vs bracketing vanilla legs): {row['speedup']:.2f}x "
          f"(IQR {row['q25']:.2f}-{row['q75']:.2f}); tiny models on CPU: not indicative of real checkpoints")
    return 0 if n_match == n else 1


if __name__ == "__main__":
    sys.exit(main())
