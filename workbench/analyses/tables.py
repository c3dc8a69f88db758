"""The table registry: each table a run folder holds (``TABLES``) and the recipe that computes it from a run's
records (a ``workbench.metrics`` function). Recipes take the run's ``RunTables`` (``analyses.runtables``,
which imports this module, so ``RunTables`` here is an annotation only, never evaluated)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd

from .. import exactness, metrics
from .base import RELAX_GRID, Table


def _speedup(t: RunTables) -> pd.DataFrame:
    t.need(t.has_spec and t.has_vanilla, "vanilla and spec legs")
    return metrics.bracketed_speedup(t.records, t.run.legs_order)


def _prompt_speedups(t: RunTables) -> pd.DataFrame:
    t.need(t.has_spec and t.has_vanilla, "vanilla and spec legs")
    return metrics.prompt_speedups(t.records, t.run.legs_order)


def _exactness(t: RunTables) -> pd.DataFrame:
    """Exact-match statistics, and each strict leg judged by the one exactness rule (``workbench.exactness``)."""
    t.need(t.has_spec and t.has_vanilla, "vanilla and spec legs")
    out = metrics.exactness_summary(t.records, refs=t.references)
    verdicts = t.verdicts
    out["dtype"] = [v.dtype if (v := verdicts.get(leg)) else None for leg in out["leg"]]
    for col in ("n_near_tie", "n_error", "n_unclassified"):
        out[col] = [v.as_dict()[col] if (v := verdicts.get(leg)) else None for leg in out["leg"]]
    out["rule_ok"] = [v.ok if (v := verdicts.get(leg)) else None for leg in out["leg"]]
    out["classification"] = [v.describe() if (v := verdicts.get(leg)) else "relaxed tier: may differ by design"
                             for leg in out["leg"]]
    return out


def _divergences(t: RunTables) -> pd.DataFrame:
    """Per strict leg and diverging prompt: first differing token, the fp32 target's top-2 gap there, class."""
    t.need(t.has_spec and t.has_vanilla, "vanilla and spec legs")
    rows = [{"leg": leg, "dtype": v.dtype, "threshold": exactness.threshold(v.dtype), "pid": d.pid,
             "position": d.position, "top2_gap": d.top2_gap, "class": d.kind}
            for leg, v in t.verdicts.items() for d in v.divergences]
    return pd.DataFrame(rows, columns=["leg", "dtype", "threshold", "pid", "position", "top2_gap", "class"])


def _acceptance(t: RunTables) -> pd.DataFrame:
    t.need(t.has_spec, "spec leg")
    return metrics.acceptance(t.records)


def _per_position(t: RunTables) -> pd.DataFrame:
    t.need(t.has_spec, "spec leg")
    return metrics.per_position_acceptance(t.records)


def _over_position(t: RunTables) -> pd.DataFrame:
    t.need(t.trace is not None, "acceptance trace (trace knob off)")
    return t.trace.over_position(t.bins)


def _counterfactual(t: RunTables) -> pd.DataFrame:
    t.need(t.trace is not None, "acceptance trace (trace knob off)")
    return t.trace.curves(RELAX_GRID)


GROUNDED_AUTO_BYTES = 2 << 30


def _token_classes(t: RunTables) -> pd.DataFrame:
    """Per traced spec leg and token class: evaluated draft positions, accepted, rate.

    Classes by the grounded definition (``workbench.grounding``: the float32 target's greedy choice there
    changes with a blank picture, teacher-forced on the leg's output by the leg's own target, cached in
    ``grounded.json``, a second target's in ``grounded-2.json``) where the target can be loaded
    (automatically up to ``GROUNDED_AUTO_BYTES`` of weights, at any size with ``WORKBENCH_GROUNDED=1``)
    or the cache has every output; else by the vocabulary proxy
    (``metrics.image_word_token_ids`` with the target's tokenizer). Column ``definition`` says which.
    """
    from .. import grounding

    t.need(t.trace is not None and t.has_spec, "acceptance trace of a spec leg")
    recs = t.records
    traced = recs[recs["trace"].map(lambda x: isinstance(x, dict) and bool(x.get("steps")))]
    t.need(len(traced) > 0, "traced spec output")
    target_of = {leg: t.leg_targets[leg] for leg in traced["leg"].unique() if leg in t.leg_targets}
    t.need(bool(target_of), "target model of the spec legs")
    # each leg's tokens are classed by its own target (E14 runs two), with a cache file per target
    order = _targets_in_order(t)
    parts = [_token_classes_of(t, traced[traced["leg"].map(target_of.get) == target], target,
                               _per_target(grounding.CACHE, order, target))
             for target in dict.fromkeys(target_of.values())]
    out = pd.concat(parts, ignore_index=True)
    tiers = traced.drop_duplicates("leg").set_index("leg")
    for k in ("tier", "blind_mm"):
        if k in tiers.columns:
            out.insert(1, k, out["leg"].map(tiers[k]))
    return out


def _token_classes_of(t: RunTables, traced: pd.DataFrame, target: str, cache: str) -> pd.DataFrame:
    from .. import grounding

    model_dir = _model_dir(target)
    # One float32 teacher pass per traced output: automatic for checkpoints up to GROUNDED_AUTO_BYTES on disk
    # (the tiny models, the organism); WORKBENCH_GROUNDED=1 asks for it at any size, 0 never.
    ask = os.environ.get("WORKBENCH_GROUNDED")
    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else 0
    cache_only = (not t.teacher or os.environ.get("WORKBENCH_NO_TEACHER") == "1" or ask == "0"
                  or (ask != "1" and weights > GROUNDED_AUTO_BYTES))
    finder = grounding.GroundedPositions(model_dir, lambda: {p.pid: p for p in _prompts(t)},
                                         cache=t.run.path / cache, cache_only=cache_only)
    rows = list(traced[["pid", "gen_ids"]].itertuples(index=False))
    if finder.available() or all(finder.cached(r.pid, r.gen_ids) for r in rows):
        labels = [finder.labels(r.pid, r.gen_ids) for r in rows]
        out = metrics.token_class_acceptance(traced, set(), position_labels=labels)
        out["definition"] = "grounded: target's greedy choice changes with a blank picture"
    else:
        from transformers import AutoTokenizer

        t.need((Path(model_dir) / "tokenizer_config.json").is_file(), "target model or tokenizer for the token classes")
        ids = metrics.image_word_token_ids(AutoTokenizer.from_pretrained(model_dir))
        out = metrics.token_class_acceptance(traced, ids)
        out["definition"] = "vocabulary proxy (metrics.IMAGE_WORDS)"
    return out


def alpha_from_length(acceptance_length: float, gamma: int) -> float:
    """The per-token acceptance probability alpha whose expected tokens per step, (1 - alpha^(gamma+1)) /
    (1 - alpha), equal the measured acceptance length (bisection; the sum is increasing in alpha)."""
    target = min(max(float(acceptance_length), 1.0), gamma + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(gamma + 1)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _speedup_model(t: RunTables) -> pd.DataFrame:
    """Per spec leg: the measured step costs, the acceptance, the speedup they predict and the measured one.

    c = draft_step_ms / verify_ms (the drafter's propose / gamma over the target's verification step, both
    from the engine's step timer); predicted S = (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)) with
    alpha from the measured acceptance length (so the numerator is that length); measured S = the median
    bracketed speedup (``speedup`` table). ``verify_over_decode``: the verification step over the bracketing
    vanilla legs' decode step (the formula takes it as 1).

    The formula counts decode steps only. ``predicted_with_prefill`` adds what a request of the leg's mean
    output length also pays, from the same step timer: vanilla ``prefill + (n - 1) decode``, spec
    ``prefill + prefill propose + (n - 1) / acceptance length x (verify + propose)``; with short outputs the
    prefill's share is what moves the measured speedup away from the formula.
    """
    t.need(t.has_spec and t.has_vanilla, "vanilla and spec legs")
    legs = t.run.legs.set_index("leg")
    t.need(legs["step_costs"].map(lambda x: isinstance(x, dict) and "verify_ms" in x).any(),
           "step timings (legs run before the step timer was recorded per leg)")
    acc = _acceptance(t).set_index("leg")
    speed = t.get("speedup")
    speed = speed.set_index("leg") if speed is not None else None

    def med(leg, key):
        sc = legs.loc[leg, "step_costs"] if leg in legs.index else None
        v = (sc or {}).get(key) if isinstance(sc, dict) else None
        return v["median"] if isinstance(v, dict) else None

    vanilla = [l for l in legs.index if legs.loc[l, "tier"] == "vanilla" and med(l, "decode_ms") is not None]
    decode = float(np.mean([med(l, "decode_ms") for l in vanilla])) if vanilla else None
    van_prefill = [med(l, "prefill_ms") for l in vanilla if med(l, "prefill_ms") is not None]
    van_prefill = float(np.mean(van_prefill)) if van_prefill else None
    gen_len = t.records.groupby("leg")["gen_len"].mean()
    rows = []
    for leg in acc.index:
        gamma = int(acc.loc[leg, "gamma"])
        verify, draft = med(leg, "verify_ms"), med(leg, "draft_step_ms")
        length = float(acc.loc[leg, "acceptance_length"])
        c = draft / verify if verify and draft is not None else None
        predicted = length / (gamma * c + 1) if c is not None else None
        measured = float(speed.loc[leg, "speedup"]) if speed is not None and leg in speed.index else None
        n, pf, ppf, propose = float(gen_len.get(leg, 0.0)), med(leg, "prefill_ms"), med(leg, "prefill_propose_ms"), \
            med(leg, "propose_ms")
        with_prefill = None
        if None not in (decode, van_prefill, verify, propose, pf, ppf) and n >= 1:
            t_vanilla = van_prefill + (n - 1) * decode
            t_spec = pf + ppf + (n - 1) / length * (verify + propose)
            with_prefill = t_vanilla / t_spec if t_spec > 0 else None
        rows.append({"leg": leg, "tier": acc.loc[leg, "tier"], "gamma": gamma,
                     "acceptance_rate": float(acc.loc[leg, "acceptance_rate"]), "acceptance_length": length,
                     "alpha": alpha_from_length(length, gamma), "decode_ms": decode, "verify_ms": verify,
                     "draft_step_ms": draft, "propose_ms": propose, "c": c,
                     "verify_over_decode": verify / decode if verify and decode else None,
                     "predicted_speedup": predicted, "mean_output_tokens": n,
                     "prefill_ms": pf, "prefill_propose_ms": ppf, "vanilla_prefill_ms": van_prefill,
                     "predicted_with_prefill": with_prefill, "measured_speedup": measured,
                     "measured_over_predicted": measured / predicted if measured and predicted else None})
    return pd.DataFrame(rows)


def _agreement(t: RunTables) -> pd.DataFrame:
    """Per prompt: teacher-forced agreement (score leg) beside realised acceptance (first strict leg)."""
    recs = t.run.records
    score = recs[recs["mode"] == "score"] if len(recs) else recs
    t.need(len(score) > 0, "score leg")
    acc = metrics.prompt_acceptance(t.records)
    strict = acc[acc["tier"] == "strict"]
    t.need(len(strict) > 0, "strict leg to compare the score leg with")
    first = strict[strict["leg"] == strict["leg"].iloc[0]]
    return score[["pid", "agreement", "n_scored"]].merge(
        first[["pid", "leg", "acceptance_rate", "acceptance_length"]], on="pid")


def _legs_throughput(t: RunTables) -> pd.DataFrame:
    recs = t.records
    t.need(len(recs) > 0, "finished engine leg")
    vt = recs.groupby("leg", sort=False).agg(tier=("tier", "first"), n=("pid", "size"),
                                             median_tok_s=("tok_s", "median"),
                                             total_tokens=("gen_len", "sum"), t_max=("t", "max"))
    # total throughput of a leg: all tokens over the time the slowest prompt finished
    vt["throughput_tok_s"] = vt["total_tokens"] / vt["t_max"]
    return vt.reset_index()


def _targets_in_order(t: "RunTables") -> list[str]:
    """The run's target checkpoints in the order its legs first use them (most runs have one; E14 two)."""
    legs = t.run.legs
    if "target" not in legs.columns:
        return []
    order = {leg: i for i, leg in enumerate(t.run.legs_order)}
    rows = sorted(legs.itertuples(index=False), key=lambda r: order.get(r.leg, len(order)))
    return list(dict.fromkeys(r.target for r in rows if isinstance(r.target, str)))


def _per_target(name: str, targets: list[str], target: str) -> str:
    """A teacher cache's file in the run folder for ``target``: ``name`` for the run's first target (so a run
    of one target keeps its one file), ``<stem>-<k>.json`` for the k-th other (a cache belongs to one target)."""
    k = targets.index(target) if target in targets else 0
    return name if k == 0 else f"{Path(name).stem}-{k + 1}{Path(name).suffix}"


def _model_dir(path: str) -> str:
    """A leg's model path as written (relative to where the run was made, the repository root) -> a folder."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return str(p)
    from ..envcapture import REPO_ROOT
    return str(REPO_ROOT / p)


def _prompts(t: RunTables) -> list:
    from ..prompts import load_prompts
    return load_prompts(t.run.path / t.run.config.get("prompts_file", "prompts.jsonl"), check_images=False)


def _mathvista_accuracy(t: RunTables) -> pd.DataFrame:
    from ..datasets.scoring import score_mathvista
    t.need(t.dataset == "mathvista" and len(t.records) > 0, "MathVista prompts")
    prompts = {p.pid: p for p in _prompts(t)}
    rows = []
    for r in t.records.itertuples():
        res = score_mathvista(r.text or "", prompts[r.pid].meta)
        rows.append({"leg": r.leg, "tier": r.tier, "pid": r.pid, "correct": bool(res.get("correct"))})
    return pd.DataFrame(rows).groupby("leg", sort=False).agg(
        tier=("tier", "first"), n=("pid", "size"), accuracy=("correct", "mean")).reset_index()


def _organism_accuracy(t: RunTables) -> pd.DataFrame:
    """Per leg: the organism's rule-scored accuracy on its held-out questions, beside ``chance``: guessing
    uniformly among each question's possible answers (``organism.corpus.chance_level`` over these prompts'
    templates), what a model that does not look at the picture reaches."""
    from ..organism.corpus import TEMPLATES, chance_level, score_output
    from ..registry import load_registry
    t.need(t.dataset == "organism" and len(t.records) > 0, "organism prompts")
    try:
        style = load_registry().profile(t.run.config.get("profile")).organism
    except Exception:  # noqa: BLE001 - a run folder from elsewhere: judge by what the outputs look like
        style = None
    # a leg's style is its target's variant (E14 under the organism runs both), read from the organism's
    # manifest where the checkpoint is here, else the profile's
    leg_style = {}
    for leg in t.records["leg"].unique():
        target = t.leg_targets.get(leg)
        try:
            leg_style[leg] = json.loads((Path(_model_dir(target)) / "manifest.json").read_text())["variant"]
        except (TypeError, OSError, ValueError, KeyError):
            leg_style[leg] = style
    prompts = {p.pid: p for p in _prompts(t)}
    templates = [p.meta.get("template") for p in prompts.values()]
    chance = chance_level(templates) if templates and all(n in TEMPLATES for n in templates) else float("nan")
    rows = []
    for r in t.records.itertuples():
        meta = prompts[r.pid].meta
        s = leg_style.get(r.leg) or ("thinking" if "<think>" in (r.text or "") else "instruct")
        res = score_output(r.text or "", meta, style=s)
        rows.append({"leg": r.leg, "tier": r.tier, "pid": r.pid, "correct": bool(res["correct"])})
    out = pd.DataFrame(rows).groupby("leg", sort=False).agg(
        tier=("tier", "first"), n=("pid", "size"), accuracy=("correct", "mean")).reset_index()
    out["chance"] = chance
    return out


def _mmvet_capability(t: RunTables) -> pd.DataFrame:
    """Per MM-Vet capability and leg: prompts, tok/s and acceptance length (no grader needed)."""
    from ..datasets.scoring import mmvet_capability_table
    t.need(t.dataset == "mmvet" and len(t.records) > 0, "MM-Vet prompts")
    prompts = _prompts(t)
    acc = metrics.prompt_acceptance(t.records)[["leg", "pid", "acceptance_length"]]
    merged = t.records[["leg", "tier", "pid", "tok_s"]].merge(acc, on=["leg", "pid"], how="left")
    parts = []
    for leg, grp in merged.groupby("leg", sort=False):
        part = mmvet_capability_table(grp, prompts=prompts, values=("tok_s", "acceptance_length"))
        part.insert(0, "leg", leg)
        parts.append(part)
    return pd.concat(parts, ignore_index=True)


def _step_costs(t: RunTables) -> pd.DataFrame:
    from .. import ladder
    t.need(t.ladder is not None, "cost-ladder leg (steps.jsonl)")
    return ladder.step_costs(t.ladder[0])


def _cost_ratio(t: RunTables) -> pd.DataFrame:
    from .. import ladder
    t.need(t.ladder is not None, "cost-ladder leg (steps.jsonl)")
    return ladder.cost_ratio(t["step_costs"], t.ladder[1])


def _first_token_costs(t: RunTables) -> pd.DataFrame:
    from .. import ladder
    t.need(t.ladder is not None, "cost-ladder leg (steps.jsonl)")
    return ladder.first_token_costs(t.ladder[0])


def _speedup_curve(t: RunTables) -> pd.DataFrame:
    from .. import ladder
    ratios = t["cost_ratio"]
    t.need(len(ratios) > 0, "complete cost-ladder spec leg")
    return ladder.speedup_curve(ratios)


def _serving(t: RunTables, i: int) -> pd.DataFrame:
    t.need(t.serving is not None, "complete serving leg (runner serve)")
    return t.serving[i]


def _serving_legs(t: RunTables) -> pd.DataFrame:
    return _serving(t, 0)


def _serving_speedup(t: RunTables) -> pd.DataFrame:
    t.need(t.serving is not None and (t.serving[0]["tier"] == "vanilla").any()
           and t.serving[0]["tier"].isin(metrics.SPEC_TIERS).any(), "vanilla and spec serving legs")
    return _serving(t, 1)


def _serving_overtake(t: RunTables) -> pd.DataFrame:
    from workbench.serving_overtake import overtake_table

    speedups = _serving_speedup(t)
    out = overtake_table(t.run.path, speedups)
    t.need(not out.empty, "synthetic serving legs of the twin (fixed γ) and of another drafter")
    return out


def _serving_requests(t: RunTables) -> pd.DataFrame:
    return _serving(t, 2)


TABLES: dict[str, Table] = {t.name: t for t in [
    Table("speedup", _speedup, "per spec leg: median bracketed speedup over prompts, IQR (metrics.bracketed_speedup)"),
    Table("prompt_speedups", _prompt_speedups, "per prompt and spec leg: tok/s over the bracketing vanilla legs'"),
    Table("acceptance", _acceptance, "per spec leg: acceptance rate and length from the per-prompt counters"),
    Table("exactness", _exactness, "per spec leg: exact-match rate and first divergence vs the first vanilla leg; "
          "strict legs judged by the exactness rule (workbench.exactness: equal, or bf16 near-ties only)"),
    Table("divergences", _divergences, "per strict leg and diverging prompt: first differing token, float32 "
          "target's top-2 gap there, near-tie / error / unclassified"),
    Table("per_position_acceptance", _per_position, "per spec leg and draft position: accepted at i / drafts"),
    Table("acceptance_over_position", _over_position, "per traced leg: acceptance vs output token position",
          in_summary=False),
    Table("counterfactual_acceptance", _counterfactual,
          "per traced leg: acceptance predicted at each relax x on RELAX_GRID from the recorded margins",
          in_summary=False),
    Table("speedup_model", _speedup_model, "per spec leg: measured step costs (target verification, draft step "
          "= propose / gamma, from the engine's step timer), c, acceptance, the speedup they predict "
          "((1 - a^(g+1)) / ((1 - a)(g c + 1))) beside the measured one"),
    Table("token_classes", _token_classes, "per traced spec leg and token class: acceptance of image-grounded "
          "tokens (the target's greedy choice changes with a blank picture, workbench.grounding) vs the others, "
          "or the vocabulary proxy where the target cannot be loaded"),
    Table("agreement", _agreement, "per prompt (E7): teacher-forced agreement beside realised acceptance"),
    Table("legs_throughput", _legs_throughput, "per engine leg: median tok/s and total throughput"),
    Table("mathvista_accuracy", _mathvista_accuracy, "per leg: rule-scored MathVista accuracy"),
    Table("organism_accuracy", _organism_accuracy, "per leg: the organism's rule-scored accuracy on its held-out "
          "questions (MathVista scorer), beside the mean chance level of their formats"),
    Table("mmvet_capability", _mmvet_capability, "per leg and MM-Vet capability: tok/s, acceptance length"),
    Table("step_costs", _step_costs, "cost ladder (E16): median and IQR ms of the target's decode step, its "
          "verification step (gamma + 1 tokens per request) and the drafter's propose, per size, batch, gamma, "
          "drafter graphs (ladder.step_costs)"),
    Table("cost_ratio", _cost_ratio, "cost ladder (E16): c = (propose / gamma) / verification step per cell, "
          "S(1, gamma, c) = (gamma + 1) / (gamma c + 1), and the measured forced-acceptance speedup, end to end "
          "and decode only (the first token, timed apart, taken off), with the time to the first token"),
    Table("first_token_costs", _first_token_costs, "cost ladder (E16): where the spec engine's first token goes: "
          "the target's prefill (vanilla and spec engine), the draft's first propose, its prefill alone (first "
          "propose - (gamma-1) single-token steps), and (target + draft) / vanilla prefill (ladder.first_token_costs)"),
    Table("speedup_curve", _speedup_curve, "cost ladder (E16): S(alpha, gamma, c) for alpha in [0.5, 0.98] at "
          "each cell's c", in_summary=False),
    Table("serving_legs", _serving_legs, "serving legs (E17): TTFT/TPOT/ITL/E2EL mean, median, p90, p99 ms, output "
          "and request throughput, acceptance from the server counters and the per-request sums (serving.leg_table)"),
    Table("serving_speedup", _serving_speedup, "serving legs (E17): per spec leg, median over the bracketing "
          "vanilla legs of its concurrency of the TPOT speedup and throughput ratio, IQR (serving.paired_speedups)"),
    Table("serving_overtake", _serving_overtake, "serving legs at synthetic acceptance (E18): per concurrency, "
          "the twin (fixed γ) beside another drafter: measured TPOT ratios, the draft cost c = (E / S - 1) / γ each "
          "implies, and the conditional α per position at which the twin overtakes (serving_overtake)"),
    Table("serving_requests", _serving_requests, "serving legs (E17): one row per request (serving.request_table)",
          in_summary=False),
]}
