"""Acceptance from the per-prompt spec counters: per prompt, per leg, per draft position, from leg summaries."""

from __future__ import annotations

import numpy as np
import pandas as pd

from .common import (LEG_KEYS, SPEC_TIERS, _leg_meta, _require, acceptance_length, acceptance_rate,
                     position_acceptance)


def _spec_rows(records: pd.DataFrame) -> pd.DataFrame:
    _require(records, ["leg", "pid", "spec"], "acceptance")
    return records[records["spec"].map(lambda s: isinstance(s, dict))]


def prompt_acceptance(records: pd.DataFrame) -> pd.DataFrame:
    """Per prompt of every spec leg, from its ``spec`` counters."""
    spec = _spec_rows(records)
    cols = LEG_KEYS + ["pid", "drafts", "draft_tokens", "accepted", "acceptance_rate", "acceptance_length"]
    if spec.empty:
        return pd.DataFrame(columns=cols)
    out = spec[[c for c in LEG_KEYS if c in spec.columns] + ["pid"]].copy()
    for k in ("drafts", "draft_tokens", "accepted"):
        out[k] = spec["spec"].map(lambda s, k=k: s.get(k)).astype(float)
    out["acceptance_rate"] = acceptance_rate(out["accepted"], out["draft_tokens"])
    out["acceptance_length"] = acceptance_length(out["accepted"], out["drafts"])
    return out.reindex(columns=cols).reset_index(drop=True)


def acceptance(records: pd.DataFrame) -> pd.DataFrame:
    """Per spec leg, pooled over prompts (sums of counters, then ratios, as vLLM does)."""
    per = prompt_acceptance(records)
    cols = LEG_KEYS + ["n_prompts", "drafts", "draft_tokens", "accepted", "acceptance_rate", "acceptance_length"]
    if per.empty:
        return pd.DataFrame(columns=cols)
    g = per.groupby("leg", sort=False)
    sums = g[["drafts", "draft_tokens", "accepted"]].sum()
    sums["n_prompts"] = g.size()
    out = _leg_meta(per).join(sums).reset_index()
    out["acceptance_rate"] = acceptance_rate(out["accepted"], out["draft_tokens"])
    out["acceptance_length"] = acceptance_length(out["accepted"], out["drafts"])
    return out.sort_values("leg_index", kind="stable")[cols].reset_index(drop=True)


def per_position_acceptance(records: pd.DataFrame) -> pd.DataFrame:
    """Long table: per spec leg and draft position i (0-based), accepted at i / drafts."""
    spec = _spec_rows(records)
    cols = LEG_KEYS + ["position", "accepted", "drafts", "rate"]
    rows = []
    for leg, grp in spec.groupby("leg", sort=False):
        per_pos = [np.asarray(s.get("accepted_per_pos") or [], dtype=float) for s in grp["spec"]]
        width = max((len(p) for p in per_pos), default=0)
        if width == 0:
            continue
        acc = np.zeros(width)
        for p in per_pos:
            acc[: len(p)] += p
        drafts = float(sum(s.get("drafts") or 0 for s in grp["spec"]))
        meta = grp.iloc[0]
        for i in range(width):
            rate = position_acceptance(acc[i], drafts)
            rows.append({**{k: meta.get(k) for k in LEG_KEYS}, "position": i, "accepted": acc[i],
                         "drafts": drafts, "rate": np.nan if rate is None else rate})
    return pd.DataFrame(rows, columns=cols)


def leg_summary_acceptance(legs: pd.DataFrame) -> pd.DataFrame:
    """Engine-wide counters from the leg summaries (``Run.legs``), same vocabulary."""
    done = legs[(legs["status"] == "complete") & legs["tier"].isin(SPEC_TIERS)].copy()
    drafts = done["spec_num_drafts"].astype(float)
    draft_tokens = done["spec_num_draft_tokens"].astype(float)
    accepted = done["spec_num_accepted_tokens"].astype(float)
    done["acceptance_rate"] = acceptance_rate(accepted, draft_tokens)
    done["acceptance_length"] = acceptance_length(accepted, drafts)
    done["per_position"] = [
        (np.asarray(p, dtype=float) / d).tolist() if isinstance(p, list) and d else None
        for p, d in zip(done["spec_accepted_per_pos"], drafts)
    ]
    return done[["leg", "leg_index", "tier", "gamma", "relax_logtau", "blind_mm", "spec_num_drafts",
                 "spec_num_draft_tokens", "spec_num_accepted_tokens", "acceptance_rate",
                 "acceptance_length", "per_position"]].reset_index(drop=True)
