"""Issue 9: vLLM's placeholder draft ids (-1) are never indices, count as rejected, leave no margin.

vLLM pads drafts it has invalidated with -1 (its own kernels reject them); on
CUDA at concurrency 8 this reached the patch's gather and crashed the
engine with a device-side assert. Here the wrapped ``rejection_sample`` is
called directly, on the CPU greedy kernel vLLM's CPU runner uses.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

VOCAB = 16


@pytest.fixture
def patched(tmp_path, monkeypatch):
    """Install the patch's rejection sampler wrapper for one test, then restore vLLM's."""
    import vllm.utils.cpu_triton_utils as cpu_tl
    from vllm.v1.sample import rejection_sampler as rs

    from vllm_patch import relaxed_gate
    from vllm_patch.engine_state import EngineState
    from vllm_patch.knobs import EngineKnobs
    from vllm_patch.telemetry import TraceWriter

    monkeypatch.setattr(rs, "rejection_greedy_sample_kernel", cpu_tl.rejection_greedy_sample_kernel)
    monkeypatch.setattr(rs, "rejection_sample", rs.rejection_sample)

    def install(relax_logtau: float, trace: bool = True):
        state = EngineState(EngineKnobs(relax_logtau=relax_logtau),
                            trace=TraceWriter(str(tmp_path), batch_steps=2) if trace else None)
        relaxed_gate.install(state)
        return rs.rejection_sample, state

    return install


def _call(fn, G, draft_ids, num_draft, logits, req_ids=("a", "b")):
    G.batch_req_ids = list(req_ids)
    try:
        cu = torch.tensor(num_draft).cumsum(0).to(torch.int32)
        bonus = torch.tensor([[7], [7]], dtype=torch.int32)[: len(num_draft)]
        meta = SimpleNamespace(all_greedy=True, all_random=False, temperature=None)
        return fn(torch.tensor(draft_ids, dtype=torch.int32), list(num_draft), max(num_draft), cu, None,
                  logits.clone(), bonus, meta)
    finally:
        G.batch_req_ids = None


def _logits(argmaxes, near=None):
    """Rows with the given argmax (logit 5.0); ``near[i] = (token, margin)`` puts a runner-up."""
    x = torch.zeros(len(argmaxes), VOCAB)
    for i, a in enumerate(argmaxes):
        x[i, a] = 5.0
        if near and i in near:
            tok, margin = near[i]
            x[i, tok] = 5.0 - margin
    return x


def _trace_lines(G, tmp_path):
    G.trace.flush()
    return [json.loads(line) for line in next(tmp_path.glob("trace-*.jsonl")).read_text().splitlines()]


@pytest.mark.parametrize("bad_id", [-1, VOCAB, 10_000])
def test_relaxed_gate_and_trace_reject_invalid_ids(patched, tmp_path, bad_id):
    fn, G = patched(relax_logtau=0.7)
    # request a: drafts 3, 4 (both within 0.5 of the max) then an invalid id;
    # request b: drafts 9 (the argmax) then an invalid id.
    logits = _logits([1, 2, 6, 9, 11], near={0: (3, 0.5), 1: (4, 0.5)})
    out = _call(fn, G, [3, 4, bad_id, 9, bad_id], [3, 2], logits)
    # a: 3 and 4 pass the relaxed gate, the invalid slot is rejected and the
    # target's argmax (6) is emitted there; b: 9 accepted, then argmax 11.
    assert out[0].tolist() == [3, 4, 6, -1]
    assert out[1].tolist()[:2] == [9, 11]
    (line,) = _trace_lines(G, tmp_path)
    rows = {r[0]: r[1:] for r in line["r"]}
    assert rows["a"] == [2, 2, [0.5, 0.5]]  # drafted (valid), accepted, margins (valid only)
    assert rows["b"] == [1, 1, [0.0]]
    assert line["invalid"] == {"a": 1, "b": 1}


def test_strict_trace_with_invalid_ids_reconciles_with_the_kernel(patched, tmp_path):
    fn, G = patched(relax_logtau=0.0)
    logits = _logits([3, 5, 6, 9, 11])
    out = _call(fn, G, [3, 4, -1, 9, -1], [3, 2], logits)
    assert out[0].tolist()[:2] == [3, 5]  # 3 accepted, 4 rejected: argmax 5 emitted
    assert out[1].tolist()[:2] == [9, 11]
    (line,) = _trace_lines(G, tmp_path)
    rows = {r[0]: r[1:] for r in line["r"]}
    assert rows["a"][:2] == [2, 1] and rows["b"][:2] == [1, 1]
    assert rows["a"][2][1] == pytest.approx(5.0)  # margin of the rejected valid draft


def test_trace_batches_steps_off_the_decode_path_and_flush_writes_all(patched, tmp_path):
    fn, G = patched(relax_logtau=0.0)
    logits = _logits([3, 4, 9, 11])
    for _ in range(5):  # batch_steps=2: two hand-overs, one remainder for flush
        _call(fn, G, [3, 4, 9, 10], [2, 2], logits)
    lines = _trace_lines(G, tmp_path)
    assert [l["s"] for l in lines] == [1, 2, 3, 4, 5]
    assert all(l["r"] == [["a", 2, 2, [0.0, 0.0]], ["b", 2, 1, [0.0, 5.0]]] for l in lines)


def test_relaxed_gate_without_trace_is_unaffected_by_invalid_ids(patched):
    fn, G = patched(relax_logtau=0.7, trace=False)
    logits = _logits([1, 2, 6, 9, 11], near={0: (3, 0.5)})
    out = _call(fn, G, [3, -1, -1, 9, -1], [3, 2], logits)
    assert out[0].tolist()[:2] == [3, 2]
