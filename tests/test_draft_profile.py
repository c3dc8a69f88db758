"""The draft-step profile (benchmarks/draft_profile.py): kernels put into the sections of a decode step by
their launch's host time (a CUDA graph's kernels by the graph launch), classes by name, prompt steps left out;
bad options refused before an engine starts; a CPU rehearsal with the tiny models splits real steps."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = REPO / "benchmarks" / "draft_profile.py"


def _module():
    spec = importlib.util.spec_from_file_location("draft_profile", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1, "args": args}


def _step(t0: float, kind: str = "decode", spec: int = 4) -> list[dict]:
    """One step's ranges and launches at host time t0..t0+100, its kernels on the GPU 1000 later."""
    base = int(t0)
    ev = [_x("user_annotation", f"twin::step:{kind}:1:{spec}", t0, 100),
          _x("user_annotation", "twin::target", t0 + 5, 30),
          _x("user_annotation", "twin::draft", t0 + 40, 50),
          _x("user_annotation", "twin::draft_loop", t0 + 60, 25)]
    launches = [  # (host time, correlation, kernels: (name, duration))
        (t0 + 10, base + 1, [("sm90_xmma_gemm_bf16", 20.0), ("flash_fwd_splitkv_kernel", 6.0)]),
        (t0 + 45, base + 2, [("Marlin<256, 1>", 9.0), ("reshape_and_cache_flash_kernel", 1.0)]),
        # a graph launch of the three single-token steps: its kernels carry its correlation
        (t0 + 65, base + 3, [("w4a16_decode<1, 1, 4, true, false>", 12.0), ("fused_add_rms_norm_kernel", 3.0),
                             ("w4a16_decode<1, 1, 4, true, false>", 12.0), ("rotary_embedding_kernel", 1.5),
                             ("argmax_kernel", 0.9), ("triton_poi_fused_mystery_0", 0.6)]),
        (t0 + 95, base + 4, [("rejection_greedy_sample_kernel", 2.0)]),
    ]
    gpu = t0 + 1000
    for ts, corr, kernels in launches:
        ev.append(_x("cuda_runtime", "cudaGraphLaunch", ts, 2, correlation=corr))
        for name, dur in kernels:
            ev.append(_x("kernel", name, gpu, dur, correlation=corr))
            gpu += dur + 1.0
    return ev


def test_kernels_go_to_their_section_and_class():
    dp = _module()
    trace = {"traceEvents": _step(0.0) + _step(10_000.0) + _step(20_000.0, kind="prefill")
             + _step(30_000.0, spec=0)
             + [_x("kernel", "orphan", 5.0, 3.0, correlation=999_999)]}  # no launch: not counted
    res = dp.split(trace, gamma=4, gpu=True)
    assert res["on_gpu"] and res["decode_steps"] == 2  # the prompt step and the step without a draft left out
    assert res["prefill_steps"] == 1 and res["prefill"]["target"]["by_class_us"]["bf16 GEMM"] == pytest.approx(20.0)
    sec = res["sections"]
    # the single-token steps per step: the graph's kernels over γ - 1 = 3 steps
    loop = sec["draft steps"]
    assert loop["per"] == "single-token draft step"
    assert loop["by_class_us"]["int4 GEMM"] == pytest.approx(24.0 / 3)
    assert loop["by_class_us"]["norm"] == pytest.approx(1.0)
    assert loop["by_class_us"]["rotary"] == pytest.approx(0.5)
    assert loop["by_class_us"]["sampling"] == pytest.approx(0.3)
    assert loop["by_class_us"]["other"] == pytest.approx(0.2)
    assert loop["kernels"] == pytest.approx(2.0) and loop["sum_us"] == pytest.approx(30.0 / 3)
    # span: first kernel start to last end (5 gaps of 1 µs between the 6 kernels)
    assert loop["span_us"] == pytest.approx((30.0 + 5.0) / 3)
    # host time: the ranges' durations (the loop's per single-token step; the rest of the step less its spans)
    assert loop["host_us"] == pytest.approx(25.0 / 3)
    assert sec["draft first pass"]["host_us"] == pytest.approx(25.0)
    assert sec["target"]["host_us"] == pytest.approx(30.0) and sec["step other"]["host_us"] == pytest.approx(20.0)
    first = sec["draft first pass"]["by_class_us"]
    assert first == {"int4 GEMM": pytest.approx(9.0), "KV write": pytest.approx(1.0)}
    assert sec["target"]["by_class_us"] == {"bf16 GEMM": pytest.approx(20.0), "attention": pytest.approx(6.0)}
    assert sec["step other"]["by_class_us"] == {"sampling": pytest.approx(2.0)}
    assert sec["step other"]["span_us"] is None  # its kernels lie before and after the spans: no span of its own
    assert loop["graph_launches"] == pytest.approx(1 / 3) and res["untraced_graphs"] == []
    top = {t["name"]: t for t in loop["top"]}
    assert top["w4a16_decode<1, 1, 4, true, false>"]["us_per"] == pytest.approx(8.0)


def test_resplit_reads_the_kept_traces_again(tmp_path):
    import gzip

    dp = _module()
    trace = {"traceEvents": _step(0.0) + _step(10_000.0)}
    with gzip.open(tmp_path / "trace_b1.json.gz", "wt") as f:
        json.dump(trace, f)
    stale = dp.split(trace, gamma=4, gpu=True)
    stale["sections"]["draft steps"]["by_class_us"] = {"int4 GEMM": 1e9}  # as an older classifier had it
    result = {"size": "8b", "knobs": {"gamma": 4, "acceptance": "alpha:1"}, "engine_report": {}, "tokens": 48,
              "prompt_len": 128, "batches": {"1": stale}}
    (tmp_path / "draft_profile.json").write_text(json.dumps(result))
    done = _run("--resplit", "--out", str(tmp_path), timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    again = json.loads((tmp_path / "draft_profile.json").read_text())["batches"]["1"]
    assert again["sections"]["draft steps"]["by_class_us"]["int4 GEMM"] == pytest.approx(8.0)
    assert "| draft steps |" in (tmp_path / "README.md").read_text()
    (tmp_path / "trace_b1.json.gz").unlink()
    gone = _run("--resplit", "--out", str(tmp_path), timeout=60)
    assert gone.returncode != 0 and "trace_b1.json.gz" in gone.stderr


def test_graph_launches_without_traced_kernels_are_named():
    dp = _module()
    trace = {"traceEvents": [e for e in _step(0.0) if e["cat"] != "kernel"]}
    res = dp.split(trace, gamma=4, gpu=True)
    assert res["decode_steps"] == 1 and set(res["untraced_graphs"]) >= {"draft steps", "target"}
    assert res["sections"]["draft steps"]["kernels"] == 0


def test_class_names():
    dp = _module()
    assert dp.class_of("reshape_and_cache_flash_kernel") == "KV write"
    assert dp.class_of("void vllm::fused_add_rms_norm_kernel<c10::BFloat16>") == "norm"
    assert dp.class_of("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "norm"
    assert dp.class_of("void marlin::Marlin<...>") == "int4 GEMM"
    assert dp.class_of("void twin_w4::w4a16_decode<1, 1, 4, true, false>(twin_w4::Params)") == "int4 GEMM"
    assert dp.class_of("twin_w4::w4a16_silu_mul_pairs(void const*, void*, int, int, int, int, int)") == "activation"
    assert dp.class_of("twin_w4::w4a16_dequant(twin_w4::DequantParams)") == "int4 dequant"
    assert dp.class_of("_C::onednn_mm") == "bf16 GEMM"
    assert dp.class_of("void flash::flash_fwd_splitkv_kernel") == "attention"
    assert dp.class_of("something_new") == "other"
    # Inductor's kernels named after the GEMMs beside them are not GEMMs
    assert dp.class_of("triton_red_fused_fused_add_rms_norm_marlin_gemm_0") == "norm"
    assert dp.class_of("triton_poi_fused_marlin_gemm_mul_silu_slice_1") == "activation"
    assert dp.class_of("triton_red_fused_4") == "other"


def test_cpu_operators_get_their_own_time():
    dp = _module()
    ops = [_x("cpu_op", "aten::linear", 0.0, 10.0), _x("cpu_op", "aten::mm", 2.0, 6.0),
           _x("cpu_op", "aten::add", 12.0, 1.0)]
    own = {o["name"]: o["own"] for o in dp._own_times(ops)}
    assert own == {"aten::linear": 4.0, "aten::mm": 6.0, "aten::add": 1.0}


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_bad_options_are_refused_before_any_engine(tmp_path):
    for args, word in ((("--batches", "0,x"), "--batches"), (("--tokens", "4"), "--tokens"),
                       (("--gamma", "0"), "gamma")):
        out = tmp_path / word.strip("-")
        done = _run(*args, "--out", str(out), timeout=60)
        assert done.returncode == 2 and word in done.stderr, done.stderr[-2000:]
        assert not out.exists()


@pytest.mark.vllm
def test_the_cpu_rehearsal_splits_real_decode_steps(tmp_path):
    out = tmp_path / "prof"
    done = _run("--size", "tiny", "--tokens", "20", "--warmup", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads((out / "draft_profile.json").read_text())
    b1 = res["batches"]["1"]
    assert not b1["on_gpu"] and b1["decode_steps"] >= 2
    sec = b1["sections"]
    # the twin's int4 GEMMs run in its steps and first pass, never in the target's forward; the target's GEMMs
    # are bf16. Where vLLM's CPU library has no int4 GEMM (AVX2), the twin's layers run the project's fallback:
    # dequantized once at load, then the dense GEMM (cpu_int4), so there its GEMMs are dense too.
    from vllm_patch import cpu_int4

    native = res["engine_report"]["draft_linear_kernel"] != cpu_int4.KERNEL_NAME
    draft_gemm = "int4 GEMM" if native else "bf16 GEMM"
    assert sec["draft steps"]["by_class_us"][draft_gemm] > 0
    assert sec["draft first pass"]["by_class_us"][draft_gemm] > 0
    assert sec["target"]["by_class_us"].get("int4 GEMM", 0.0) == 0.0
    assert sec["target"]["by_class_us"]["bf16 GEMM"] > 0
    assert all(sec[s]["by_class_us"].get("attention", 0.0) > 0 for s in ("draft steps", "target"))
    assert res["engine_report"]["num_speculative_tokens"] == 4
    # the prompt step apart: the draft's prefill (its first pass) and first draft, the target's prefill
    assert b1["prefill_steps"] >= 1 and b1["prefill"]["draft first pass"]["by_class_us"][draft_gemm] > 0
    assert b1["prefill"]["draft first pass"]["host_us"] > 0
    text = (out / "README.md").read_text()
    assert "cost measurement" in text and "| draft steps | single-token draft step |" in text
    assert (out / "env.json").is_file() and not list(out.glob("trace_*"))
