"""Scoring leg: teacher-forced top-1 agreement of a draft model with the target's vanilla output (E7).

For each prompt, the draft reads prompt + the target's generated tokens in one
forward pass; position i agrees when the draft's argmax after the first i
generated tokens is the target's token i. That is what a gamma=1 strict draft
would get accepted with perfect context, so it predicts acceptance without
running speculation.

    python -m workbench.score --model DIR --reference legs/vanilla_1/records.jsonl \
        --prompts prompts.jsonl --out DIR [--dtype bfloat16] [--experiment E7 --leg score_twin --run-id ID]

Runs with transformers (CPU or GPU): one forward per prompt, no engine start.
Writes records.jsonl + summary.json like a leg (records streamed to records.jsonl.partial
as prompts finish, renamed when all are scored), or failure.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from workbench.runfolder import (FAILURE, RECORDS, RECORDS_PARTIAL, SUMMARY, append_jsonl, read_jsonl,
                                 write_json_atomic)


def _load_reference(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"reference records not found: {path}")
    out = read_jsonl(path)
    for lineno, rec in enumerate(out, 1):
        if "pid" not in rec or not isinstance(rec.get("gen_ids"), list):
            raise ValueError(f"{path}: record {lineno} needs 'pid' and a 'gen_ids' list")
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def score_prompt(teacher, prompt, gen_ids: list[int]) -> dict[str, Any]:
    """Top-1 agreement of ``teacher``'s model with ``gen_ids`` at every position."""
    if not gen_ids:
        return {"in_len": teacher.prompt_len(prompt), "n_scored": 0, "n_agree": 0, "agreement": None,
                "first_disagreement": None, "agree": []}
    from workbench.teacher import top1_agreement

    logits, n_prompt = teacher.forward(prompt, gen_ids)
    agree = [int(a) for a in top1_agreement(logits, gen_ids)]
    first = next((i for i, a in enumerate(agree) if not a), None)
    return {"in_len": n_prompt, "n_scored": len(agree), "n_agree": sum(agree),
            "agreement": sum(agree) / len(agree), "first_disagreement": first, "agree": agree}


def run(args: argparse.Namespace) -> Path:
    from workbench.prompts import load_prompts

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    reference = _load_reference(Path(args.reference))
    prompts = {p.pid: p for p in load_prompts(args.prompts, pids=[r["pid"] for r in reference])}
    from workbench.teacher import TeacherForcer

    teacher = TeacherForcer(args.model, dtype=args.dtype)
    device, dtype = teacher.device, teacher.dtype
    load_s = time.monotonic() - t_start
    records = []
    partial = out / RECORDS_PARTIAL
    partial.unlink(missing_ok=True)
    for ref in reference:
        t0 = time.monotonic()
        res = score_prompt(teacher, prompts[ref["pid"]], list(ref["gen_ids"]))
        t = time.monotonic() - t0
        records.append({
            "pid": ref["pid"], "mode": "score", "tier": "score", "gamma": None,
            "in_len": res["in_len"], "in_len_reference": ref.get("in_len"),
            "gen_len": res["n_scored"], "t": t, "tok_s": (res["n_scored"] / t) if t > 0 else None,
            "agreement": res["agreement"], "n_agree": res["n_agree"], "n_scored": res["n_scored"],
            "first_disagreement": res["first_disagreement"], "agree": res["agree"],
            "reference_leg": ref.get("leg"), "experiment": args.experiment, "leg": args.leg,
            "run_id": args.run_id, "knobs": {}, "spec": None, "trace": None,
            "gen_ids": None, "text": None,
        })
        # streamed as prompts finish: a scoring pass that dies keeps what it scored (never as records.jsonl)
        append_jsonl(partial, records[-1:])
    os.replace(partial, out / RECORDS)
    scored = [r for r in records if r["n_scored"]]
    pooled = (sum(r["n_agree"] for r in scored) / sum(r["n_scored"] for r in scored)) if scored else None
    mism = [r["pid"] for r in records if r["in_len_reference"] is not None and r["in_len"] != r["in_len_reference"]]
    import torch
    import transformers
    write_json_atomic(out / SUMMARY, {
        "status": "complete", "experiment": args.experiment, "leg": args.leg, "run_id": args.run_id,
        "mode": "score", "tier": "score", "gamma": None, "model": args.model, "target": None,
        "draft": args.model, "reference": str(args.reference), "backend": "transformers", "device": device,
        "dtype": dtype, "n_prompts": len(records), "pooled_agreement": pooled,
        "in_len_mismatch_pids": mism,
        "note": ("prompt token count differs from the reference leg for these pids: the chat prompt was "
                 "rebuilt differently, agreement there is approximate") if mism else None,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "engine_start_s": load_s, "wall_s": time.monotonic() - t_start, "knobs": {}, "spec": None,
    })
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.score", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="draft checkpoint (folder or hub id)")
    ap.add_argument("--reference", required=True, help="records.jsonl of the target's vanilla leg")
    ap.add_argument("--prompts", required=True, help="prompt file (JSONL) the reference leg ran on")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--max-model-len", type=int, default=None, help="accepted for symmetry with legs; unused")
    ap.add_argument("--experiment")
    ap.add_argument("--leg")
    ap.add_argument("--run-id")
    args = ap.parse_args(argv)
    out = Path(args.out)
    try:
        run(args)
    except Exception as exc:  # a scoring failure is a recorded result, not a crash of the whole run
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / FAILURE, {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                                           "traceback": traceback.format_exc(), "leg": args.leg,
                                           "mode": "score", "tier": "score"})
        print(f"score leg failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
