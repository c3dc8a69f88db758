"""What the acceptance trace costs in decode rate, trace on and off side by side in one engine.

    python benchmarks/trace_cost.py --out results/trace-cost/<run id> [--dtype bfloat16] [--reps 4]

One engine (the strict tier, the int4 twin, gamma 6) started with the trace on;
the plugin's trace is then switched off and on between passes
(off, on, off, on, ..., off), so every "on" pass is bracketed by two "off"
passes of the same engine. A pass decodes the tiny prompt set twice: one prompt
at a time (concurrency 1) and all at once (concurrency 8; ``--c8-copies N``
submits the set N times, a pass long enough to time on a GPU). The cost of a
pass pair is 1 - (tok/s on) / mean(tok/s of the two bracketing off passes);
the table reports its median and IQR per concurrency. Passes drift (a GPU's
"off" passes alone varied by 9-12 % over one run), so the table also gives a
drift-free figure: the host time the trace itself spends on the decode path
(timed inside the engine, ``twin_spec_trace_stats``) per traced step and as
a share of the "on" pass's time. Where the decoding loop is bound by host work,
as it is for the tiny models on a GPU, that share is the trace's cost.

Writes ``passes.jsonl``, ``tables/trace_cost.csv`` and ``env.json`` into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=4, help="number of 'on' passes (each between two 'off' passes)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--c8-copies", type=int, default=1,
                    help="the concurrency-8 pass decodes the prompt set this many times (a longer, steadier pass)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    cpu = not torch.cuda.is_available()
    report_dir = tempfile.mkdtemp(prefix="trace-cost-")
    os.environ.update({"VLLM_SPEC_TRACE": "1", "VLLM_SPEC_REPORT_DIR": report_dir,
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    if cpu:
        from workbench.leg import in_process_cpu_env

        in_process_cpu_env()

    from vllm import LLM, SamplingParams

    from workbench.chat import load_images, render_prompt
    from workbench.prompts import load_prompts
    from workbench.tiny import ensure_tiny_models

    m = ensure_tiny_models()
    kw = dict(model=str(m["target"]), dtype=args.dtype, max_model_len=2048, max_num_seqs=8, seed=0,
              limit_mm_per_prompt={"image": 4, "video": 0}, disable_log_stats=False,
              speculative_config={"method": "draft_model", "model": str(m["twin-int4"]),
                                  "num_speculative_tokens": args.gamma})
    kw.update(dict(enforce_eager=True, gpu_memory_utilization=0.05, distributed_executor_backend="uni") if cpu
              else dict(gpu_memory_utilization=0.2))
    llm = LLM(**kw)
    tok = llm.get_tokenizer()
    prompts = load_prompts(REPO / "data" / "tiny" / "prompts.jsonl")
    inputs = []
    for p in prompts:
        item = {"prompt": render_prompt(tok, p)}
        if p.images:
            item["multi_modal_data"] = {"image": load_images(p)}
        inputs.append(item)
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)

    def set_trace(on: bool) -> None:
        llm.collective_rpc("twin_spec_set_trace", args=(on,))

    def stats() -> dict:
        return llm.collective_rpc("twin_spec_trace_stats")[0]

    def one_pass(on: bool, i: int, f) -> None:
        set_trace(on)
        s0 = stats()
        t0 = time.perf_counter()
        n1 = sum(len(llm.generate([x], sp, use_tqdm=False)[0].outputs[0].token_ids) for x in inputs)
        t1 = time.perf_counter()
        s1 = stats()
        n8 = sum(len(o.outputs[0].token_ids) for o in llm.generate(inputs * args.c8_copies, sp, use_tqdm=False))
        t8 = time.perf_counter()
        s8 = stats()
        for conc, n, t, a, b in (("c1", n1, t1 - t0, s0, s1), ("c8", n8, t8 - t1, s1, s8)):
            # the trace's own host time on the decode path during this pass, as a share of the pass
            host_ms = b["host_ms"] - a["host_ms"]
            f.write(json.dumps({"pass": i, "trace": on, "concurrency": conc, "tokens": n, "seconds": t,
                                "tok_s": n / t, "traced_steps": b["steps"] - a["steps"],
                                "trace_host_ms": host_ms, "trace_host_share": host_ms / 1e3 / t}) + "\n")
        f.flush()

    with open(os.devnull, "w") as sink:  # a full pass of each shape first: warm caches, nothing recorded
        one_pass(False, -1, sink)
    with (args.out / "passes.jsonl").open("w") as f:
        order = [False] + [x for _ in range(args.reps) for x in (True, False)]
        for i, on in enumerate(order):
            one_pass(on, i, f)
    set_trace(True)
    steps = llm.collective_rpc("twin_spec_flush_trace")

    import pandas as pd

    from workbench.metrics import median_iqr

    passes = pd.read_json(args.out / "passes.jsonl", lines=True)
    rows = []
    for conc, g in passes.groupby("concurrency"):
        g = g.sort_values("pass").reset_index(drop=True)
        costs = []
        for i in range(1, len(g) - 1, 2):
            on, before, after = g.loc[i, "tok_s"], g.loc[i - 1, "tok_s"], g.loc[i + 1, "tok_s"]
            costs.append(1 - on / ((before + after) / 2))
        st = median_iqr(costs)
        on = g[g["trace"]]
        rows.append({"concurrency": conc, "pairs": len(costs), "cost_median": st["median"],
                     "cost_q25": st["q25"], "cost_q75": st["q75"],
                     "tok_s_off": g[~g["trace"]]["tok_s"].median(), "tok_s_on": on["tok_s"].median(),
                     # drift-free: the trace's own host time per traced step, and its share of the pass
                     "trace_host_us_per_step": float((on["trace_host_ms"] / on["traced_steps"]).median() * 1e3),
                     "trace_host_share": float(on["trace_host_share"].median())})
    table = pd.DataFrame(rows)
    (args.out / "tables").mkdir(exist_ok=True)
    table.to_csv(args.out / "tables" / "trace_cost.csv", index=False, float_format="%.4f")
    import vllm

    (args.out / "env.json").write_text(json.dumps({
        "vllm": vllm.__version__, "torch": torch.__version__, "dtype": args.dtype, "gamma": args.gamma,
        "reps": args.reps, "tokens": args.tokens, "c8_copies": args.c8_copies,
        "device": torch.cuda.get_device_name(0) if not cpu else "cpu", "trace_steps": steps,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1) + "\n")
    print(table.to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
