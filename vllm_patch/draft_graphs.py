"""The drafter's CUDA-graph modes: which one to build, the FULL graphs' sizes, keys and capture.

``draft_cudagraph_mode`` picks how the twin's forward passes run on CUDA: ``piecewise`` (vLLM's own
drafter graphs), ``full`` (one FULL graph per padded batch size for the gamma-1 single-token steps, the
first pass staying piecewise), ``full_all`` (``full``, and the first pass of a decode step too: one FULL
graph per padded batch size of ``gamma + 2`` tokens a request, replayed whenever every request of the
batch verified the same number of tokens) or ``none``. The FULL graphs are the drafter's own: keyed by
padded batch size (single-token steps: ``BatchDescriptor(num_tokens=n)``; first passes:
``BatchDescriptor(num_tokens=n * q, num_reqs=n, uniform=True)``, so the two kinds never share a key),
captured at the first capture-time dummy run, largest first, and known to exist only through the graph
wrapper's own entries.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.config import CUDAGraphMode
from vllm.v1.spec_decode.utils import PADDING_SLOT_ID

GRAPH_MODES = ("none", "piecewise", "full", "full_all")  # each one's graphs include the previous one's
# FULL single-token graphs of the drafter are exact on the H200 (tests/test_gpu.py,
# test_draft_cudagraph_modes_exact; results/cuda-verify/20261201T1200Z-h200-077f25d) and faster than the
# piecewise ones at every measured cell (E16, one engine timing both: 32B single-token step 9.5 ms vs
# 9.6-14.5, 8B 3.6 ms vs 3.7-9.0; results/E16/20261201T151639Z-67f5442a, .../20261201T152639Z-c54d599a):
# ``auto`` builds them on CUDA.
FULL_VERIFIED = True
# FULL first passes too (``full_all``): exact in fp32 at concurrency 1 and 8 and drafting as piecewise
# in bf16 at concurrency 1 on the H200 (results/cuda-verify/20261203T0455Z-h200-25e5115), and ahead of
# ``full`` at every E16 cell measured side by side in one engine (32B batch 1: c 0.511 vs 0.520; 8B
# batch 1 / 4: 0.708 / 0.733 vs 0.723 / 0.738; results/E16/20261203T075405Z-68ff8b06,
# .../20261203T080243Z-73e95d40): ``auto`` builds them on CUDA.
FULL_ALL_VERIFIED = True
# Padded replays: a batch of n requests replaying the graph of a larger captured size. With FA3's
# ahead-of-time scheduling on (full_pass_metadata), such replays hung the H200 at concurrency 8 in bf16
# (results/cuda-verify/20261203T0805Z-h200-a2d746d: 5 requests in the graph of 8), the scheduler metadata
# having been built for n requests and the captured kernels launched for the padded batch. Built for the
# padded batch (padded_metadata), they are exact in fp32 and draft what piecewise drafts in bf16, for the
# single-token steps and the first pass, with batches of 2-7 replaying the graph of 8
# (results/cuda-verify/20261203T1453Z-h200-1e43d86), so they are on; since every size up to DENSE_SIZES
# has a graph of its own, only larger batches pad. ``VLLM_SPEC_FULL_PADDED_REPLAY=0`` turns them off
# (then a batch without a graph of its exact size runs piecewise).
PADDED_REPLAY_ENV = "VLLM_SPEC_FULL_PADDED_REPLAY"


def resolve_graph_mode(requested: str, draft_cudagraph: bool, on_cuda: bool,
                       full_verified: bool = FULL_VERIFIED,
                       full_all_verified: bool = FULL_ALL_VERIFIED) -> tuple[str, str]:
    """The drafter's graph mode to build (``none`` / ``piecewise`` / ``full`` / ``full_all``) and why.

    ``draft_cudagraph`` false means no drafter graphs, whatever the mode; a CPU host has no CUDA
    graphs at all. Whether the attention backend allows FULL decode graphs is decided later
    (:meth:`TwinDraftProposer.initialize_cudagraph_keys`), when the backends are known.
    """
    if not on_cuda:
        return "none", "no CUDA graphs on this platform"
    if not draft_cudagraph:
        return "none", "draft_cudagraph is off"
    if requested == "auto":
        if full_verified and full_all_verified:
            return "full_all", "auto: FULL graphs for the first pass and the single-token steps"
        return ("full", "auto: FULL decode graphs") if full_verified else (
            "piecewise", "auto: vLLM's piecewise drafter graphs (FULL not verified on this build)")
    return requested, "requested"



# Every batch of up to this many requests has a FULL graph of its own size, so that it replays without
# padding (see PADDED_REPLAY_ENV); beyond it, every multiple of 8 has one. A drafter graph is small: the
# extra captures cost seconds at engine start, and vLLM's graph pool shares their memory.
# ``VLLM_SPEC_FULL_DENSE_SIZES=<n>`` changes the bound (1: graphs of 1, then every 8, so that a
# concurrency-8 run pads its batches of 2-7: how the GPU suite exercises padded replays).
DENSE_SIZES = 32
DENSE_SIZES_ENV = "VLLM_SPEC_FULL_DENSE_SIZES"


def dense_sizes() -> int:
    """The bound of exact-size FULL graphs (``VLLM_SPEC_FULL_DENSE_SIZES``, default ``DENSE_SIZES``)."""
    value = os.environ.get(DENSE_SIZES_ENV, "").strip()
    if not value:
        return DENSE_SIZES
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{DENSE_SIZES_ENV}={value!r}: expected a whole number of requests, at least 1")
    return int(value)


def full_decode_sizes(max_batch: int, dense: int = DENSE_SIZES) -> list[int]:
    """Batch sizes of the drafter's FULL graphs: every size up to ``dense``, then every 8, up to
    ``max_batch`` (included, so every batch the scheduler can form fits one)."""
    if max_batch < 1:
        return []
    sizes = set(range(1, min(dense, max_batch) + 1)) | set(range(8, max_batch + 1, 8)) | {max_batch}
    return sorted(sizes)


def padded_size(batch: int, captured) -> int | None:
    """The smallest captured size that holds ``batch`` requests, or None (then no FULL replay)."""
    fits = [s for s in captured if s >= batch]
    return min(fits) if fits else None


def padded_replays() -> bool:
    """Whether a FULL graph may replay a smaller batch, padded (on; ``VLLM_SPEC_FULL_PADDED_REPLAY=0``: off)."""
    value = os.environ.get(PADDED_REPLAY_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{PADDED_REPLAY_ENV}={value!r}: expected 0 or 1")
    return value == "1"


def replay_size(batch: int, captured, padded: bool | None = None) -> int | None:
    """The captured size a FULL replay of ``batch`` requests uses, or None (no FULL replay): the smallest
    that holds it with padded replays on, else ``batch`` itself when a graph of that size exists."""
    if padded_replays() if padded is None else padded:
        return padded_size(batch, captured)
    return batch if batch in set(captured) else None


def full_state(proposer, n: int, cap: int) -> dict:
    """The single-token FULL graphs' state for up to ``n`` requests (graphs up to ``cap``); the report
    says whether padded replays are on."""
    padded = padded_replays()  # read once: the dispatch of every propose consults it
    sizes = full_decode_sizes(min(n, cap), dense_sizes())
    proposer._twin_engine.report.update(draft_full_padded_replay=padded, draft_full_graph_sizes=sizes)
    # Persistent sequence lengths: a FULL graph reads the tensor it was captured with.
    return {"seq_lens": torch.zeros(n, dtype=torch.int32, device=proposer.device),
            "sizes": sizes, "padded": padded}


def note_padded(proposer, batch: int, size: int, what: str) -> None:
    """The report learns, once per kind of pass (``single`` / ``first``), when the dispatch replays a FULL
    graph for a smaller batch, padded: ``draft_full_padded_replays_ran`` (whether the padded path was exercised at all)."""
    if size <= batch:
        return
    ran = proposer._twin_engine.report.facts.get("draft_full_padded_replays_ran") or []
    if what not in ran:
        proposer._twin_engine.report.update(draft_full_padded_replays_ran=sorted([*ran, what]))


def full_decode_support(proposer, uniform_batch: bool = False) -> tuple[bool, str]:
    """Whether every draft attention layer's backend can replay a FULL graph of one-token decodes
    (``uniform_batch``: of decodes of several tokens a request, the first pass of ``full_all``)."""
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
        need = AttentionCGSupport.UNIFORM_BATCH if uniform_batch else AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        if support.value < need.value:
            what = "uniform multi-token" if uniform_batch else "decode"
            return False, f"{layer.get_attn_backend().get_name()} has no FULL {what} graphs ({support.name})"
    return True, "ok"


def first_pass_key(n: int, q: int):
    """The FULL graph key of a first pass of ``n`` (padded) requests of ``q`` tokens each."""
    from vllm.forward_context import BatchDescriptor

    return BatchDescriptor(num_tokens=n * q, num_reqs=n, uniform=True)


def capture_full_decode(proposer, n: int, q: int = 1) -> None:
    """Warm up, then capture the FULL graph of one drafter pass of ``n`` (padded) requests of ``q`` tokens
    each: a single-token step (``q`` 1) or a first pass (``q`` = gamma + 2, keyed by :func:`first_pass_key`).

    Every tensor the graph reads is one the loop later writes in place: the input buffers, the query
    starts (``proposer.arange`` for single-token steps, the first pass's own constant buffer), the
    persistent sequence lengths, the runner's block table and the drafter's slot-mapping buffer.
    """
    from vllm.forward_context import BatchDescriptor, set_forward_context
    from vllm.v1.attention.backend import CommonAttentionMetadata

    state = proposer._twin_full if q == 1 else proposer._twin_first
    tokens = n * q
    seq_lens = state["seq_lens"][:n]
    seq_lens.fill_(q)
    # the runner's block table of the draft's KV group: the tensor the loop's metadata reads
    block_table = proposer._twin["runner"].input_batch.block_table[proposer.kv_cache_gid].get_device_tensor(n)
    qsl = proposer.arange[: n + 1] if q == 1 else state["qsl"][: n + 1]
    cad = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=torch.arange(n + 1, dtype=torch.int32) * q,
        seq_lens=seq_lens, num_reqs=n, num_actual_tokens=tokens, max_query_len=q,
        max_seq_len=proposer.max_model_len, block_table_tensor=block_table,
        slot_mapping=proposer._slot_mapping_buffer[:tokens], causal=True,
        _seq_lens_cpu=torch.full((n,), q, dtype=torch.int32),
        _num_computed_tokens_cpu=torch.zeros(n, dtype=torch.int32),
    )
    proposer._slot_mapping_buffer[:tokens].fill_(PADDING_SLOT_ID)  # capture writes no KV entry
    per_layer: dict[str, Any] = {}
    for group in proposer.draft_attn_groups:
        md = group.get_metadata_builder().build_for_cudagraph_capture(cad)
        per_layer.update({name: md for name in group.layer_names})
    kwargs = {"positions": proposer._get_positions(tokens)}
    if proposer.supports_mm_inputs:
        kwargs.update(input_ids=None, inputs_embeds=proposer.inputs_embeds[:tokens])
    else:
        kwargs.update(input_ids=proposer.input_ids[:tokens], inputs_embeds=None)
    key = BatchDescriptor(num_tokens=n) if q == 1 else first_pass_key(n, q)
    for mode in (CUDAGraphMode.NONE, CUDAGraphMode.FULL):  # warm-up, then capture
        with set_forward_context(per_layer, proposer.vllm_config, num_tokens=tokens, cudagraph_runtime_mode=mode,
                                 batch_descriptor=key, slot_mapping=proposer._get_slot_mapping(tokens)):
            proposer.model(**kwargs)


def full_captured(model, first_pass: bool = False) -> set[int]:
    """Batch sizes whose FULL single-token graph (``first_pass``: FULL first-pass graph) exists now.
    The wrapper's own entries decide: vLLM's CUDA-graph memory profile captures graphs and then
    clears them all, and a replay key whose graph is gone would make the wrapper try to capture in
    the middle of serving."""
    entries = getattr(model, "concrete_cudagraph_entries", None) or {}
    live = [desc for desc, entry in entries.items() if entry.cudagraph is not None]
    if first_pass:
        return {desc.num_reqs for desc in live if desc.uniform and desc.num_reqs is not None}
    return {desc.num_tokens for desc in live if desc.num_reqs is None}


def make_graph_wrapper(model, vllm_config):
    """vLLM's FULL graph wrapper around the drafter, which replays a first pass under the key the
    proposer set (``wrapper.twin_key``, consumed by the next call): vLLM's forward context keys every
    pass by its token count alone, and a first pass of n requests may have as many tokens as a
    single-token step of a larger batch."""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.forward_context import get_forward_context, is_forward_context_available

    class TwinFullGraphWrapper(CUDAGraphWrapper):
        twin_key = None

        def __call__(self, *args, **kwargs):
            key, self.twin_key = self.twin_key, None
            if key is not None and is_forward_context_available():
                get_forward_context().batch_descriptor = key
            return super().__call__(*args, **kwargs)

    return TwinFullGraphWrapper(model, vllm_config, runtime_mode=CUDAGraphMode.FULL)


def first_pass_state(proposer, n: int):
    """The FULL first-pass buffers of ``full_all`` for up to ``n`` requests (its graphs have the
    single-token steps' padded sizes), or None (the mode then
    falls back to ``full``, saying why in the report) when the draft's attention backend has no FULL
    graphs of uniform multi-token batches."""
    ok, why = full_decode_support(proposer, uniform_batch=True)
    if not ok:
        proposer._twin_graph_mode = "full"
        proposer._twin_engine.report.update(draft_cudagraph_mode_planned="full",
                                            draft_cudagraph_mode_reason=f"full_all refused: {why}; full instead")
        return None
    q = proposer._first_pass_tokens()
    return {"q": q,
            "seq_lens": torch.zeros(n, dtype=torch.int32, device=proposer.device),
            # query starts of a uniform first pass, 0, q, 2q, ...: constant, written once
            "qsl": torch.arange(n + 1, dtype=torch.int32, device=proposer.device) * q,
            "padded": proposer._twin_full["padded"]}


def first_pass_metadata(proposer, cad, new_cad, num_out: int):
    """A uniform first pass's query starts and sequence lengths in the persistent buffers its FULL
    graph reads (``full_all``); any other first pass's metadata as vLLM built it. Decided on host
    values only: the batch is uniform when its verified tokens are ``batch * max_query_len``. Sets
    ``proposer._twin_first_pad`` (the padded batch of the replay) when the graph will replay."""
    first = proposer._twin_first
    if (first is None or not proposer._twin_in_propose or proposer._twin_first_off
            or proposer._twin_graphs_off):
        return new_cad
    n, q = cad.num_reqs, first["q"]
    if cad.max_query_len * n != cad.num_actual_tokens or new_cad.max_query_len != q or num_out != n * q:
        return new_cad
    pad = replay_size(n, proposer._first_captured(), padded=first.get("padded"))
    if pad is None:
        return new_cad
    buf = first["seq_lens"]
    buf[:n].copy_(new_cad.seq_lens[:n])
    buf[n:pad].zero_()   # padded requests read nothing
    proposer._twin_first_pad = pad
    return new_cad.replace(query_start_loc=first["qsl"][: n + 1], seq_lens=buf[:n])


def padded_metadata(proposer, cad, pad: int, first_pass: bool):
    """``cad`` (n requests) as the batch of ``pad`` requests its FULL graph launches, built the way vLLM's
    runner pads the target's FULL steps: the padded requests with the graph's query starts (``q`` tokens
    each), sequence length 0 (they read no KV entry), the runner's block-table rows and the drafter's slot
    mapping up to ``pad``. FA3's scheduler metadata is then computed for the batch the kernels run."""
    n = cad.num_reqs
    if pad <= n:
        return cad
    if first_pass:
        state = proposer._twin_first
        q, qsl = state["q"], state["qsl"]
    else:
        state, q, qsl = proposer._twin_full, 1, proposer.arange
    seq_lens = state["seq_lens"]
    seq_lens[n:pad].zero_()
    block_table = proposer._twin["runner"].input_batch.block_table[proposer.kv_cache_gid].get_device_tensor(pad)
    return cad.replace(query_start_loc=qsl[: pad + 1],
                       query_start_loc_cpu=torch.arange(pad + 1, dtype=torch.int32) * q,
                       seq_lens=seq_lens[:pad], num_reqs=pad, num_actual_tokens=pad * q, max_query_len=q,
                       block_table_tensor=block_table, slot_mapping=proposer._slot_mapping_buffer[: pad * q],
                       _seq_lens_cpu=None, _num_computed_tokens_cpu=None, seq_lens_cpu_upper_bound=None,
                       is_prefilling=None, positions=None)


def full_pass_metadata(proposer, cad, pad: int, first_pass: bool):
    """Attention metadata of a drafter pass that replays the FULL graph of ``pad`` requests, built as the
    target's own FULL steps get theirs: for the padded batch (:func:`padded_metadata`) and with the
    backend's ahead-of-time scheduling on, so that FA3 writes this pass's scheduler metadata (splits,
    batch order, per-request blocks) into the persistent buffer the captured kernels read. vLLM's
    drafting build skips it (``fast_build``), which left the capture's metadata (one-token sequences) in
    place: wrong draft attention at batch > 1, seen on the H200 as bf16 acceptance 0.21 at concurrency 8
    against 0.66 piecewise while the output stayed exact (fp32 on TRITON_ATTN, which keeps no such
    metadata, was unaffected)."""
    cad = padded_metadata(proposer, cad, pad, first_pass)
    per_group, per_layer = [], {}
    for group in proposer.draft_attn_groups:
        md = group.get_metadata_builder().build(common_prefix_len=0, common_attn_metadata=cad, fast_build=False)
        per_group.append(md)
        per_layer.update({name: md for name in group.layer_names})
    return per_group, per_layer
