"""What the acceptance trace costs in decode rate, trace on and off side by side in one engine.

    python benchmarks/trace_cost.py --out results/trace-cost/<run id> [--dtype bfloat16] [--rounds 8]

One engine (the strict tier, the int4 twin, gamma 6) started with the trace on;
the plugin's trace is then switched off and on between generate calls, so the
"on" and "off" runs of the same work stand next to each other in time. A unit
of work is one prompt alone (concurrency 1; each of the 13 tiny prompts is a
unit) or the whole prompt set submitted ``--c8-copies`` times at once
(concurrency 8; ``--c8-pairs`` such units per round). Every round runs each
unit twice, on and off, the order alternating from unit to unit and round to
round (on-off, off-on, ...), so slow drift and a second-run advantage both
cancel.

The cost is 1 - (tok/s on) / (tok/s off) over all pairs of a concurrency
(ratio of total rates), with a 95 % bootstrap interval over pairs and the
median of the per-pair costs. An earlier design that compared whole passes
could not resolve 5 %: a GPU's "off" passes alone varied by 9-12 % over one
run. The table also gives a drift-free figure: the host time the trace itself
spends on the decode path (timed inside the engine, ``twin_spec_trace_stats``)
per traced step and as a share of the "on" time. Where the decoding loop is
bound by host work, as it is for the tiny models on a GPU, that share is the
trace's direct cost.

Writes ``pairs.jsonl`` (one line per timed run), ``tables/trace_cost.csv`` and
``env.json`` (``workbench.envcapture``, with this benchmark's settings) into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def summarize(runs, boot: int = 2000, seed: int = 0):
    """Per concurrency: the trace's cost over adjacent on/off pairs (see the module docstring)."""
    import numpy as np
    import pandas as pd

    from workbench.metrics import median_iqr

    need = {"round", "unit", "concurrency", "trace", "tokens", "seconds", "traced_steps", "trace_host_ms"}
    missing = need - set(runs.columns)
    if missing:
        raise ValueError(f"trace-cost runs lack columns {sorted(missing)}")
    rng = np.random.default_rng(seed)
    rows = []
    for conc, g in runs.groupby("concurrency"):
        on = g[g["trace"]].set_index(["round", "unit"]).sort_index()
        off = g[~g["trace"]].set_index(["round", "unit"]).sort_index()
        if not on.index.equals(off.index) or on.index.has_duplicates:
            raise ValueError(f"{conc}: every (round, unit) needs exactly one run with the trace on and one off")
        if (on["tokens"] != off["tokens"]).any():
            raise ValueError(f"{conc}: a pair decoded different token counts; the runs are not the same work")
        n_on, t_on, n_off, t_off = (x.to_numpy(float) for x in (on["tokens"], on["seconds"], off["tokens"], off["seconds"]))

        def rates(i):  # total tok/s on and off over the pairs indexed by i (the last axis)
            return n_on[i].sum(-1) / t_on[i].sum(-1), n_off[i].sum(-1) / t_off[i].sum(-1)

        rate_on, rate_off = rates(np.arange(len(on)))
        boot_on, boot_off = rates(rng.integers(0, len(on), size=(boot, len(on))))
        boots = 1 - boot_on / boot_off
        per_pair = median_iqr(1 - (n_on / t_on) / (n_off / t_off))
        rows.append({"concurrency": conc, "pairs": len(on), "cost": 1 - rate_on / rate_off,
                     "cost_ci95_lo": float(np.quantile(boots, 0.025)), "cost_ci95_hi": float(np.quantile(boots, 0.975)),
                     "pair_cost_median": per_pair["median"], "pair_cost_q25": per_pair["q25"],
                     "pair_cost_q75": per_pair["q75"],
                     "tok_s_off": rate_off, "tok_s_on": rate_on,
                     # drift-free: the trace's own host time per traced step, and its share of the "on" time
                     "trace_host_us_per_step": float(on["trace_host_ms"].sum() / max(on["traced_steps"].sum(), 1) * 1e3),
                     "trace_host_share": float(on["trace_host_ms"].sum() / 1e3 / t_on.sum())})
    return pd.DataFrame(rows)


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The arguments, checked, and the unit shapes to time (c1, c8)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=8, help="rounds; each runs every unit once on and once off")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--c8-copies", type=int, default=1,
                    help="a concurrency-8 unit decodes the prompt set this many times (a longer, steadier unit)")
    ap.add_argument("--c8-pairs", type=int, default=2, help="concurrency-8 units per round")
    ap.add_argument("--concurrency", default="c1,c8", help="which units to time: c1, c8 or both (default)")
    args = ap.parse_args(argv)
    shapes = [c.strip() for c in args.concurrency.split(",") if c.strip()]
    if not shapes or set(shapes) - {"c1", "c8"}:
        ap.error(f"--concurrency takes c1, c8 or c1,c8; got {args.concurrency!r}")
    for name in ("rounds", "tokens", "gamma", "c8_copies", "c8_pairs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args, shapes


def _engine(args: argparse.Namespace, cpu: bool):
    """The engine (strict tier, the tiny int4 twin, trace on), the tiny prompts as its inputs, the sampling."""
    from workbench import engine as engines

    report_dir = tempfile.mkdtemp(prefix="engine-", dir=args.out)  # the engine's report, in the run folder
    engines.knob_env({"VLLM_SPEC_TRACE": "1", "VLLM_SPEC_REPORT_DIR": report_dir})
    engines.in_process_env(cpu)

    from vllm import SamplingParams

    from workbench.chat import load_images, render_prompt
    from workbench.prompts import load_prompts
    from workbench.tiny import ensure_tiny_models

    m = ensure_tiny_models()
    kw = dict(model=str(m["target"]), dtype=args.dtype, max_model_len=2048, max_num_seqs=8, seed=0,
              limit_mm_per_prompt={"image": 4, "video": 0}, disable_log_stats=False,
              speculative_config=engines.spec_config(str(m["twin-int4"]), args.gamma))
    kw.update(engines.cpu_args() if cpu else dict(gpu_memory_utilization=0.2))
    llm, _ = engines.build(kw)
    tok = llm.get_tokenizer()
    prompts = load_prompts(REPO / "data" / "tiny" / "prompts.jsonl")
    inputs = []
    for p in prompts:
        item = {"prompt": render_prompt(tok, p)}
        if p.images:
            item["multi_modal_data"] = {"image": load_images(p)}
        inputs.append(item)
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    return llm, inputs, sp


def _timed(llm, sp, on: bool, batch: list) -> dict:
    """One timed generate of ``batch`` with the trace on or off, and the trace's own host time during it."""
    llm.collective_rpc("twin_spec_set_trace", args=(on,))
    a = llm.collective_rpc("twin_spec_trace_stats")[0]
    t0 = time.perf_counter()
    n = sum(len(o.outputs[0].token_ids) for o in llm.generate(batch, sp, use_tqdm=False))
    t = time.perf_counter() - t0
    b = llm.collective_rpc("twin_spec_trace_stats")[0]
    return {"trace": on, "tokens": n, "seconds": t, "tok_s": n / t, "traced_steps": b["steps"] - a["steps"],
            # the trace's own host time on the decode path during this run
            "trace_host_ms": b["host_ms"] - a["host_ms"]}


def _time_pairs(llm, sp, units: list, rounds: int, out: Path) -> None:
    """Every unit warmed once each way, then ``rounds`` rounds of on/off pairs (order alternating) into ``out``."""
    for _, batch in units:  # every unit once, trace off and on: warm caches, nothing recorded
        _timed(llm, sp, False, batch)
        _timed(llm, sp, True, batch)
    tmp = out.with_suffix(".jsonl.partial")
    with tmp.open("w") as f:
        for r in range(rounds):
            for u, (conc, batch) in enumerate(units):
                order = (True, False) if (r + u) % 2 == 0 else (False, True)
                for pos, on in enumerate(order):
                    f.write(json.dumps({"round": r, "unit": u, "concurrency": conc, "position": pos,
                                        **_timed(llm, sp, on, batch)}) + "\n")
            f.flush()
    tmp.replace(out)  # only a finished schedule carries the final name


def main(argv: list[str] | None = None) -> int:
    args, shapes = _parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    cpu = not torch.cuda.is_available()
    llm, inputs, sp = _engine(args, cpu)
    units = (([("c1", [x]) for x in inputs] if "c1" in shapes else [])
             + ([("c8", inputs * args.c8_copies)] * args.c8_pairs if "c8" in shapes else []))
    out = args.out / "pairs.jsonl"
    _time_pairs(llm, sp, units, args.rounds, out)
    llm.collective_rpc("twin_spec_set_trace", args=(True,))
    steps = llm.collective_rpc("twin_spec_flush_trace")

    import pandas as pd

    from workbench.envcapture import write_env
    from workbench.runfolder import write_text_atomic

    table = summarize(pd.read_json(out, lines=True))
    (args.out / "tables").mkdir(exist_ok=True)
    write_text_atomic(args.out / "tables" / "trace_cost.csv", table.to_csv(index=False, float_format="%.4f"))
    write_env(args.out / "env.json", {
        "dtype": args.dtype, "gamma": args.gamma, "rounds": args.rounds, "c8_pairs": args.c8_pairs,
        "tokens": args.tokens, "c8_copies": args.c8_copies,
        "device": torch.cuda.get_device_name(0) if not cpu else "cpu", "trace_steps": steps})
    print(table.to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
