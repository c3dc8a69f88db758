"""Issue 2: the patched engine drafts with an M-RoPE twin, and the strict tier is exact."""

from __future__ import annotations

import json

import pytest

from conftest import TINY_PROMPTS, run_leg_process

pytestmark = pytest.mark.vllm

FP32 = ["--max-tokens", "64", "--ignore-eos", "--dtype", "float32", "--max-model-len", "1024"]
BF16 = ["--max-tokens", "64", "--ignore-eos", "--dtype", "bfloat16", "--max-model-len", "1024"]


@pytest.fixture(scope="module")
def prompts_with_repeats(tmp_path_factory):
    """The tiny set plus two exact repeats, so prefix caching hits mid-leg."""
    from workbench.prompts import load_prompts, save_prompts

    prompts = load_prompts(TINY_PROMPTS)
    repeats = []
    for p in prompts:
        if p.pid in ("tiny-001", "tiny-010"):
            q = type(p)(pid=p.pid + "-again", text=p.text, images=list(p.images), dataset=p.dataset, meta=p.meta)
            repeats.append(q)
    out = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    save_prompts(prompts + repeats, out)
    return out


@pytest.fixture(scope="module")
def legs(tmp_path_factory, tiny_models, prompts_with_repeats):
    cache = {}

    def get(name, *args, prompts=prompts_with_repeats):
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            cache[name] = run_leg_process(
                out, "--target", tiny_models["target"], "--prompts", prompts, *args
            ).ok()
        return cache[name]

    return get


@pytest.fixture(scope="module")
def teacher(tiny_models):
    from workbench.teacher import TeacherForcer

    return TeacherForcer(str(tiny_models["target"]), dtype="float32")


def _verdict(van: dict, spec: dict, dtype: str, teacher, prompts):
    from workbench.exactness import classify

    return classify({p: r["gen_ids"] for p, r in van.items()}, {p: r["gen_ids"] for p, r in spec.items()}, dtype,
                    lambda pid, prefix: teacher.top2_gap(prompts[pid], list(prefix)))


def _prompts_by_pid(path):
    from workbench.prompts import load_prompts

    return {p.pid: p for p in load_prompts(path)}


def test_prompt_set_covers_what_exactness_needs(prompts_with_repeats):
    prompts = list(_prompts_by_pid(prompts_with_repeats).values())
    assert len(prompts) >= 8
    assert any(len(p.images) == 2 for p in prompts), "needs a two-image prompt"
    assert any(len(p.images) == 0 for p in prompts), "needs a text-only prompt"
    sizes = {tuple(s) for p in prompts for s in p.meta.get("image_sizes", [])}
    assert len(sizes) >= 3, f"needs several image sizes, got {sizes}"


@pytest.mark.parametrize("max_num_seqs", [1, 4])
@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_strict_tier_is_exact_in_float32(legs, tiny_models, teacher, prompts_with_repeats, gamma, max_num_seqs):
    vanilla = legs("vanilla_fp32", *FP32)
    spec = legs(
        f"strict_g{gamma}_mns{max_num_seqs}",
        *FP32, "--draft", tiny_models["twin-dequant"], "--gamma", str(gamma),
        "--max-num-seqs", str(max_num_seqs),
    )
    prompts = _prompts_by_pid(prompts_with_repeats)
    van = vanilla.by_pid()
    assert set(van) == set(spec.by_pid()) == set(prompts)
    assert all(rec["gen_len"] >= 64 for rec in spec.records)
    # the exactness rule in float32: equal, token for token (a failure reports the gap where it left)
    _verdict(van, spec.by_pid(), "float32", teacher, prompts).check(f"strict gamma={gamma} mns={max_num_seqs}")
    # The draft really speculated.
    s = spec.summary["spec"]
    assert s["num_drafts"] > 0 and s["num_accepted_tokens"] > 0
    assert len(s["accepted_per_pos"]) == gamma


def test_strict_exact_with_small_chunks_and_no_prefix_cache(legs, tiny_models):
    """Chunked prefill cuts prompts (and images) into pieces; prefix caching off."""
    vanilla = legs("vanilla_fp32", *FP32)
    spec = legs(
        "strict_chunked_nocache",
        *FP32, "--draft", tiny_models["twin-dequant"], "--gamma", "3", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "48", "--no-prefix-caching",
    )
    van = vanilla.by_pid()
    mismatched = [pid for pid, r in spec.by_pid().items() if r["gen_ids"] != van[pid]["gen_ids"]]
    assert not mismatched


def test_trace_sums_reproduce_vllm_counters(legs, tiny_models):
    spec = legs(
        "strict_g3_mns4", *FP32, "--draft", tiny_models["twin-dequant"], "--gamma", "3", "--max-num-seqs", "4"
    )
    s = spec.summary["spec"]
    per = [r["spec"] for r in spec.records]
    assert sum(p["drafts"] for p in per) == s["num_drafts"]
    assert sum(p["draft_tokens"] for p in per) == s["num_draft_tokens"]
    assert sum(p["accepted"] for p in per) == s["num_accepted_tokens"]
    pos = [sum(p["accepted_per_pos"][i] for p in per) for i in range(3)]
    assert pos == s["accepted_per_pos"]
    # Per-step detail adds up to the per-prompt numbers.
    for r in spec.records:
        steps = r["trace"]["steps"]
        assert sum(st["accepted"] for st in steps) == r["spec"]["accepted"]
        assert all(len(st["margins"]) == st["drafted"] for st in steps)
        # accepted tokens are exactly the leading run of zero-margin drafts
        for st in steps:
            lead = 0
            for m in st["margins"]:
                if m > 0:
                    break
                lead += 1
            assert st["accepted"] <= lead


def test_leg_records_state_what_the_engine_ran(legs, tiny_models):
    spec = legs(
        "strict_g3_mns4", *FP32, "--draft", tiny_models["twin-dequant"], "--gamma", "3", "--max-num-seqs", "4"
    )
    rec = spec.records[0]
    for field in ("pid", "mode", "gamma", "in_len", "gen_len", "t", "tok_s", "gen_ids"):
        assert field in rec
    assert rec["mode"] == "spec" and rec["tier"] == "strict" and rec["gamma"] == 3
    assert rec["knobs"]["gamma"] == 3
    assert rec["knobs"]["relax_logtau"] == 0.0
    assert rec["knobs"]["draft_vision"] == "shared"  # the twin's tower is the target's: its outputs serve both
    report = spec.summary["engine_report"]
    assert report["draft_uses_mrope"] is True and report["target_uses_mrope"] is True
    assert "draft_vision_items_encoded" not in report  # no second vision pass
    assert spec.summary["versions"]["patch_fingerprint"]
    assert spec.summary["engine_args"]["speculative_config"]["method"] == "draft_model"


def test_bfloat16_int4_twin_match_rate_and_divergence_classes(legs, tiny_models, teacher, prompts_with_repeats):
    """The real int4 twin (compressed-tensors W4A16) in bfloat16: report, classify, fail on real errors."""
    vanilla = legs("vanilla_bf16", *BF16)
    spec = legs("strict_int4_bf16", *BF16, "--draft", tiny_models["twin-int4"], "--gamma", "3")
    prompts = _prompts_by_pid(prompts_with_repeats)
    # the one exactness rule (workbench.exactness): in bf16 every divergence must be a near-tie
    verdict = _verdict(vanilla.by_pid(), spec.by_pid(), "bfloat16", teacher, prompts)
    print(f"\nbf16 int4 twin, strict gamma=3: {verdict.describe()}")
    verdict.check()
    assert spec.summary["engine_report"]["draft_model"].endswith("twin-int4")


def test_twin_acceptance_far_above_unrelated_random_draft(legs, tiny_models):
    twin = legs("strict_int4_bf16", *BF16, "--draft", tiny_models["twin-int4"], "--gamma", "3")
    rand = legs("strict_random_bf16", *BF16, "--draft", tiny_models["random-draft"], "--gamma", "3")
    a_twin = twin.summary["spec"]["acceptance_rate"]
    a_rand = rand.summary["spec"]["acceptance_rate"]
    print(f"\nacceptance rate: int4 twin {a_twin:.3f}, random draft {a_rand:.3f}")
    assert a_twin > 0.5
    assert a_twin > 3 * a_rand


def test_target_drafting_for_itself_accepts_every_token(legs, tiny_models):
    """A draft identical to the target must agree at every drafted position.

    Any error in the draft's 3-D M-RoPE positions (image tokens included),
    its image embeddings, its KV-cache slots or its multimodal mask shows up
    here as a rejection. Batch of 4, prompts cut into 48-token chunks
    (through images), prefix-cache hits from the repeated prompts.
    """
    spec = legs(
        "self_draft", *FP32, "--draft", tiny_models["target"], "--gamma", "4", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "48",
    )
    s = spec.summary["spec"]
    assert s["num_draft_tokens"] > 0
    assert s["num_accepted_tokens"] == s["num_draft_tokens"], s
    assert all(r["spec"]["acceptance_rate"] == 1.0 for r in spec.records)


@pytest.mark.parametrize("leg_args", [
    ("strict_g3_mns4", FP32, "twin-dequant", 3, 4),
    ("strict_int4_bf16", BF16, "twin-int4", 3, 1),
])
def test_counterfactual_at_zero_reproduces_the_strict_counters(legs, tiny_models, leg_args):
    """The tie rule: replayed at x = 0, the trace accepts exactly what the strict leg accepted
    (a draft tied with the target's argmax but not picked counts as rejected there)."""
    import pandas as pd

    from workbench import metrics

    name, dtype_args, draft, gamma, mns = leg_args
    spec = legs(name, *dtype_args, "--draft", tiny_models[draft], "--gamma", str(gamma),
                "--max-num-seqs", str(mns))
    recs = pd.DataFrame(spec.records).assign(leg=name)
    index = metrics.TraceIndex(recs)
    s = spec.summary["spec"]
    at0 = index.curve(name, [0.0]).iloc[0]
    assert (at0["accepted"], at0["draft_tokens"], at0["drafts"]) == (
        s["num_accepted_tokens"], s["num_draft_tokens"], s["num_drafts"])
    assert list(index.per_position_at(name, 0.0) * s["num_drafts"]) == pytest.approx(s["accepted_per_pos"])
    ties = sum(len(st.get("ties", ())) for r in spec.records for st in r["trace"]["steps"])
    at0p = index.curve(name, [metrics.ZERO_PLUS]).iloc[0]
    print(f"\n{name}: {ties} tied drafts; accepted at x=0 {at0['accepted']:.0f}, at x=0+ {at0p['accepted']:.0f}")
    assert at0p["accepted"] >= at0["accepted"]
