"""Dtype, kernel and device combinations that cannot run, refused before an engine starts.

    weight_only_bits(config) -> (quant_method, bits) or None
    cpu_int4_path(env=None) -> "native" | "fallback" | "missing"
    combination_problems(legs, models, device, env=None) -> [problem, ...]
    kernel_problems(legs, device, env=None, which=shutil.which) -> [problem, ...]

A weight-only quantized checkpoint (the int4 twin) on a CPU runs through one W4A16 kernel: vLLM's
``cpu_gemm_wna16`` where its kernel library has it, else the plugin's PyTorch fallback
(``vllm_patch.cpu_int4``). vLLM's op has no float32 path: a float32 leg with the int4 twin loads, then
fails on its first step (``"cpu_gemm_wna16" not implemented for 'Float'``), after the run's vanilla legs
have taken their time. With the fallback switched off on a library without the op, the twin cannot
run at all. Both are known from the configs, the run's environment and ``/proc/cpuinfo``, so the run's
preflight and each leg's own check refuse them, naming the leg, the role, the checkpoint and the way
out. The project's own CUDA kernels (``draft_linear_kernel=own-cuda`` and its hybrids, ``draft_attention=twin``) are built with the
host's ``nvcc`` at the first engine start: without one the engine stops at load, so that is refused up front too.
(Too many ranks for the host's devices: ``workbench.parallel``.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = ["weight_only_bits", "cpu_int4_path", "combination_problems", "kernel_problems", "dequantized_twin"]

# knob -> (its values whose extension the host's nvcc builds, the value that needs none)
BUILT = {"draft_linear_kernel": (("own-cuda", "own-cuda+marlin", "own-cuda+marlin+machete"), "auto (Marlin)"),
         "draft_attention": (("twin",), "vllm")}  # vllm_patch.twin_cuda / twin_hybrid; vllm_patch.twin_attention


def weight_only_bits(config: Mapping[str, Any] | None) -> tuple[str, int] | None:
    """(quant_method, weight bits) of a weight-only quantized checkpoint's config (W4A16, W8A16), else None."""
    if not isinstance(config, Mapping):
        return None
    for c in (config, config.get("text_config")):
        q = c.get("quantization_config") if isinstance(c, Mapping) else None
        if not isinstance(q, Mapping):
            continue
        method = str(q.get("quant_method") or "")
        if method == "compressed-tensors":
            for group in (q.get("config_groups") or {}).values():
                w = group.get("weights") if isinstance(group, Mapping) else None
                if (isinstance(w, Mapping) and isinstance(w.get("num_bits"), int) and w.get("type", "int") == "int"
                        and not group.get("input_activations")):
                    return method, w["num_bits"]
        elif method in ("awq", "gptq", "awq_marlin", "gptq_marlin"):
            bits = q.get("bits", q.get("w_bit"))
            if isinstance(bits, int):
                return method, bits
    return None


def cpu_int4_path(env: Mapping[str, str] | None = None) -> str:
    """The W4A16 path a CPU leg started with ``env`` takes: ``native`` (vLLM's cpu_gemm_wna16),
    ``fallback`` (the plugin's) or ``missing`` (no op and the fallback switched off). Without loading vLLM:
    the kernel library follows the CPU's vector extensions (``vllm_patch.cpu_int4.cpu_kind``).

    Raises ``vllm_patch.cpu_int4.Int4FallbackError`` on a switch value the plugin refuses."""
    from vllm_patch.cpu_int4 import cpu_kind, fallback_mode

    mode = fallback_mode(env)
    native = bool(cpu_kind(env)["native_int4_op"])
    if mode == "force":
        return "fallback"
    if mode == "off":
        return "native" if native else "missing"
    return "native" if native else "fallback"


def _config(path: str) -> dict[str, Any] | None:
    try:
        data = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # a missing or broken config is the checkpoint checks' problem
    return data if isinstance(data, dict) else None


def combination_problems(legs: Iterable[tuple[str, str, dict[str, str]]], models: Mapping[str, str], device: str,
                         env: Mapping[str, str] | None = None) -> list[str]:
    """Why a leg's dtype and a quantized checkpoint cannot run on ``device`` (``cpu`` / ``gpu``).

    ``legs``: (leg name, dtype, {role: model reference}); ``models``: reference -> checkpoint (a hub id
    is not read). One line per checkpoint and dtype, naming the legs."""
    if device != "cpu":
        return []
    found: dict[tuple[str, str, str], list[str]] = {}
    for name, dtype, roles in legs:
        for role, ref in roles.items():
            found.setdefault((role, ref, str(dtype)), []).append(name)
    quant: dict[str, tuple[str, int] | None] = {}
    path_kind: str | None = None
    problems: list[str] = []
    for (role, ref, dtype), names in found.items():
        path = models.get(ref, ref)
        if path not in quant:
            quant[path] = weight_only_bits(_config(path)) if Path(path).is_dir() else None
        q = quant[path]
        if q is None:
            continue
        if path_kind is None:
            try:
                path_kind = cpu_int4_path(env)
            except ValueError as exc:  # a switch of this host's setup: doctor names every one of them
                return [f"{exc} (workbench doctor checks this host's setup)"]
        where = (f"leg(s) {', '.join(names)}: the {role} {ref}{f' ({path})' if path != ref else ''} is a "
                 f"{q[1]}-bit weight-only checkpoint ({q[0]})")
        # a run names the checkpoint by role (--model-path), a single leg by its flag (--draft, --target)
        flag = f"--model-path {ref}=" if ref in models else f"--{role} "
        if path_kind == "missing":
            problems.append(f"{where}, and this CPU's vLLM kernel library has no cpu_gemm_wna16 while "
                            "VLLM_SPEC_INT4_FALLBACK=0 switches the plugin's fallback off: unset it "
                            "(docs/cpu-int4.md), or use an unquantized checkpoint")
        elif path_kind == "native" and dtype == "float32":
            twin = dequantized_twin(path)
            problems.append(f"{where}: dtype float32 with it on CPU has no kernel (vLLM's cpu_gemm_wna16 has no "
                            "float32 path). Use "
                            + (f"the dequantized twin ({flag}{twin})" if twin else
                               f"an unquantized checkpoint ({flag}<folder>)")
                            + (", or -p dtype=bfloat16" if ref in models else ", or --dtype bfloat16"))
    return problems


def kernel_problems(legs: Iterable[tuple[str, Mapping[str, Any]]], device: str,
                    env: Mapping[str, str] | None = None, which=shutil.which) -> list[str]:
    """Spec legs (name, knobs) whose draft kernel this GPU host cannot build; one line per kernel value."""
    if device != "gpu":
        return []
    by_kernel: dict[tuple[str, str], list[str]] = {}
    for name, knobs in legs:
        for knob, (built, _) in BUILT.items():
            if knobs.get(knob) in built:
                by_kernel.setdefault((knob, knobs[knob]), []).append(name)
    if not by_kernel:
        return []
    from vllm_patch.cuda_ext import toolchain_reason

    why = toolchain_reason(env, which)
    return [f"leg(s) {', '.join(names)}: {knob}={value} cannot be built here: {why}. Put the CUDA "
            f"toolkit's nvcc on PATH, or use -p {knob}={BUILT[knob][1]}"
            for (knob, value), names in by_kernel.items()] if why else []


def dequantized_twin(path: str) -> str | None:
    """The dequantized twin the project builds beside an int4 twin (``twin-int4`` -> ``twin-dequant``),
    relative to the working folder where it lies below it; None where there is none."""
    p = Path(path)
    twin = p.parent / "twin-dequant"
    if p.name != "twin-int4" or not (twin / "config.json").is_file():
        return None
    try:
        return str(twin.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(twin)
