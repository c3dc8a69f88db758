"""The W4A16 kernel of the twin's linear layers (knob ``draft_linear_kernel``), the target's untouched.

vLLM 0.27.1 picks a mixed-precision kernel per layer with ``choose_mp_linear_kernel``: the first
class of its platform list (``_POSSIBLE_KERNELS``) that is not disabled, meets the compute
capability and says ``can_implement``. On SM90 that list tries Machete before Marlin whatever the
batch size, and Machete is the slower of the two at decode batch sizes (issue 18's survey: 32B
layer set at M = 1, 157 µs Machete, 113 µs Marlin). :func:`prefer` moves one class to the head of
that list while the draft's layers are built and restores it afterwards, so the target (loaded
before its drafter) keeps vLLM's choice. A layer the preferred class cannot implement falls
through to vLLM's own order; :func:`report` counts such layers.

``auto``: on CUDA, Marlin first (never Machete for the twin); on CPU, today's behaviour (vLLM's
CPU list with the plugin's int4 fallback at its head, see ``cpu_int4``). The CUDA-only values on
a CPU host are accepted and recorded as having no effect (``draft_linear_kernel_applies: false``).
``own`` is ``TwinGemvLinearKernel`` of ``vllm_patch.twin_gemv`` (Triton), ``own-cuda``
``TwinCudaLinearKernel`` of ``vllm_patch.twin_cuda`` (CUDA C++, built at first use), ``own-cuda+marlin``
``TwinHybridLinearKernel`` of ``vllm_patch.twin_hybrid`` (both layouts, the kernel picked per call by its
token count); each is imported only when asked for. ``auto`` stays Marlin: on one H100 ``own-cuda`` made the 8B
draft step 11 % shorter alone but 20 % longer at batch 16 (docs/benchmarks.md), and it needs a compiler on the
host; ``own-cuda+marlin`` is 2–6 % faster behind the server at concurrency 1–4 and 2–4 % slower at 16–32 (one
H100, 8B, docs/serving.md), so it stays a choice, not the default.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

# knob value -> vLLM MPLinearKernel class name
KERNEL_CLASSES = {
    "machete": "MacheteLinearKernel",
    "marlin": "MarlinLinearKernel",
    "humming": "HummingLinearKernel",
    "exllama": "ExllamaLinearKernel",
    "own": "TwinGemvLinearKernel",
    "own-cuda": "TwinCudaLinearKernel",  # the faster of the two own kernels (issue 37)
    "own-cuda+marlin": "TwinHybridLinearKernel",  # own-cuda up to twin_hybrid.SPLIT_M tokens, Marlin above
    # ... and Machete above twin_hybrid.MACHETE_M tokens (its layout held too)
    "own-cuda+marlin+machete": "TwinHybridMacheteLinearKernel",
}
AUTO_ON_CUDA = "marlin"


def resolve(requested: str, on_cuda: bool) -> tuple[str | None, str]:
    """The kernel class name to put first for the draft (None: vLLM's order unchanged) and why."""
    if not on_cuda:
        return None, ("auto: vLLM's CPU kernels" if requested == "auto"
                      else f"{requested} acts on CUDA only: vLLM's CPU kernels")
    if requested == "auto":
        return KERNEL_CLASSES[AUTO_ON_CUDA], "auto: Marlin first on CUDA (never Machete at decode batch sizes)"
    return KERNEL_CLASSES[requested], "requested"


CONFIG_TAG = "twin_spec_draft_linear_kernel"


def tag_config(draft_config, requested: str, preferred: str | None):
    """Put the kernel knob into ``additional_config`` of the draft's own ``VllmConfig`` (vLLM builds it
    with ``dataclasses.replace``, so it is not the target's), where it is a factor of the config's hash
    and so of vLLM's compile-cache key. The dict is replaced, not changed: it is shared with the
    target's config. A non-dict ``additional_config`` is left as it is. Returns the config."""
    extra = draft_config.additional_config
    if isinstance(extra, dict):
        draft_config.additional_config = {**extra, CONFIG_TAG: f"{requested}:{preferred or 'vllm-order'}"}
    return draft_config


def kernel_class(name: str):
    """The class named ``name``: one of vLLM's MPLinearKernel classes or the project's own."""
    if name == KERNEL_CLASSES["own"]:
        from .twin_gemv import TwinGemvLinearKernel

        return TwinGemvLinearKernel
    if name == KERNEL_CLASSES["own-cuda"]:
        from .twin_cuda import TwinCudaLinearKernel

        return TwinCudaLinearKernel
    if name in (KERNEL_CLASSES["own-cuda+marlin"], KERNEL_CLASSES["own-cuda+marlin+machete"]):
        from . import twin_hybrid

        return getattr(twin_hybrid, name)
    from vllm.model_executor.kernels import linear

    cls = getattr(linear, name, None)
    if cls is None:
        raise ValueError(f"draft_linear_kernel: vLLM has no kernel class {name}")
    return cls


def reorder(kernels: list, first) -> list:
    """``kernels`` with ``first`` at the head (added when absent), the rest in their order."""
    return [first] + [k for k in kernels if k is not first]


@contextlib.contextmanager
def prefer(name: str | None) -> Iterator[list[str]]:
    """While inside: vLLM's mixed-precision kernel list of this platform starts with ``name``. Yields the list
    of what that class answered when it could not implement a layer (distinct reasons, in order; vLLM's
    chooser keeps its reasons only when no kernel at all fits), filled while inside."""
    refused: list[str] = []
    if name is None:
        yield refused
        return
    from vllm.model_executor.kernels import linear
    from vllm.platforms import current_platform

    cls = kernel_class(name)
    platform_list = linear._POSSIBLE_KERNELS.setdefault(current_platform._enum, [])
    saved = list(platform_list)
    platform_list[:] = reorder(saved, cls)  # in place: choose_mp_linear_kernel reads this list per call
    own = cls.__dict__.get("can_implement")
    asked = cls.can_implement.__func__  # the classmethod's function: a subclass that inherits it keeps its own cls

    def can_implement(klass, config):
        ok, why = asked(klass, config)
        if not ok and klass is cls and str(why) not in refused:
            refused.append(str(why))
        return ok, why

    cls.can_implement = classmethod(can_implement)
    try:
        yield refused
    finally:
        platform_list[:] = saved
        if own is None:
            del cls.can_implement
        else:
            cls.can_implement = own


def report(model, preferred: str | None) -> dict:
    """What the draft's quantized layers run on; layers that fell back from the preferred kernel."""
    counts: dict[str, int] = {}
    if model is not None:
        for module in model.modules():
            kernel = getattr(getattr(module, "scheme", None), "kernel", None)
            if kernel is not None:
                counts[type(kernel).__name__] = counts.get(type(kernel).__name__, 0) + 1
    fell_back = {k: n for k, n in counts.items() if preferred is not None and k != preferred}
    if not counts:
        ran = None
    elif len(counts) == 1:
        ran = next(iter(counts))
    else:
        ran = "mixed"
    out = {"draft_linear_kernel": ran, "draft_mp_kernels": counts, "draft_linear_kernel_fallback_layers": fell_back}
    hybrids = (KERNEL_CLASSES["own-cuda+marlin"], KERNEL_CLASSES["own-cuda+marlin+machete"])
    if not any(counts.get(k) for k in hybrids):
        return out
    from . import twin_hybrid  # only where a hybrid ran: importing it registers its ops

    # the layouts held: what the choice per M costs in memory
    out.update(draft_hybrid_split_m=twin_hybrid.SPLIT_M, draft_hybrid_extra_bytes=twin_hybrid.extra_bytes(model),
               draft_hybrid_marlin_direct=twin_hybrid.direct_layers(model))
    if counts.get(twin_hybrid.MACHETE_KERNEL_NAME):
        held, why = twin_hybrid.machete_layers(model)
        out.update(draft_hybrid_machete_m=twin_hybrid.MACHETE_M, draft_hybrid_machete_layers=held,
                   draft_hybrid_machete_refused=why)
    return out


def checked_report(model, preferred: str | None, requested: str, refused: list[str] = ()) -> dict:
    """:func:`report`, refusing a kernel asked for by name that none of the draft's quantized layers runs:
    the engine would otherwise time vLLM's next kernel under the requested one's name (seen on the H200:
    ``humming`` without the ``humming-kernels`` package ran every layer on Machete)."""
    out = report(model, preferred)
    out["draft_linear_kernel_refused"] = list(refused) if out["draft_linear_kernel_fallback_layers"] else []
    counts = out["draft_mp_kernels"]
    if requested != "auto" and preferred is not None and counts and not counts.get(preferred):
        said = "; ".join(out["draft_linear_kernel_refused"]) or "no reason given"
        raise RuntimeError(
            f"draft_linear_kernel={requested}: none of the draft's {sum(counts.values())} quantized layers "
            f"can run on {preferred} here (it said: {said}; vLLM fell back to {', '.join(sorted(counts))}). "
            "A missing package (humming: humming-kernels), this GPU, or the layers' shape or quantization "
            "(e.g. zero points) can be the cause. Use draft_linear_kernel=auto to accept vLLM's choice")
    return out
