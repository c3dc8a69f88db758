"""Knob ``target_graphs``: the target's FULL decode CUDA graphs under vLLM's batch-size γ schedule.

vLLM 0.27.1's V1 model runner captures the target's FULL uniform-decode graphs for one verification
length, ``1 + num_speculative_tokens``. With ``num_speculative_tokens_per_batch_size`` set, a step may
verify fewer tokens per request, so ``VllmConfig._maybe_override_dynamic_sd_cudagraph_mode`` turns
FULL_AND_PIECEWISE into PIECEWISE for the whole engine ("for reliability"): every target step then runs
piecewise graphs, attention outside them. Measured behind a server (E18, 8B shape, one H100): a step
where the schedule said γ 0 took 13.9 ms against vanilla's 7.0 ms on FULL graphs.

``vllm`` (the default) keeps vLLM's rule. ``full`` keeps FULL_AND_PIECEWISE and gives the runner a second
family of FULL uniform-decode graphs, for steps that verify one token per request (every request at γ 0:
a vanilla step), beside vLLM's own family at ``1 + γ_max``:

* the override is skipped (``VllmConfig``);
* after vLLM built its graph keys, the dispatcher gets the keys of the one-token family, made by vLLM's own
  ``_create_padded_batch_descriptor`` with the query length set to 1, at the capture sizes a vanilla engine
  has (vLLM's list before it rounds it to multiples of ``1 + γ_max`` for the γ_max family) up to
  ``max_num_seqs``, with a padding table of their own: a one-token batch pads as a vanilla engine's does.
  (Padding one-token batches on the rounded list put 31–32 requests at 33 tokens, past ``max_num_seqs``:
  no FULL key, so PIECEWISE; measured at concurrency 32, 8B shape, one H100: 14.9 ms a step against 7.3);
* a one-token step that finds no FULL graph (vLLM excludes FULL for cascade attention, say) is dispatched
  again on vLLM's own padding, so it runs the PIECEWISE graph vLLM's rule would give it;
* a capture (``_warmup_and_capture``) of a descriptor of that family, and the batch planning
  (``_determine_batch_execution_and_padding``) of a step whose requests each run one token, run with the
  runner's and the dispatcher's ``uniform_decode_query_len`` at 1, so vLLM's own code builds, pads and
  dispatches that step as a vanilla engine's;
* a step of any other length (a γ between 0 and γ_max) is not uniform to either family and runs the
  PIECEWISE graphs, as every step does under vLLM's rule.

Both families are keyed by (tokens, requests): a one-token batch and a γ_max batch never share a key.
On a CPU there are no CUDA graphs and the knob has no effect.
"""

from __future__ import annotations

import contextlib
import functools
from itertools import product
from typing import Any, Iterator


def schedule_on(config: Any) -> bool:
    """vLLM's batch-size γ schedule (``num_speculative_tokens_per_batch_size``) is on in ``config``."""
    spec = getattr(config, "speculative_config", None)
    dynamic = getattr(spec, "uses_dynamic_speculative_decoding", None)
    return bool(dynamic()) if callable(dynamic) else False


@contextlib.contextmanager
def query_len(runner: Any, q: int) -> Iterator[None]:
    """The runner's and its dispatcher's ``uniform_decode_query_len`` at ``q`` for the block."""
    holders = [runner, getattr(runner, "cudagraph_dispatcher", None)]
    holders = [h for h in holders if h is not None and hasattr(h, "uniform_decode_query_len")]
    saved = [h.uniform_decode_query_len for h in holders]
    for h in holders:
        h.uniform_decode_query_len = q
    try:
        yield
    finally:
        for h, v in zip(holders, saved):
            h.uniform_decode_query_len = v


def one_token_sizes(dispatcher: Any, sizes_before_rounding: list | None, max_num_seqs: int) -> list:
    """The capture sizes of the one-token family: vLLM's list before its rounding for speculation (else the
    rounded one) up to ``max_num_seqs``."""
    sizes = sizes_before_rounding or dispatcher.compilation_config.cudagraph_capture_sizes or []
    return sorted({int(s) for s in sizes if 1 <= s <= max_num_seqs})


def one_token_table(dispatcher: Any, sizes: list) -> list:
    """vLLM's padding table (batch size -> graph size) with the batches up to ``max(sizes)`` padded to the
    smallest of ``sizes`` that holds them; larger batches as vLLM pads them."""
    table = list(dispatcher._bs_to_padded_graph_size)
    j = 0
    for n in range(1, min(max(sizes), len(table) - 1) + 1):
        while sizes[j] < n:
            j += 1
        table[n] = sizes[j]
    return table


@contextlib.contextmanager
def _padding(dispatcher: Any, table: list) -> Iterator[None]:
    saved = dispatcher._bs_to_padded_graph_size
    dispatcher._bs_to_padded_graph_size = table
    try:
        yield
    finally:
        dispatcher._bs_to_padded_graph_size = saved


def single_token_keys(dispatcher: Any, max_num_seqs: int, sizes_before_rounding: list | None = None) -> list:
    """The FULL uniform-decode keys of one-token batches (vLLM's descriptor at query length 1), one per
    one-token capture size; the dispatcher keeps their padding table (``_twin_one_token_table``). None where
    the dispatcher has no separate FULL decode routine or its query length is already 1."""
    from vllm.config import CUDAGraphMode

    mode = dispatcher.cudagraph_mode
    if (dispatcher.uniform_decode_query_len <= 1 or mode.decode_mode() != CUDAGraphMode.FULL
            or not mode.separate_routine()):
        return []
    sizes = one_token_sizes(dispatcher, sizes_before_rounding, max_num_seqs)
    if not sizes:
        return []
    table = one_token_table(dispatcher, sizes)
    keys = []
    with query_len(dispatcher, 1), _padding(dispatcher, table):
        for size, loras in product(sizes, dispatcher._get_lora_cases()):
            keys.append(dispatcher._create_padded_batch_descriptor(size, True, loras > 0, loras))
    dispatcher._twin_one_token_table = table
    return keys


def dispatch_one_token(dispatch, dispatcher: Any, num_tokens: int, uniform_decode: bool = False, *args,
                       **kwargs):
    """vLLM's ``dispatch``; a uniform batch at query length 1 of an engine with the one-token family is
    padded on that family's table first, and on vLLM's own where that finds no FULL graph."""
    from vllm.config import CUDAGraphMode

    table = getattr(dispatcher, "_twin_one_token_table", None)
    if table is not None and uniform_decode and dispatcher.uniform_decode_query_len == 1:
        with _padding(dispatcher, table):
            mode, desc = dispatch(dispatcher, num_tokens, uniform_decode, *args, **kwargs)
        if mode == CUDAGraphMode.FULL:
            return mode, desc
    return dispatch(dispatcher, num_tokens, uniform_decode, *args, **kwargs)


def is_single_token_key(desc: Any) -> bool:
    """A uniform-decode descriptor of one token per request (the family this module adds)."""
    return bool(getattr(desc, "uniform", False)) and desc.num_reqs is not None and desc.num_tokens == desc.num_reqs


def _at_one_token(runner: Any, one_token: bool):
    """``query_len(runner, 1)`` for a one-token batch of an engine that has the one-token family, else nothing."""
    if one_token and getattr(runner, "_twin_single_token_graphs", 0) and runner.uniform_decode_query_len > 1:
        return query_len(runner, 1)
    return contextlib.nullcontext()


def install(knobs: Any) -> None:
    """Wrap vLLM's config override, the V1 runner's graph set-up, capture and batch planning, and the
    dispatcher's padding (``full``)."""
    if getattr(knobs, "target_graphs", "vllm") != "full":
        return
    from vllm.config import CUDAGraphMode, VllmConfig
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(VllmConfig, "_twin_target_graphs", False):
        return
    VllmConfig._twin_target_graphs = True
    override = VllmConfig._maybe_override_dynamic_sd_cudagraph_mode

    @functools.wraps(override)
    def keep_full(self):
        if schedule_on(self):
            return None  # FULL graphs stay; the runner captures a family per verification length below
        return override(self)

    VllmConfig._maybe_override_dynamic_sd_cudagraph_mode = keep_full

    setup = GPUModelRunner._check_and_update_cudagraph_mode

    @functools.wraps(setup)
    def with_single_token_keys(self, *args, **kwargs):
        # vLLM rounds the capture sizes for the γ_max family inside ``setup``; keep its list from before
        if getattr(self, "_twin_sizes_before_rounding", None) is None:
            self._twin_sizes_before_rounding = list(self.compilation_config.cudagraph_capture_sizes or [])
        out = setup(self, *args, **kwargs)
        if schedule_on(self.vllm_config):
            keys = single_token_keys(self.cudagraph_dispatcher, self.scheduler_config.max_num_seqs,
                                     self._twin_sizes_before_rounding)
            for key in keys:
                self.cudagraph_dispatcher.add_cudagraph_key(CUDAGraphMode.FULL, key)
            self._twin_single_token_graphs = len(keys)
        return out

    GPUModelRunner._check_and_update_cudagraph_mode = with_single_token_keys

    capture = GPUModelRunner._warmup_and_capture

    @functools.wraps(capture)
    def capture_at_its_length(self, desc, *args, **kwargs):
        with _at_one_token(self, is_single_token_key(desc)):
            return capture(self, desc, *args, **kwargs)

    GPUModelRunner._warmup_and_capture = capture_at_its_length

    planning = GPUModelRunner._determine_batch_execution_and_padding

    @functools.wraps(planning)
    def plan_at_its_length(self, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens,
                           *args, **kwargs):
        one_token_step = (kwargs.get("force_uniform_decode") is None and max_num_scheduled_tokens == 1
                          and num_tokens == num_reqs)
        with _at_one_token(self, one_token_step):
            return planning(self, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens,
                            *args, **kwargs)

    GPUModelRunner._determine_batch_execution_and_padding = plan_at_its_length

    dispatch = CudagraphDispatcher.dispatch

    @functools.wraps(dispatch)
    def dispatch_at_its_padding(self, *args, **kwargs):
        return dispatch_one_token(dispatch, self, *args, **kwargs)

    CudagraphDispatcher.dispatch = dispatch_at_its_padding
