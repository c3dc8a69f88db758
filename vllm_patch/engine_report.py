"""The engine report: ``engine-<pid>.json``, what an engine process actually runs with.

The knobs as the engine read them from its environment (not as a leg asked), and what was built:
the drafter and its graphs (written by the twin proposer and the runner hooks), weight bytes,
attention backends and linear kernels of target and draft (:func:`build_facts`, once the KV cache
is initialised), the CPU int4 path. The workbench reads these files back into every leg summary.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from .knobs import EngineKnobs


class EngineReport:
    """Writes ``engine-<pid>.json`` into the report directory.

    The workbench reads these back to state the knobs in effect as seen inside
    the engine, not as requested.
    """

    def __init__(self, knobs: EngineKnobs):
        self.knobs = knobs
        self.facts: dict[str, Any] = {"pid": os.getpid(), "knobs": knobs.as_dict()}
        self._lock = threading.Lock()  # the engine thread and a worker RPC may both update

    def update(self, **facts: Any) -> None:
        with self._lock:
            self.facts.update(facts)
            if not self.knobs.report_dir:
                return
            os.makedirs(self.knobs.report_dir, exist_ok=True)
            path = os.path.join(self.knobs.report_dir, f"engine-{os.getpid()}.json")
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.facts, f, indent=1, default=str)
            os.replace(tmp, path)


def _linear_kernels(model) -> dict[str, int]:
    """How many linear layers of a model run on which method / kernel."""
    counts: dict[str, int] = {}
    if model is None:
        return counts
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(method, "apply"):
            continue
        name = type(method).__name__
        if "Embedding" in type(module).__name__ or "Embedding" in name or "KVCache" in name:
            continue
        scheme = getattr(module, "scheme", None)
        kernel = getattr(scheme, "kernel", None)
        if kernel is not None:
            name = f"{type(scheme).__name__}/{type(kernel).__name__}"
        elif scheme is not None:
            name = type(scheme).__name__
        counts[name] = counts.get(name, 0) + 1
    return counts


def _attention_backends(runner, draft_layers: set[str]) -> dict[str, list[str]]:
    """Attention backend of the target's and the draft's decoder layers."""
    out: dict[str, set[str]] = {"target": set(), "draft": set()}
    ctx = getattr(runner.compilation_config, "static_forward_context", {}) or {}
    for name, layer in ctx.items():
        get_backend = getattr(layer, "get_attn_backend", None)
        if get_backend is None:
            continue
        try:
            label = get_backend().get_name()
        except Exception:
            continue
        fa = getattr(getattr(layer, "impl", None), "vllm_flash_attn_version", None)
        if fa:
            label = f"{label}/FA{fa}"
        out["draft" if name in draft_layers else "target"].add(label)
    return {k: sorted(v) for k, v in out.items()}


def _weight_bytes(model) -> int | None:
    if model is None:
        return None
    tensors = list(model.parameters()) + list(model.buffers())
    return int(sum(t.numel() * t.element_size() for t in tensors))


def _target_graphs(runner) -> dict[str, Any]:
    """The target's CUDA-graph mode as the engine runs it, and whether vLLM's batch-size gamma schedule is on:
    vLLM 0.27.1's V1 runner turns FULL target graphs into PIECEWISE ones under that schedule, which costs
    the target's step where it would otherwise replay one FULL graph."""
    from .target_graphs import schedule_on

    mode = getattr(getattr(runner, "compilation_config", None), "cudagraph_mode", None)
    return {"target_cudagraph_mode": getattr(mode, "name", None if mode is None else str(mode)),
            "gamma_schedule_dynamic": schedule_on(getattr(runner, "vllm_config", None)),
            # knob target_graphs=full: the FULL graph keys of one-token steps added beside vLLM's (target_graphs)
            "target_single_token_graphs": int(getattr(runner, "_twin_single_token_graphs", 0))}


def build_facts(runner) -> dict[str, Any]:
    from vllm.platforms import current_platform

    from . import cpu_int4

    drafter = getattr(runner, "drafter", None)
    draft_model = getattr(drafter, "model", None) if drafter is not None else None
    draft_layers = set(getattr(drafter, "_draft_attn_layer_names", set()) or set())
    facts: dict[str, Any] = {
        "weight_bytes": {"target": _weight_bytes(getattr(runner, "model", None)), "draft": _weight_bytes(draft_model)},
        "attention_backend": _attention_backends(runner, draft_layers),
        "linear_kernels": {
            "target": _linear_kernels(getattr(runner, "model", None)),
            "draft": _linear_kernels(draft_model),
        },
        **_target_graphs(runner),
    }
    if current_platform.is_cpu():
        kernels = facts["linear_kernels"]["target"] | facts["linear_kernels"]["draft"]
        int4_layers = [k for k in kernels if "WNA16" in k]
        facts["cpu_vector_extensions"] = cpu_int4.cpu_vector_extensions()
        facts["cpu_kernel_library"] = cpu_int4.cpu_kernel_library()
        facts["int4_native_op"] = cpu_int4.native_wna16_available()
        facts["int4_path"] = (
            ("fallback" if any(cpu_int4.KERNEL_NAME in k for k in int4_layers) else "native")
            if int4_layers else None
        )
    else:
        facts["int4_path"] = None
        facts["gpu"] = str(current_platform.get_device_name())
    return facts
