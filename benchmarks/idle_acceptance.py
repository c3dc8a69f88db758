"""What the draft's skipped passes cost in real acceptance (knob ``draft_idle``), with the target judging.

    python benchmarks/idle_acceptance.py --out /tmp/idle                  # tiny models, CPU, float32
    python benchmarks/idle_acceptance.py --target DIR --twin DIR --dtype bfloat16 --out DIR   # any pair

Under a γ schedule that turns speculation off at large batches, ``draft_idle=skip`` runs no draft pass at
a decode step with γ 0 and ``skip_all`` none at a γ-0 step that admits prompts either. Behind a server
that made the twin's TPOT equal vanilla's at concurrency 32 (``results/E18/README.md``), measured at a
synthetic α, which cannot show the price: the draft's KV cache lacks the tokens of the skipped passes
(``skip``: those decode tokens; ``skip_all``: the prompts admitted then too), so once the batch is small
enough for γ > 0 again its drafts read entries never written.

This measures that price at real acceptance, the target verifying every drafted token (strict tier):
one batch of requests with staggered output lengths (``--lengths``) starts together at a batch size where
the schedule says γ 0 (``--off-from``), shrinks as the short ones finish, and the long ones are drafted
for at γ ``--gamma`` once at most ``--off-from`` - 1 remain. Engines, one process each: vanilla (the
outputs to compare with), the twin at a fixed γ (no schedule: its cache always whole), and the schedule
with ``draft_idle`` ``sync`` (vLLM's: the draft's pass runs at γ 0 too), ``skip`` and ``skip_all``.
Per engine: vLLM's spec-decode counters (drafts, drafted and accepted tokens, per position), the plugin's
skip counters, and whether every output equals vanilla's (strict tier: it must, in float32).

Output: ``<mode>.json`` per engine and ``summary.json``, printed as a table. Acceptance depends on the
pair: the tiny models rehearse the measurement; the organism or real checkpoints give the number.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODES = ("vanilla", "fixed", "sync", "skip", "skip_all")
METRICS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
           "vllm:spec_decode_num_accepted_tokens": "accepted",
           "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos"}


def schedule(gamma: int, off_from: int, batch: int) -> str:
    """The γ schedule: ``gamma`` below ``off_from`` requests, 0 from there to the batch."""
    return f"1-{off_from - 1}:{gamma}/{off_from}-{max(batch, off_from)}:0"


def _knobs(args, mode: str):
    from workbench.knobs import Knobs

    if mode == "vanilla":
        return Knobs(trace=False)
    if mode == "fixed":
        return Knobs(gamma=args.gamma, trace=False)
    return Knobs(gamma=args.gamma, trace=False, draft_idle=mode,
                 gamma_schedule=schedule(args.gamma, args.off_from, len(args.lengths)))


def run_mode(args, mode: str) -> dict:
    """One engine in this process: the batch, its outputs and counters -> ``<mode>.json``."""
    from workbench import ladder_engine as le
    from workbench.engine import cuda_present

    roles = _roles(args)
    cpu = not cuda_present()
    knobs = _knobs(args, mode)
    report = tempfile.mkdtemp(prefix=f"engine-{mode}-", dir=args.out)  # the engine's report, in the run folder
    le.set_process_env(cpu, report, {**knobs.to_env(report), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    spec = mode != "vanilla"
    extra = knobs.spec_config_extra(len(args.lengths), roles["target"])[0] if spec else None
    llm, _ = le.engine(roles["target"], roles["twin"] if spec else None, knobs.gamma, len(args.lengths), cpu,
                       dummy=False, dtype=args.dtype, engine_args=knobs.engine_args(on_cuda=not cpu) if spec else None,
                       spec_extra=extra)
    from vllm import SamplingParams

    from vllm_patch import engine_patches as ep

    prompts = le.prompts(len(args.lengths), args.vocab_hi, seed=args.seed, prompt_len=args.prompt_len)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in args.lengths]
    outs = llm.generate(prompts, params, use_tqdm=False)
    counters = {name: 0 for name in METRICS.values()}
    for metric in llm.get_metrics():
        if metric.name in METRICS:
            counters[METRICS[metric.name]] = getattr(metric, "values", None) or getattr(metric, "value", 0)
    state = ep.G
    out = {"mode": mode, "knobs": knobs.as_dict(), "spec_config_extra": extra,
           "outputs": [list(o.outputs[0].token_ids) for o in outs], **counters,
           "draft_idle_skips": state.draft_idle_skips, "draft_idle_prompt_skips": state.draft_idle_prompt_skips}
    (args.out / f"{mode}.json").write_text(json.dumps(out))
    if mode == "vanilla":
        from workbench import envcapture

        envcapture.write_env(args.out / "env.json", {"command": sys.argv[1:], "roles": roles})
    le.free(llm)
    return out


def summarize(out_dir: Path, modes: list[str]) -> dict:
    rows = {m: json.loads((out_dir / f"{m}.json").read_text()) for m in ["vanilla", *modes]}
    ref = rows["vanilla"]["outputs"]
    summary = {}
    for mode in modes:
        r = rows[mode]
        drafts = r["drafts"]
        per_pos = list(r["accepted_per_pos"] or [])
        summary[mode] = {
            "drafts": drafts, "draft_tokens": r["draft_tokens"], "accepted": r["accepted"],
            "acceptance_length": 1 + r["accepted"] / drafts if drafts else None,
            "acceptance_rate_per_position": [a / drafts for a in per_pos] if drafts else [],
            "draft_idle_skips": r["draft_idle_skips"], "draft_idle_prompt_skips": r["draft_idle_prompt_skips"],
            "outputs_equal_to_vanilla": sum(a == b for a, b in zip(r["outputs"], ref)), "requests": len(ref)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"{'mode':<10}{'drafts':>8}{'acc. length':>13}{'skipped passes':>16}{'with prompts':>14}{'equal':>8}")
    for mode, s in summary.items():
        length = f"{s['acceptance_length']:.2f}" if s["acceptance_length"] else "-"
        print(f"{mode:<10}{s['drafts']:>8}{length:>13}{s['draft_idle_skips']:>16}{s['draft_idle_prompt_skips']:>14}"
              f"{s['outputs_equal_to_vanilla']:>5}/{s['requests']}")
    return summary


def _roles(args) -> dict[str, str]:
    if args.target and args.twin:
        return {"target": str(args.target), "twin": str(args.twin)}
    from workbench.tiny import ensure_tiny_models

    m = ensure_tiny_models()  # float32 on CPU: the twin dequantized (vLLM's CPU int4 kernel has no float32 path)
    return {"target": str(m["target"]), "twin": str(m["twin-dequant" if args.dtype == "float32" else "twin-int4"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, help="target folder (default: the tiny target)")
    ap.add_argument("--twin", type=Path, help="twin folder (default: the tiny twin)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--lengths", default="8,12,16,20,24,28,96,128",
                    help="output tokens per request, comma-separated: the batch that starts together")
    ap.add_argument("--off-from", type=int, default=3, help="batch size from which the schedule says γ 0")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--vocab-hi", type=int, default=400, help="prompt token ids are drawn below this")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--modes", default="fixed,sync,skip,skip_all",
                    help="spec engines beside vanilla, comma-separated: fixed, sync, skip, skip_all")
    ap.add_argument("--only", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        ap.error(f"--lengths must be integers separated by commas, got {args.lengths!r}")
    if bool(args.target) != bool(args.twin):
        ap.error("--target and --twin go together")
    if not 2 <= args.off_from <= len(args.lengths) or min(args.lengths) < 1 or not 1 <= args.gamma <= 32:
        ap.error("--off-from must be 2..(number of requests), every length >= 1, --gamma 1..32")
    if sorted(args.lengths)[-args.off_from + 1] <= sorted(args.lengths)[-args.off_from]:
        ap.error("--lengths: the longest off-from - 1 requests must outlast the rest, or nothing is drafted at γ > 0")
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or any(m not in MODES[1:] for m in args.modes):
        ap.error(f"--modes: one or more of {', '.join(MODES[1:])}, got {','.join(args.modes)!r}")
    for mode in args.modes:
        _knobs(args, mode)  # bad knobs are refused here, before any engine starts
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only:
        run_mode(args, args.only)
        return 0
    from workbench.childproc import wrap

    for mode in ["vanilla", *args.modes]:  # one engine per process
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--only", mode]
        rc = subprocess.run(wrap(os.getpid(), cmd), cwd=REPO, check=False).returncode
        if rc != 0:
            print(f"[idle-acceptance] {mode} engine failed (exit {rc})", file=sys.stderr)
            return rc
    summarize(args.out, args.modes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
