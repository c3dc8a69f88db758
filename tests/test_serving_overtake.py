"""The α at which the twin overtakes another drafter behind the server (``workbench.serving_overtake``)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from workbench.serving_overtake import alpha_to_reach, c_from_measured, expected_tokens_at, overtake_table


def test_the_bound_inverts_both_ways():
    # S = E / (1 + γ c): c recovered from S, and the α that gives S recovered from c
    for alpha, gamma, c in [(0.8, 4, 0.5), (0.95, 3, 0.2), (0.6, 6, 0.35)]:
        s = expected_tokens_at(alpha, gamma) / (1 + gamma * c)
        assert c_from_measured(s, expected_tokens_at(alpha, gamma), gamma) == pytest.approx(c)
        assert alpha_to_reach(s, gamma, c) == pytest.approx(alpha, abs=1e-9)
    assert expected_tokens_at(1.0, 4) == 5 and expected_tokens_at(0.0, 4) == 1
    assert alpha_to_reach(0.3, 4, 0.5) == 0.0          # a step of one token (0.33x) already beats it
    assert alpha_to_reach(1.8, 4, 0.51) is None         # 5 / 3.04 = 1.64 < 1.8: out of reach at any α


def _leg(root, name, draft, rates, schedule=None):
    d = root / "legs" / name
    d.mkdir(parents=True)
    spec = {"synthetic_acceptance_rates": rates, "num_speculative_tokens": len(rates)} if rates else None
    if schedule:
        spec["gamma_schedule"] = schedule
    (d / "summary.json").write_text(json.dumps({"speculative": spec}))
    return {"name": name, "draft": draft}


def test_overtake_table_reads_each_legs_acceptance_and_gamma_from_its_run(tmp_path):
    """The 32B numbers of the issue: the twin at α = 1 (γ 4, c 0.51: S 1.64) against the seed PR's 0.6B text
    draft at acceptance length 1.49 (γ 3, geometric rates) measured at 1.28×."""
    pr_rates = [0.3289, 0.1082, 0.0356]           # a geometric profile of length ~1.47 (as acceptance:length)
    legs = [_leg(tmp_path, "vanilla_1", None, None), _leg(tmp_path, "twin_a1", "twin", [1.0] * 4),
            _leg(tmp_path, "twin_auto", "twin", [0.9, 0.81, 0.729, 0.6561], [[1, 32, 4]]),
            _leg(tmp_path, "pr_text_g3", "text-draft", pr_rates), _leg(tmp_path, "vanilla_2", None, None)]
    (tmp_path / "run.json").write_text(json.dumps({"legs": legs}))
    s_twin = 5 / (1 + 4 * 0.51)
    speedups = pd.DataFrame([
        {"leg": "twin_a1", "tier": "synthetic", "concurrency": 1, "tpot_speedup": s_twin},
        {"leg": "twin_auto", "tier": "synthetic", "concurrency": 1, "tpot_speedup": 1.3},
        {"leg": "pr_text_g3", "tier": "synthetic", "concurrency": 1, "tpot_speedup": 1.28},
        {"leg": "twin_a1", "tier": "synthetic", "concurrency": 16, "tpot_speedup": 0.9},
        {"leg": "pr_text_g3", "tier": "synthetic", "concurrency": 16, "tpot_speedup": 1.1}])
    t = overtake_table(tmp_path, speedups)
    # the scheduled twin leg is not a fixed-γ cost, and vanilla legs have no drafter: one pair per concurrency
    assert list(t["concurrency"]) == [1, 16] and set(t["twin_leg"]) == {"twin_a1"}
    row = t.iloc[0]
    assert row.twin_c_measured == pytest.approx(0.51) and row.other_draft == "text-draft"
    e_pr = 1 + sum(pr_rates)
    assert row.other_c_measured == pytest.approx((e_pr / 1.28 - 1) / 3)
    # the twin matches 1.28x where E(α, 4) = 1.28 · 3.04 = 3.89: α ≈ 0.874
    a = row.alpha_twin_overtakes
    assert expected_tokens_at(a, 4) == pytest.approx(1.28 * (1 + 4 * 0.51)) and 0.86 < a < 0.89
    # at 16 the twin at α = 1 measured 0.9 (c = (5 / 0.9 - 1) / 4 = 1.14): 1.1 needs E 6.1 > 5, out of reach
    assert t.iloc[1].alpha_twin_overtakes is None or pd.isna(t.iloc[1].alpha_twin_overtakes)
