"""The workbench's overhead over a bare vLLM `generate` on the same prompts (goal: < 5% of decode time).

    python benchmarks/bench_overhead.py [--spec]                    # E103 (vanilla) or E104 (strict gamma=6 + trace)
    python benchmarks/bench_overhead.py --analyze results/E103/<run id>

One run through the protocol (benchmarks/benchmarks.yaml): legs ``bare_k`` and ``leg_k``
alternate bare, leg, bare, leg, bare. A ``bare_k`` leg is this script: it builds the
engine the leg's configuration describes and calls `LLM.generate` once per prompt,
timing each call, and writes records like a leg (no trace); a ``leg_k`` leg is
`python -m workbench.leg` (per-prompt timing, trace, knob read-back, records). Each leg
prompt's decode time is compared with the mean of the bare legs around it
(``workbench.metrics.prompt_ratios`` on ``t``); the numbers go to ``tables/benchmark.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from runs import fmt_ratio, leg_rows, main_with, run, write_numbers

EXPERIMENTS = {False: "E103", True: "E104"}
RUNNER_FLAG = "--as-leg"


def bare(leg_argv: list[str]) -> None:
    """A leg process without the workbench: the engine and prompts of the leg, nothing else."""
    from workbench import engine as engines
    from workbench.leg import build_parser, config_from_args, engine_args, prepare_process_env
    from workbench.runfolder import write_jsonl_atomic, write_summary

    cfg = config_from_args(build_parser().parse_args(leg_argv))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    prepare_process_env(cfg)
    env = cfg.knobs.to_env()
    env["VLLM_SPEC_TRACE"] = "0"  # bare: no acceptance trace, no report files
    engines.knob_env(env)
    from vllm import SamplingParams

    from workbench.chat import load_images, render_prompt
    from workbench.prompts import load_prompts

    llm, start_s = engines.build(engine_args(cfg))
    tok = llm.get_tokenizer()
    prompts = load_prompts(cfg.prompts, pids=cfg.pids, n=cfg.n)
    sp = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, ignore_eos=cfg.ignore_eos)
    tier = "vanilla" if cfg.draft is None else "strict"
    records = []
    t_all = time.perf_counter()
    for p in prompts:
        item = {"prompt": render_prompt(tok, p)}
        if p.images:
            item["multi_modal_data"] = {"image": load_images(p)}
        t1 = time.perf_counter()
        ids = list(llm.generate([item], sp, use_tqdm=False)[0].outputs[0].token_ids)
        t = time.perf_counter() - t1
        records.append({"pid": p.pid, "mode": cfg.mode, "tier": tier, "gamma": cfg.knobs.gamma if cfg.draft else None,
                        "gen_len": len(ids), "t": t, "tok_s": len(ids) / t, "gen_ids": ids,
                        "experiment": cfg.experiment, "leg": cfg.leg, "run_id": cfg.run_id, "knobs": {},
                        "spec": None, "trace": None})
    wall = time.perf_counter() - t_all
    write_jsonl_atomic(out / "records.jsonl", records)
    write_summary(out, {
        "experiment": cfg.experiment, "leg": cfg.leg, "run_id": cfg.run_id,
        "mode": cfg.mode, "tier": tier, "gamma": records[0]["gamma"] if records else None,
        "target": cfg.target, "draft": cfg.draft, "engine_start_s": start_s, "wall_s": wall,
        "n_prompts": len(records), "knobs": {}, "written_by": "benchmarks/bench_overhead.py (bare generate)"})


def as_leg(leg_argv: list[str]) -> int:
    """The protocol's leg runner for this benchmark: bare_* legs here, every other leg is a real leg."""
    from workbench import leg
    from workbench.leg import build_parser, config_from_args

    if (config_from_args(build_parser().parse_args(leg_argv)).leg or "").startswith("bare"):
        bare(leg_argv)
        return 0
    return leg.main(leg_argv)


def report(run_dir: Path) -> dict:
    from workbench import metrics
    from workbench.results import load_run

    run_ = load_run(run_dir)
    per = metrics.prompt_ratios(run_.records, leg_rows(run_, "bare"), run_.legs_order, "t",
                                legs=leg_rows(run_, "leg"))
    ratio = metrics.median_iqr(per["ratio"])
    numbers = {"run": f"{run_.experiment}/{run_.run_id}",
               "what": f"{run_.config.get('title')}: per-prompt decode time of the leg over the mean of the bare "
                       f"generate legs on either side, pooled over the legs",
               "ratio": ratio, "overhead_pct_of_decode_time": 100 * (ratio["median"] - 1),
               "per_leg": metrics.ratio_summary(per)[["leg", "ratio", "q25", "q75", "n"]].to_dict(orient="records")}
    write_numbers(run_dir, numbers)
    print(f"\n{numbers['run']}: {numbers['what']}")
    print(f"  leg/bare decode time: median {fmt_ratio(ratio)}")
    print(f"  overhead: {numbers['overhead_pct_of_decode_time']:+.1f}% of decode time (goal < 5%)")
    return numbers


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [RUNNER_FLAG]:
        return as_leg(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", action="store_true", help="strict twin-draft legs (E104) instead of vanilla (E103)")
    runner = [sys.executable, str(Path(__file__).resolve()), RUNNER_FLAG]
    return main_with(ap, argv, lambda args: run(EXPERIMENTS[args.spec], args.results, runner=runner), report)


if __name__ == "__main__":
    sys.exit(main())
