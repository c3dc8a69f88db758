"""A draft's quantization ignore list reaches its own layers (compressed-tensors checkpoints)."""

from __future__ import annotations


def install() -> None:
    """Let a draft's quantization ignore list reach its own layers.

    The draft is built under the module prefix ``draft_model.``, so its layer
    names never equal the checkpoint's ignore entries: the unquantized vision
    tower of an AWQ twin was then built as int4 layers, and loading failed
    looking for ``weight_packed`` there. Match with the prefix removed too.
    """
    from vllm.model_executor.layers.quantization.compressed_tensors import (
        compressed_tensors as ct,
    )

    orig = ct.should_ignore_layer
    prefix = "draft_model."

    def should_ignore_layer(layer_name, ignore=tuple(), fused_mapping=None):
        kw = {} if fused_mapping is None else {"fused_mapping": fused_mapping}
        if orig(layer_name, ignore, **kw):
            return True
        if layer_name and layer_name.startswith(prefix):
            return orig(layer_name[len(prefix):], ignore, **kw)
        return False

    ct.should_ignore_layer = should_ignore_layer
