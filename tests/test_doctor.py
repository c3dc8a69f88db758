"""Issue 8: `workbench doctor` says what a host can run and what to do about the rest."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO, TINY_PROMPTS, run_leg_process


def _doctor(env: dict | None = None) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "doctor", "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    return proc.returncode, {c["name"]: c for c in json.loads(proc.stdout)}


def test_doctor_reports_vllm_plugin_and_the_int4_path_of_this_host():
    rc, checks = _doctor()
    assert rc == 0, checks
    assert checks["vllm"]["status"] == "ok" and "0.27.1" in checks["vllm"]["detail"]
    assert checks["plugin"]["status"] == "ok" and "fingerprint" in checks["plugin"]["detail"]
    detail = checks["int4 path"]["detail"]
    assert "kernel library _C" in detail
    native = "cpu_gemm_wna16 present" in detail
    assert ("native int4 path" in detail) == native and ("fallback int4 path" in detail) == (not native)
    for name in ("python", "cpu", "gpu", "chromium", "tiny models", "prompt data"):
        assert checks[name]["status"] in ("ok", "warn"), checks[name]


def test_doctor_on_the_avx2_library_says_the_fallback_drafts():
    rc, checks = _doctor({"VLLM_SPEC_CPU_ISA": "avx2"})
    assert rc == 0
    detail = checks["int4 path"]["detail"]
    assert "_C_AVX2.abi3.so" in detail and "absent" in detail and "fallback int4 path" in detail
    assert "PyTorch W4A16" in checks["int4 path"]["fix"]


def test_doctor_fails_where_the_twin_cannot_draft():
    rc, checks = _doctor({"VLLM_SPEC_CPU_ISA": "avx2", "VLLM_SPEC_INT4_FALLBACK": "0"})
    assert rc == 1 and checks["int4 path"]["status"] == "FAIL"
    assert "VLLM_SPEC_INT4_FALLBACK" in checks["int4 path"]["fix"]
    rc, checks = _doctor({"VLLM_SPEC_INT4_FALLBACK": "sometimes"})
    assert rc == 1 and "VLLM_SPEC_INT4_FALLBACK='sometimes'" in checks["int4 path"]["detail"]


def test_a_leg_failing_for_the_host_points_to_doctor(tmp_path, tiny_models):
    res = run_leg_process(tmp_path / "leg", "--target", tiny_models["target"], "--draft", tiny_models["twin-int4"],
                          "--gamma", "3", "--prompts", TINY_PROMPTS, "--max-tokens", "8",
                          env={"VLLM_SPEC_INT4_FALLBACK": "sometimes"})
    assert res.returncode != 0
    assert "VLLM_SPEC_INT4_FALLBACK" in res.stderr and "workbench doctor" in res.stderr


def test_cpu_kind_names_extensions_kernel_library_and_bf16_gemm(monkeypatch):
    """Issue 17: the CPU kind decides the kernel library and how bf16 GEMMs round; doctor and env.json state it."""
    import torch

    from vllm_patch import cpu_int4
    from workbench import envcapture

    def kind(flags, onednn_bf16, isa=""):
        monkeypatch.setattr(cpu_int4, "cpu_vector_extensions", lambda: flags)
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn_bf16)
        k = cpu_int4.cpu_kind({"VLLM_SPEC_CPU_ISA": isa})
        return k["kernel_library"], k["native_int4_op"], k["bf16_gemm"]

    assert kind(["avx2", "avx512f", "avx512_bf16", "amx_bf16"], True) == ("_C.abi3.so", True, "native")
    assert kind(["avx2", "avx512f", "avx512_vnni"], True) == ("_C_AVX512.abi3.so", True, "emulated")
    assert kind(["avx2"], False) == ("_C_AVX2.abi3.so", False, "reference")
    # the AVX2 library can be forced; oneDNN's bf16 path still follows the hardware
    assert kind(["avx2", "avx512f", "avx512_bf16"], True, isa="avx2") == ("_C_AVX2.abi3.so", False, "native")
    monkeypatch.undo()
    here = envcapture.cpu_info()["kind"]
    assert here == cpu_int4.cpu_kind() and here["bf16_gemm"] in ("native", "emulated", "reference")
    rc, checks = _doctor()
    assert f"vLLM kernel library {here['kernel_library']}" in checks["cpu"]["detail"]
    assert f"bf16 GEMM {here['bf16_gemm']}" in checks["cpu"]["detail"]
