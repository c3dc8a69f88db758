"""The workbench's overhead over a bare vLLM `generate` on the same prompts (goal: < 5% of decode time).

    python benchmarks/bench_overhead.py [--spec] [--pairs 2] [--max-tokens 96]

A "bare" process builds the same engine (same arguments as the leg) and calls
`LLM.generate` once per prompt, timing each call; a "leg" process is
`python -m workbench.leg` (per-prompt timing, trace, knob read-back, records).
They alternate bare, leg, bare, leg, bare; each leg prompt's decode time is
compared with the mean of the two bare processes around it. Prints figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def bare(cfg_path: str, out_path: str) -> None:
    """Child process: the engine and prompts of a leg, nothing else."""
    from workbench.leg import _engine_kwargs, config_from_args, build_parser, prepare_process_env

    argv = json.loads(Path(cfg_path).read_text())
    cfg = config_from_args(build_parser().parse_args(argv))
    prepare_process_env(cfg)
    env = cfg.knobs.to_env()
    env["VLLM_SPEC_TRACE"] = "0"  # bare: no acceptance trace, no report files
    os.environ.update(env)
    from vllm import LLM, SamplingParams

    from workbench.chat import load_images, render_prompt
    from workbench.prompts import load_prompts

    llm = LLM(**_engine_kwargs(cfg))
    tok = llm.get_tokenizer()
    items = []
    for p in load_prompts(cfg.prompts):
        item = {"prompt": render_prompt(tok, p)}
        if p.images:
            item["multi_modal_data"] = {"image": load_images(p)}
        items.append((p.pid, item))
    sp = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, ignore_eos=cfg.ignore_eos)
    times = {}
    for pid, item in items:
        t0 = time.perf_counter()
        llm.generate([item], sp, use_tqdm=False)
        times[pid] = time.perf_counter() - t0
    Path(out_path).write_text(json.dumps(times))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", action="store_true", help="strict twin-draft legs instead of vanilla legs")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--_bare", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._bare:
        bare(*args._bare)
        return 0

    from workbench.tiny import ensure_tiny_models

    m = ensure_tiny_models()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        leg_argv = ["--target", str(m["target"]), "--prompts", str(REPO / "data/tiny/prompts.jsonl"),
                    "--max-tokens", str(args.max_tokens), "--ignore-eos", "--dtype", "bfloat16",
                    "--max-model-len", "1024"]
        if args.spec:
            leg_argv += ["--draft", str(m["twin-int4"]), "--gamma", "6"]
        leg_argv += ["--out", "unused"]
        (tmp / "cfg.json").write_text(json.dumps(leg_argv))
        seq = ["bare", "leg"] * args.pairs + ["bare"]
        runs = []
        for i, kind in enumerate(seq):
            if kind == "bare":
                out = tmp / f"bare{i}.json"
                proc = subprocess.run([sys.executable, __file__, "--_bare", str(tmp / "cfg.json"), str(out)],
                                      cwd=REPO, capture_output=True, text=True)
                if proc.returncode:
                    raise SystemExit(proc.stderr[-3000:])
                runs.append(("bare", json.loads(out.read_text())))
            else:
                out = tmp / f"leg{i}"
                argv_i = leg_argv[:-1] + [str(out)]
                proc = subprocess.run([sys.executable, "-m", "workbench.leg", *argv_i], cwd=REPO,
                                      capture_output=True, text=True)
                if proc.returncode:
                    raise SystemExit(proc.stderr[-3000:])
                recs = [json.loads(l) for l in (out / "records.jsonl").read_text().splitlines()]
                runs.append(("leg", {r["pid"]: r["t"] for r in recs}))
            total = sum(runs[-1][1].values())
            print(f"  {kind:<5} decode time over prompts {total:.3f} s", flush=True)
    ratios = []
    for i in range(1, len(runs), 2):
        before, leg, after = runs[i - 1][1], runs[i][1], runs[i + 1][1]
        for pid, t in leg.items():
            ratios.append(t / ((before[pid] + after[pid]) / 2))
    q = statistics.quantiles(ratios, n=4)
    med = statistics.median(ratios)
    print(f"\nworkbench leg vs bare vLLM generate ({'strict twin gamma 6' if args.spec else 'vanilla'}, tiny, CPU)")
    print(f"  per-prompt decode time ratio leg/bare: median {med:.3f} (IQR {q[0]:.3f}-{q[2]:.3f}, n={len(ratios)})")
    print(f"  overhead: {100 * (med - 1):+.1f}% of decode time (goal < 5%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
