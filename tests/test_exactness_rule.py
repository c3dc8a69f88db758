"""Issue 17: one exactness rule for every device and CPU kind, and one tie rule for gate and counterfactual."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from conftest import REPO, TINY_PROMPTS
from workbench import exactness as X
from workbench import metrics

H200 = REPO / "results" / "cuda-verify" / "20261129T235800Z-h200"


# --------------------------------------------------------------------------- the rule, on its own
def _gaps(table):
    return lambda pid, prefix: table[(pid, len(prefix))]


def test_bf16_near_ties_pass_and_are_reported_with_their_gaps():
    ref = {"a": [1, 2, 3, 4], "b": [5, 6, 7], "c": [1, 1]}
    other = {"a": [1, 2, 9, 4], "b": [5, 6, 7], "c": [1, 2]}
    v = X.classify(ref, other, "bfloat16", _gaps({("a", 2): 0.032, ("c", 1): 0.037}))
    assert v.ok and v.n_exact == 1 and [d.kind for d in v.divergences] == ["near-tie", "near-tie"]
    assert v.describe() == "1/3 equal, 2 near-ties (gaps 0.032, 0.037)"
    v.check()


def test_a_divergence_where_the_target_was_sure_fails_naming_it():
    v = X.classify({"a": [1, 2, 3]}, {"a": [1, 7, 3]}, "bf16", _gaps({("a", 1): 0.8}))
    assert not v.ok and v.errors == [X.Divergence("a", 1, 0.8, "error")]
    with pytest.raises(AssertionError, match=r"a at token 1, gap 0\.8"):
        v.check()


def test_float32_excuses_nothing_and_bf16_without_a_teacher_is_unclassified():
    tiny_gap = _gaps({("a", 0): 1e-7})
    assert not X.classify({"a": [1]}, {"a": [2]}, "float32", tiny_gap).ok
    assert X.classify({"a": [1]}, {"a": [2]}, "float32", None).errors
    v = X.classify({"a": [1]}, {"a": [2]}, "bfloat16", None)
    assert not v.ok and v.unclassified and "1 unclassified (a at token 0)" in v.describe()
    # a gap the function cannot give (no model, not cached) is unclassified, not a crash
    v = X.classify({"a": [1]}, {"a": [2]}, "bfloat16", _gaps({}))
    assert [d.kind for d in v.divergences] == ["unclassified"]
    assert X.threshold("float32") == 0 and X.threshold("bfloat16") == X.NEAR_TIE
    with pytest.raises(ValueError, match="dtype must be one of"):
        X.classify({}, {}, "int8")
    with pytest.raises(ValueError, match="not in the reference"):
        X.classify({"a": [1]}, {"b": [1]}, "bfloat16")


# --------------------------------------------------------------------------- recorded on the H200
def _records(leg):
    path = H200 / "legs" / leg / "records.jsonl"
    return {r["pid"]: r["gen_ids"] for r in map(json.loads, path.read_text().splitlines()) if r}


@pytest.fixture(scope="module")
def h200_gaps(tiny_models):
    from workbench.prompts import load_prompts

    return X.TeacherGaps(tiny_models["target"], {p.pid: p for p in load_prompts(TINY_PROMPTS)})


def test_recorded_h200_near_ties_and_a_recorded_real_divergence(h200_gaps):
    """The H200's bf16 strict leg (2 near-ties) passes; its relaxed leg, judged as if strict, fails."""
    suite = json.loads((H200 / "gpu_suite.json").read_text())["bf16_strict_vs_vanilla_c1"]
    vanilla = _records("bf16_vanilla_c1")
    strict = X.classify(vanilla, _records("bf16_strict_c1"), "bfloat16", h200_gaps)
    print(f"\nH200 bf16 strict c1, classified here: {strict.describe()}")
    assert strict.ok and [(d.pid, d.position) for d in strict.divergences] == [
        (d["pid"], d["position"]) for d in suite["divergences"]]
    # the tiny models are rebuilt bit for bit here: the same fp32 gaps as the GPU host's teacher
    for mine, theirs in zip(strict.divergences, suite["divergences"]):
        assert mine.top2_gap == pytest.approx(theirs["top2_gap"], abs=2e-3)
    relaxed = X.classify(_records("bf16_vanilla_c8"), _records("bf16_relaxed_c8"), "bfloat16", h200_gaps)
    print(f"H200 bf16 relaxed c8 judged as if strict: {relaxed.describe()}")
    assert relaxed.errors and not relaxed.ok


def test_gaps_are_cached_in_the_run_folder_and_read_back_without_the_model(tmp_path, h200_gaps):
    cache = tmp_path / X.GAPS_CACHE
    gaps = X.TeacherGaps(h200_gaps.target_dir, h200_gaps.prompts, cache=cache)
    first = X.classify(_records("bf16_vanilla_c1"), _records("bf16_strict_c1"), "bfloat16", gaps)
    assert cache.is_file() and len(json.loads(cache.read_text())) == len(first.divergences)
    offline = X.TeacherGaps(tmp_path / "no-model", h200_gaps.prompts, cache=cache)
    again = X.classify(_records("bf16_vanilla_c1"), _records("bf16_strict_c1"), "bfloat16", offline)
    assert again.divergences == first.divergences


def test_run_tables_judge_strict_legs_by_the_rule(tmp_path, tiny_models):
    """The exactness table (E1's notebook, the explorer, the demo) carries the verdict and the gaps."""
    from synthetic_runs import E1_LEGS, write_run
    from workbench.analyses import RunTables
    from workbench.results import load_run

    rdir = write_run(tmp_path, legs=E1_LEGS, n_prompts=4)
    # plant one divergence in the strict leg, at a position whose gap is cached as a near-tie
    path = rdir / "legs" / "strict_g6" / "records.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[0]["gen_ids"][5] += 1
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    van = {json.loads(line)["pid"]: json.loads(line)["gen_ids"]
           for line in (rdir / "legs" / "vanilla_0" / "records.jsonl").read_text().splitlines()}
    gaps = X.TeacherGaps("unused", {}, cache=rdir / X.GAPS_CACHE)
    gaps._cache[gaps._key(rows[0]["pid"], van[rows[0]["pid"]][:5])] = 0.04
    gaps._save()
    # the legs name a model that does not exist here: the cache answers
    t = RunTables(load_run(rdir))
    ex = t["exactness"].set_index("leg").loc["strict_g6"]
    assert ex["rule_ok"] and ex["n_near_tie"] == 1 and ex["classification"] == "3/4 equal, 1 near-tie (gaps 0.04)"
    div = t["divergences"]
    assert div[["pid", "position", "class"]].values.tolist() == [[rows[0]["pid"], 5, "near-tie"]]
    from workbench import plots
    cells = plots.exactness_table(t["exactness"]).data[0].cells.values
    assert "3/4 equal, 1 near-tie (gaps 0.04)" in cells[-1]


def test_a_strict_leg_is_judged_against_a_vanilla_leg_of_its_own_target(tmp_path):
    """E14 runs two targets: each strict leg is compared with the vanilla output of its own target (not the
    run's first vanilla leg), with a gap cache per target."""
    from synthetic_runs import write_run
    from workbench.analyses import RunTables
    from workbench.results import load_run

    legs = [{"name": "vanilla_1", "tier": "vanilla"}, {"name": "a_strict", "tier": "strict", "gamma": 6},
            {"name": "vanilla_2", "tier": "vanilla"}, {"name": "vanilla_3", "tier": "vanilla"},
            {"name": "b_strict", "tier": "strict", "gamma": 6}, {"name": "vanilla_4", "tier": "vanilla"}]
    rdir = write_run(tmp_path, legs=legs, n_prompts=3)
    for leg in ("vanilla_3", "b_strict", "vanilla_4"):  # target B: other outputs, its strict leg equal to them
        for name, edit in (("summary.json", None), ("records.jsonl", True)):
            path = rdir / "legs" / leg / name
            if edit:
                rows = [json.loads(line) for line in path.read_text().splitlines()]
                for r in rows:
                    r["gen_ids"] = [(i + 1) % 1000 for i in r["gen_ids"]]
                path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            else:
                summary = json.loads(path.read_text())
                summary["target"] = "target-b"
                path.write_text(json.dumps(summary))
    t = RunTables(load_run(rdir), teacher=False)
    ex = t["exactness"].set_index("leg")
    assert ex.loc["a_strict", "n_exact"] == ex.loc["b_strict", "n_exact"] == 3
    assert ex.loc["b_strict", "rule_ok"] and ex.loc["a_strict", "rule_ok"]
    assert ex.loc["a_strict", "ref_leg"] == "vanilla_1" and ex.loc["b_strict", "ref_leg"] == "vanilla_3"
    from workbench.analyses import _per_target, _targets_in_order
    order = _targets_in_order(t)
    assert order == ["tiny-target", "target-b"]
    assert [_per_target(X.GAPS_CACHE, order, x) for x in order] == ["top2_gaps.json", "top2_gaps-2.json"]


# --------------------------------------------------------------------------- the tie rule
@pytest.fixture
def sampler(tmp_path, monkeypatch):
    import vllm.utils.cpu_triton_utils as cpu_tl
    from vllm.v1.sample import rejection_sampler as rs

    from vllm_patch import relaxed_gate
    from vllm_patch.engine_state import EngineState
    from vllm_patch.knobs import EngineKnobs
    from vllm_patch.telemetry import TraceWriter

    monkeypatch.setattr(rs, "rejection_greedy_sample_kernel", cpu_tl.rejection_greedy_sample_kernel)
    monkeypatch.setattr(rs, "rejection_sample", rs.rejection_sample)

    def install(relax_logtau: float):
        state = EngineState(EngineKnobs(relax_logtau=relax_logtau), trace=TraceWriter(str(tmp_path), batch_steps=1))
        relaxed_gate.install(state)
        return rs.rejection_sample, state

    return install


def _verify(fn, G, draft_ids, logits):
    from types import SimpleNamespace

    import torch

    G.batch_req_ids = ["a"]
    try:
        n = len(draft_ids)
        meta = SimpleNamespace(all_greedy=True, all_random=False, temperature=None)
        out = fn(torch.tensor(draft_ids, dtype=torch.int32), [n], n, torch.tensor([n], dtype=torch.int32), None,
                 logits.clone(), torch.tensor([[7]], dtype=torch.int32), meta)
    finally:
        G.batch_req_ids = None
    G.trace.flush()
    return out


def _tied_logits():
    import torch

    # position 0: tokens 2 and 5 tie at the max (argmax picks 2, the first); position 1: argmax 4
    x = torch.zeros(2, 8)
    x[0, 2] = x[0, 5] = 3.0
    x[1, 4] = 3.0
    return x


@pytest.mark.parametrize("x, accepted", [(0.0, 0), (0.5, 2)])
def test_gate_and_trace_follow_the_tie_rule(sampler, tmp_path, x, accepted):
    fn, G = sampler(x)
    out = _verify(fn, G, [5, 4], _tied_logits())
    assert (out[0] != -1).sum().item() - 1 == accepted  # strict rejects the tie; any x > 0 accepts it
    (line,) = [json.loads(s) for s in next(Path(tmp_path).glob("trace-*.jsonl")).read_text().splitlines()]
    assert line["r"] == [["a", 2, accepted, [0.0, 0.0]]]
    assert line["ties"] == {"a": [0]}


def test_counterfactual_replays_a_strict_trace_with_ties_exactly():
    """Two steps recorded by a strict leg: a tie rejected at position 0, then two argmax picks and a miss."""
    steps = [{"drafted": 2, "accepted": 0, "margins": [0.0, 0.0], "ties": [0]},
             {"drafted": 3, "accepted": 2, "margins": [0.0, 0.0, 0.25]}]
    recs = pd.DataFrame([{"leg": "strict_g3", "pid": "p", "tier": "strict", "gamma": 3, "relax_logtau": 0.0,
                          "blind_mm": False, "trace": {"steps": steps}}])
    index = metrics.TraceIndex(recs)
    curve = index.curve("strict_g3", [0.0, metrics.ZERO_PLUS, 0.25]).set_index("relax_logtau")["accepted"]
    assert curve.tolist() == [2, 4, 5]  # x = 0: the strict counters; 0+: the tie and what follows it
    assert list(index.step_accepted(0.0)) == [0, 2]


def test_the_tau_curve_draws_the_jump_at_zero_plus():
    from workbench import plots

    steps = [{"drafted": 2, "accepted": 0, "margins": [0.0, 0.0], "ties": [0]}]
    recs = pd.DataFrame([{"leg": "s", "pid": "p", "tier": "strict", "gamma": 2, "relax_logtau": 0.0,
                          "blind_mm": False, "trace": {"steps": steps}}])
    from workbench.analyses import RELAX_GRID
    assert metrics.ZERO_PLUS in RELAX_GRID
    curve = metrics.TraceIndex(recs).curves(RELAX_GRID)
    fig = plots.acceptance_vs_tau(pd.DataFrame(columns=["leg", "tier", "gamma", "relax_logtau",
                                                        "acceptance_length"]), curve)
    notes = [a.text for a in fig.layout.annotations]
    assert any(n.startswith("x = 0+: ties accepted (+2.000)") for n in notes), notes
