"""The relaxed gate and the trace's margins: a wrapper around vLLM's ``rejection_sample``.

Verification is vLLM's own greedy kernel. Before it runs, the wrapper computes each drafted
token's margin under the target, ``max(logits) - logit(drafted)``, when the relaxed gate or the
trace needs it:

* relaxed tier (``relax_logtau`` x > 0), greedy requests: a drafted token with margin <= x is made
  the argmax of its row, so the kernel accepts up to the first failing position and emits the true
  argmax there and as the bonus token. Sampled requests never reach it in the relaxed tier
  (``request_checks``); in a mixed batch their rows are left alone.
* placeholder draft ids (vLLM pads drafts it invalidated with -1) are never an index, never pass,
  and have no margin (NaN).
* the tie rule (docs/exactness.md): "picked" is torch's argmax, the first index among tied maxima,
  as in vLLM's greedy verification. A token the target did not pick whose margin the trace would
  write as 0 (a tie in the logits' dtype, or below the trace's 4 decimals) is marked
  (``TraceWriter.TIE``): strict (x = 0) replays it as rejected, any x > 0 as accepted, as the gate
  itself decides.

vLLM calls ``rejection_sample`` as a module function, without the runner; the runner's ``_sample``
hook (``runner_hooks``) puts the batch's request ids on the engine state for the call.
"""

from __future__ import annotations

import time

import torch

from .engine_state import EngineState
from .telemetry import TraceWriter


def _margins(draft_token_ids, num_draft_tokens, target_logits, sampling_metadata, x: float, rs):
    """Each drafted token's margin under the target, ``max(logits) - logit(drafted)`` (NaN for a placeholder
    id), with the relaxed gate applied in place when ``x`` > 0; also the clamped ids (``[n, 1]``) and the
    target's picks, which the trace's tie rule reads."""
    vocab = target_logits.shape[-1]
    # vLLM pads drafts it invalidated with -1 (its kernels reject them):
    # such an id is never an index, never passes, and has no margin.
    idx = draft_token_ids.long().clamp(0, vocab - 1)
    invalid = idx != draft_token_ids
    idx = idx.unsqueeze(1)
    drafted_logit = target_logits.gather(1, idx).squeeze(1)
    # vLLM's greedy verification accepts a draft iff it is torch's argmax
    # (the first index among tied maxima); the same argmax decides "picked".
    pick = target_logits.argmax(dim=-1)
    top = target_logits.gather(1, pick.unsqueeze(1)).squeeze(1)
    margins = (top - drafted_logit).float().masked_fill_(invalid, float("nan"))
    if x > 0:
        passes = margins <= x  # an invalid id's margin is NaN: it never passes
        if not sampling_metadata.all_greedy:
            greedy_req = sampling_metadata.temperature == rs.GREEDY_TEMPERATURE
            counts = torch.as_tensor(num_draft_tokens, device=greedy_req.device)
            passes &= torch.repeat_interleave(
                greedy_req, counts, output_size=draft_token_ids.shape[0]
            )
        # Make a passing drafted token the argmax of its row; the
        # greedy kernel then accepts up to the first failing position
        # and emits the (true) argmax there and as the bonus token.
        # Rows of invalid ids write their (clamped) column's own logit back.
        raised = torch.where(passes, top + 1.0, drafted_logit)
        target_logits.scatter_(1, idx, raised.unsqueeze(1))
    return margins, idx, pick


def _record(trace, req_ids, num_draft_tokens, out, margins, idx, pick, traced_ns: int, rs) -> None:
    """The step's accepted counts and margins into the trace, and the host time the trace took."""
    t1 = time.perf_counter_ns()
    accepted = (out != rs.PLACEHOLDER_TOKEN_ID).sum(dim=1) - 1
    if margins is None:
        margins = torch.empty(0, device=out.device)
    else:
        # The tie rule: a token the target did not pick but whose margin the
        # trace would write as 0 (a bf16 tie, or below its 4 decimals) is
        # marked, so strict (x = 0) replays as rejected and x > 0 as accepted.
        margins = margins.masked_fill(
            (pick != idx.squeeze(1)) & (margins < TraceWriter.ZERO), TraceWriter.TIE)
    trace.record(req_ids, num_draft_tokens, accepted, margins)
    # ... and the count of accepted tokens and the recording (a batch hand-over included)
    trace.host_ns += traced_ns + time.perf_counter_ns() - t1


def install(state: EngineState) -> None:
    """Replace vLLM's ``rejection_sample`` with the gate-and-trace wrapper over it."""
    from vllm.v1.sample import rejection_sampler as rs

    orig_rejection_sample = rs.rejection_sample
    x = float(state.knobs.relax_logtau)

    def rejection_sample(
        draft_token_ids,
        num_draft_tokens,
        max_spec_len,
        cu_num_draft_tokens,
        draft_probs,
        target_logits,
        bonus_token_ids,
        sampling_metadata,
        *args,
        **kwargs,
    ):
        req_ids = state.batch_req_ids
        trace = state.trace if req_ids is not None else None
        t0 = time.perf_counter_ns() if trace is not None else 0
        margins = idx = pick = None
        if (x > 0 or trace is not None) and draft_token_ids.numel() > 0:
            margins, idx, pick = _margins(draft_token_ids, num_draft_tokens, target_logits, sampling_metadata, x, rs)
        # host time the trace adds to the step: the margins (unless the relaxed gate needs them) ...
        traced_ns = time.perf_counter_ns() - t0 if trace is not None and x <= 0 else 0
        sample = orig_rejection_sample
        if kwargs.get("synthetic_mode") and target_logits.device.type == "cpu":
            sample = synthetic_greedy_cpu  # vLLM's CPU kernels refuse synthetic mode
        out = sample(
            draft_token_ids,
            num_draft_tokens,
            max_spec_len,
            cu_num_draft_tokens,
            draft_probs,
            target_logits,
            bonus_token_ids,
            sampling_metadata,
            *args,
            **kwargs,
        )
        if trace is not None:
            _record(trace, req_ids, num_draft_tokens, out, margins, idx, pick, traced_ns, rs)
        return out

    rs.rejection_sample = rejection_sample


def synthetic_greedy_cpu(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                         target_logits, bonus_token_ids, sampling_metadata, synthetic_mode=False,
                         synthetic_conditional_rates=None, **_):
    """vLLM's synthetic acceptance on a CPU, with its CUDA kernel's semantics (greedy requests).

    At position ``pos`` of a request's draft, a uniform draw below the conditional rate of ``pos`` keeps
    the drafted token (a placeholder id -1 never passes); the first failing position emits the target's
    argmax and ends the step; a fully kept draft gets the bonus token. The draws are vLLM's own
    ``generate_uniform_probs`` (the requests' generators where they have one).
    """
    from vllm.v1.sample import rejection_sampler as rs

    if not sampling_metadata.all_greedy:
        raise NotImplementedError("synthetic acceptance on CPU: greedy requests only (temperature 0)")
    batch = len(num_draft_tokens)
    out = torch.full((batch, max_spec_len + 1), rs.PLACEHOLDER_TOKEN_ID, dtype=torch.int32,
                     device=target_logits.device)
    uniform = rs.generate_uniform_probs(draft_token_ids.shape[0], num_draft_tokens,
                                        sampling_metadata.generators, target_logits.device)
    argmax = target_logits.argmax(dim=-1)
    rates = synthetic_conditional_rates.tolist()
    start = 0
    for r, n in enumerate(num_draft_tokens):
        kept_all = True
        for pos in range(n):
            i = start + pos
            draft = int(draft_token_ids[i])
            if float(uniform[i]) < rates[pos] and draft >= 0:
                out[r, pos] = draft
            else:
                out[r, pos] = int(argmax[i])
                kept_all = False
                break
        if kept_all:
            out[r, n] = int(bonus_token_ids[r, 0])
        start += n
    return out
