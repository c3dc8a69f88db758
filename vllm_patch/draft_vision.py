"""Whether the draft can read the target's image embeddings instead of running its own vision tower.

A W4A16 twin keeps its vision tower in full precision (the quantization recipe ignores ``visual``), so its
vision weights are the target's, value for value: the draft's tower would compute, on the same images, the
target's encoder outputs again. With knob ``draft_vision_share`` (on by default) the twin proposer compares
the two towers once at load (names, shapes, dtypes and values of every parameter and buffer, on this
rank's shards) and, where they are equal, the runner hands the drafter the target's encoder outputs: the
draft's tower never runs and its outputs are not cached twice. The outputs are the ones the draft's tower
would have made (equal weights, equal inputs, the same kernels), so nothing a request sees changes; the
first token no longer waits for a second vision pass. Where they differ (another model as the draft, a
tower quantized with the rest) the draft runs its own, as before, and the report says why.
"""

from __future__ import annotations

import torch

VISION_ATTRS = ("visual", "vision_tower", "vision_model")


def vision_tower(model) -> torch.nn.Module | None:
    """The vision tower of a vLLM multimodal model (Qwen3-VL: ``visual``), unwrapped; None where it has none."""
    unwrap = getattr(model, "unwrap", None)
    model = unwrap() if callable(unwrap) else model
    for name in VISION_ATTRS:
        tower = getattr(model, name, None)
        if isinstance(tower, torch.nn.Module):
            return tower
    return None


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = dict(module.named_parameters(remove_duplicate=False))
    out.update(dict(module.named_buffers(remove_duplicate=False)))
    return out


def same_vision(target_model, draft_model) -> tuple[bool, str]:
    """(True, why) where the draft's vision tower equals the target's in every tensor; else (False, why)."""
    t, d = vision_tower(target_model), vision_tower(draft_model)
    if t is None or d is None:
        return False, f"no vision tower in the {'target' if t is None else 'draft'}"
    if type(t) is not type(d):
        return False, f"different towers ({type(t).__name__} vs {type(d).__name__})"
    tt, dt = _tensors(t), _tensors(d)
    if tt.keys() != dt.keys():
        diff = sorted(tt.keys() ^ dt.keys())
        return False, f"different tensors ({len(diff)}, e.g. {diff[0]})"
    for name, a in tt.items():
        b = dt[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            return False, f"{name}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
        if a.device != b.device:
            b = b.to(a.device)
        if not torch.equal(a, b):
            return False, f"{name}: different values"
    return True, f"equal weights ({len(tt)} tensors)"


def share(proposer, target_model) -> None:
    """At the twin proposer's load: mark the drafter to read the target's encoder outputs where the towers
    are equal (knob ``draft_vision_share``), and say so in the report (``draft_vision``, and why)."""
    knobs, report = proposer._twin_engine.knobs, proposer._twin_engine.report
    if not proposer.supports_mm_inputs or knobs.blind_mm:
        return
    if not knobs.draft_vision_share:
        report.update(draft_vision="own", draft_vision_share_reason="knob off")
        return
    same, why = same_vision(target_model, proposer.model)
    proposer._twin["share_vision"] = same
    report.update(draft_vision="shared" if same else "own", draft_vision_share_reason=why)
