"""Where the twin overtakes another drafter behind the server: the acceptance it needs, from measured costs.

E18 runs the twin and the seed PR's setup (a small text draft at γ 3 and its reported acceptance length)
on one host, in one run, each at a stated acceptance drawn by vLLM's synthetic sampler. Each synthetic
serving leg's measured TPOT ratio S and its known expected tokens per step E = 1 + Σ rates[:γ] give the
cost of its draft as the bound's c, measured behind the server:

    S = E / (1 + γ c)   =>   c = (E / S − 1) / γ.

With the twin's c so measured, the twin at a conditional acceptance α per position (E(α, γ) =
1 + α + … + α^γ) reaches the other drafter's measured S where E(α, γ) = S_other · (1 + γ c_twin): the α at
which the twin overtakes (table ``serving_overtake``). It is a statement about the twin's cost, not its
acceptance: whether a real twin reaches that α is what the real-acceptance legs (E1, E6, E11) measure.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from workbench.serving_predict import _gamma_at

__all__ = ["expected_tokens_at", "c_from_measured", "alpha_to_reach", "overtake_table", "OVERTAKE_COLUMNS"]

OVERTAKE_COLUMNS = ["concurrency", "twin_leg", "other_leg", "other_draft", "twin_gamma", "twin_expected_tokens",
                    "twin_tpot_speedup", "twin_c_measured", "other_gamma", "other_expected_tokens",
                    "other_tpot_speedup", "other_c_measured", "alpha_twin_overtakes"]


def expected_tokens_at(alpha: float, gamma: int) -> float:
    """Tokens a step yields at a conditional acceptance α per position: 1 + α + … + α^γ."""
    return float(sum(alpha ** i for i in range(gamma + 1)))


def c_from_measured(speedup: float, expected: float, gamma: int) -> float:
    """The draft's cost c = (E / S − 1) / γ that a measured speedup S at E tokens per step implies."""
    return (expected / speedup - 1.0) / gamma


def alpha_to_reach(speedup: float, gamma: int, c: float) -> float | None:
    """The smallest conditional α at which E(α, γ) / (1 + γ c) ≥ ``speedup``: 0.0 where even α = 0 does,
    None where α = 1 does not (the draft's cost alone rules it out)."""
    need = speedup * (1.0 + gamma * c)
    if need <= 1.0:
        return 0.0
    if need > gamma + 1.0 + 1e-12:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):  # E(α, γ) increases with α: bisection to ~1e-18
        mid = (lo + hi) / 2
        if expected_tokens_at(mid, gamma) >= need:
            hi = mid
        else:
            lo = mid
    return hi


def _legs_info(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Leg -> {"draft": role, "speculative": the summary's resolved acceptance and schedule}."""
    run_dir = Path(run_dir)
    try:
        planned = json.loads((run_dir / "run.json").read_text()).get("legs") or []
    except (OSError, ValueError):
        planned = []
    out: dict[str, dict[str, Any]] = {}
    for leg in planned:
        name = leg.get("name")
        try:
            summary = json.loads((run_dir / "legs" / str(name) / "summary.json").read_text())
        except (OSError, ValueError):
            continue
        out[name] = {"draft": leg.get("draft"), "speculative": summary.get("speculative") or {}}
    return out


def _cost_at(info: dict[str, Any], conc: int, speedup: float) -> tuple[int, float, float] | None:
    spec = info["speculative"]
    rates = spec.get("synthetic_acceptance_rates")
    gamma = _gamma_at(spec, conc)
    if not rates or gamma < 1 or not (isinstance(speedup, float) and math.isfinite(speedup) and speedup > 0):
        return None
    expected = 1.0 + float(sum(rates[:gamma]))
    return gamma, expected, c_from_measured(speedup, expected, gamma)


def overtake_table(run_dir: str | Path, speedups: pd.DataFrame) -> pd.DataFrame:
    """Per concurrency, per (twin leg at a fixed γ, leg of another drafter), both synthetic: measured TPOT
    ratios, the c each implies, and the α at which the twin overtakes (``alpha_to_reach``)."""
    legs = _legs_info(Path(run_dir))
    rows = []
    synth = speedups[speedups["tier"] == "synthetic"]
    for conc, part in synth.groupby("concurrency", sort=True):
        cells = {}
        for r in part.itertuples(index=False):
            info = legs.get(r.leg)
            cost = _cost_at(info, int(conc), float(r.tpot_speedup)) if info else None
            if cost is not None:
                cells[r.leg] = (info, cost, float(r.tpot_speedup))
        twins = {k: v for k, v in cells.items() if v[0]["draft"] == "twin" and not v[0]["speculative"].get("gamma_schedule")}
        others = {k: v for k, v in cells.items() if v[0]["draft"] not in (None, "twin")}
        for tname, (_, (tg, te, tc), ts) in twins.items():
            for oname, (oinfo, (og, oe, oc), os_) in others.items():
                rows.append({"concurrency": int(conc), "twin_leg": tname, "other_leg": oname,
                             "other_draft": oinfo["draft"], "twin_gamma": tg, "twin_expected_tokens": te,
                             "twin_tpot_speedup": ts, "twin_c_measured": tc, "other_gamma": og,
                             "other_expected_tokens": oe, "other_tpot_speedup": os_, "other_c_measured": oc,
                             "alpha_twin_overtakes": alpha_to_reach(os_, tg, tc)})
    return pd.DataFrame(rows, columns=OVERTAKE_COLUMNS)
