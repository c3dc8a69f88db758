"""The project's CUDA extensions (``csrc/``): built at first use with the host's ``nvcc`` through
``torch.utils.cpp_extension.load`` and cached under torch's extensions folder, per torch and CUDA version. Used by
``twin_cuda`` (the W4A16 GEMM) and ``twin_attention`` (the draft's decode attention). Importing it needs neither
CUDA nor nvcc.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"


def toolchain_reason(env=None, which=shutil.which) -> str | None:
    """Why the extension cannot be built on this host (no CUDA context needed: the workbench asks before a run)."""
    if which("nvcc") is None and not (os.environ if env is None else env).get("CUDA_HOME"):
        return "nvcc is not on PATH and CUDA_HOME is unset (the extension is built at the first engine start)"
    return None


def extension_name(prefix: str = "twin_w4a16") -> str:
    """An extension's name, so its cache folder, per torch and CUDA version: torch's loader rebuilds on a change
    of the sources or flags only, and would load a build made against another torch's headers."""
    return re.sub(r"\W", "_", f"{prefix}_t{torch.__version__}_cu{torch.version.cuda}")


def load_extension(prefix: str, sources) -> object:
    """``csrc/`` ``sources`` built for this device with the host's nvcc (then loaded from torch's cache)."""
    from torch.utils.cpp_extension import load

    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if torch.cuda.is_available() and saved is None:
        major, minor = torch.cuda.get_device_capability()
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}" + ("a" if (major, minor) == (9, 0) else "")
    try:
        return load(name=extension_name(prefix), sources=[str(CSRC / s) for s in sources],
                    extra_include_paths=[str(CSRC)], extra_cflags=["-O3", "-std=c++17"],
                    extra_cuda_cflags=["-O3", "-std=c++17", "-lineinfo"], verbose=False)
    finally:
        if saved is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
