"""Side-by-side leg benchmarks on the tiny models (CPU), legs alternating A and B in one run.

    python benchmarks/bench_legs.py spec   # E101: vanilla vs strict twin drafting: decode tok/s, engine start
    python benchmarks/bench_legs.py trace  # E102: strict with vs without the acceptance trace: cost of tracing
    python benchmarks/bench_legs.py --analyze results/E101/<run id>   # the numbers of a finished run

Each benchmark is an experiment of benchmarks/benchmarks.yaml run through the protocol
into results/<id>/<run id>/ (every leg a fresh process). Every B leg is compared with
the mean of the A legs on either side of it, prompt by prompt
(``workbench.metrics.prompt_ratios``), and the median ratio over prompts of all B legs
is reported with its IQR; the numbers go to ``tables/benchmark.json`` of the run.
Numbers, not assertions: this machine is noisy and shared.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runs import fmt_ratio, leg_rows, main_with, run, write_numbers

EXPERIMENTS = {"spec": "E101", "trace": "E102"}


def spec_numbers(run_) -> dict:
    from workbench import metrics
    from workbench.analyses import RunTables

    t = RunTables(run_)
    legs = run_.legs.set_index("leg")
    throughput = t["legs_throughput"].set_index("leg")
    strict = [leg for leg in run_.legs_order if leg.startswith("strict")]
    vanilla = leg_rows(run_, "vanilla")
    counters = metrics.leg_summary_acceptance(run_.legs)
    accepted, drafted, drafts = (float(counters[c].sum()) for c in
                                 ("spec_num_accepted_tokens", "spec_num_draft_tokens", "spec_num_drafts"))
    return {
        "what": "strict gamma=6 (int4 twin) vs vanilla: per-prompt decode tok/s ratio against the bracketing "
                "vanilla legs, pooled over the strict legs",
        "ratio": metrics.median_iqr(t["prompt_speedups"]["speedup"]),
        "per_leg": t["speedup"][["leg", "speedup", "q25", "q75", "n"]].to_dict(orient="records"),
        # generated tokens over the leg's decode wall time, mean over the legs of a kind
        "decode_tok_s": {kind: float((throughput.loc[names, "total_tokens"] / legs.loc[names, "wall_s"]).mean())
                         for kind, names in (("vanilla", vanilla), ("strict", strict))},
        "engine_start_s": {kind: float(legs.loc[names, "engine_start_s"].mean())
                           for kind, names in (("vanilla", vanilla), ("strict", strict))},
        "acceptance_rate": metrics.acceptance_rate(accepted, drafted),
        "acceptance_length": metrics.acceptance_length(accepted, drafts),
        "exact": {r["leg"]: f"{r['n_exact']}/{r['n']}" for r in t["exactness"].to_dict(orient="records")},
    }


def trace_numbers(run_) -> dict:
    from workbench import metrics

    per = metrics.prompt_ratios(run_.records, leg_rows(run_, "strict_notrace"), run_.legs_order, "tok_s",
                                legs=leg_rows(run_, "strict_trace"))
    ratio = metrics.median_iqr(per["ratio"])
    return {"what": "strict with the acceptance trace vs strict without: per-prompt decode tok/s ratio against "
                    "the untraced legs on either side, pooled over the traced legs",
            "ratio": ratio, "per_leg": metrics.ratio_summary(per).drop(columns=["tier"], errors="ignore")
            [["leg", "ratio", "q25", "q75", "n"]].to_dict(orient="records"),
            "cost_pct_of_decode_rate": 100 * (1 - ratio["median"])}


def report(run_dir: Path) -> dict:
    from workbench.results import load_run

    run_ = load_run(run_dir)
    numbers = spec_numbers(run_) if run_.experiment == EXPERIMENTS["spec"] else trace_numbers(run_)
    numbers["run"] = f"{run_.experiment}/{run_.run_id}"
    write_numbers(run_dir, numbers)
    print(f"\n{numbers['run']}: {numbers['what']}")
    print(f"  median {fmt_ratio(numbers['ratio'])}")
    if "decode_tok_s" in numbers:
        print("  decode tok/s (mean of legs): " + ", ".join(f"{k} {v:.1f}" for k, v in numbers["decode_tok_s"].items()))
        print("  engine start s: " + ", ".join(f"{k} {v:.1f}" for k, v in numbers["engine_start_s"].items()))
        print(f"  acceptance rate {numbers['acceptance_rate']:.3f}, length {numbers['acceptance_length']:.2f}; "
              f"exact: {numbers['exact']}")
    else:
        print(f"  tracing cost: {numbers['cost_pct_of_decode_rate']:.1f}% of decode rate (median)")
    return numbers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", nargs="?", choices=sorted(EXPERIMENTS))

    def start(args) -> Path:
        if not args.what:
            ap.error("name a benchmark (spec, trace) or --analyze RUN_DIR")
        return run(EXPERIMENTS[args.what], args.results)

    return main_with(ap, argv, start, report)


if __name__ == "__main__":
    sys.exit(main())
