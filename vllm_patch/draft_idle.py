"""Knob ``draft_idle``: what a decode step costs where vLLM's batch-size γ schedule says 0.

vLLM 0.27.1's proposer still runs the draft's first pass over the batch at γ 0 (``llm_base_proposer.propose``:
"the prefill forward pass above already ran to keep the drafter KV cache in sync") and returns an empty
draft, so speculation "off" costs a vanilla step plus about one draft step (``sync``, the default). With
``skip`` the twin proposer returns that empty draft without the pass at a decode-only step (every request
one token); a step with prompt tokens still runs it, so every prompt is in the draft's cache. The draft's
cache then misses the tokens of the skipped steps: drafts made after such a stretch read stale entries,
which lowers real acceptance and never changes an output (the target verifies every token).
"""

from __future__ import annotations

import torch


def empty_draft(proposer, kwargs: dict) -> torch.Tensor | None:
    """The empty draft of a skipped step (``[batch, 0]``, as vLLM's own γ-0 path returns), or None: run it."""
    if proposer._twin is None or proposer._twin_engine.knobs.draft_idle != "skip":
        return None
    cad = kwargs.get("common_attn_metadata")
    if kwargs.get("num_speculative_tokens", -1) != 0 or cad is None or int(cad.max_query_len) != 1:
        return None
    proposer.num_speculative_tokens = 0
    engine = proposer._twin_engine
    engine.draft_idle_skips += 1
    if engine.report is not None and (engine.draft_idle_skips == 1 or engine.draft_idle_skips % 100 == 0):
        engine.report.update(draft_idle_skips=engine.draft_idle_skips)
    return torch.empty(cad.batch_size(), 0, dtype=torch.int64, device=proposer.device)
