"""Synthetic, schema-correct run folders for the analysis tests and benchmarks.

The records follow docs/architecture.md (per-prompt record, leg summary,
failure file, run.json/env.json). Acceptance is simulated from per-step
margins, so that every spec leg's ``spec`` counters, ``trace`` and
``gen_ids`` agree with each other the way a real leg's do:

- margins are 0 (the drafted token is the target's argmax) with a per-prompt
  probability, otherwise exponential;
- a leg at relax x accepts the leading run of margins <= x (capped at gamma);
- strict legs reproduce the vanilla ids; a relaxed leg diverges at the first
  accepted token whose margin is > 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

E1_LEGS = [
    {"name": "vanilla_0", "tier": "vanilla"},
    {"name": "strict_g6", "tier": "strict", "gamma": 6},
    {"name": "vanilla_1", "tier": "vanilla"},
]

LADDER_LEGS = [
    {"name": "vanilla_0", "tier": "vanilla"},
    {"name": "strict_g2", "tier": "strict", "gamma": 2},
    {"name": "strict_g4", "tier": "strict", "gamma": 4},
    {"name": "vanilla_1", "tier": "vanilla"},
    {"name": "strict_g6", "tier": "strict", "gamma": 6},
    {"name": "relaxed_g6_x0.693", "tier": "relaxed", "gamma": 6, "relax_logtau": 0.693},
    {"name": "vanilla_2", "tier": "vanilla"},
]

VOCAB = 1000


def _vanilla_ids(pid_index: int, gen_len: int) -> list[int]:
    rng = np.random.default_rng(10_000 + pid_index)
    return rng.integers(10, VOCAB, size=gen_len).tolist()


def _text(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def simulate_leg(
    leg: dict[str, Any],
    n_prompts: int,
    *,
    experiment: str = "E1",
    run_id: str = "20260101T000000Z-0000",
    gen_len: int = 32,
    trace: bool = True,
    seed: int = 0,
    leg_drift: float = 1.0,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Records and summary of one leg (not written)."""
    tier = leg["tier"]
    gamma = leg.get("gamma")
    x = float(leg.get("relax_logtau", 0.0)) if tier != "vanilla" else None
    spec_mode = tier != "vanilla"
    records = []
    tot = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
           "accepted_per_pos": [0] * (gamma or 0)}
    for p in range(n_prompts):
        pid = f"p{p:06d}"
        base_ids = _vanilla_ids(p, gen_len)
        # The prompt's own speed and draft difficulty are fixed across legs.
        prng = np.random.default_rng(p)
        base_tok_s = 20.0 + 10.0 * prng.random()
        p_zero = 0.55 + 0.4 * prng.random()
        if not spec_mode:
            ids = base_ids
            t = gen_len / (base_tok_s * leg_drift)
            spec = None
            tr = None
        else:
            srng = np.random.default_rng([seed, p, gamma, int(round((x or 0) * 1000))])
            steps, per_pos = [], [0] * gamma
            produced, diverge_at = 1, None  # the first token comes from prefill
            while produced < gen_len:
                k = gamma
                zero = srng.random(k) < p_zero
                margins = np.where(zero, 0.0, srng.exponential(1.0, k))
                passed = np.cumprod(margins <= x)
                a = int(passed.sum())
                if diverge_at is None and a and np.any(margins[:a] > 0):
                    diverge_at = produced + int(np.argmax(margins[:a] > 0))
                steps.append({"drafted": k, "accepted": a, "margins": [round(float(m), 4) for m in margins]})
                for i in range(a):
                    per_pos[i] += 1
                produced += a + 1
            ids = list(base_ids)
            if diverge_at is not None and diverge_at < gen_len:
                drng = np.random.default_rng(777 + p)
                ids[diverge_at:] = ((np.array(base_ids[diverge_at:]) + drng.integers(1, 9, gen_len - diverge_at)) % VOCAB).tolist()
            drafts = len(steps)
            draft_tokens = sum(s["drafted"] for s in steps)
            accepted = sum(s["accepted"] for s in steps)
            al = 1 + accepted / drafts
            spec = {"drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted,
                    "accepted_per_pos": per_pos, "acceptance_length": al}
            tr = {"steps": steps} if trace else None
            t = gen_len / (base_tok_s * leg_drift * al / (1 + 0.08 * gamma))
            tot["num_drafts"] += drafts
            tot["num_draft_tokens"] += draft_tokens
            tot["num_accepted_tokens"] += accepted
            tot["accepted_per_pos"] = [a + b for a, b in zip(tot["accepted_per_pos"], per_pos)]
        knobs = {"relax_logtau": x if x is not None else 0.0, "blind_mm": bool(leg.get("blind_mm", False)),
                 "draft_cudagraph": "n/a (cpu)", "trace": bool(trace and spec_mode)}
        records.append({
            "pid": pid, "mode": "spec" if spec_mode else "vanilla", "tier": tier, "gamma": gamma,
            "in_len": 40 + p % 7, "gen_len": gen_len, "t": t, "tok_s": gen_len / t,
            "gen_ids": ids, "text": _text(ids), "experiment": experiment, "leg": leg["name"],
            "run_id": run_id, "knobs": knobs, "spec": spec, "trace": tr,
        })
    summary = {
        "status": "complete", "experiment": experiment, "leg": leg["name"], "run_id": run_id,
        "mode": "spec" if spec_mode else "vanilla", "tier": tier, "gamma": gamma,
        "target": "tiny-target", "draft": "tiny-twin" if spec_mode else None,
        "engine_args": {"max_model_len": 512},
        "knobs": {"relax_logtau": x if x is not None else 0.0, "blind_mm": bool(leg.get("blind_mm", False)),
                  "draft_cudagraph": "n/a (cpu)", "trace": bool(trace and spec_mode)},
        "versions": {"vllm": "0.27.1", "torch": "2.13.0", "transformers": "5.17.0",
                     "workbench": "0", "patch_fingerprint": "synthetic"},
        "engine_start_s": 21.0, "wall_s": sum(r["t"] for r in records), "n_prompts": n_prompts,
        "spec": tot if spec_mode else {"num_drafts": 0, "num_draft_tokens": 0,
                                       "num_accepted_tokens": 0, "accepted_per_pos": []},
    }
    return records, summary


def write_run(
    root: str | Path,
    *,
    experiment: str = "E1",
    run_id: str = "20260101T000000Z-0000",
    legs: list[dict[str, Any]] | None = None,
    n_prompts: int = 8,
    gen_len: int = 32,
    trace: bool = True,
    failed: tuple[str, ...] = (),
    incomplete: tuple[str, ...] = (),
    pending: tuple[str, ...] = (),
    drift: dict[str, float] | None = None,
) -> Path:
    """Write ``root/<experiment>/<run_id>/`` and return its path.

    ``failed`` legs get a failure.json, ``incomplete`` legs a records.jsonl
    without summary, ``pending`` legs no folder at all.
    """
    legs = legs or E1_LEGS
    drift = drift or {}
    rdir = Path(root) / experiment / run_id
    (rdir / "legs").mkdir(parents=True, exist_ok=True)
    (rdir / "run.json").write_text(json.dumps({
        "experiment": experiment, "run_id": run_id, "profile": "tiny", "overrides": {},
        "smoke": True, "legs": [dict(leg) for leg in legs],
    }, indent=1))
    (rdir / "env.json").write_text(json.dumps({
        "packages": {"vllm": "0.27.1"}, "git_commit": "0" * 40, "patch_fingerprint": "synthetic",
        "cpu": "synthetic", "gpu": None,
    }, indent=1))
    for leg in legs:
        name = leg["name"]
        if name in pending:
            continue
        ldir = rdir / "legs" / name
        ldir.mkdir(parents=True, exist_ok=True)
        if name in failed:
            (ldir / "failure.json").write_text(json.dumps({
                "status": "failed", "error": "RuntimeError: synthetic engine crash",
                "traceback": "Traceback (most recent call last):\n  ...\nRuntimeError: synthetic engine crash\n",
            }))
            continue
        records, summary = simulate_leg(leg, n_prompts, experiment=experiment, run_id=run_id,
                                        gen_len=gen_len, trace=trace, leg_drift=drift.get(name, 1.0))
        with (ldir / "records.jsonl").open("w") as fh:
            for rec in records:
                fh.write(json.dumps(rec) + "\n")
        if name not in incomplete:
            (ldir / "summary.json").write_text(json.dumps(summary, indent=1))
    return rdir


def bulk_records(legs: list[dict[str, Any]], n_prompts: int, *, steps: int = 12, seed: int = 0,
                 experiment: str = "BENCH", run_id: str = "20260101T000000Z-beef") -> list[dict[str, Any]]:
    """Many schema-correct records fast (vectorised), for benchmarks: every spec prompt runs
    ``steps`` draft steps; ids stay below 256 so the lists stay small in memory."""
    rng = np.random.default_rng(seed)
    base_tok_s = 20.0 + 10.0 * rng.random(n_prompts)
    p_zero = 0.55 + 0.4 * rng.random(n_prompts)
    out: list[dict[str, Any]] = []
    for li, leg in enumerate(legs):
        tier, gamma = leg["tier"], leg.get("gamma")
        x = float(leg.get("relax_logtau", 0.0))
        knobs = {"relax_logtau": x, "blind_mm": False, "draft_cudagraph": "n/a (cpu)", "trace": tier != "vanilla"}
        common = {"mode": "vanilla" if tier == "vanilla" else "spec", "tier": tier, "gamma": gamma,
                  "experiment": experiment, "leg": leg["name"], "leg_index": li, "run_id": run_id,
                  "knobs": knobs, "relax_logtau": x if tier != "vanilla" else None, "blind_mm": False}
        if tier == "vanilla":
            gen_len = 1 + steps * 4
            ids = list(range(gen_len))
            for p in range(n_prompts):
                t = gen_len / base_tok_s[p]
                out.append({**common, "pid": f"p{p:06d}", "in_len": 40, "gen_len": gen_len, "t": t,
                            "tok_s": base_tok_s[p], "gen_ids": ids, "text": None, "spec": None, "trace": None})
            continue
        zero = rng.random((n_prompts, steps, gamma)) < p_zero[:, None, None]
        margins = np.where(zero, 0.0, np.round(rng.exponential(1.0, (n_prompts, steps, gamma)), 4))
        accepted = np.cumprod(margins <= x, axis=2).sum(axis=2)
        per_pos = (accepted[:, :, None] > np.arange(gamma)).sum(axis=1)
        acc_tot = accepted.sum(axis=1)
        margins_l = margins.tolist()
        acc_l = accepted.tolist()
        for p in range(n_prompts):
            gen_len = int(1 + acc_tot[p] + steps)
            al = 1 + acc_tot[p] / steps
            tok_s = base_tok_s[p] * al / (1 + 0.08 * gamma)
            out.append({
                **common, "pid": f"p{p:06d}", "in_len": 40, "gen_len": gen_len, "t": gen_len / tok_s,
                "tok_s": tok_s, "gen_ids": list(range(min(gen_len, 255))), "text": None,
                "spec": {"drafts": steps, "draft_tokens": steps * gamma, "accepted": int(acc_tot[p]),
                         "accepted_per_pos": per_pos[p].tolist(), "acceptance_length": float(al)},
                "trace": {"steps": [{"drafted": gamma, "accepted": a, "margins": m}
                                    for a, m in zip(acc_l[p], margins_l[p])]},
            })
    return out
