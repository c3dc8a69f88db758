"""Tensor parallelism: which sizes a checkpoint and a host allow, checked before an engine starts.

vLLM shards every attention layer's query heads over the ranks (each rank takes
``num_attention_heads / tp``), its key/value heads too (or replicates them when there are fewer
KV heads than ranks: then ``tp`` must be a multiple of them), and Qwen3-VL's vision tower's heads
the same way. vLLM's draft_model drafter runs at the target's tensor-parallel size, so the draft
must shard at that size as well. A size the models or the host cannot take is refused here,
naming the model, the heads and the size, instead of failing inside a worker process.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["head_counts", "tp_problems", "host_devices"]


def head_counts(config: dict[str, Any]) -> dict[str, int]:
    """The head counts of a model config (``config.json`` as a dict) that tensor parallelism divides:
    ``attention`` and ``kv`` of the language model, ``vision`` of the vision tower (when there is one)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    out: dict[str, int] = {}
    heads = text.get("num_attention_heads")
    if isinstance(heads, int):
        out["attention"] = heads
        kv = text.get("num_key_value_heads", heads)
        if isinstance(kv, int):
            out["kv"] = kv
    vision = config.get("vision_config")
    if isinstance(vision, dict) and isinstance(vision.get("num_heads"), int):
        out["vision"] = vision["num_heads"]
    return out


def tp_problems(tp: int, configs: dict[str, dict[str, Any] | None], devices: int | None = None,
                device_kind: str = "device") -> list[str]:
    """Why ``tp`` cannot run these models on this host (empty: it can). ``configs``: role -> config dict
    (None: a hub id, not checked here); ``devices``: how many the host has (None: not checked)."""
    if tp <= 1:
        return []
    problems = []
    if devices is not None and tp > devices:
        problems.append(f"tensor_parallel_size {tp} needs {tp} {device_kind}s, one per rank; this host has "
                        f"{devices}")
    for role, config in configs.items():
        if not config:
            continue
        h = head_counts(config)
        if "attention" in h and h["attention"] % tp:
            problems.append(f"tensor_parallel_size {tp} does not divide the {role}'s {h['attention']} attention "
                            f"heads (use a divisor of {h['attention']})")
        if "kv" in h and h["kv"] % tp and tp % h["kv"]:
            problems.append(f"tensor_parallel_size {tp} and the {role}'s {h['kv']} key/value heads: neither "
                            "divides the other (vLLM shards KV heads, or replicates them when there are fewer "
                            "than ranks)")
        if "vision" in h and h["vision"] % tp:
            problems.append(f"tensor_parallel_size {tp} does not divide the {role}'s vision tower's "
                            f"{h['vision']} heads")
    return problems


def host_devices(on_cuda: bool) -> tuple[int, str]:
    """How many ranks this host can give one device each: CUDA devices, or on CPU the cores this process may
    run on (vLLM's CPU backend runs one worker per rank, each with its own cores)."""
    if on_cuda:
        import torch

        return torch.cuda.device_count(), "CUDA device"
    try:
        return len(os.sched_getaffinity(0)), "CPU core"
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1, "CPU core"
