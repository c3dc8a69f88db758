"""The drafter's CUDA-graph modes: which one to build, the FULL single-token graphs' sizes and capture.

``draft_cudagraph_mode`` picks how the twin's forward passes run on CUDA: ``piecewise`` (vLLM's own
drafter graphs), ``full`` (one FULL graph per padded batch size for the gamma-1 single-token steps, the
first pass staying piecewise) or ``none``. The FULL graphs are the drafter's own: keyed by padded batch
size, captured at the first capture-time dummy run, largest first, and known to exist only through the
graph wrapper's own entries.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import CUDAGraphMode
from vllm.v1.spec_decode.utils import PADDING_SLOT_ID

GRAPH_MODES = ("none", "piecewise", "full")
# FULL single-token graphs of the drafter are exact on the H200 (tests/test_gpu.py,
# test_draft_cudagraph_modes_exact; results/cuda-verify/20261201T1200Z-h200-077f25d) and faster than the
# piecewise ones at every measured cell (E16, one engine timing both: 32B single-token step 9.5 ms vs
# 9.6-14.5, 8B 3.6 ms vs 3.7-9.0; results/E16/20261201T151639Z-67f5442a, .../20261201T152639Z-c54d599a):
# ``auto`` builds them on CUDA.
FULL_VERIFIED = True


def resolve_graph_mode(requested: str, draft_cudagraph: bool, on_cuda: bool,
                       full_verified: bool = FULL_VERIFIED) -> tuple[str, str]:
    """The drafter's graph mode to build (``none`` / ``piecewise`` / ``full``) and why.

    ``draft_cudagraph`` false means no drafter graphs, whatever the mode; a CPU host has no CUDA
    graphs at all. Whether the attention backend allows FULL decode graphs is decided later
    (:meth:`TwinDraftProposer.initialize_cudagraph_keys`), when the backends are known.
    """
    if not on_cuda:
        return "none", "no CUDA graphs on this platform"
    if not draft_cudagraph:
        return "none", "draft_cudagraph is off"
    if requested == "auto":
        return ("full", "auto: FULL decode graphs") if full_verified else (
            "piecewise", "auto: vLLM's piecewise drafter graphs (FULL not verified on this build)")
    return requested, "requested"



def full_decode_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes of the drafter's FULL single-token graphs: 1, 2, 4, then every 8, up to
    ``max_batch`` (included, so every batch the scheduler can form has a graph)."""
    if max_batch < 1:
        return []
    sizes = {s for s in (1, 2, 4) if s <= max_batch} | set(range(8, max_batch + 1, 8)) | {max_batch}
    return sorted(sizes)


def padded_size(batch: int, captured) -> int | None:
    """The smallest captured size that holds ``batch`` requests, or None (then no FULL replay)."""
    fits = [s for s in captured if s >= batch]
    return min(fits) if fits else None


def full_decode_support(proposer) -> tuple[bool, str]:
    """Whether every draft attention layer's backend can replay a FULL graph of one-token decodes."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.config import get_layers_from_vllm_config

    layers = get_layers_from_vllm_config(proposer.vllm_config, AttentionLayerBase)
    names = sorted(getattr(proposer, "_draft_attn_layer_names", ()) or ())
    if not names:
        return False, "no draft attention layers found"
    for name in names:
        layer = layers[name]
        builder = layer.get_attn_backend().get_builder_cls()
        support = builder.get_cudagraph_support(proposer.vllm_config, layer.get_kv_cache_spec(proposer.vllm_config))
        if support.value < AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE.value:
            return False, f"{layer.get_attn_backend().get_name()} has no FULL decode graphs ({support.name})"
    return True, "ok"


def capture_full_decode(proposer, n: int) -> None:
    """Warm up, then capture the FULL graph of one single-token step of ``n`` (padded) requests.

    Every tensor the graph reads is one the loop later writes in place: the input buffers,
    ``proposer.arange`` (query starts), the persistent sequence lengths, the runner's block table
    and the drafter's slot-mapping buffer.
    """
    from vllm.forward_context import BatchDescriptor, set_forward_context
    from vllm.v1.attention.backend import CommonAttentionMetadata

    seq_lens = proposer._twin_full["seq_lens"][:n]
    seq_lens.fill_(1)
    # the runner's block table of the draft's KV group: the tensor the loop's metadata reads
    block_table = proposer._twin["runner"].input_batch.block_table[proposer.kv_cache_gid].get_device_tensor(n)
    cad = CommonAttentionMetadata(
        query_start_loc=proposer.arange[: n + 1],
        query_start_loc_cpu=torch.from_numpy(proposer.token_arange_np[: n + 1]).clone(),
        seq_lens=seq_lens, num_reqs=n, num_actual_tokens=n, max_query_len=1,
        max_seq_len=proposer.max_model_len, block_table_tensor=block_table,
        slot_mapping=proposer._slot_mapping_buffer[:n], causal=True,
        _seq_lens_cpu=torch.ones(n, dtype=torch.int32),
        _num_computed_tokens_cpu=torch.zeros(n, dtype=torch.int32),
    )
    proposer._slot_mapping_buffer[:n].fill_(PADDING_SLOT_ID)  # capture writes no KV entry
    per_layer: dict[str, Any] = {}
    for group in proposer.draft_attn_groups:
        md = group.get_metadata_builder().build_for_cudagraph_capture(cad)
        per_layer.update({name: md for name in group.layer_names})
    kwargs = {"positions": proposer._get_positions(n)}
    if proposer.supports_mm_inputs:
        kwargs.update(input_ids=None, inputs_embeds=proposer.inputs_embeds[:n])
    else:
        kwargs.update(input_ids=proposer.input_ids[:n], inputs_embeds=None)
    for mode in (CUDAGraphMode.NONE, CUDAGraphMode.FULL):  # warm-up, then capture
        with set_forward_context(per_layer, proposer.vllm_config, num_tokens=n, cudagraph_runtime_mode=mode,
                                 batch_descriptor=BatchDescriptor(num_tokens=n),
                                 slot_mapping=proposer._get_slot_mapping(n)):
            proposer.model(**kwargs)


def full_captured(model) -> set[int]:
    """Batch sizes whose FULL single-token graph exists now. The wrapper's own entries decide:
    vLLM's CUDA-graph memory profile captures graphs and then clears them all, and a replay key
    whose graph is gone would make the wrapper try to capture in the middle of serving."""
    entries = getattr(model, "concrete_cudagraph_entries", None) or {}
    return {desc.num_tokens for desc, entry in entries.items() if entry.cudagraph is not None}
