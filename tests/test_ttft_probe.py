"""The TTFT probe (benchmarks/ttft_probe.py): bad options are refused before an engine starts; a CPU rehearsal
with the tiny models times each request from arrival to its first token's release, vanilla beside spec."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO

PROBE = REPO / "benchmarks" / "ttft_probe.py"


def _probe(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROBE), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_bad_knobs_and_sizes_are_refused_before_any_engine(tmp_path):
    bad = _probe("--gamma", "0", "--out", str(tmp_path / "a"), timeout=60)
    assert bad.returncode != 0 and "gamma" in bad.stderr
    assert not (tmp_path / "a").exists()
    short = _probe("--tokens", "1", "--out", str(tmp_path / "b"), timeout=60)
    assert short.returncode == 2 and "--tokens" in short.stderr


def test_the_cpu_rehearsal_times_each_first_token_and_finds_the_draft_in_the_spec_window(tmp_path):
    out = tmp_path / "probe"
    done = _probe("--size", "tiny", "--requests", "2", "--warmup", "1", "--tokens", "2", "--profile",
                  "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for kind in ("vanilla", "spec"):
        raw = json.loads((out / f"probe_{kind}.json").read_text())
        # only the timed requests, each with its window: arrival before every event, release after
        assert raw["summary"]["requests"] == 2 and len(raw["requests"]) == 2
        for req in raw["requests"]:
            assert req["ttft_host_ms"] > 0
            assert all(0 <= ev[1] <= req["ttft_host_ms"] for ev in req["events"])
            assert req["ms_by_kind"]["execute_model"] > 0
    assert json.loads((out / "probe_spec.json").read_text())["knobs"]["gamma"] == 4
    # the spec engine really drafted (its engine report), the vanilla one has no drafter
    spec_report = json.loads(next((out / "report_spec").glob("engine-*.json")).read_text())
    assert spec_report["proposer"] == "TwinDraftProposer" and spec_report["num_speculative_tokens"] == 4
    assert not list((out / "report_vanilla").glob("engine-*.json")) or "proposer" not in json.loads(
        next((out / "report_vanilla").glob("engine-*.json")).read_text())
    # both windows hold the same engine-core phases; the comparison is per phase (times are not judged here)
    assert set(summary["extra_ms_by_kind"]) >= {"schedule", "execute_model", "sample_tokens"}
    assert summary["ttft_ratio"] > 0 and (out / "env.json").is_file()
    assert "time to first token, host" in done.stdout
    # --profile: one profiled sample_tokens per timed request (its prefill step); the spec one holds the
    # draft's prefill and first draft (vLLM's spec-decode code and the plugin), the vanilla one neither
    prof = {k: json.loads((out / f"probe_{k}.json").read_text())["profile"] for k in ("vanilla", "spec")}
    assert prof["vanilla"]["calls"] == 2 and prof["spec"]["calls"] == 2
    assert prof["spec"]["by_area_ms_per_call"]["vllm spec-decode"] > 0
    assert prof["spec"]["by_area_ms_per_call"]["plugin"] > 0
    assert "vllm spec-decode" not in prof["vanilla"]["by_area_ms_per_call"]
    assert prof["spec"]["ms_per_call"] > prof["vanilla"]["ms_per_call"]
    text = (out / "profile_spec.txt").read_text()
    assert summary["profile"]["spec"] == prof["spec"] and "propose" in text and str(REPO) not in text
    assert "prefill step's sample_tokens under cProfile" in done.stdout


def test_a_synchronizing_operation_torch_warns_of_becomes_an_event_with_its_call_site(monkeypatch):
    """On CUDA torch's sync debug mode warns at each synchronizing operation; the probe turns each warning into
    a ``sync-op`` event (here torch's switch is a stand-in: this host has no CUDA)."""
    import importlib.util
    import warnings

    import torch

    spec = importlib.util.spec_from_file_location("ttft_probe", PROBE)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    modes = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    tl = probe.Timeline(min_ms=0.2)
    tl.on = True
    with probe.SyncOps(tl):
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
    assert modes == ["warn", "default"]
    assert [e[0] for e in tl.events] == ["sync-op", "sync-op"]
    with warnings.catch_warnings(record=True) as seen:  # outside the window: warnings as before
        warnings.simplefilter("always")
        warnings.warn("something else", UserWarning, stacklevel=1)
    assert len(tl.events) == 2 and len(seen) == 1


def test_the_profile_sorts_functions_into_code_areas_by_their_file():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ttft_probe", PROBE)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    site = "/opt/env/lib/python3.12/site-packages"
    assert probe.area_of("/repo/vllm_patch/twin_proposer.py") == "plugin"
    assert probe.area_of(f"{site}/vllm/v1/spec_decode/llm_base_proposer.py") == "vllm spec-decode"
    assert probe.area_of(f"{site}/vllm/v1/attention/backends/flash_attn.py") == "vllm attention"
    assert probe.area_of("/tmp/torchinductor_root/ab/cabc123.py") == "compiled code (Inductor)"
    assert probe.area_of(f"{site}/vllm/compilation/cuda_graph.py") == "cuda-graph replay"
    assert probe.area_of(f"{site}/vllm/model_executor/models/qwen3.py") == "vllm other"
    assert probe.area_of(f"{site}/torch/nn/modules/module.py") == "torch other"
    assert probe.area_of("~") == "C calls" and probe.area_of("/usr/lib/python3.12/json/encoder.py") == "other"
    # the written profile names no directory of the host
    text = (f"  8  0.001 {site}/vllm/v1/spec_decode/llm_base_proposer.py:502(propose)\n"
            f"  8  0.001 {probe.REPO}/vllm_patch/twin_proposer.py:252(propose)\n"
            "  8  0.000 /root/.pyenv/versions/3.11.7/lib/python3.11/ctypes/__init__.py:342(__init__)\n"
            f"  8  0.000 {probe.REPO}/.venv/lib/python3.11/site-packages/torch/nn/modules/module.py:1782(_call_impl)\n")
    assert probe.short_paths(text).split() == [
        "8", "0.001", "vllm/v1/spec_decode/llm_base_proposer.py:502(propose)",
        "8", "0.001", "vllm_patch/twin_proposer.py:252(propose)", "8", "0.000", "ctypes/__init__.py:342(__init__)",
        "8", "0.000", "torch/nn/modules/module.py:1782(_call_impl)"]
