"""Dtype / kernel / device combinations that cannot run are refused before any leg (#38)."""

from __future__ import annotations

import json
import os
import time

import pytest

from conftest import REPO, run_leg_process
from workbench import cli, protocol
from workbench.combinations import combination_problems, cpu_int4_path, weight_only_bits
from workbench.protocol import ProtocolError

TINY = REPO / "models" / "tiny"
NATIVE = {"VLLM_SPEC_INT4_FALLBACK": "0"}  # this host's kernel library as it is, no fallback


def _w4a16(input_activations=None) -> dict:
    return {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "int"}, "input_activations": input_activations}}}}


def test_weight_only_bits_reads_the_quantization_schemes():
    assert weight_only_bits(_w4a16()) == ("compressed-tensors", 4)
    assert weight_only_bits({"text_config": _w4a16()}) == ("compressed-tensors", 4)
    assert weight_only_bits(_w4a16({"num_bits": 8, "type": "int"})) is None  # W8A8: not the W4A16 kernel
    assert weight_only_bits({"quantization_config": {"quant_method": "awq", "bits": 4}}) == ("awq", 4)
    assert weight_only_bits({"torch_dtype": "float32"}) is None


def test_the_int4_path_follows_the_switches():
    assert cpu_int4_path({"VLLM_SPEC_INT4_FALLBACK": "1"}) == "fallback"
    assert cpu_int4_path({"VLLM_SPEC_INT4_FALLBACK": "0", "VLLM_SPEC_CPU_ISA": "avx2"}) == "missing"
    assert cpu_int4_path({"VLLM_SPEC_CPU_ISA": "avx2"}) == "fallback"
    with pytest.raises(ValueError, match="VLLM_SPEC_INT4_FALLBACK"):
        cpu_int4_path({"VLLM_SPEC_INT4_FALLBACK": "maybe"})


def _legs(dtype: str) -> list:
    return [("vanilla_1", dtype, {"target": "target"}), ("strict_g4", dtype, {"target": "target", "draft": "twin"})]


def test_float32_with_the_int4_twin_is_named_with_the_way_out(tiny_models, monkeypatch):
    monkeypatch.chdir(REPO)
    models = {"target": str(TINY / "target"), "twin": str(TINY / "twin-int4")}
    if cpu_int4_path(NATIVE) == "native":  # an AVX-512 host: vLLM's op, which has no float32 path
        (msg,) = combination_problems(_legs("float32"), models, "cpu", NATIVE)
        assert msg.startswith("leg(s) strict_g4: the draft twin (")
        assert "4-bit weight-only" in msg and "dtype float32" in msg
        assert "--model-path twin=models/tiny/twin-dequant" in msg and "-p dtype=bfloat16" in msg
    else:  # the AVX2 library has no op at all, so the fallback switched off cannot run the twin in any dtype
        (msg,) = combination_problems(_legs("bfloat16"), models, "cpu", NATIVE)
        assert "VLLM_SPEC_INT4_FALLBACK=0" in msg
    # what runs: bfloat16 on the native op; float32 on the dequantized twin, or on the plugin's fallback
    assert combination_problems(_legs("bfloat16"), models, "cpu", {}) == []
    dequant = dict(models, twin=str(TINY / "twin-dequant"))
    assert combination_problems(_legs("float32"), dequant, "cpu", {}) == []
    assert combination_problems(_legs("float32"), models, "cpu", {"VLLM_SPEC_INT4_FALLBACK": "1"}) == []
    assert combination_problems(_legs("float32"), models, "gpu", NATIVE) == []


def test_int4_twin_without_any_kernel_is_refused(tiny_models):
    env = {"VLLM_SPEC_INT4_FALLBACK": "0", "VLLM_SPEC_CPU_ISA": "avx2"}
    models = {"target": str(TINY / "target"), "twin": str(TINY / "twin-int4")}
    (msg,) = combination_problems(_legs("bfloat16"), models, "cpu", env)
    assert "strict_g4" in msg and "has no cpu_gemm_wna16" in msg and "unset it" in msg


needs_native = pytest.mark.skipif(cpu_int4_path({**os.environ, **NATIVE}) != "native",  # VLLM_SPEC_CPU_ISA as set
                                  reason="float32 fails only on vLLM's native int4 op (an AVX-512 host)")


@needs_native
def test_run_with_float32_and_the_int4_twin_is_refused_before_anything(tmp_path, tiny_models, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("VLLM_SPEC_INT4_FALLBACK", "0")
    monkeypatch.setattr(protocol, "execute", lambda *a, **k: pytest.fail("a leg was started"))
    root = tmp_path / "results"
    t = time.perf_counter()
    rc = cli.main(["run", "E1", "--profile", "tiny", "-p", "dtype=float32", "--results", str(root), "--no-notebook"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "nothing was created" in err and "dtype float32" in err and "the draft twin" in err
    assert "--model-path twin=models/tiny/twin-dequant" in err
    assert not root.exists()
    print(f"refused in {time.perf_counter() - t:.2f} s")
    # the way out the message names is accepted (folder prepared, no leg run here)
    rdir = protocol.prepare_run("E1", "tiny", ["dtype=float32"], True, root,
                                model_paths={"twin": "models/tiny/twin-dequant"})
    assert json.loads((rdir / "run.json").read_text())["models"]["twin"] == os.path.abspath("models/tiny/twin-dequant")
    with pytest.raises(ProtocolError, match="dtype float32"):
        protocol.prepare_run("E1", "tiny", ["dtype=float32"], True, tmp_path / "r2")


@needs_native
def test_a_leg_refuses_float32_with_the_int4_twin_before_its_engine(tmp_path, tiny_models, tiny_prompts):
    res = run_leg_process(tmp_path / "leg", "--target", TINY / "target", "--draft", TINY / "twin-int4",
                          "--prompts", tiny_prompts, "--n", "1", "--max-tokens", "4", "--gamma", "2",
                          "--dtype", "float32", env={"VLLM_SPEC_INT4_FALLBACK": "0"}, timeout=300)
    assert res.returncode != 0
    text = res.stderr + json.dumps(res.failure or {})
    assert "dtype float32" in text and "--draft models/tiny/twin-dequant" in text
    assert "Engine" not in (res.failure or {}).get("error_type", ""), res.failure


def test_a_draft_kernel_the_host_cannot_build_is_named_with_the_way_out(tmp_path):
    """own-cuda and own-cuda+marlin build their CUDA extension with nvcc at the first engine start: without one
    (no nvcc on PATH, no CUDA_HOME) a GPU run's spec legs that ask for them are named before anything starts."""
    from workbench.combinations import kernel_problems

    legs = [("a", {"draft_linear_kernel": "own-cuda+marlin"}), ("b", {"draft_linear_kernel": "auto"}),
            ("c", {"draft_linear_kernel": "own-cuda+marlin"}), ("d", {"draft_linear_kernel": "own-cuda"})]
    (problem_hybrid, problem_own) = kernel_problems(legs, "gpu", env={}, which=lambda name: None)
    assert problem_hybrid.startswith("leg(s) a, c: draft_linear_kernel=own-cuda+marlin cannot be built here")
    assert "nvcc is not on PATH" in problem_hybrid and "-p draft_linear_kernel=auto" in problem_hybrid
    assert problem_own.startswith("leg(s) d: draft_linear_kernel=own-cuda ")
    assert kernel_problems(legs, "gpu", env={"CUDA_HOME": "/opt/cuda"}, which=lambda name: None) == []
    assert kernel_problems(legs, "gpu", env={}, which=lambda name: "/usr/bin/" + name) == []
    assert kernel_problems(legs, "cpu", env={}, which=lambda name: None) == []  # CPU: the knob has no effect
    # the draft's decode attention is built the same way
    (attn,) = kernel_problems([("e", {"draft_attention": "twin"}), ("f", {"draft_attention": "vllm"})], "gpu",
                              env={}, which=lambda name: None)
    assert attn.startswith("leg(s) e: draft_attention=twin cannot be built here") and "-p draft_attention=vllm" in attn


def test_the_run_preflight_asks_for_the_kernel(monkeypatch, tmp_path):
    """The run's preflight (before any leg) reports it for the E16 legs that ask, not for vanilla."""
    from test_acceptance import _shapes
    from workbench.planning import plan
    from workbench.preparing import preflight_problems

    root = _shapes()
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvcc (and no nvidia-smi: no memory plan)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    p = plan("E16", "8b-shape", ["draft_linear_kernel=own-cuda+marlin", "gamma=4", "batches=1"])
    problems = preflight_problems(p, {"target": str(root / "8b-target"), "twin": str(root / "8b-twin")}, None)
    assert problems == ["leg(s) forced_g4: draft_linear_kernel=own-cuda+marlin cannot be built here: nvcc is not on "
                        "PATH and CUDA_HOME is unset (the extension is built at the first engine start). Put the CUDA "
                        "toolkit's nvcc on PATH, or use -p draft_linear_kernel=auto (Marlin)"]
