"""What the twin proposer changes in its draft model once vLLM has loaded it (``TwinDraftProposer.load_model``).

In this order, each reported in the engine report: the MLPs fused where the draft's gate_up runs on the own CUDA
kernel (``draft_mlp``), the W4A16 kernel vLLM built checked against the one asked (``draft_kernels``), the int4
lm_head (``draft_head``, knob ``draft_lm_head``), the decode attention (``draft_attention``, knob
``draft_attention``; CUDA only) and the target's vision tower shared (``draft_vision``). The drafter's FULL graph
wrapper comes after these, in the proposer, and captures what they installed.
"""

from __future__ import annotations

from . import draft_attention, draft_head, draft_kernels, draft_mlp, draft_vision


def finish(proposer, target_model, refused) -> None:
    """Install the draft's own pieces into ``proposer.model`` (loaded) and report them; ``refused``: the kernel
    classes vLLM refused while it built the draft's layers (``draft_kernels.prefer``)."""
    engine, model = proposer._twin_engine, proposer.model
    knobs, kernel = engine.knobs, proposer._twin_kernel[0]
    engine.report.update(**draft_mlp.fuse(model), **draft_kernels.checked_report(
        model, kernel, knobs.draft_linear_kernel, refused))
    if knobs.draft_lm_head == "int4":
        engine.report.update(**draft_head.install(model, kernel))
    else:
        engine.report.update(draft_lm_head="model", draft_lm_head_applies=True)
    on_gpu = str(proposer.device).startswith("cuda")
    engine.report.update(draft_attention_applies=on_gpu)
    if on_gpu:
        cfg = proposer.vllm_config
        engine.report.update(**draft_attention.install(
            model, knobs.draft_attention, max_batch=max(int(proposer.max_batch_size), int(
                cfg.compilation_config.max_cudagraph_capture_size or 0)),
            max_len=int(cfg.model_config.max_model_len), dtype=cfg.model_config.dtype, device=proposer.device,
            report=engine.report.update))
    else:
        engine.report.update(draft_attention_requested=knobs.draft_attention, draft_attention="vllm")
    draft_vision.share(proposer, target_model)
