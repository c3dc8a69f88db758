"""Knob ``draft_idle``: what a decode step costs where vLLM's batch-size γ schedule says 0.

vLLM 0.27.1's proposer still runs the draft's first pass over the batch at γ 0 (``llm_base_proposer.propose``:
"the prefill forward pass above already ran to keep the drafter KV cache in sync") and returns an empty
draft, so speculation "off" costs a vanilla step plus about one draft step (``sync``, the default). With
``skip`` the twin proposer returns that empty draft without the pass at a decode-only step (every request
one token); a step with prompt tokens still runs it, so every prompt is in the draft's cache. The draft's
cache then misses the tokens of the skipped steps: drafts made after such a stretch read stale entries,
which lowers real acceptance and never changes an output (the target verifies every token).

With ``skip_all`` a γ-0 step that admits prompt tokens runs no draft pass either. Under load such a step
otherwise costs the draft's prefill on top of the target's, and every running request waits for it (8B
shape on an H100, concurrency 32, speculation off: 11 ms of draft prefill beside the target's 6.7 ms, the
6 % by which the twin's TPOT trailed vanilla's, ``results/E18/README.md``). The draft's cache then lacks
the prompts admitted at such steps: once the batch is small enough for γ > 0 again, drafts for those
requests read entries never written, so real acceptance drops there; outputs do not change.
"""

from __future__ import annotations

import torch


def empty_draft(proposer, kwargs: dict) -> torch.Tensor | None:
    """The empty draft of a skipped step (``[batch, 0]``, as vLLM's own γ-0 path returns), or None: run it."""
    if proposer._twin is None:
        return None
    engine = proposer._twin_engine
    engine.draft_pass_queued = True  # this step's draft pass runs unless skipped below (read by early_release)
    idle = engine.knobs.draft_idle
    if idle not in ("skip", "skip_all"):
        return None
    cad = kwargs.get("common_attn_metadata")
    if kwargs.get("num_speculative_tokens", -1) != 0 or cad is None:
        return None
    prompt = int(cad.max_query_len) != 1
    if prompt and idle != "skip_all":
        return None
    proposer.num_speculative_tokens = 0
    engine.draft_pass_queued = False
    engine.bump("draft_idle_skips", draft_idle_prompt_skips=int(prompt))
    return torch.empty(cad.batch_size(), 0, dtype=torch.int64, device=proposer.device)
