"""Custom ops the draft's GEMMs go through, registered the way vLLM registers its own
(``vllm.utils.torch_utils.direct_register_custom_op``): ``Library.define`` + ``impl`` + a fake.

``torch.library.custom_op`` costs 7–9 µs of host time a call on a CPU host, the direct registration 1.4
(``benchmarks/op_dispatch.py``, results/op-dispatch/20261206T172224Z-cpu). A draft's prefill runs outside CUDA
graphs and is bound by host launches, so the twin's 145 GEMM calls of an 8B prefill would pay it each time.
vLLM's helper is not used because these ops are also registered where vLLM is absent (the kernel benchmarks on a
GPU host with its own torch). One kernel for every backend (``CompositeExplicitAutograd``): the same op on CUDA
and in the CPU tests.
"""

from __future__ import annotations

from typing import Callable

import torch

NAMESPACE = "twin_spec"


def register(lib: torch.library.Library, name: str, schema: str, impl: Callable, fake: Callable):
    """``twin_spec::name`` (its overload packet), defined in ``lib`` unless this process has it already; ``lib``
    must live as long as the op (the module that registers keeps it)."""
    ns = getattr(torch.ops, NAMESPACE)
    if not hasattr(ns, name):
        lib.define(f"{name}{schema}")
        lib.impl(name, impl, "CompositeExplicitAutograd")
        lib._register_fake(name, fake)
    return getattr(ns, name)


def library() -> torch.library.Library:
    return torch.library.Library(NAMESPACE, "FRAGMENT")
