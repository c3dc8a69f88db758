"""The quick-start job: experiment E1 (vanilla / strict twin drafting / vanilla) on the tiny models.

    python -m workbench.demo [--gamma 6] [--max-tokens 64] [--results results]
    python -m workbench.demo --show results/E1/<run id>      # print the comparison of a finished run

Builds the tiny Qwen3-VL and its int4 twin (once), runs E1 under the ``tiny``
profile through the protocol -- three legs, each a fresh process, into
``results/E1/<run id>/`` -- on all 13 built-in prompts, writes the run's tables
(``workbench.analyses``) and prints the comparison: exact match of the strict
tier, acceptance, and per-prompt speedup against the bracketing vanilla legs.
On the tiny models the draft costs about as much as the target, so the
speedup printed here says nothing about real checkpoints; exactness and
acceptance do.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT, PROFILE = "E1", "tiny"
N_PROMPTS = 13  # the whole built-in tiny set


def report(run_dir: str | Path) -> tuple[str, bool]:
    """The comparison printed for a finished demo run, and whether the strict tier passed the exactness rule
    (``workbench.exactness``: equal to vanilla, or in bf16 every divergence a near-tie)."""
    from .analyses import RunTables

    t = RunTables(_load(run_dir))
    legs = t.run.legs.set_index("leg")
    tokens = t["legs_throughput"].set_index("leg")["total_tokens"]
    lines = [f"run folder: {t.run.path}",
             f"{'leg':<12}{'engine start s':>16}{'decode s':>10}{'tokens':>8}{'tok/s':>8}"]
    for leg in t.run.legs_order:
        start, wall = legs.loc[leg, "engine_start_s"], legs.loc[leg, "wall_s"]
        lines.append(f"{leg:<12}{start:>16.1f}{wall:>10.2f}{int(tokens[leg]):>8}{tokens[leg] / wall:>8.1f}")
    ex, acc, sp = t["exactness"].iloc[0], t["acceptance"].iloc[0], t["speedup"].iloc[0]
    pos = t["per_position_acceptance"]
    rates = [round(float(r), 2) for r in pos[pos["leg"] == acc["leg"]].sort_values("position")["rate"]]
    ok = bool(ex["rule_ok"])
    lines += [
        "",
        f"strict tier (int4 twin, gamma={int(acc['gamma'])}) vs vanilla, {ex['dtype']}: {ex['classification']}"
        f" -> {'passes' if ok else 'FAILS'} the exactness rule (docs/exactness.md)",
        f"acceptance: rate {acc['acceptance_rate']:.3f}, length {acc['acceptance_length']:.2f}, per position {rates}",
        f"speedup (median over prompts vs bracketing vanilla legs): {sp['speedup']:.2f}x "
        f"(IQR {sp['q25']:.2f}-{sp['q75']:.2f}); tiny models on CPU: not indicative of real checkpoints",
    ]
    return "\n".join(lines), ok


def _load(run_dir):
    from .results import load_run
    return load_run(run_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--results", default=str(REPO / "results"), help="results root (default: results)")
    ap.add_argument("--show", metavar="RUN_DIR", help="print the comparison of a finished demo run and stop")
    args = ap.parse_args(argv)
    if args.show:
        text, exact = report(args.show)
        print(text)
        return 0 if exact else 1

    from . import protocol
    from .tiny import ensure_tiny_models

    print("building the tiny models (first run only) ...", flush=True)
    ensure_tiny_models()
    overrides = {"n": N_PROMPTS, "max_tokens": args.max_tokens, "gamma": args.gamma}
    rdir = protocol.prepare_run(EXPERIMENT, PROFILE, overrides, smoke=True, results_root=args.results)
    statuses = protocol.execute(rdir)
    failed = [leg for leg, s in statuses.items() if s != "complete"]
    if failed:
        print(f"legs not complete: {', '.join(failed)} (see {rdir}/legs/<leg>/failure.json)", file=sys.stderr)
        return 1
    protocol.analyze_run(rdir, figures=False)
    text, exact = report(rdir)
    print()
    print(text)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
