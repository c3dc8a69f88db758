"""The suite's leg zygote (tests/leg_zygote.py) forks a leg only where a fresh process would run it the same."""

from __future__ import annotations

import json

import leg_zygote as lz

BASE = {"PATH": "/usr/bin", "HF_HOME": "/cache/hf", "PYTHONPATH": "/repo"}
DEFAULTS = {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
IMPORTED = {**BASE, **DEFAULTS, "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_root"}


def _refusal(env=None, args=("--out", "o"), module="workbench.leg"):
    req = {"module": module, "args": list(args), "env": {**BASE, **(env or {})}}
    return lz.refusal(req, BASE, IMPORTED, DEFAULTS, path=["/repo", "/site"])


def test_a_leg_in_the_zygotes_environment_is_forked():
    assert _refusal() is None
    # the leg sets its own defaults, as the zygote did; the plugin's knobs, the suite's and the parent's
    # variables are read after the fork; what importing vLLM put in the environment is as the zygote has it
    assert _refusal({"OMP_NUM_THREADS": "1", "VLLM_SPEC_RELAX_LOGTAU": "0.5", "WORKBENCH_PARENT_PID": "7",
                     "PYTEST_CURRENT_TEST": "t", "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_root",
                     "COLUMNS": "80"}) is None
    assert _refusal({"PYTHONPATH": "/repo:/site"}) is None
    assert _refusal({"LD_LIBRARY_PATH": "/no/such/folder"}) is None


def test_what_the_zygote_cannot_stand_for_runs_fresh(tmp_path):
    assert "VLLM_SPEC_CPU_ISA" in _refusal({"VLLM_SPEC_CPU_ISA": "avx2"})  # picks the kernel library at import
    assert "OMP_NUM_THREADS" in _refusal({"OMP_NUM_THREADS": "2"})
    assert "HF_HOME" in _refusal({"HF_HOME": "/elsewhere"})
    assert "LD_LIBRARY_PATH" in _refusal({"LD_LIBRARY_PATH": str(tmp_path)})
    assert "PYTHONPATH" in _refusal({"PYTHONPATH": "/other"})
    assert "module" in _refusal(module="workbench.score")
    assert _refusal(module="workbench.cli", args=("run", "E1", "--config", "x")) is None  # a run's process
    assert "OpenMP" in _refusal(args=("--out", "o", "--cpu-threads", "2"))
    assert "OpenMP" in _refusal(args=("--out", "o", "--no-in-process"))
    config = tmp_path / "leg.json"
    config.write_text(json.dumps({"cpu_threads": 2}))
    assert "OpenMP" in _refusal(args=("--config", str(config)))
    config.write_text(json.dumps({"cpu_threads": 1, "in_process": None}))
    assert _refusal(args=("--config", str(config))) is None


def test_the_leg_command_is_plain_where_the_zygote_is_off(monkeypatch):
    monkeypatch.setenv(lz.ENV, "0")
    assert lz.command("workbench.leg", ["--out", 1])[1:] == ["-m", "workbench.leg", "--out", "1"]
    monkeypatch.setenv(lz.ENV, "/run/zygote.sock")
    assert lz.command("workbench.leg", ["--out", 1])[1:] == [lz.__file__, "workbench.leg", "--out", "1"]
