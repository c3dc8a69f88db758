"""The step timer counts Triton compiles inside a step (``vllm_patch.jit_count``), through Triton's own hooks.

A CPU host runs no Triton kernel, so the hooks are called here as Triton's ``JITFunction._do_compile`` calls
them (the cache hook before a compile, the post-compile hook after, keyword arguments, ``fn`` a
``JitFunctionInfo``); that the names exist on the Triton this environment pins is checked too."""

from __future__ import annotations

import json
import types

import pytest

triton = pytest.importorskip("triton")
from triton import knobs  # noqa: E402

from vllm_patch.jit_count import JitCounter  # noqa: E402


@pytest.fixture
def hooks():
    """Triton's two hooks as they were, put back after the test."""
    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    yield
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved


def _compile(name: str, skip_answer=None) -> object:
    """What Triton does around one compile of kernel ``name``: the cache hook (True: skip), the post hook."""
    info = types.SimpleNamespace(module="vllm.v1.spec_decode.utils", name=name, jit_function=None)
    answer = knobs.runtime.jit_cache_hook(key="k", repr=name, fn=info, compile={}, is_manual_warmup=False,
                                          already_compiled=False)
    if not answer:
        knobs.runtime.jit_post_compile_hook(key="k", repr=name, fn=info, compile={}, is_manual_warmup=False,
                                            already_compiled=False)
    return answer


def test_compiles_are_counted_per_kernel_and_the_hooks_before_still_run(hooks):
    assert hasattr(knobs.runtime, "jit_cache_hook") and hasattr(knobs.runtime, "jit_post_compile_hook")
    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(("before", kw["fn"].name)) or None
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(("after", kw["fn"].name))
    counter = JitCounter()
    assert counter.install() and counter.snapshot() == (0, 0.0)
    _compile("copy_and_expand_eagle_inputs_kernel")
    _compile("copy_and_expand_eagle_inputs_kernel")
    _compile("eagle_prepare_next_token_padded_kernel")
    n, ms = counter.snapshot()
    assert n == 3 and ms >= 0.0
    assert counter.kernels() == {"copy_and_expand_eagle_inputs_kernel": 2, "eagle_prepare_next_token_padded_kernel": 1}
    assert [s for s, _ in seen] == ["before", "after"] * 3            # the hooks that were set still run


def test_a_previous_cache_hook_that_skips_the_compile_keeps_its_answer(hooks):
    knobs.runtime.jit_cache_hook = lambda **kw: True                 # "skip": Triton compiles nothing
    knobs.runtime.jit_post_compile_hook = None
    counter = JitCounter()
    counter.install()
    assert _compile("k") is True and counter.snapshot()[0] == 0


def test_the_step_timer_writes_each_steps_compiles(hooks, tmp_path):
    from vllm_patch.telemetry import StepTimer

    knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
    timer = StepTimer(str(tmp_path), batch_steps=1)
    out = types.SimpleNamespace(num_scheduled_tokens={"a": 52}, total_num_scheduled_tokens=52,
                                scheduled_spec_decode_tokens={}, scheduled_new_reqs=["a"])
    for compiles in (2, 0):
        timer.begin(out)
        with timer.span("target"):
            for _ in range(compiles):
                _compile("copy_and_expand_eagle_inputs_kernel")
        timer.end()
    timer.flush()
    rows = [json.loads(x) for x in open(timer.path)]
    assert [r["jit_compiles"] for r in rows] == [2, 0]
    assert all(r["jit_ms"] >= 0 for r in rows) and rows[1]["jit_ms"] == 0
    assert timer.jit.kernels() == {"copy_and_expand_eagle_inputs_kernel": 2}
