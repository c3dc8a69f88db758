"""workbench.metrics on hand-made records with answers worked out by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from synthetic_runs import LADDER_LEGS, write_run  # noqa: E402

from workbench import metrics as M  # noqa: E402
from workbench.results import load_run  # noqa: E402


def rec(leg, pid, tier, tok_s, gamma=None, gen_ids=(1, 2, 3), spec=None, trace=None, x=None, leg_index=0):
    return {"leg": leg, "leg_index": leg_index, "pid": pid, "tier": tier,
            "mode": "vanilla" if tier == "vanilla" else "spec", "gamma": gamma,
            "relax_logtau": x if x is not None else (None if tier == "vanilla" else 0.0),
            "blind_mm": False, "tok_s": tok_s, "gen_ids": list(gen_ids), "spec": spec, "trace": trace}


# legs in run order: v0, s1, v1, s2   (s2 has only a vanilla leg before it)
VAN0 = {"a": 10, "b": 20, "c": 10, "d": 5}
VAN1 = {"a": 30, "b": 20, "c": 10, "d": 15}
S1 = {"a": 40, "b": 30, "c": 10, "d": 25}   # / [20, 20, 10, 10] = [2.0, 1.5, 1.0, 2.5]
S2 = {"a": 60, "b": 20, "c": 10, "d": 30}   # / [30, 20, 10, 15] = [2.0, 1.0, 1.0, 2.0]


def speed_records(order=("v0", "s1", "v1", "s2")):
    rows = []
    tables = {"v0": (VAN0, "vanilla", None), "s1": (S1, "strict", 6), "v1": (VAN1, "vanilla", None),
              "s2": (S2, "strict", 4)}
    for i, leg in enumerate(order):
        if leg not in tables:
            continue
        vals, tier, g = tables[leg]
        rows += [rec(leg, pid, tier, v, gamma=g, leg_index=i) for pid, v in vals.items()]
    return pd.DataFrame(rows)


def test_bracketed_speedup_median_iqr_and_sides():
    out = M.bracketed_speedup(speed_records()).set_index("leg")
    s1 = out.loc["s1"]
    assert s1["speedup"] == pytest.approx(1.75)
    # numpy linear quantiles of [1.0, 1.5, 2.0, 2.5]
    assert (s1["q25"], s1["q75"], s1["iqr"], s1["n"]) == (pytest.approx(1.375), pytest.approx(2.125),
                                                          pytest.approx(0.75), 4)
    assert (s1["vanilla_before"], s1["vanilla_after"]) == ("v0", "v1")
    s2 = out.loc["s2"]
    assert (s2["vanilla_before"], s2["vanilla_after"]) == ("v1", None)
    assert s2["speedup"] == pytest.approx(1.5)
    assert list(out.index) == ["s1", "s2"]


def test_bracketing_skips_a_leg_without_records():
    # "vfail" is in the run order but failed: s1 and s2 are bracketed by v0 and v1 on both sides.
    records = speed_records(order=("v0", "s1", "vfail", "s2", "v1"))
    out = M.bracketed_speedup(records, ["v0", "s1", "vfail", "s2", "v1"]).set_index("leg")
    assert (out.loc["s2", "vanilla_before"], out.loc["s2", "vanilla_after"]) == ("v0", "v1")
    assert out.loc["s1", "speedup"] == pytest.approx(1.75)
    per = M.prompt_speedups(records, ["v0", "s1", "vfail", "s2", "v1"])
    assert per.loc[(per["leg"] == "s2") & (per["pid"] == "a"), "speedup"].item() == pytest.approx(3.0)


def test_prompt_missing_on_one_side_uses_the_other():
    records = speed_records()
    records = records[~((records["leg"] == "v0") & (records["pid"] == "a"))]
    per = M.prompt_speedups(records).set_index(["leg", "pid"])
    assert per.loc[("s1", "a"), "baseline_tok_s"] == pytest.approx(30.0)
    assert per.loc[("s1", "a"), "speedup"] == pytest.approx(40 / 30)


def test_speedup_errors():
    records = speed_records()
    with pytest.raises(ValueError, match="no.*vanilla|vanilla leg"):
        M.bracketed_speedup(records[records["tier"] != "vanilla"])
    with pytest.raises(ValueError, match="not in legs_order"):
        M.bracketed_speedup(records, ["v0", "s1"])


def test_exactness_divergence_and_rate():
    rows = [rec("v", "p1", "vanilla", 1, gen_ids=[1, 2, 3, 4]), rec("s", "p1", "strict", 1, gen_ids=[1, 2, 9, 4]),
            rec("v", "p2", "vanilla", 1, gen_ids=[1, 2, 3, 4]), rec("s", "p2", "strict", 1, gen_ids=[1, 2, 3]),
            rec("v", "p3", "vanilla", 1, gen_ids=[5, 6]), rec("s", "p3", "strict", 1, gen_ids=[5, 6])]
    ex = M.exactness(pd.DataFrame(rows), "v", "s").set_index("pid")
    assert ex.loc["p1", "first_divergence"] == 2 and not ex.loc["p1", "exact"]
    assert ex.loc["p2", "first_divergence"] == 3  # prefix: diverges where the shorter ends
    assert ex.loc["p3", "exact"] and pd.isna(ex.loc["p3", "first_divergence"])
    assert ex.loc["p1", "prefix_match_frac"] == pytest.approx(0.5)
    summ = M.exactness_summary(pd.DataFrame(rows)).iloc[0]
    assert summ["ref_leg"] == "v" and summ["match_rate"] == pytest.approx(1 / 3)
    assert (summ["n"], summ["n_exact"], summ["median_first_divergence"]) == (3, 1, 2.5)
    with pytest.raises(ValueError, match="'nope' has no records"):
        M.exactness(pd.DataFrame(rows), "v", "nope")


SPEC1 = {"drafts": 4, "draft_tokens": 12, "accepted": 6, "accepted_per_pos": [3, 2, 1], "acceptance_length": 2.5}
SPEC2 = {"drafts": 2, "draft_tokens": 6, "accepted": 0, "accepted_per_pos": [0, 0, 0], "acceptance_length": 1.0}


def test_acceptance_from_spec_counters():
    df = pd.DataFrame([rec("s", "p1", "strict", 1, gamma=3, spec=SPEC1), rec("s", "p2", "strict", 1, gamma=3, spec=SPEC2),
                       rec("v", "p1", "vanilla", 1)])
    leg = M.acceptance(df).iloc[0]
    assert leg["acceptance_rate"] == pytest.approx(6 / 18)
    assert leg["acceptance_length"] == pytest.approx(1 + 6 / 6)
    assert leg["n_prompts"] == 2
    per = M.prompt_acceptance(df).set_index("pid")
    assert per.loc["p1", "acceptance_length"] == pytest.approx(2.5)
    assert per.loc["p2", "acceptance_rate"] == 0
    pos = M.per_position_acceptance(df)
    assert list(pos["position"]) == [0, 1, 2]
    assert np.allclose(pos["rate"], [3 / 6, 2 / 6, 1 / 6])


def test_acceptance_from_leg_summaries(tmp_path):
    run = load_run(write_run(tmp_path, n_prompts=4))
    from_summary = M.leg_summary_acceptance(run.legs).set_index("leg")
    from_records = M.acceptance(run.records).set_index("leg")
    # The synthetic summary's counters are the sums of the per-prompt ones.
    assert from_summary.loc["strict_g6", "acceptance_length"] == pytest.approx(
        from_records.loc["strict_g6", "acceptance_length"])
    assert len(from_summary.loc["strict_g6", "per_position"]) == 6


# One prompt, gamma 3, a strict leg:
#   step 1: margins [0, 0.5, 2.0] -> accepted 1 at x=0
#   step 2: margins [0.3, 0, 0]   -> accepted 0
#   step 3: margins [0, 0, 0]     -> accepted 3
STEPS = [{"drafted": 3, "accepted": 1, "margins": [0.0, 0.5, 2.0]},
         {"drafted": 3, "accepted": 0, "margins": [0.3, 0.0, 0.0]},
         {"drafted": 3, "accepted": 3, "margins": [0.0, 0.0, 0.0]}]


def traced(steps=STEPS, gen_ids=tuple(range(100, 108))):
    return pd.DataFrame([rec("s", "p1", "strict", 1, gamma=3, gen_ids=gen_ids, trace={"steps": steps}),
                         rec("v", "p1", "vanilla", 1, gen_ids=gen_ids)])


@pytest.mark.parametrize("x, accepted", [(0.0, 4), (0.3, 7), (0.5, 8), (1.99, 8), (2.0, 9), (10.0, 9)])
def test_predict_acceptance_counterfactual(x, accepted):
    # x=0.3: step 2 now passes all three (running max 0.3); x=0.5: step 1 passes two; x=2: all.
    pred = M.predict_acceptance(traced(), x)
    agg = pred.aggregate.iloc[0]
    assert agg["accepted"] == accepted
    assert agg["acceptance_length"] == pytest.approx(1 + accepted / 3)
    assert agg["acceptance_rate"] == pytest.approx(accepted / 9)
    pp = pred.per_prompt.iloc[0]
    assert (pp["pid"], pp["accepted"], pp["relax_logtau"]) == ("p1", accepted, x)


def test_predict_at_leg_x_reproduces_measured_and_caps_at_drafted():
    steps = STEPS + [{"drafted": 2, "accepted": 2, "margins": [0.0, 0.0]}]
    pred = M.predict_acceptance(traced(steps), [0.0, 5.0]).aggregate.set_index("relax_logtau")
    assert pred.loc[0.0, "accepted"] == sum(s["accepted"] for s in steps)
    assert pred.loc[5.0, "accepted"] == 11  # 3 + 3 + 3 + 2: never more than drafted
    with pytest.raises(ValueError, match=">= 0"):
        M.predict_acceptance(traced(), -1.0)
    with pytest.raises(ValueError, match="no record carries a trace"):
        M.predict_acceptance(speed_records(), 0.5)


def test_trace_step_validation_names_prompt():
    bad = [{"drafted": 3, "accepted": 1, "margins": [0.0, 0.1]}]
    with pytest.raises(ValueError, match="prompt 'p1'.*2 margins"):
        M.predict_acceptance(traced(bad), 0.0)


def test_acceptance_over_position():
    # Step starts: 1 (after the prefill token), 1+2=3, 3+1=4.
    idx = M.TraceIndex(traced())
    assert list(idx.position) == [1, 3, 4]
    over = M.acceptance_over_position(traced(), bins=[0, 2, 5])
    assert list(over["n_steps"]) == [1, 2]
    assert np.allclose(over["acceptance_rate"], [1 / 3, 3 / 6])
    assert np.allclose(over["acceptance_length"], [2.0, 2.5])
    pred = M.acceptance_over_position(traced(), bins=[0, 2, 5], relax_logtau=2.0)
    assert np.allclose(pred["acceptance_rate"], [1.0, 1.0])
    with pytest.raises(ValueError, match="bins"):
        M.acceptance_over_position(traced(), bins=[3, 1])


def test_token_class_acceptance_proxy():
    # Evaluated output positions: step1 -> 1 (acc), 2 (rej); step2 -> 3 (rej); step3 -> 4, 5, 6 (acc).
    # gen_ids[i] = 100 + i; class ids {102, 103} = positions 2 and 3, both rejected.
    out = M.token_class_acceptance(traced(), {102, 103}).set_index("token_class")
    assert (out.loc["image-word", "evaluated"], out.loc["image-word", "accepted"]) == (2, 0)
    assert (out.loc["other", "evaluated"], out.loc["other", "accepted"]) == (4, 4)
    by_map = M.token_class_acceptance(traced(), {104: "digit"}).set_index("token_class")
    assert by_map.loc["digit", "rate"] == 1.0 and by_map.loc["other", "evaluated"] == 5

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [len(text.strip())]
    ids = M.image_word_token_ids(Tok(), ["red", "circle"])
    assert ids == {3, 6}


def test_token_class_acceptance_by_position_labels():
    # the same evaluated positions as above, labelled per position (the grounded definition's shape):
    # positions 1 and 4 grounded -> one accepted (1), one accepted (4); 2, 3 rejected, 5, 6 accepted
    labels = [["other", "g", "other", "other", "g", "other", "other", "other"]]
    out = M.token_class_acceptance(traced(), set(), position_labels=labels).set_index("token_class")
    assert (out.loc["g", "evaluated"], out.loc["g", "accepted"]) == (2, 2)
    assert (out.loc["other", "evaluated"], out.loc["other", "accepted"]) == (4, 2)
    with pytest.raises(ValueError, match="one label per output token"):
        M.token_class_acceptance(traced(), set(), position_labels=[["g"] * 3])


def test_step_costs_and_the_speedup_model():
    from workbench.analyses import alpha_from_length
    from workbench.leg import step_costs_of

    rows = [{"prefill": True, "target_ms": 50.0, "spec_tokens": 0, "draft_ms": 9.0},
            *({"prefill": False, "target_ms": t, "spec_tokens": 4, "draft_ms": d, "draft_loop_ms": d / 2}
              for t, d in ((10.0, 8.0), (12.0, 4.0), (11.0, 6.0))),
            {"prefill": False, "target_ms": 7.0, "spec_tokens": 0}]
    sc = step_costs_of(rows, gamma=4)
    assert sc["steps"] == 5 and sc["decode_steps"] == 4  # the prefill step is left out
    assert sc["verify_ms"]["median"] == 11.0 and sc["verify_ms"]["n"] == 3
    assert sc["decode_ms"] == {"median": 7.0, "q1": 7.0, "q3": 7.0, "n": 1}
    assert sc["propose_ms"]["median"] == 6.0 and sc["draft_step_ms"]["median"] == 1.5
    assert sc["draft_loop_ms"]["median"] == 3.0
    assert sc["prefill_ms"]["median"] == 50.0 and sc["prefill_propose_ms"]["median"] == 9.0
    assert step_costs_of(rows, gamma=None)["draft_step_ms"] is None
    for gamma, alpha in ((4, 0.7), (6, 0.35), (2, 0.95)):
        length = sum(alpha ** i for i in range(gamma + 1))
        assert alpha_from_length(length, gamma) == pytest.approx(alpha, abs=1e-9)
    assert alpha_from_length(1.0, 4) == pytest.approx(0.0, abs=1e-9)


def test_synthetic_run_is_self_consistent(tmp_path):
    """Across a ladder: strict legs are exact, relaxed accepts more, predicted at the leg's x = measured."""
    run = load_run(write_run(tmp_path, legs=LADDER_LEGS, n_prompts=12))
    ex = M.exactness_summary(run.records).set_index("leg")
    assert ex.loc["strict_g6", "match_rate"] == 1.0
    assert ex.loc["relaxed_g6_x0.693", "match_rate"] < 1.0
    acc = M.acceptance(run.records).set_index("leg")
    assert acc.loc["relaxed_g6_x0.693", "acceptance_length"] > acc.loc["strict_g6", "acceptance_length"]
    agg = M.predict_acceptance(run.records, [0.0, 0.693]).aggregate.set_index(["leg", "relax_logtau"])
    assert agg.loc[("strict_g6", 0.0), "acceptance_length"] == pytest.approx(acc.loc["strict_g6", "acceptance_length"])
    assert agg.loc[("relaxed_g6_x0.693", 0.693), "acceptance_length"] == pytest.approx(
        acc.loc["relaxed_g6_x0.693", "acceptance_length"])


def test_per_position_prediction():
    idx = M.TraceIndex(traced())
    assert np.allclose(idx.per_position_at("s", 0.0), [2 / 3, 1 / 3, 1 / 3])
    assert np.allclose(idx.per_position_at("s", 0.5), [1.0, 1.0, 2 / 3])
    with pytest.raises(ValueError, match="no acceptance trace"):
        idx.per_position_at("v", 0.5)


def test_score_records_are_neither_vanilla_nor_spec():
    records = speed_records()
    score = [{**rec("score", pid, "score", None, leg_index=9), "mode": "score", "gen_ids": None} for pid in "abcd"]
    both = pd.concat([records, pd.DataFrame(score)], ignore_index=True)
    assert list(M.bracketed_speedup(both)["leg"]) == ["s1", "s2"]
    assert list(M.exactness_summary(both)["leg"]) == ["s1", "s2"]


def test_prompt_ratios_against_named_reference_legs_and_pooled_median():
    # A (reference) and B legs alternate; B's value is 0.8 of the mean of the A legs around it.
    rows = []
    for i, (leg, scale) in enumerate([("a1", 1.0), ("b1", None), ("a2", 1.5), ("b2", None), ("a3", 2.0)]):
        for pid, base in (("p1", 100.0), ("p2", 200.0)):
            rows.append({"leg": leg, "leg_index": i, "pid": pid, "tier": "strict", "t": 1.0,
                         "tok_s": base * scale if scale else None})
    rec = pd.DataFrame(rows)
    for leg, (before, after) in {"b1": ("a1", "a2"), "b2": ("a2", "a3")}.items():
        for pid, base in (("p1", 100.0), ("p2", 200.0)):
            ref = base * ({"a1": 1.0, "a2": 1.5, "a3": 2.0}[before] + {"a1": 1.0, "a2": 1.5, "a3": 2.0}[after]) / 2
            rec.loc[(rec["leg"] == leg) & (rec["pid"] == pid), "tok_s"] = 0.8 * ref
    per = M.prompt_ratios(rec, ["a1", "a2", "a3"])
    assert sorted(per["leg"].unique()) == ["b1", "b2"]
    assert per["ratio"].tolist() == pytest.approx([0.8] * 4)
    assert set(zip(per["leg"], per["ref_before"], per["ref_after"])) == {("b1", "a1", "a2"), ("b2", "a2", "a3")}
    summary = M.ratio_summary(per)
    assert summary["ratio"].tolist() == pytest.approx([0.8, 0.8]) and summary["n"].tolist() == [2, 2]
    pooled = M.median_iqr(per["ratio"])
    assert pooled["median"] == pytest.approx(0.8) and pooled["n"] == 4 and pooled["iqr"] == pytest.approx(0)
    with pytest.raises(ValueError, match="at least one finished reference leg"):
        M.prompt_ratios(rec[rec["leg"].str.startswith("b")], ["a1"])


def test_acceptance_formulas_defined_once():
    assert M.acceptance_rate(3, 4) == 0.75 and M.acceptance_length(3, 2) == 2.5
    assert M.acceptance_rate(0, 0) is None and M.acceptance_length(5, 0) is None
    arr = M.acceptance_length(np.array([2.0, 1.0]), np.array([1.0, 0.0]))
    assert arr[0] == 3.0 and np.isnan(arr[1])
    s = M.acceptance_rate(pd.Series([1.0, 2.0], index=[5, 6]), pd.Series([2.0, 0.0], index=[5, 6]))
    assert list(s.index) == [5, 6] and s[5] == 0.5 and np.isnan(s[6])
