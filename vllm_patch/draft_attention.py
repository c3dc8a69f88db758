"""``draft_attention=twin``: the draft's single-token decode steps on the project's decode attention (issue 37).

vLLM 0.27.1 runs the draft's attention on its FlashAttention backend, FA3 on Hopper: two kernels a layer in a
single-token step (split-KV and combine), 12 µs a layer at batch 1 on an H100 at the 8B shape
(``benchmarks/draft_profile.py``). With this knob each draft layer's ``FlashAttentionImpl`` keeps its forward for
everything but a decode-only call (``max_query_len == 1``, no cascade): there ``vllm_patch.twin_attention``'s
one-launch kernel reads the same paged cache (the KV write stays vLLM's ``do_kv_cache_update``, which runs before
the attention op). The first pass (γ + 1 tokens a request) and every prefill stay on FA3.

The kernel's split count is fixed per batch size (``twin_attention.splits_for`` at the model's longest sequence),
and it reads the lengths on the device, so a drafter CUDA graph captured at one length replays at any other. One
workspace (split partials, arrival counters the kernel leaves at zero) serves every layer, made here before any
capture for the drafter's largest batch. Only the draft is changed: the target verifies every drafted token, so
the strict tier's output is the target's whatever the draft's attention rounds.

A layer keeps vLLM's forward where the kernel does not fit it (another backend, head size other than 128, a
quantized KV cache, ALiBi, a sliding window, soft cap, sinks, decode context parallelism, a dtype other than
bf16, a head grouping other than 1 / 2 / 4 / 8); the engine report names why (``draft_attention_refused``).
"""

from __future__ import annotations

import types

import torch

from . import twin_attention

def why_not(impl, dtype: torch.dtype) -> str | None:
    """Why a draft layer's attention ``impl`` keeps vLLM's forward under ``draft_attention=twin``, or None."""
    name = type(impl).__name__
    if name != "FlashAttentionImpl":
        return f"backend {name}, not FlashAttentionImpl"
    if getattr(impl, "attn_type", "decoder") != "decoder":  # vLLM's AttentionType is a str enum
        return f"attention type {impl.attn_type}"
    if impl.head_size != twin_attention.HEAD_DIM:
        return f"head size {impl.head_size}, not {twin_attention.HEAD_DIM}"
    if impl.num_heads % impl.num_kv_heads or impl.num_heads // impl.num_kv_heads not in twin_attention.GROUPS:
        return f"{impl.num_heads} query heads over {impl.num_kv_heads} KV heads"
    if str(impl.kv_cache_dtype) not in ("auto", "bfloat16"):
        return f"KV cache dtype {impl.kv_cache_dtype}"
    if dtype != torch.bfloat16:
        return f"model dtype {str(dtype).replace('torch.', '')}, the kernel is bf16"
    if impl.alibi_slopes is not None or tuple(impl.sliding_window) != (-1, -1) or impl.logits_soft_cap \
            or getattr(impl, "sinks", None) is not None:
        return "ALiBi, a sliding window, a soft cap or sinks"
    if getattr(impl, "dcp_world_size", 1) > 1:
        return "decode context parallelism"
    return None


def workspace_size(max_batch: int, q_heads: int, kv_heads: int, max_len: int, sms: int) -> int:
    """Split partials (rows of 128) the largest launch of a batch up to ``max_batch`` needs."""
    return max(b * q_heads * twin_attention.splits_for(b, kv_heads, max_len, sms) for b in range(1, max_batch + 1))


def make_state(max_batch: int, q_heads: int, kv_heads: int, max_len: int, device, kernel=None, report=None) -> dict:
    """What every wrapped layer shares: the workspace, the split rule's inputs, and the kernel (injectable for the
    CPU tests; ``twin_attention.decode_attention`` otherwise)."""
    dev = torch.device(device)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
    rows = workspace_size(max_batch, q_heads, kv_heads, max_len, sms)
    ws = {"o": torch.empty(rows * twin_attention.HEAD_DIM, dtype=torch.float32, device=dev),
          "ml": torch.empty(rows * 2, dtype=torch.float32, device=dev),
          "counters": torch.zeros(max(1, max_batch * kv_heads), dtype=torch.int32, device=dev)}
    return {"ws": ws, "max_batch": max_batch, "max_len": max_len, "sms": sms,
            "kernel": kernel or twin_attention.decode_attention, "splits": {}, "ran": False, "report": report}


def _decode_only(md, output_scale, output_block_scale) -> bool:
    return (md is not None and md.max_query_len == 1 and not md.use_cascade and md.causal is True
            and output_scale is None and output_block_scale is None
            and getattr(md, "mm_prefix_range_tensor", None) is None)


def _forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
             output_block_scale=None):
    """FlashAttentionImpl.forward with the decode-only calls on the twin kernel."""
    st = self._twin_attention
    md = attn_metadata
    n = md.num_actual_tokens if md is not None else 0
    if not _decode_only(md, output_scale, output_block_scale) or not 0 < n <= st["max_batch"]:
        return self._twin_vllm_forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                       output_scale=output_scale, output_block_scale=output_block_scale)
    k_cache, v_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)  # [blocks, block, Hkv, 128] views
    splits = st["splits"].get(n)
    if splits is None:
        splits = st["splits"][n] = twin_attention.splits_for(n, self.num_kv_heads, st["max_len"], st["sms"])
    q = query[:n].view(n, self.num_heads, self.head_size)
    out = output[:n].view(n, self.num_heads, self.head_size)
    st["kernel"](q, k_cache, v_cache, md.block_table, md.seq_lens, self.scale, splits, out=out, workspace=st["ws"])
    if not st["ran"]:  # once: a decode-only call reached the kernel (run, or captured into a drafter graph)
        st["ran"] = True
        if st["report"] is not None:
            st["report"](draft_attention_ran=True)
    return output


def install(model, requested: str, max_batch: int, max_len: int, dtype: torch.dtype, device, kernel=None,
            report=None) -> dict:
    """Wrap the forward of every draft attention layer of ``model`` the kernel fits (``requested == "twin"``); the
    engine report's ``draft_attention`` (what the layers run: twin, vllm or mixed), ``draft_attention_layers``
    (layers wrapped) and ``draft_attention_refused`` (why the others were not, counted). ``report`` (the engine
    report's update) later learns ``draft_attention_ran`` at the first decode-only call that reached the kernel."""
    out = {"draft_attention_requested": requested, "draft_attention": "vllm", "draft_attention_layers": 0,
           "draft_attention_refused": {}, "draft_attention_ran": False}
    if requested != "twin" or model is None:
        return out
    layers = [m for m in model.modules() if hasattr(m, "impl") and hasattr(m, "kv_cache") and hasattr(m, "layer_name")]
    refused: dict[str, int] = {}
    wrap = []
    heads = None
    for layer in layers:
        why = why_not(layer.impl, dtype)
        if why is None and heads not in (None, (layer.impl.num_heads, layer.impl.num_kv_heads)):
            why = f"head counts {layer.impl.num_heads}/{layer.impl.num_kv_heads}, not the first layer's {heads}"
        if why is None:
            heads = (layer.impl.num_heads, layer.impl.num_kv_heads)
            wrap.append(layer.impl)
        else:
            refused[why] = refused.get(why, 0) + 1
    if wrap:
        first = wrap[0]
        state = make_state(max_batch, first.num_heads, first.num_kv_heads, max_len, device, kernel, report)
        for impl in wrap:
            impl._twin_attention = state
            impl._twin_vllm_forward = impl.forward
            impl.forward = types.MethodType(_forward, impl)
    out.update(draft_attention=("twin" if not refused else "mixed") if wrap else "vllm",
               draft_attention_layers=len(wrap), draft_attention_refused=refused)
    if not wrap:
        said = "; ".join(f"{k} ({v})" for k, v in refused.items()) or "the draft has no attention layer"
        raise ValueError(f"draft_attention=twin: none of the draft's {len(layers)} attention layers can run the "
                         f"twin decode kernel: {said}. Use draft_attention=vllm")
    return out
