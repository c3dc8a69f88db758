"""Issue 9: every switch proven on CUDA (``pytest -m gpu``; skipped where CUDA is absent).

The legs are the product's own (``python -m workbench.leg``), with the tiny
models, the tiny prompt set (one image of several sizes, two images, text
only), 128 tokens each, greedy. Legs share the one GPU, a few at a time, each
with a fixed KV cache: vLLM's start-up memory profile otherwise refuses to
start (``Error in memory profiling``) when another process on the GPU frees
memory meanwhile. Nothing here is a timing.

``WORKBENCH_GPU_RESULTS`` names the folder the legs and the suite's summary
(``gpu_suite.json``) are written to, so the evidence can be kept as a run
folder; by default a temporary folder.

``env.json`` there records versions, GPU, commit and the suite's settings.

Exactness vocabulary: in float32 (TRITON_ATTN; FlashAttention has no fp32)
the strict tier must equal vanilla token for token. In bfloat16 a strict
output may leave vanilla's only at a near-tie: a position where the float32
target's top-2 logit gap is below ``workbench.exactness.NEAR_TIE`` (bf16 resolves logits of
magnitude ~10 to ~0.05, and a verification step computes gamma + 1 tokens at
once where vanilla computes one, so the rounding differs). Every divergence
is classified with that gap; one that is not a near-tie fails the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import REPO, TINY_PROMPTS, LegResult

torch = pytest.importorskip("torch")
# ``WORKBENCH_GPU_RECHECK=<results folder>``: judge a GPU suite's finished legs again on any host (the
# fp32 teacher on the CPU when there is no GPU). No leg runs; the tests that need a live GPU skip, saying so.
RECHECK = os.environ.get("WORKBENCH_GPU_RECHECK")
ON_CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ON_CUDA and not RECHECK,
                       reason="needs a CUDA GPU (pytest -m gpu on a GPU host), or WORKBENCH_GPU_RECHECK"),
]
needs_live_gpu = pytest.mark.skipif(not ON_CUDA, reason="needs a live CUDA GPU (a recheck judges recorded legs only)")

TOKENS = ["--max-tokens", "128", "--ignore-eos", "--max-model-len", "2048", "--gpu-memory-utilization", "0.06"]
FP32 = [*TOKENS, "--dtype", "float32"]
BF16 = [*TOKENS, "--dtype", "bfloat16"]
TAU_HALF = "0.693"
KV_BYTES = 1 << 30  # per leg; the tiny models need a few MiB of it
# a tiny-model leg takes 1-3 min with its compile; one that runs longer has hung (WORKBENCH_GPU_LEG_TIMEOUT)
LEG_TIMEOUT_S = int(os.environ.get("WORKBENCH_GPU_LEG_TIMEOUT", "600"))


# A tiny Qwen3-VL of another shape with a symmetric group-64 twin (vLLM's uint4b8, the flavour llm-compressor's
# AWQ writes), built by tests/unseen_twin.py; its legs are named sym_*. Built only when a selected leg needs it.
UNSEEN_ROOT = Path(tempfile.gettempdir()) / "gpu-suite-unseen"


def _legs_plan(m: dict[str, Path], unseen: Path = UNSEEN_ROOT) -> dict[str, list[str]]:
    dq, i4 = ["--draft", str(m["twin-dequant"])], ["--draft", str(m["twin-int4"])]
    g6 = ["--gamma", "6"]
    c8 = ["--max-num-seqs", "8"]
    sym = ["--target", str(unseen / "target")]
    sym_i4 = [*sym, "--draft", str(unseen / "twin-int4"), "--gamma", "4"]
    return {
        "fp32_vanilla_c1": FP32,
        "fp32_vanilla_c8": [*FP32, *c8],
        "fp32_strict_c1": [*FP32, *dq, *g6],
        "fp32_strict_c8": [*FP32, *dq, *g6, *c8],
        "fp32_relaxed_c1": [*FP32, *dq, *g6, "--relax-logtau", TAU_HALF],
        "fp32_relaxed_c8": [*FP32, *dq, *g6, *c8, "--relax-logtau", TAU_HALF],
        "bf16_vanilla_c1": BF16,
        "bf16_vanilla_c8": [*BF16, *c8],
        "bf16_vanilla_eager_c1": [*BF16, "--enforce-eager"],
        "bf16_vanilla_triton_c1": [*BF16, "--attention-backend", "TRITON_ATTN"],
        "bf16_strict_c1": [*BF16, *i4, *g6],
        "bf16_strict_c8": [*BF16, *i4, *g6, *c8],
        "bf16_relaxed_c8": [*BF16, *i4, *g6, *c8, "--relax-logtau", TAU_HALF],
        "bf16_blind_c1": [*BF16, *i4, *g6, "--blind-mm"],
        "bf16_nograph_c1": [*BF16, *i4, *g6, "--no-draft-cudagraph"],
        "bf16_target_eager_c1": [*BF16, *i4, *g6, "--enforce-eager"],
        # issue 18: drafter graph modes, async scheduling (fp32 strict: exact vs vanilla) ...
        **{f"fp32_graph_{mode}_{c}": [*FP32, *dq, *g6, "--draft-cudagraph-mode", mode, *extra]
           for mode in GRAPH_MODES for c, extra in (("c1", []), ("c8", c8))},
        "fp32_async_c1": [*FP32, *dq, *g6, "--async-scheduling"],
        "fp32_async_c8": [*FP32, *dq, *g6, *c8, "--async-scheduling"],
        "fp32_full_async_c8": [*FP32, *dq, *g6, *c8, "--async-scheduling", "--draft-cudagraph-mode", "full"],
        "fp32_full_all_async_c8": [*FP32, *dq, *g6, *c8, "--async-scheduling", "--draft-cudagraph-mode", "full_all"],
        # issue 36: the sampled tokens' copy ahead of the drafter and the early hand-over (both off by default)
        "fp32_async_early_c8": [*FP32, *dq, *g6, *c8, "--async-scheduling", "--early-output", "--early-release"],
        # FULL drafter graphs in bf16 (FA3) with the int4 twin: the drafts' acceptance beside piecewise graphs'
        **{f"bf16_graph_{mode}_{c}": [*BF16, *i4, *g6, "--draft-cudagraph-mode", mode, *extra]
           for mode in ("piecewise", "full", "full_all") for c, extra in (("c1", []), ("c8", c8))},
        # FULL graphs replaying smaller batches padded (VLLM_SPEC_FULL_PADDED_REPLAY=1 and
        # VLLM_SPEC_FULL_DENSE_SIZES=1, set for legs named *_padded_*, so that batches of 2-7 replay the graph
        # of 8); padded replays hung at concurrency 8 with FA3 before their metadata was built for the padded batch
        **{f"{dt}_graph_{mode}_padded_c8": [*args, "--draft-cudagraph-mode", mode, *c8]
           for mode in ("full", "full_all") for dt, args in (("fp32", [*FP32, *dq, *g6]), ("bf16", [*BF16, *i4, *g6]))},
        # ... and the draft's W4A16 kernel (bf16 int4 twin: the near-tie rule)
        **{f"bf16_kernel_{k}_c1": [*BF16, *i4, *g6, "--draft-linear-kernel", k] for k in _draft_kernels()},
        # ... and the draft's lm_head in int4 on the draft's kernel (Marlin by auto)
        "bf16_int4_head_c1": [*BF16, *i4, *g6, "--draft-lm-head", "int4"],
        "bf16_int4_head_c8": [*BF16, *i4, *g6, *c8, "--draft-lm-head", "int4"],
        # ... and a symmetric (uint4b8) twin: on each kernel named, and under auto at c8 (full_all, Marlin)
        "sym_bf16_vanilla_c1": [*BF16, *sym],
        "sym_bf16_vanilla_c8": [*BF16, *sym, *c8],
        **{f"sym_bf16_kernel_{k}_c1": [*BF16, *sym_i4, "--draft-linear-kernel", k] for k in _sym_kernels()},
        "sym_bf16_strict_c8": [*BF16, *sym_i4, *c8],
    }


GRAPH_MODES = ("none", "piecewise", "full", "full_all")


def _sym_kernels() -> list[str]:
    """The kernels the symmetric twin's legs name: all but Exllama, which takes float16 activations only."""
    return [k for k in _draft_kernels() if k != "exllama"]


def _draft_kernels() -> list[str]:
    from vllm_patch.knobs import own_kernel_available

    recorded = bool(RECHECK) and (Path(RECHECK) / "legs" / "bf16_kernel_own_c1").is_dir()
    return ["marlin", "humming", "machete", "exllama"] + (["own"] if own_kernel_available() or recorded else [])


@pytest.fixture(scope="module")
def results_dir() -> Path:
    root = RECHECK or os.environ.get("WORKBENCH_GPU_RESULTS")
    path = Path(root) if root else Path(tempfile.mkdtemp(prefix="gpu-suite-"))
    path.mkdir(parents=True, exist_ok=True)
    from workbench import envcapture

    # what the evidence was made with: versions, GPU, commit, switches
    if RECHECK:   # the evidence's env.json describes the host that ran the legs: keep it, note the recheck
        (path / "recheck.json").write_text(json.dumps(envcapture.capture(), indent=1, default=str) + "\n")
        return path
    env = envcapture.capture()
    env["suite"] = {"parallel": os.environ.get("WORKBENCH_GPU_PARALLEL", "4"), "kv_cache_memory_bytes": KV_BYTES,
                    "reuse": os.environ.get("WORKBENCH_GPU_REUSE") == "1"}
    (path / "env.json").write_text(json.dumps(env, indent=1, default=str) + "\n")
    return path


@pytest.fixture(scope="module")
def legs(tiny_models, results_dir) -> dict[str, LegResult]:
    """Run every leg of the plan, ``WORKBENCH_GPU_PARALLEL`` at a time (default 4).

    Legs share the GPU safely because each is given a fixed KV cache
    (``--kv-cache-memory-bytes``), which skips vLLM's start-up memory profile;
    each has its own vLLM compile-cache folder (torch's own caches are safe to
    share). ``WORKBENCH_GPU_REUSE=1`` keeps legs that already finished in the
    results folder (a suite continued in a second call).
    """
    plan = _select(_legs_plan(tiny_models), os.environ.get("WORKBENCH_GPU_LEGS"))
    if not RECHECK and any(name.startswith("sym_") for name in plan):
        from unseen_twin import build_unseen

        build_unseen(UNSEEN_ROOT)
    parallel = int(os.environ.get("WORKBENCH_GPU_PARALLEL", "4"))
    reuse = os.environ.get("WORKBENCH_GPU_REUSE") == "1" or bool(RECHECK)
    caches = Path(tempfile.mkdtemp(prefix="gpu-suite-cache-"))

    def finished(out: Path) -> bool:
        return (out / "summary.json").exists() and not (out / "failure.json").exists()

    def run(name: str) -> tuple[str, LegResult, float]:
        out = results_dir / "legs" / name
        if reuse and finished(out):
            return name, LegResult(out, subprocess.CompletedProcess([], 0, "", "(reused)")), 0.0
        if RECHECK:
            log = results_dir / "legs" / f"{name}.log"
            said = log.read_text() if (out / "failure.json").exists() and log.exists() else ""
            return name, LegResult(out, subprocess.CompletedProcess([], 1, "", f"leg {name}: not finished in "
                                                                             f"{RECHECK} (a recheck runs no leg)\n"
                                                                             + said)), 0.0
        cmd = [sys.executable, "-m", "workbench.leg", "--out", str(out), "--force", "--leg", name,
               "--target", str(tiny_models["target"]), "--prompts", str(TINY_PROMPTS),
               "--kv-cache-memory-bytes", str(KV_BYTES), *plan[name]]
        env = {**os.environ, "VLLM_CACHE_ROOT": str(caches / name)}
        if "_padded_" in name:  # padded replays on, and graphs of 1 then every 8: a c8 leg's batches of 2-7 pad
            env["VLLM_SPEC_FULL_PADDED_REPLAY"] = "1"
            env["VLLM_SPEC_FULL_DENSE_SIZES"] = "1"
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=LEG_TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired as exc:  # a hung engine (a FULL replay did once): a failed leg, named
            def text(b):
                return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
            proc = subprocess.CompletedProcess(cmd, 124, text(exc.stdout),
                                               text(exc.stderr) + f"\nleg {name}: killed after {LEG_TIMEOUT_S} s")
        # vLLM's engine core logs its own traceback to stdout: keep the head of both streams as well as the
        # tail, so a failed leg's root cause is in the evidence (an EngineDeadError alone says nothing)
        def keep(text: str) -> str:
            return text if len(text) <= 40000 else text[:20000] + "\n[...]\n" + text[-20000:]
        (results_dir / "legs" / f"{name}.log").write_text(
            "== stderr\n" + keep(proc.stderr) + "\n== stdout\n" + keep(proc.stdout))
        return name, LegResult(out, proc), time.perf_counter() - t0

    (results_dir / "legs").mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        done = {name: (res, s) for name, res, s in pool.map(run, start_order(plan))}
    summary = {name: {"returncode": r.returncode, "seconds": round(s, 1),
                      "spec": (r.summary or {}).get("spec"),
                      "engine_report": {k: (r.summary or {}).get("engine_report", {}).get(k) for k in (
                          "attention_backend", "linear_kernels", "draft_cudagraph", "draft_cudagraph_keys",
                          "draft_cudagraph_requested", "draft_vision", "draft_vision_items_encoded", "draft_vision_share_reason", "gpu",
                          "draft_cudagraph_mode", "draft_cudagraph_mode_reason", "draft_single_step_modes_ran",
                          "draft_linear_kernel", "draft_mp_kernels", "draft_linear_kernel_fallback_layers",
                          "async_scheduling", "draft_full_padded_replay", "draft_full_padded_replays_ran",
                          "draft_full_graph_sizes", "early_output_steps")}}
               for name, (r, s) in done.items()}
    if not RECHECK:
        (results_dir / "legs_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return {name: r for name, (r, _) in done.items()}


@pytest.fixture(scope="module")
def teacher(tiny_models):
    from workbench.teacher import TeacherForcer

    return TeacherForcer(str(tiny_models["target"]), dtype="float32", device="cuda" if ON_CUDA else "cpu")


@pytest.fixture(scope="module")
def prompts():
    from workbench.prompts import load_prompts

    return {p.pid: p for p in load_prompts(TINY_PROMPTS)}


def start_order(plan) -> list[str]:
    """Longest legs first, so a call that runs out of time loses short legs: the kernel legs (Humming's NVRTC
    and the own kernel's Triton compiles at engine start), the int4 head, then concurrency 8, then the rest."""
    def rank(name: str) -> int:
        return 0 if "_kernel_" in name or "_int4_head_" in name else 1 if name.endswith("_c8") else 2
    return sorted(plan, key=rank)


def _select(plan: dict[str, list[str]], patterns: str | None) -> dict[str, list[str]]:
    """``WORKBENCH_GPU_LEGS`` (comma-separated shell patterns): run only the matching legs in this call
    (GPU time is scarce; with ``WORKBENCH_GPU_REUSE=1`` a later call adds the rest). Tests whose legs
    did not run are skipped, saying so."""
    if not patterns:
        return plan
    from fnmatch import fnmatch

    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    return {name: args for name, args in plan.items() if any(fnmatch(name, p) for p in pats)}


def _ok(legs, name) -> LegResult:
    if name not in legs:
        pytest.skip(f"leg {name} not in this call's plan (WORKBENCH_GPU_LEGS={os.environ.get('WORKBENCH_GPU_LEGS')})")
    return legs[name].ok()


def _classify(ref: LegResult, other: LegResult, teacher, prompts) -> dict:
    """The one exactness rule (``workbench.exactness``, bf16): every prompt where ``other`` leaves ``ref``,
    its position, the fp32 target's top-2 gap there and its class."""
    from workbench.exactness import classify

    verdict = classify({p: r["gen_ids"] for p, r in ref.by_pid().items()},
                       {p: r["gen_ids"] for p, r in other.by_pid().items()}, "bfloat16",
                       lambda pid, prefix: teacher.top2_gap(prompts[pid], list(prefix)))
    rows = [{"pid": d.pid, "position": d.position, "top2_gap": d.top2_gap, "class": d.kind}
            for d in verdict.divergences]
    return {"n": verdict.n, "exact": verdict.n_exact, "divergences": rows, "classification": verdict.describe()}


def _record(results_dir: Path, key: str, value) -> None:
    path = results_dir / "gpu_suite.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    path.write_text(json.dumps(data, indent=1, default=str))


# --------------------------------------------------------------------------- strict tier
@pytest.mark.parametrize("conc", ["c1", "c8"])
def test_strict_fp32_is_exact(legs, results_dir, conc):
    van, spec = _ok(legs, f"fp32_vanilla_{conc}"), _ok(legs, f"fp32_strict_{conc}")
    diffs = [pid for pid, r in spec.by_pid().items() if r["gen_ids"] != van.by_pid()[pid]["gen_ids"]]
    _record(results_dir, f"fp32_strict_{conc}", {"exact": len(spec.records) - len(diffs), "n": len(spec.records),
                                                 "acceptance": spec.summary["spec"]["acceptance_rate"]})
    assert not diffs, f"fp32 strict differs from vanilla at {conc} on {diffs}"
    assert spec.summary["engine_report"]["attention_backend"]["target"] == ["TRITON_ATTN"]
    assert spec.summary["spec"]["acceptance_rate"] > 0.5


@pytest.mark.parametrize("conc", ["c1", "c8"])
def test_bf16_divergences_are_near_ties(legs, teacher, prompts, results_dir, conc):
    van, spec = _ok(legs, f"bf16_vanilla_{conc}"), _ok(legs, f"bf16_strict_{conc}")
    result = _classify(van, spec, teacher, prompts)
    result["acceptance"] = spec.summary["spec"]["acceptance_rate"]
    result["kernels"] = {"attention": spec.summary["engine_report"]["attention_backend"],
                         "linear": spec.summary["engine_report"]["linear_kernels"]}
    _record(results_dir, f"bf16_strict_vs_vanilla_{conc}", result)
    print(f"\nbf16 strict {conc}: {result['exact']}/{result['n']} exact; divergences {result['divergences']}")
    assert not [d for d in result["divergences"] if d["class"] == "error"], result
    assert "MarlinLinearKernel" in json.dumps(result["kernels"]["linear"]["draft"])
    assert any("FLASH_ATTN" in b for b in result["kernels"]["attention"]["target"])


@pytest.mark.parametrize("other", ["bf16_vanilla_eager_c1", "bf16_vanilla_triton_c1"])
def test_bf16_noise_floor_between_vanilla_kernel_choices(legs, teacher, prompts, results_dir, other):
    """Vanilla against vanilla with other kernels: the floor bf16 exactness is judged against."""
    result = _classify(_ok(legs, "bf16_vanilla_c1"), _ok(legs, other), teacher, prompts)
    result["attention"] = legs[other].summary["engine_report"]["attention_backend"]
    _record(results_dir, f"noise_floor_{other}", result)
    print(f"\nnoise floor vanilla graphs+FA3 vs {other}: {result['exact']}/{result['n']} exact; {result['divergences']}")
    assert not [d for d in result["divergences"] if d["class"] == "error"], result


# --------------------------------------------------------------------------- relaxed tier
@pytest.mark.parametrize("conc", ["c1", "c8"])
def test_relaxed_gate_every_token_within_x_rescored_by_the_target(legs, teacher, prompts, results_dir, conc):
    strict, relaxed = _ok(legs, f"fp32_strict_{conc}"), _ok(legs, f"fp32_relaxed_{conc}")
    x = float(TAU_HALF)
    worst, not_argmax = 0.0, 0
    for pid, rec in relaxed.by_pid().items():
        m = teacher.margins(prompts[pid], rec["gen_ids"])
        worst = max(worst, float(m.max()))
        not_argmax += int((m > 1e-5).sum())
    a_s, a_r = strict.summary["spec"]["acceptance_rate"], relaxed.summary["spec"]["acceptance_rate"]
    _record(results_dir, f"fp32_relaxed_{conc}", {"worst_margin": worst, "tokens_not_argmax": not_argmax,
                                                  "acceptance_strict": a_s, "acceptance_relaxed": a_r})
    print(f"\nrelaxed x={x} {conc}: acceptance {a_s:.3f} -> {a_r:.3f}; {not_argmax} tokens not the argmax, "
          f"worst margin {worst:.4f}")
    assert worst <= x + 1e-3  # the engine judged with its own fp32 logits; the teacher is a second fp32 model run
    assert a_r > a_s


def test_relaxed_and_trace_complete_at_concurrency_8_in_bf16(legs, results_dir):
    """The leg that crashed before (placeholder ids used as indices)."""
    relaxed, strict = _ok(legs, "bf16_relaxed_c8"), _ok(legs, "bf16_strict_c8")
    invalid = sum((r["spec"] or {}).get("invalid_draft_ids", 0) for r in relaxed.records + strict.records)
    _record(results_dir, "bf16_c8_relaxed", {"acceptance_strict": strict.summary["spec"]["acceptance_rate"],
                                             "acceptance_relaxed": relaxed.summary["spec"]["acceptance_rate"],
                                             "invalid_draft_ids_seen": invalid})
    assert relaxed.summary["spec"]["acceptance_rate"] > strict.summary["spec"]["acceptance_rate"]


@pytest.mark.parametrize("name", ["fp32_strict_c8", "bf16_strict_c8", "bf16_relaxed_c8", "bf16_strict_c1"])
def test_trace_reconciles_with_vllm_counters(legs, name):
    leg = _ok(legs, name)
    s = leg.summary["spec"]
    assert sum(r["spec"]["drafts"] for r in leg.records) == s["num_drafts"]
    assert sum(r["spec"]["draft_tokens"] for r in leg.records) == s["num_draft_tokens"]
    assert sum(r["spec"]["accepted"] for r in leg.records) == s["num_accepted_tokens"]
    per_pos = [sum(r["spec"]["accepted_per_pos"][i] for r in leg.records) for i in range(6)]
    assert per_pos == s["accepted_per_pos"][:6]


# --------------------------------------------------------------------------- blind draft, graphs
def test_blind_draft_runs_without_its_vision_tower(legs, teacher, prompts, results_dir):
    seeing, blind = _ok(legs, "bf16_strict_c1"), _ok(legs, "bf16_blind_c1")
    report = blind.summary["engine_report"]
    assert report["draft_vision"] == "blind"
    assert not report.get("draft_vision_items_encoded")

    def image_rate(leg):
        recs = [r for r in leg.records if r["n_images"] > 0]
        return sum(r["spec"]["accepted"] for r in recs) / sum(r["spec"]["draft_tokens"] for r in recs)

    result = _classify(_ok(legs, "bf16_vanilla_c1"), blind, teacher, prompts)
    result.update(image_acceptance_seeing=image_rate(seeing), image_acceptance_blind=image_rate(blind))
    _record(results_dir, "bf16_blind_c1", result)
    assert image_rate(blind) < image_rate(seeing)
    assert not [d for d in result["divergences"] if d["class"] == "error"], result


def test_drafter_cuda_graphs_are_captured_and_switch_off(legs, results_dir):
    on, off, eager = _ok(legs, "bf16_strict_c1"), _ok(legs, "bf16_nograph_c1"), _ok(legs, "bf16_target_eager_c1")
    r_on, r_off, r_eager = (x.summary["engine_report"] for x in (on, off, eager))
    _record(results_dir, "draft_cudagraph", {k: {"built": r["draft_cudagraph"], "keys": r["draft_cudagraph_keys"],
                                                 "requested": r["draft_cudagraph_requested"]}
                                             for k, r in (("on", r_on), ("off", r_off), ("target_eager", r_eager))})
    assert r_on["draft_cudagraph"] is True and r_on["draft_cudagraph_keys"] > 0
    assert r_off["draft_cudagraph"] is False and r_off["draft_cudagraph_keys"] == 0
    # The target in eager mode captures nothing: the report says so although graphs were asked for.
    assert r_eager["draft_cudagraph_requested"] is True and r_eager["draft_cudagraph"] is False
    assert on.summary["knobs"]["draft_cudagraph_applies"] is True


# --------------------------------------------------------------------------- invalid ids on the device
@needs_live_gpu
def test_invalid_draft_ids_on_cuda_tensors(tmp_path, monkeypatch):
    """The wrapped rejection sampler with vLLM's Triton greedy kernel on CUDA tensors."""
    from types import SimpleNamespace

    from vllm.v1.sample import rejection_sampler as rs

    from vllm_patch import relaxed_gate
    from vllm_patch.engine_state import EngineState
    from vllm_patch.knobs import EngineKnobs
    from vllm_patch.telemetry import TraceWriter

    monkeypatch.setattr(rs, "rejection_sample", rs.rejection_sample)
    G = EngineState(EngineKnobs(relax_logtau=0.7), trace=TraceWriter(str(tmp_path)))
    relaxed_gate.install(G)
    logits = torch.zeros(5, 16, device="cuda")
    for i, a in enumerate([1, 2, 6, 9, 11]):
        logits[i, a] = 5.0
    logits[0, 3] = 4.5
    G.batch_req_ids = ["a", "b"]
    try:
        out = rs.rejection_sample(torch.tensor([3, 2, -1, 9, 10_000], dtype=torch.int32, device="cuda"), [3, 2], 3,
                                  torch.tensor([3, 5], dtype=torch.int32, device="cuda"), None, logits,
                                  torch.tensor([[7], [7]], dtype=torch.int32, device="cuda"),
                                  SimpleNamespace(all_greedy=True, all_random=False, temperature=None))
        torch.cuda.synchronize()
    finally:
        G.batch_req_ids = None
    assert out[0].tolist() == [3, 2, 6, -1] and out[1].tolist()[:2] == [9, 11]
    G.trace.flush()
    line = json.loads(next(tmp_path.glob("trace-*.jsonl")).read_text().splitlines()[0])
    assert line["invalid"] == {"a": 1, "b": 1}


# --------------------------------------------------------------------------- end to end
@needs_live_gpu
def test_workbench_run_e1_end_to_end(tmp_path, results_dir):
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "run", "E1", "--profile", "tiny",
                           "--results", str(results_dir / "runs"), "--formats", "html"],
                          cwd=REPO, capture_output=True, text=True, timeout=1200)
    (results_dir / "e1_run.log").write_text(proc.stdout[-20000:] + "\n--- stderr\n" + proc.stderr[-20000:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dirs = list((results_dir / "runs").glob("E1/*/"))
    assert len(run_dirs) == 1
    tables = {p.name for p in (run_dirs[0] / "tables").glob("*.csv")}
    assert tables, "E1 produced no tables"
    assert (run_dirs[0] / "notebook.ipynb").exists()


# --------------------------------------------------------------------------- issue 18: graph modes, async, kernels
@pytest.mark.parametrize("conc", ["c1", "c8"])
@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_draft_cudagraph_modes_exact(legs, results_dir, mode, conc):
    """fp32 strict with each drafter graph mode equals vanilla token for token; the report names the mode that ran."""
    van, spec = _ok(legs, f"fp32_vanilla_{conc}"), _ok(legs, f"fp32_graph_{mode}_{conc}")
    diffs = [pid for pid, r in spec.by_pid().items() if r["gen_ids"] != van.by_pid()[pid]["gen_ids"]]
    r = spec.summary["engine_report"]
    _record(results_dir, f"fp32_graph_{mode}_{conc}", {
        "exact": len(spec.records) - len(diffs), "n": len(spec.records),
        "acceptance": spec.summary["spec"]["acceptance_rate"], "built": r.get("draft_cudagraph_mode"),
        "reason": r.get("draft_cudagraph_mode_reason"), "ran": r.get("draft_single_step_modes_ran"),
        "attention": r.get("attention_backend")})
    assert not diffs, f"fp32 strict with draft_cudagraph_mode={mode} differs from vanilla at {conc} on {diffs}"
    assert r["draft_cudagraph_mode_requested"] == mode and r["draft_cudagraph_mode_applies"] is True
    assert r["draft_cudagraph_mode"] == mode, r.get("draft_cudagraph_mode_reason")
    assert spec.records[0]["knobs"]["draft_cudagraph_mode"] == mode
    # the single-token steps ran under the mode built (batches beyond the captured sizes aside)
    single = "full" if mode == "full_all" else mode
    assert single in r["draft_single_step_modes_ran"], r["draft_single_step_modes_ran"]
    if mode == "full_all":  # decode-step first passes replayed FULL graphs (the prefill's ran piecewise)
        assert "full" in r["draft_first_pass_modes_ran"], r.get("draft_first_pass_modes_ran")
    if mode == "none":
        assert r["draft_cudagraph_keys"] == 0


@pytest.mark.parametrize("dtype,mode,ref,conc", [
    ("fp32", "full_all", "full", "c1"), ("fp32", "full_all", "full", "c8"),
    ("bf16", "full", "piecewise", "c1"), ("bf16", "full", "piecewise", "c8"),
    ("bf16", "full_all", "piecewise", "c1"), ("bf16", "full_all", "piecewise", "c8"),
    ("bf16", "full_padded", "piecewise", "c8"), ("bf16", "full_all_padded", "piecewise", "c8")])
def test_full_drafter_graphs_draft_as_piecewise_ones(legs, results_dir, dtype, mode, ref, conc):
    """The same drafter under FULL graphs drafts what it drafts under piecewise graphs: the acceptance,
    which a FULL replay reading stale attention metadata lowers while the output stays exact (the
    target verifies). FA3's scheduler metadata did exactly that (bf16 c8: 0.21 FULL vs 0.66 piecewise)
    until FULL replays built it afresh. bf16 may round differently at near-ties: 0.02 of slack."""
    a, b = _ok(legs, f"{dtype}_graph_{ref}_{conc}"), _ok(legs, f"{dtype}_graph_{mode}_{conc}")
    acc_a, acc_b = a.summary["spec"]["acceptance_rate"], b.summary["spec"]["acceptance_rate"]
    rep = b.summary["engine_report"]
    _record(results_dir, f"{dtype}_{mode}_vs_{ref}_{conc}", {
        ref: acc_a, mode: acc_b, "attention": rep.get("attention_backend"),
        "single_step_modes": rep.get("draft_single_step_modes_ran"),
        "first_pass_modes": rep.get("draft_first_pass_modes_ran"),
        "padded_replays_ran": rep.get("draft_full_padded_replays_ran")})
    if "padded" in mode:  # the padded path really ran (graphs of 1 and 8 only: batches of 2-7 pad)
        assert "single" in (rep.get("draft_full_padded_replays_ran") or []), rep.get("draft_full_graph_sizes")
    assert abs(acc_a - acc_b) <= 0.02, (acc_a, acc_b)


@pytest.mark.parametrize("mode", ["full", "full_all"])
def test_padded_full_replays_are_exact_and_reported(legs, results_dir, mode):
    """With padded replays on and FULL graphs of 1 and 8 only, fp32 strict at concurrency 8 (batches of
    every size from 8 down to 1, those of 2-7 replaying the graph of 8) equals vanilla, and the report says
    padded replays were on and ran."""
    van, spec = _ok(legs, "fp32_vanilla_c8"), _ok(legs, f"fp32_graph_{mode}_padded_c8")
    diffs = [pid for pid, r in spec.by_pid().items() if r["gen_ids"] != van.by_pid()[pid]["gen_ids"]]
    r = spec.summary["engine_report"]
    _record(results_dir, f"fp32_graph_{mode}_padded_c8", {"exact": len(spec.records) - len(diffs),
                                                         "n": len(spec.records), "padded": r.get("draft_full_padded_replay"),
                                                         "padded_replays_ran": r.get("draft_full_padded_replays_ran"),
                                                         "graph_sizes": r.get("draft_full_graph_sizes"),
                                                         "acceptance": spec.summary["spec"]["acceptance_rate"]})
    assert r.get("draft_full_padded_replay") is True and r["draft_cudagraph_mode"] == mode
    assert "single" in (r.get("draft_full_padded_replays_ran") or []), \
        f"no single-token step replayed a padded graph (sizes {r.get('draft_full_graph_sizes')})"
    assert not diffs, f"fp32 strict with padded {mode} replays differs from vanilla on {diffs}"


@pytest.mark.parametrize("name,ref", [("fp32_async_c1", "fp32_vanilla_c1"), ("fp32_async_c8", "fp32_vanilla_c8"),
                                      ("fp32_full_async_c8", "fp32_vanilla_c8"),
                                      ("fp32_full_all_async_c8", "fp32_vanilla_c8")])
def test_async_scheduling_is_on_and_exact(legs, results_dir, name, ref):
    van, spec = _ok(legs, ref), _ok(legs, name)
    diffs = [pid for pid, r in spec.by_pid().items() if r["gen_ids"] != van.by_pid()[pid]["gen_ids"]]
    r = spec.summary["engine_report"]
    _record(results_dir, name, {"exact": len(spec.records) - len(diffs), "n": len(spec.records),
                                "async_scheduling": r.get("async_scheduling"),
                                "graph_mode": r.get("draft_cudagraph_mode"),
                                "acceptance": spec.summary["spec"]["acceptance_rate"]})
    assert spec.summary["engine_args"].get("async_scheduling") is True
    assert r["async_scheduling"] is True, "vLLM kept async scheduling on for the draft_model leg"
    assert spec.records[0]["knobs"]["async_scheduling"] is True
    assert not diffs, f"fp32 strict with async scheduling differs from vanilla on {diffs}"
    # early_output (off by default): vLLM's copy order
    assert not r.get("early_output_steps"), "a step's output went ahead of the drafter with early_output off"
    s = spec.summary["spec"]
    assert sum(x["spec"]["accepted"] for x in spec.records) == s["num_accepted_tokens"]  # trace = counters


def test_early_output_and_release_copy_ahead_of_the_drafter_and_stay_exact(legs, results_dir):
    van, early, late = _ok(legs, "fp32_vanilla_c8"), _ok(legs, "fp32_async_early_c8"), _ok(legs, "fp32_async_c8")
    diffs = [pid for pid, r in early.by_pid().items() if r["gen_ids"] != van.by_pid()[pid]["gen_ids"]]
    report = early.summary["engine_report"]
    _record(results_dir, "fp32_async_early_c8", {"exact": len(early.records) - len(diffs), "n": len(early.records),
                                                 "early_output_steps": report.get("early_output_steps"),
                                                 "early_release_steps": report.get("early_release_steps")})
    assert (report.get("early_output_steps") or 0) >= 1, "no step's output went ahead of the drafter"
    assert early.records[0]["knobs"]["early_output"] is True and late.records[0]["knobs"]["early_output"] is False
    assert early.records[0]["knobs"]["early_release"] is True
    assert not diffs, f"fp32 strict with early_output and early_release on differs from vanilla on {diffs}"


def _refused_with_reason(legs, results_dir: Path, leg: str, kernel: str) -> bool:
    """Whether vLLM's ``kernel`` (not Marlin or the own kernel, which must run every twin here) refused the
    leg's draft at engine start: none of its layers can run on it (their group size, zero points, activation
    dtype), so the engine refuses to start under that kernel's name. The refusal must quote what the kernel
    answered; it is recorded in ``gpu_suite.json``."""
    from vllm_patch.draft_kernels import KERNEL_CLASSES

    refusal = f"draft_linear_kernel={kernel}: none of the draft's"
    if kernel in ("marlin", "own") or leg not in legs or legs[leg].returncode == 0 or refusal not in legs[leg].stderr:
        return False
    line = legs[leg].stderr[legs[leg].stderr.index(refusal):].splitlines()[0]
    _record(results_dir, leg, {"refused": line})
    assert f"can run on {KERNEL_CLASSES[kernel]} here (it said: " in line and "no reason given" not in line, line
    return True


@pytest.mark.parametrize("kernel", _draft_kernels())
def test_draft_linear_kernel_knob(legs, teacher, prompts, results_dir, kernel):
    """The draft's W4A16 layers run on the kernel asked for (or say which fell back); the target's are vLLM's."""
    from vllm_patch.draft_kernels import KERNEL_CLASSES

    if kernel == "humming" and not RECHECK:
        from vllm.utils.import_utils import has_humming

        if not has_humming():   # the leg is refused at load (draft_kernels.checked_report), not run on Machete
            pytest.skip("draft_linear_kernel=humming needs the humming-kernels package on this host "
                        "(carry its wheel beside the staged vLLM)")
    want = KERNEL_CLASSES[kernel]
    if _refused_with_reason(legs, results_dir, f"bf16_kernel_{kernel}_c1", kernel):
        return
    base, leg = _ok(legs, "bf16_strict_c1"), _ok(legs, f"bf16_kernel_{kernel}_c1")
    r, r_base = leg.summary["engine_report"], base.summary["engine_report"]
    result = _classify(_ok(legs, "bf16_vanilla_c1"), leg, teacher, prompts)
    result.update(ran=r.get("draft_mp_kernels"), fallback=r.get("draft_linear_kernel_fallback_layers"),
                  acceptance=leg.summary["spec"]["acceptance_rate"])
    _record(results_dir, f"bf16_kernel_{kernel}_c1", result)
    ran = r["draft_mp_kernels"]
    assert sum(ran.values()) > 0
    # every draft layer is on the kernel asked for, or counted as having fallen back to vLLM's order
    assert ran.get(want, 0) + sum(r["draft_linear_kernel_fallback_layers"].values()) == sum(ran.values())
    assert r["linear_kernels"]["target"] == r_base["linear_kernels"]["target"], "the target's kernels changed"
    assert not [d for d in result["divergences"] if d["class"] == "error"], result


@pytest.fixture(scope="module")
def sym_teacher():
    from unseen_twin import build_unseen
    from workbench.teacher import TeacherForcer

    build_unseen(UNSEEN_ROOT)  # seeded: a recheck host builds the target the legs ran (seconds, on a CPU)
    return TeacherForcer(str(UNSEEN_ROOT / "target"), dtype="float32", device="cuda" if ON_CUDA else "cpu")


@pytest.mark.parametrize("kernel", [*_sym_kernels(), None], ids=[*_sym_kernels(), "auto_c8"])
def test_a_symmetric_twin_drafts_on_the_kernel_named(legs, prompts, results_dir, kernel, request):
    """A symmetric group-64 twin (uint4b8, no zero points) of another tiny target: every draft layer on the
    kernel asked for (Marlin and the own kernel must run it; a vLLM kernel that cannot may refuse at engine
    start, quoting its reason), the target's kernels untouched, every bf16 divergence a near-tie."""
    from vllm_patch.draft_kernels import KERNEL_CLASSES

    leg = f"sym_bf16_kernel_{kernel}_c1" if kernel else "sym_bf16_strict_c8"
    if kernel == "humming" and not RECHECK:
        from vllm.utils.import_utils import has_humming

        if not has_humming():
            pytest.skip("draft_linear_kernel=humming needs the humming-kernels package on this host")
    if kernel is not None and _refused_with_reason(legs, results_dir, leg, kernel):
        return
    spec = _ok(legs, leg)
    van = _ok(legs, "sym_bf16_vanilla_c8" if leg.endswith("_c8") else "sym_bf16_vanilla_c1")
    teacher = request.getfixturevalue("sym_teacher")
    r = spec.summary["engine_report"]
    result = _classify(van, spec, teacher, prompts)
    result.update(ran=r.get("draft_mp_kernels"), fallback=r.get("draft_linear_kernel_fallback_layers"),
                  mode=r.get("draft_cudagraph_mode"), acceptance=spec.summary["spec"]["acceptance_rate"])
    _record(results_dir, leg, result)
    ran = r["draft_mp_kernels"]
    assert sum(ran.values()) > 0
    if kernel is not None:
        assert ran.get(KERNEL_CLASSES[kernel], 0) + sum(r["draft_linear_kernel_fallback_layers"].values()) \
            == sum(ran.values())
    assert not [d for d in result["divergences"] if d["class"] == "error"], result


@pytest.mark.parametrize("conc", ["c1", "c8"])
def test_an_int4_draft_head_runs_on_the_drafts_kernel_and_every_divergence_is_a_near_tie(
        legs, teacher, prompts, results_dir, conc):
    leg, base = _ok(legs, f"bf16_int4_head_{conc}"), _ok(legs, f"bf16_strict_{conc}")
    r = leg.summary["engine_report"]
    result = _classify(_ok(legs, f"bf16_vanilla_{conc}"), leg, teacher, prompts)
    result.update(head=r.get("draft_lm_head"), kernel=r.get("draft_lm_head_kernel"),
                  bytes=r.get("draft_lm_head_bytes"), acceptance=leg.summary["spec"]["acceptance_rate"],
                  acceptance_bf16_head=base.summary["spec"]["acceptance_rate"])
    _record(results_dir, f"bf16_int4_head_{conc}", result)
    assert r["draft_lm_head"] == "int4" and r["draft_lm_head_kernel"] == "MarlinLinearKernel", r
    assert base.summary["engine_report"]["draft_lm_head"] == "model"
    assert leg.records[0]["knobs"]["draft_lm_head"] == "int4"
    assert not [d for d in result["divergences"] if d["class"] == "error"], result


def test_draft_linear_kernel_auto_is_never_machete(legs):
    r = _ok(legs, "bf16_strict_c1").summary["engine_report"]
    assert r["draft_linear_kernel_preferred"] == "MarlinLinearKernel"
    assert "MacheteLinearKernel" not in r["draft_mp_kernels"]
