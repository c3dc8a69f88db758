"""The scaffolding the project's own W4A16 kernels share as vLLM ``MPLinearKernel`` classes.

``own`` (Triton, ``twin_gemv``) and ``own-cuda`` (CUDA C++, ``twin_cuda``) differ in their shape rules, their
repack and their GEMM; how they answer vLLM (capability, ``can_implement`` on CUDA only, the packed weight's
shape check, the lazy class) is the same and lives here. The class is built on first access, so importing a
kernel module needs neither vLLM nor CUDA.
"""

from __future__ import annotations

from typing import Callable

import torch


def build(name: str, min_capability: int, unavailable_reason: Callable[[], str | None],
          check_config: Callable, load: Callable, apply: Callable) -> type:
    """An ``MPLinearKernel`` named ``name``.

    ``load(kernel, layer, w_q, w_s, w_zp, replace_parameter)`` repacks a layer's checkpoint tensors once
    (``w_zp`` None for symmetric weights) after the packed weight's shape is checked; ``apply(kernel, layer,
    x, bias)`` is the layer's GEMM.
    """
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearKernel
    from vllm.model_executor.utils import replace_parameter
    from vllm.platforms import current_platform

    class Kernel(MPLinearKernel):
        @classmethod
        def get_min_capability(cls) -> int:
            return min_capability

        @classmethod
        def can_implement(cls, c) -> tuple[bool, str | None]:
            if not current_platform.is_cuda():
                return False, f"{name} needs CUDA"
            reason = unavailable_reason()
            if reason:
                return False, f"{name}: {reason}"
            return check_config(c)

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            load(self, layer, *checkpoint_tensors(self, layer, name), replace_parameter)

        def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
            return apply(self, layer, x, bias)

    Kernel.__name__ = Kernel.__qualname__ = name
    return Kernel


def checkpoint_tensors(kernel, layer, name: str) -> tuple:
    """``(w_q, w_s, w_zp)`` of a layer as compressed-tensors loaded it (``w_zp`` None for symmetric weights), the
    packed weight's shape checked against the kernel's config."""
    c = kernel.config
    w_q, w_s, w_zp, _ = kernel._get_weight_params(layer)
    k, n = c.partition_weight_shape
    if tuple(w_q.shape) != (n, k // 8):
        raise ValueError(f"{name}: packed weight {tuple(w_q.shape)} is not [out={n}, in/8={k // 8}]")
    return w_q, w_s, w_zp if c.zero_points else None


def lazy_class(module_name: str, class_name: str | tuple[str, ...], build: Callable[[], type | dict]) -> Callable:
    """A module's ``__getattr__`` that builds ``class_name`` (or each of several names: ``build`` then returns a
    dict name -> class) with ``build`` on first access and keeps it (the kernel modules import without vLLM; the
    class needs it)."""
    names = (class_name,) if isinstance(class_name, str) else tuple(class_name)
    built: dict[str, type] = {}

    def __getattr__(name: str) -> type:
        if name not in names:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        if name not in built:
            made = build()
            built.update(made if isinstance(made, dict) else {names[0]: made})
        return built[name]

    return __getattr__
