"""GPU memory planned before an engine or a server starts, not discovered when it dies.

A speculative engine holds the target's and the draft's weights and one KV cache for both (vLLM
allocates the draft's layers in the same pool). vLLM sizes that cache from ``gpu_memory_utilization``
after loading and profiling, and refuses to start when it cannot hold one request of
``max_model_len`` — minutes into a 32B start. The plan does the arithmetic up front from the checkpoints'
configs (the shape profiles have no weights to measure) and the device's memory:

* weights: the safetensors files' sizes where the folder has them, else the parameter count of the
  config (Qwen3-VL text and vision towers, a text-only Qwen3), int4 layers at 4 bits plus their group
  scales and zero points;
* KV: 2 (K and V) × layers × KV heads × head dim × dtype bytes per token, target and draft, for
  ``max_model_len`` tokens × ``max_num_seqs`` sequences (every sequence at the engine's longest);
* overhead: activations of a ``max_num_batched_tokens`` forward, CUDA graphs, the CUDA context and
  allocator slack (a flat 5 GiB plus the MLP's activations);
* the draft's extra layouts: a hybrid ``draft_linear_kernel`` holds the twin's int4 layers once more per
  layout beside vLLM's (``own-cuda+marlin`` one copy, ``own-cuda+marlin+machete`` two; ``LAYOUT_COPIES``).

It then asks vLLM for exactly that KV cache (``kv_cache_memory_bytes``) and a
``gpu_memory_utilization`` that covers the sum, or refuses with the numbers and a way out.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["MemoryPlanError", "MemoryPlan", "model_memory", "plan_memory", "device_memory_bytes", "GiB",
           "plan_for_leg", "memory_problems"]

GiB = 1024 ** 3
MAX_UTILIZATION = 0.94     # what the plan may ask of one device (vLLM's own default is 0.9)
OVERHEAD_BYTES = 5 * GiB   # CUDA context, graphs, allocator slack, sampler buffers (measured 3-4 GiB at 32B)
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "auto": 2, "float32": 4}
# draft_linear_kernel -> copies of the draft's int4 layers held beside vLLM's (vllm_patch.twin_hybrid)
LAYOUT_COPIES = {"own-cuda+marlin": 1, "own-cuda+marlin+machete": 2}


class MemoryPlanError(ValueError):
    """The legs cannot fit the device; the message has the numbers and a way out."""


@dataclass
class ModelMemory:
    weights_bytes: int
    kv_bytes_per_token: int
    intermediate: int
    source: str   # "safetensors" or "config"
    quantized_bytes: int = 0  # of weights_bytes, the int4 layers' (packed weights, scales, zero points)


def _text_cfg(cfg: dict) -> dict:
    return cfg.get("text_config") or cfg


def _quant_bits(cfg: dict) -> tuple[float, int] | None:
    """(bits, group size) of a compressed-tensors / AWQ / GPTQ int4 config, or None (unquantized)."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    if "config_groups" in q:
        w = next(iter(q["config_groups"].values())).get("weights") or {}
        return float(w.get("num_bits", 4)), int(w.get("group_size") or 128)
    return float(q.get("bits", q.get("w_bit", 4))), int(q.get("group_size", q.get("q_group_size", 128)))


def _vision_params(v: dict) -> int:
    if not v:
        return 0
    h, i, depth = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["depth"])
    merge = h * int(v.get("spatial_merge_size", 2)) ** 2
    out = int(v.get("out_hidden_size", h))
    mergers = 1 + len(v.get("deepstack_visual_indexes") or [])
    patch = 3 * int(v.get("temporal_patch_size", 2)) * int(v.get("patch_size", 16)) ** 2 * h
    return depth * (4 * h * h + 2 * h * i) + mergers * (merge * merge + merge * out) + patch


def model_memory(folder: str | Path, dtype: str = "bfloat16") -> ModelMemory:
    """Weights and KV per token of one checkpoint folder (its config; its safetensors when present)."""
    folder = Path(folder)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise MemoryPlanError(f"memory plan: cannot read {folder / 'config.json'}: {exc}") from None
    t = _text_cfg(cfg)
    hidden, layers = int(t["hidden_size"]), int(t["num_hidden_layers"])
    heads, kv_heads = int(t["num_attention_heads"]), int(t.get("num_key_value_heads") or t["num_attention_heads"])
    head_dim = int(t.get("head_dim") or hidden // heads)
    inter, vocab = int(t["intermediate_size"]), int(t["vocab_size"])
    elt = _DTYPE_BYTES.get(dtype, 2)
    kv = 2 * layers * kv_heads * head_dim * elt
    linear = layers * (hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter)
    q = _quant_bits(cfg)
    # packed weights, a bf16 scale and a packed zero point per group of each output row
    qbytes = 0 if q is None else int(linear * (q[0] / 8 + 2 / q[1] + 0.5 / q[1]))
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return ModelMemory(sum(f.stat().st_size for f in files), kv, inter, "safetensors", qbytes)
    tied = bool(cfg.get("tie_word_embeddings", t.get("tie_word_embeddings", False)))
    dense = vocab * hidden * (1 if tied else 2) + _vision_params(cfg.get("vision_config") or {})
    wbytes = (linear + dense) * elt if q is None else qbytes + dense * 2
    return ModelMemory(int(wbytes), kv, inter, "config", qbytes)


@dataclass
class MemoryPlan:
    device_bytes: int
    weights_bytes: int
    kv_bytes_per_token: int
    kv_tokens: int
    kv_bytes: int
    overhead_bytes: int
    needed_bytes: int
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int
    sources: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (f"weights {self.weights_bytes / GiB:.1f} GiB + KV {self.kv_bytes / GiB:.1f} GiB "
                f"({self.kv_tokens} tokens × {self.kv_bytes_per_token / 1024:.0f} KiB) + overhead "
                f"{self.overhead_bytes / GiB:.1f} GiB = {self.needed_bytes / GiB:.1f} GiB of "
                f"{self.device_bytes / GiB:.1f} GiB (gpu_memory_utilization {self.gpu_memory_utilization})")


def plan_memory(models: dict[str, str | Path], max_model_len: int, max_num_seqs: int, device_bytes: int,
                dtype: str = "bfloat16", max_num_batched_tokens: int | None = None,
                tensor_parallel_size: int = 1, where: str = "", cap: float | None = None,
                draft_linear_kernel: str = "auto") -> MemoryPlan:
    """The plan for one engine holding ``models`` (role -> folder: the target and, for a spec leg, its draft;
    ``draft_linear_kernel``: the draft's extra layouts, ``LAYOUT_COPIES``).

    Under tensor parallelism each device holds 1/tp of weights and KV. Raises MemoryPlanError when it
    cannot fit ``cap`` (the leg's ``gpu_memory_utilization`` knob, at most ``MAX_UTILIZATION``) of
    ``device_bytes``.
    """
    cap = min(MAX_UTILIZATION, float(cap)) if cap else MAX_UTILIZATION
    mems = {role: model_memory(path, dtype) for role, path in models.items()}
    tp = max(1, int(tensor_parallel_size))
    copies = LAYOUT_COPIES.get(draft_linear_kernel, 0) if "draft" in mems else 0
    extra = copies * mems["draft"].quantized_bytes if copies else 0
    weights = (sum(m.weights_bytes for m in mems.values()) + extra) // tp
    per_token = sum(m.kv_bytes_per_token for m in mems.values()) // tp
    block = 16
    tokens = max_num_seqs * (math.ceil(max_model_len / block) + 1) * block
    kv = tokens * per_token
    batched = max_num_batched_tokens or max(8192, max_model_len)
    inter = max(m.intermediate for m in mems.values())
    overhead = OVERHEAD_BYTES + batched * inter * 2 * 2 * 2 // tp  # gate_up out and its SiLU·mul, bf16
    needed = weights + kv + overhead
    budget = int(device_bytes * cap)
    pre = f"{where}: " if where else ""
    if needed > budget:
        free_for_kv = budget - weights - overhead
        fit_seqs = max(0, free_for_kv // max(1, (math.ceil(max_model_len / block) + 1) * block * per_token))
        fit_len = max(0, free_for_kv // max(1, max_num_seqs * per_token) // block * block - block)
        way = (f"lower max_num_seqs to {fit_seqs} or max_model_len to {fit_len}" if free_for_kv > 0
               else "the weights alone do not fit: use tensor_parallel_size > 1 or a larger device")
        raise MemoryPlanError(
            f"{pre}does not fit the device: weights {weights / GiB:.1f} GiB"
            + (f" (the draft's int4 layers {copies + 1} times: draft_linear_kernel {draft_linear_kernel})"
               if copies else "")
            + f" + KV cache {kv / GiB:.1f} GiB "
            f"(max_model_len {max_model_len} × max_num_seqs {max_num_seqs} = {tokens} tokens × "
            f"{per_token / 1024:.0f} KiB) + overhead {overhead / GiB:.1f} GiB = {needed / GiB:.1f} GiB > "
            f"{cap:.0%} of {device_bytes / GiB:.1f} GiB (gpu_memory_utilization {cap}); {way}")
    util = min(cap, math.ceil((needed / device_bytes + 0.01) * 100) / 100)
    return MemoryPlan(device_bytes=int(device_bytes), weights_bytes=int(weights), kv_bytes_per_token=int(per_token),
                      kv_tokens=int(tokens), kv_bytes=int(kv), overhead_bytes=int(overhead), needed_bytes=int(needed),
                      gpu_memory_utilization=util, kv_cache_memory_bytes=int(kv),
                      sources={r: m.source for r, m in mems.items()})


def device_memory_bytes() -> int | None:
    """Total memory of the first CUDA device (nvidia-smi, without a CUDA context), or None."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20)
            first = out.stdout.strip().splitlines()[0]
            return int(float(first)) * 1024 * 1024
        except (OSError, subprocess.SubprocessError, IndexError, ValueError):
            pass
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    except Exception:
        pass
    return None


def plan_for_leg(cfg, where: str = "") -> MemoryPlan | None:
    """The plan of one leg (``workbench.leg.LegConfig``) on this host's CUDA device, or None without one."""
    device = device_memory_bytes()
    if device is None:
        return None
    models = {"target": cfg.target, **({"draft": cfg.draft} if cfg.draft else {})}
    return plan_memory(models, cfg.max_model_len, cfg.max_num_seqs, device, dtype=cfg.dtype,
                       max_num_batched_tokens=cfg.max_num_batched_tokens,
                       tensor_parallel_size=cfg.tensor_parallel_size, where=where or f"leg {cfg.leg}",
                       cap=cfg.gpu_memory_utilization,
                       draft_linear_kernel=str(getattr(cfg.knobs, "draft_linear_kernel", "auto")))


def memory_problems(p, models: dict[str, str], bad_models: set[str]) -> list[str]:
    """On a CUDA host: the legs whose weights and KV cache cannot fit the device (``workbench.memory_plan``),
    before any engine or server starts. The cost ladder sizes its own engines (ladder_engine)."""
    from workbench.knobs import parse_concurrencies

    if p.profile.device != "gpu" or p.experiment.runner == "ladder":
        return []
    device = device_memory_bytes()
    if device is None:
        return []
    out = []
    for l in p.legs:
        roles = [l.model] + ([l.draft] if l.kind == "spec" and l.draft else [])
        if any(r in bad_models or not Path(models.get(r, "")).is_dir() for r in roles):
            continue
        k = l.knobs
        concs = parse_concurrencies(k.get("concurrencies"))
        try:
            plan_memory({r: models[r] for r in roles}, int(k["max_model_len"]),
                        max(concs) if concs else int(k["max_num_seqs"]), device,
                        dtype=str(k.get("dtype") or "auto"), tensor_parallel_size=int(k.get("tensor_parallel_size") or 1),
                        where=f"leg {l.name}", cap=k.get("gpu_memory_utilization"),
                        draft_linear_kernel=str(k.get("draft_linear_kernel") or "auto"))
        except MemoryPlanError as exc:
            out.append(str(exc))
    return out
