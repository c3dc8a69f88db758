"""The CUDA W4A16 decode kernel on a CPU: its layout and math, emulated with the kernel's own index math
against the dequantized checkpoint; its source compiled for sm_90a where nvcc is on PATH."""
import dataclasses
import re
import shutil
import subprocess
from itertools import product
from pathlib import Path

import pytest
import torch

from vllm_patch import twin_cuda
from vllm_patch import twin_cuda_layout as L


def checkpoint(n, k, group, symmetric, seed=0):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=gen)
    scales = (torch.rand(n, k // group, generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
    zeros = None if symmetric else torch.randint(-2**31, 2**31 - 1, (-(-n // 8), k // group), dtype=torch.int32,
                                                 generator=gen)
    return packed, scales, zeros


def reference(packed, scales, zeros, group):
    """fp32 [N, K] dequantized from the checkpoint tensors (natural order, independent of the repack)."""
    n, k8 = packed.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    q = ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(n, 8 * k8).float()
    if zeros is None:
        z = torch.full((n, k8 * 8 // group), 8.0)
    else:
        z = ((zeros.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF).reshape(-1, zeros.shape[1])[:n].float()
    return (q - z.repeat_interleave(group, 1)) * scales.float().repeat_interleave(group, 1)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("n,k", [(48, 256), (40, 384), (8, 128), (21, 512)])
def test_kernel_index_math_reads_the_checkpoint_weight(n, k, group, symmetric):
    if k % group:
        pytest.skip("group does not divide K")
    packed, scales, zeros = checkpoint(n, k, group, symmetric, seed=n + k + group)
    st = L.repack(packed, scales, zeros, group)
    t = -(-n // 16)
    assert st["qw"].shape == (t, k // 64, 32, 4) and st["sc"].shape == (t, k // group, 8)
    assert (st["zp"] is None) == symmetric
    ref = reference(packed, scales, zeros, group)
    assert torch.equal(L.kernel_weight(st), ref)  # exact: every nibble, scale and zero point where read


@pytest.mark.parametrize("m", [5, 16], ids=["one-token-tile", "two-token-tiles"])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", [32, 128])
def test_emulated_accumulation_matches_the_dequantized_product(group, symmetric, m):
    """One token tile: the 128 offsets cancel to fp32 rounding; two: the zero point subtracted in bf16 first
    (exact), so the sums are the dequantized product's up to fp32 rounding too, and differ from the one-tile
    order's."""
    n, k = 56, 512
    packed, scales, zeros = checkpoint(n, k, group, symmetric, seed=7)
    st = L.repack(packed, scales, zeros, group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ref = x.float() @ reference(packed, scales, zeros, group).t()
    got = L.emulate_mm(x, st)
    assert ((got - ref).abs().max() / ref.abs().max()) < 1e-5
    if m > L.TOKEN_TILE:  # the two orders are both exact to rounding, and not the same rounding
        assert not torch.equal(got[:5], L.emulate_mm(x[:5], st))


def test_padding_rows_are_zero_and_tiles_are_contiguous_along_k():
    packed, scales, zeros = checkpoint(20, 128, 64, False, seed=3)
    st = L.repack(packed, scales, zeros, 64)
    sc_pad = st["sc"][1].view(torch.int16).view(-1, 8, 2)[:, 4:, 1]  # rows 16 + 8 + 4.. are past N = 20
    assert torch.equal(sc_pad, torch.zeros_like(sc_pad))
    # tile 0's first chunk, lane 0, step 0, nibble 0 is W[0, 0]; nibble 1 is W[8, 0]; nibble 4 is W[0, 1]
    q = L.unpack_cols(packed)
    v = int(st["qw"][0, 0, 0, 0]) & 0xFFFFFFFF
    assert [(v >> (4 * j)) & 15 for j in (0, 1, 4, 2)] == [int(q[0, 0]), int(q[8, 0]), int(q[0, 1]), int(q[0, 2])]


def test_the_plans_limits_are_the_kernels():
    """The launch plan (Python) and the kernels (C++) share their limits: warps a CTA, the staged x rows and the
    TMA-fed kernel's scales a warp; the binding refuses a plan beyond them, the planner never makes one."""
    api = (twin_cuda.CSRC / "twin_w4a16_api.h").read_text()

    def const(name):
        m = re.search(rf"constexpr int {name} = (\d+)( \* 1024)?;", api)
        assert m, name
        return int(m.group(1)) * (1024 if m.group(2) else 1)

    assert const("kWarps") == twin_cuda.WARPS
    assert const("kXStageBytes") == twin_cuda.X_STAGE_BYTES
    assert const("kBulkMetaBytes") == twin_cuda.BULK_META_BYTES
    for n, k in ((10240, 5120), (5120, 25600), (51200, 5120), (40, 128 * 64)):
        for m in (1, 4, 8):
            for group in L.GROUPS:
                p = twin_cuda.plan(n, k, m, group)
                assert min(m, 8) * (p.cps * 8 + 1) * 16 <= twin_cuda.X_STAGE_BYTES, (n, k, m, p)
                b = twin_cuda.plan(n, k, m, group, bulk=True)
                assert b.r * -(-b.cps * 64 // group) * 48 <= twin_cuda.BULK_META_BYTES, (n, k, m, b)


def test_shapes_the_kernel_does_not_take_are_refused():
    packed, scales, zeros = checkpoint(16, 96, 32, True)
    with pytest.raises(ValueError, match="multiple of 64"):
        L.repack(packed, scales, zeros, 32)
    packed, scales, zeros = checkpoint(16, 256, 256, True)
    with pytest.raises(ValueError, match="group size"):
        L.repack(packed, scales, zeros, 256)


def test_the_staged_kernel_takes_one_or_two_row_tiles_without_the_deep_ring():
    for bad in ({"r": 4}, {"deep": True}, {"pdl": True}):
        with pytest.raises(ValueError, match="the staged kernel"):
            twin_cuda.plan(5120, 8192, 1, 128, pipe=True, **bad)


def test_the_tma_fed_kernel_is_a_plan_of_its_own():
    """``bulk`` changes which kernel runs, not the plan's row tiles and token tiles, and takes neither the deep
    scale ring nor the staging; the sweep holds its default plan."""
    for bad in ({"deep": True}, {"pipe": True}):
        with pytest.raises(ValueError, match="TMA-fed"):
            twin_cuda.plan(5120, 8192, 1, 128, bulk=True, **bad)
    for n, k, m in ((10240, 5120, 1), (5120, 25600, 4), (51200, 5120, 16)):
        b, d = twin_cuda.plan(n, k, m, 128, bulk=True), twin_cuda.plan(n, k, m, 128)
        assert b.bulk and b.pdl and (b.r, b.nt, b.grid[0], b.grid[2]) == (d.r, d.nt, d.grid[0], d.grid[2])
        assert b.cps % b.ring == 0 or b.cps == -(-k // 64)  # splits on whole rings (each caps a split its own way)
        assert b in twin_cuda.sweep_plans(n, k, m, 128)


def test_programmatic_dependent_launch_is_the_default_launch_of_the_default_plan():
    """``pdl`` changes how the default plan's kernel is launched, nothing of the plan itself. It is the default
    (measured ahead of the plain launch at every M, results/int4-gemm/20261206T015518Z-h100), except for the
    staged kernel, which has no such launch; the sweep times the plain launch (``own-cuda[plain]``)."""
    for n, k, m in ((10240, 5120, 1), (5120, 25600, 4), (51200, 5120, 16)):
        pdl, plain = twin_cuda.plan(n, k, m, 128), twin_cuda.plan(n, k, m, 128, pdl=False)
        assert pdl == twin_cuda.plan(n, k, m, 128, pdl=True)
        assert not plain.pdl and pdl.pdl and pdl.tag == plain.tag + "-pdl"
        assert not twin_cuda.plan(n, k, m, 128, pipe=True).pdl
        assert (pdl.r, pdl.nt, pdl.cps, pdl.splits, pdl.grid) == (plain.r, plain.nt, plain.cps, plain.splits, plain.grid)
        assert pdl in twin_cuda.sweep_plans(n, k, m, 128) and plain in twin_cuda.sweep_plans(n, k, m, 128)
    src = (twin_cuda.CSRC / "twin_w4a16.cuh").read_text()
    body = src[src.index("w4a16_decode(const Params p)"):]
    # the kernel reads x only after it waited for the kernel before (which writes x): the wait comes before the
    # first load of x, and the weights' first ring before the wait
    assert body.index("buf[d][r] = ld_stream") < body.index("pdl_wait();") < body.index("cp_async_b16(xs")


def test_launch_plan_covers_k_in_whole_groups_and_rings():
    for n, k, m in ((10240, 5120, 1), (5120, 8192, 4), (51200, 5120, 16), (5120, 25600, 1), (40, 128, 33)):
        for group in L.GROUPS:
            plan = twin_cuda.plan(n, k, m, group, sms=132)
            c = k // 64
            assert plan.cps % max(1, group // 64) == 0 and plan.cps % plan.ring == 0 or plan.cps >= c
            assert plan.splits == -(-c // plan.cps) and plan.splits * plan.cps >= c
            assert plan.nt == (1 if m <= 8 else 2) and plan.grid[2] == -(-m // (8 * plan.nt))
            assert plan.grid[0] * twin_cuda.WARPS * plan.r * 16 >= n
            staged = twin_cuda.plan(n, k, m, group, sms=132, pipe=True)
            assert staged.pipe and staged.r <= 2 and staged.cps % max(1, group // 64) == 0 or staged.cps >= c
            # the default's waves: 3 at every M (the sweep's measurement)
            assert plan == twin_cuda.plan(n, k, m, group, sms=132, r=plan.r, waves=3.0)


@pytest.fixture(scope="module")
def nvrtc_info(tmp_path_factory):
    """Every instance compiled by NVRTC for sm_90a: ptxas's facts per instance."""
    from vllm_patch import twin_cuda_compile as cc

    if cc.nvrtc_paths() is None:
        pytest.fail("no NVRTC in this environment: torch's CUDA wheels (nvidia-cuda-nvrtc) install it; "
                    "scripts/setup_env.sh installs them with torch")
    return cc.compile_cubin_nvrtc(tmp_path_factory.mktemp("nvrtc"), "sm_90a")[1]


def test_cuda_source_compiles_for_sm90a_without_spills(nvrtc_info):
    """On any host: NVRTC (torch's CUDA wheels) compiles every instance for sm_90a, as ptxas reports them."""
    info = nvrtc_info
    assert sorted(info) == sorted([twin_cuda.instance_name(*i) for i in twin_cuda.INSTANCES]
                                  + [twin_cuda.instance_name(*i, pipe=True) for i in twin_cuda.PIPE_INSTANCES]
                                  + [twin_cuda.instance_name(*i, bulk=True) for i in twin_cuda.BULK_INSTANCES]
                                  + ["dequant"])
    # the large-M path's dequantization: a thread a 16-byte word, few registers, no spills, no shared memory
    assert info["dequant"]["spill_bytes"] == 0 and info["dequant"]["regs"] <= 64 and not info["dequant"]["smem_bytes"]
    for name, r in info.items():
        if name.endswith("-bulk") or name == "dequant":
            continue  # its own limits, below
        assert r["spill_bytes"] == 0 or r["regs"] >= 250, (name, r)  # only the widest tiles may spill
        assert r["regs"] <= 255 and (r["smem_bytes"] < 1024 or name.endswith("-pipe")), (name, r)
    # the TMA-fed kernel: one chunk in registers (3 CTAs an SM: at most 168 a thread), its ring in dynamic shared
    # memory (ptxas reports the static part: the barriers); spills only at 4 row tiles, never at group 128 and
    # one token tile (the 32B gate_up's plan at M <= 8)
    for i in twin_cuda.BULK_INSTANCES:
        r = info[twin_cuda.instance_name(*i, bulk=True)]
        assert r["regs"] <= 168 and r["smem_bytes"] < 1024 and (r["spill_bytes"] == 0 or i[0] == 4), (i, r)
        assert r["spill_bytes"] == 0 or i[1:3] != (1, 4), (i, r)
    # the M <= 8 instances of the default plans (r 1 / 2 / 4, one token tile) never spill, nor the deep scale
    # ring's at r 1 and 2 (the plans that carry it; r 4 is already at 255 registers without it)
    assert all(info[twin_cuda.instance_name(r, 1, gs, z)]["spill_bytes"] == 0
               for r in (1, 2, 4) for gs in (1, 2, 4) for z in (False, True))
    assert all(info[twin_cuda.instance_name(r, 1, gs, z, True)]["spill_bytes"] == 0
               for r in (1, 2) for gs in (2, 4) for z in (False, True))
    # the staged kernel: one chunk in registers (3 CTAs an SM: at most 170 a thread), its ring in shared memory
    for i in twin_cuda.PIPE_INSTANCES:
        r = info[twin_cuda.instance_name(*i, pipe=True)]
        assert r["spill_bytes"] == 0 and r["regs"] <= 170 and 24 * 1024 < r["smem_bytes"] <= 48 * 1024, (i, r)


def decode_kernel_ops(sass: str) -> list[str]:
    """The SASS instructions of the decode kernels of a cubin (the large-M path's kernels, compiled beside them,
    are left out: their own 16-byte loads are not x's)."""
    funcs = [f for f in sass.split("Function : ")[1:] if "w4a16_decode" in f.split("\n", 1)[0]]
    assert funcs, "no decode kernel in the cubin"
    return [m.group(1).strip() for f in funcs for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+([^;]*);", f)]


def test_under_pdl_the_weight_ring_is_loaded_before_the_wait(tmp_path):
    """In the SASS NVRTC builds for sm_90a: the kernel lets its dependents start (PREEXIT) before anything
    it loads, and every 16-byte streaming load of the first weight ring (r 2: 4 chunks x 2 row tiles) comes
    before the wait for the kernel before (ACQBULK), and every load of x after it. With the wait first written
    unconditionally after the loads, ptxas hoisted it above all of them (the early launch would have bought
    nothing); with x read through the read-only path, ptxas moved x's first loads above the wait (a race)."""
    import triton

    from vllm_patch import twin_cuda_compile as cc

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    assert cuobjdump.is_file(), f"Triton's NVIDIA backend ships cuobjdump; not found at {cuobjdump}"
    cubin, _ = cc.compile_cubin_nvrtc(tmp_path, "sm_90a", instances=[(2, 1, 4, True, False)], pipe_instances=[],
                                      bulk_instances=[])
    sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = decode_kernel_ops(sass)
    # (either may carry a predicate: both run only when the kernel was launched as a dependent)
    first = {name: next(i for i, op in enumerate(ops) if name in op.split()) for name in ("PREEXIT", "ACQBULK")}
    loads = [i for i, op in enumerate(ops) if "LDG" in op]
    ring = [i for i, op in enumerate(ops) if "LDG.E.NA.LTC256B.128" in op]  # ld_stream: the weights
    assert first["PREEXIT"] < loads[0]
    assert sum(i < first["ACQBULK"] for i in ring) == twin_cuda.ring_depth(2) * 2, ops[:first["ACQBULK"] + 1]
    # x (written by the kernel before) only after the wait (read through the read-only path, __ldg, ptxas had
    # moved its first loads above it): staged by the CTA into shared memory (cp.async: LDGSTS), never read from
    # global memory into registers
    xs = [i for i, op in enumerate(ops) if any(t.startswith("LDGSTS") for t in op.split())]
    assert xs and min(xs) > first["ACQBULK"], ops[:first["ACQBULK"] + 1]
    assert not any(t.startswith("LDG.E.128") for op in ops for t in op.split())


def test_the_tma_fed_kernel_issues_its_whole_ring_before_the_wait(tmp_path):
    """In the SASS NVRTC builds for sm_90a of the TMA-fed kernel (r 2, group 128): dependents released first
    (PREEXIT), then a stage's expected bytes, then the first ring's weight copies before the wait for the kernel
    before (ACQBULK) and its x copies after it (the ring's depth is M's: the loops are not unrolled, so the
    SASS has one copy instruction per loop, not one per stage); no 16-byte global loads (x comes by bulk copy)."""
    import triton

    from vllm_patch import twin_cuda_compile as cc

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    cubin, _ = cc.compile_cubin_nvrtc(tmp_path, "sm_90a", instances=[], pipe_instances=[],
                                      bulk_instances=[(2, 1, 4, True)])
    sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = decode_kernel_ops(sass)
    wait = next(i for i, op in enumerate(ops) if "ACQBULK" in op.split())
    pre = next(i for i, op in enumerate(ops) if "PREEXIT" in op.split())
    copies = [i for i, op in enumerate(ops) if "UBLKCP" in op]
    assert pre < min(copies) and any(i < wait for i in copies) and any(i > wait for i in copies), ops[:wait + 1]
    arrives = [i for i, op in enumerate(ops) if "SYNCS.ARRIVE.TRANS64" in op]
    assert min(arrives) < min(copies) < wait
    # x comes by bulk copies too, after the wait: no 16-byte global loads to registers (LDGSTS: the scales'
    # cp.async into shared memory)
    assert not any(t.startswith("LDG.") and ".128" in t for op in ops for t in op.split())


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH to compare NVRTC's build with")
def test_nvrtc_builds_the_kernel_nvcc_builds(nvrtc_info, tmp_path):
    """The source NVRTC sees (host code guarded by __CUDACC_RTC__) is the kernel nvcc builds: same registers
    (the one-token-tile instances of group 128, both flavours, both scale rings, the staged and the TMA-fed
    kernel: a compile of all takes minutes)."""
    some = [i for i in twin_cuda.INSTANCES if i[1] == 1 and i[2] == 4]
    pipe = [i for i in twin_cuda.PIPE_INSTANCES if i[1] == 1 and i[2] == 4]
    bulk = [i for i in twin_cuda.BULK_INSTANCES if i[1] == 1 and i[2] == 4]
    by_nvcc = twin_cuda.compile_cubin(tmp_path, arch="sm_90a", instances=some, pipe_instances=pipe,
                                      bulk_instances=bulk)[1]
    assert len(by_nvcc) == len(some) + len(pipe) + len(bulk) + 1 == 23  # and the large-M path's dequantization
    plain = [k for k in by_nvcc if not k.endswith(("-pipe", "-bulk")) and k != "dequant"]
    # (within a few registers: the two front ends schedule the x staging's loop a little differently)
    assert all(abs(by_nvcc[k]["regs"] - nvrtc_info[k]["regs"]) <= 4 for k in plain), (
        {k: (by_nvcc[k]["regs"], nvrtc_info[k]["regs"]) for k in plain})
    assert all(by_nvcc[k]["spill_bytes"] == nvrtc_info[k]["spill_bytes"] for k in plain)
    # the staged and TMA-fed kernels' register counts differ by a few between the two front ends (their copy
    # lambdas); both compile them without spills
    assert all(by_nvcc[k]["spill_bytes"] == nvrtc_info[k]["spill_bytes"] == 0 for k in by_nvcc if k not in plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (and nvcc to build the extension)")
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_cuda_kernel_matches_the_dequantized_reference(group, symmetric):
    dev = torch.device("cuda")
    for n, k in ((40, 256), (1000, 1024), (5120, 8192)):
        packed, scales, zeros = checkpoint(n, k, group, symmetric, seed=n)
        ref_w = reference(packed, scales, zeros, group).to(dev)
        st = L.repack(packed.to(dev), scales.to(dev), None if zeros is None else zeros.to(dev), group)
        for m in (1, 3, 8, 9, 16, 33):
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            ref = x.float() @ ref_w.t()
            variants = [(r, w, d, False, False) for r, w, d in product((1, 2, 4), (1.0, 4.0, 16.0), (False, True))]
            variants += [(r, w, False, True, False) for r, w in product((1, 2), (1.0, 4.0, 16.0))]  # staged kernel
            if torch.cuda.get_device_capability(dev)[0] >= 9:  # the TMA-fed kernel
                variants += [(r, w, False, False, True) for r, w in product((1, 2, 4), (1.0, 4.0, 16.0))]
            for r, waves, deep, pipe, bulk in variants:  # one split and several
                p = twin_cuda.plan(n, k, m, group, twin_cuda.sm_count(dev), r=r, waves=waves, deep=deep, pipe=pipe,
                                   bulk=bulk)
                y = twin_cuda.w4a16_mm(x, st, p).float()
                err = float((y - ref).abs().max() / ref.abs().max())
                assert err < 8e-3, (n, k, m, r, p, err)  # bf16 output rounding
                assert torch.equal(y, twin_cuda.w4a16_mm(x, st, p).float())  # deterministic split-K
                if deep or pipe or bulk:  # the same sums in the same order: the scale ring, staging or TMA change
                    # when the bytes arrive, not what is summed (the same tiles and splits: bulk caps a split)
                    flat = dataclasses.replace(p, deep=False, pipe=False, bulk=False)
                    assert torch.equal(y, twin_cuda.w4a16_mm(x, st, flat).float())
                if not pipe:  # launched plainly, not as a programmatic dependent: the same kernel, the same sums
                    assert p.pdl
                    plain = twin_cuda.plan(n, k, m, group, twin_cuda.sm_count(dev), r=r, waves=waves, deep=deep,
                                           pdl=False, bulk=bulk)
                    assert torch.equal(y, twin_cuda.w4a16_mm(x, st, plain).float())
    assert int(twin_cuda.counters(dev).abs().sum()) == 0  # every call leaves the counters zero


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (and nvcc to build the extension)")
@pytest.mark.parametrize("bulk", [False, True], ids=["register-ring", "tma-fed"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
def test_a_chain_of_dependent_launches_reads_each_x_after_it_was_written(graph, bulk):
    """Each GEMM's x is the output of the kernel before it (the GEMM before, or a torch op between two): with
    programmatic dependent launch the next GEMM starts loading its weights early, and must still read x only
    once written. The chain under PDL equals the chain launched plainly, bit for bit, eagerly and replayed
    from a CUDA graph; split-K calls share the counters."""
    dev = torch.device("cuda")
    if bulk and torch.cuda.get_device_capability(dev)[0] < 9:
        pytest.skip("the TMA-fed kernel needs SM 9.0")
    sms = twin_cuda.sm_count(dev)
    layers = []
    for i, (n, k) in enumerate(((4096, 4096), (11008, 4096), (4096, 11008), (4096, 4096)) * 2):
        packed, scales, zeros = checkpoint(n, k, 128, i % 2 == 1, seed=100 + i)
        layers.append(L.repack(packed.to(dev), scales.to(dev), None if zeros is None else zeros.to(dev), 128))

    def chain(x, pdl):
        for i, st in enumerate(layers):
            p = twin_cuda.plan(st["n"], st["k"], x.shape[0], 128, sms, pdl=pdl, bulk=bulk)
            x = twin_cuda.w4a16_mm(x, st, p)
            x = x / x.float().abs().amax().clamp(min=1e-3).to(x.dtype) if i % 3 == 2 else x  # a torch op between
        return x

    for m in (1, 4, 16):
        x = torch.randn(m, 4096, device=dev).to(torch.bfloat16)
        want = chain(x, False)
        if graph:
            xs = x.clone()
            for _ in range(2):
                chain(xs, True)  # workspace and extension outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = chain(xs, True)
            for _ in range(3):
                g.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, want), m
        else:
            for _ in range(3):
                assert torch.equal(chain(x, True), want), m
    assert int(twin_cuda.counters(dev).abs().sum()) == 0


def test_the_extension_is_cached_per_torch_and_cuda_version(monkeypatch):
    """torch's loader rebuilds on changed sources or flags only: a build cached by another torch (the GPU host's
    own torch beside a staged one) must not be loaded, so the extension's name carries both versions."""
    name = twin_cuda.extension_name()
    assert name.isidentifier() and name.startswith("twin_w4a16_")
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    other = twin_cuda.extension_name()
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert len({name, other, twin_cuda.extension_name()}) == 3


def test_above_large_m_the_call_takes_the_dequantized_path(monkeypatch):
    """More than LARGE_M tokens (a prefill) go to mm_large, not to the decode kernel's plan (which would read the
    weights once per 16 tokens and run out of split-K counters); an explicit plan keeps the decode kernel."""
    packed, scales, zeros = checkpoint(48, 256, 128, False)
    st = L.repack(packed, scales, zeros, 128)
    calls = []
    monkeypatch.setattr(twin_cuda, "mm_large", lambda x, s: calls.append(x.shape[0]) or "large")
    monkeypatch.setattr(twin_cuda, "extension", lambda: pytest.fail("the decode kernel was called"))
    monkeypatch.setattr(twin_cuda, "sm_count", lambda device: 132)
    x = torch.zeros(twin_cuda.LARGE_M + 1, 256, dtype=torch.bfloat16)
    assert twin_cuda.w4a16_mm(x, st) == "large" and calls == [twin_cuda.LARGE_M + 1]
    with pytest.raises(pytest.fail.Exception):  # at LARGE_M, and with a plan, the decode kernel
        twin_cuda.w4a16_mm(x[:twin_cuda.LARGE_M], st)
    with pytest.raises(pytest.fail.Exception):
        twin_cuda.w4a16_mm(x, st, twin_cuda.plan(48, 256, x.shape[0], 128))
    assert calls == [twin_cuda.LARGE_M + 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (and nvcc to build the extension)")
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_dequantized_rows_are_the_kernels_weight_rounded_once(group, symmetric):
    """The large-M path's bf16 rows: s (q - z) of the kernel's own index math, rounded once (bit for bit), for the
    whole layout and for any slice of row tiles; rows past N are not written."""
    dev = torch.device("cuda")
    for n, k in ((40, 256), (1000, 1024), (21, 512)):
        packed, scales, zeros = checkpoint(n, k, group, symmetric, seed=n)
        st = L.repack(packed.to(dev), scales.to(dev), None if zeros is None else zeros.to(dev), group)
        want = L.kernel_weight(st).to(torch.bfloat16)
        assert torch.equal(twin_cuda.dequant(st), want)
        assert torch.equal(want.float(), reference(packed, scales, zeros, group).to(dev).to(torch.bfloat16).float())
        t_all = st["qw"].shape[0]
        for t0, tiles in ((0, 1), (1, t_all - 1), (t_all - 1, 1)):
            out = torch.full((16 * tiles + 5, k), float("nan"), dtype=torch.bfloat16, device=dev)
            w = twin_cuda.dequant(st, t0, tiles, out=out)
            rows = min(16 * tiles, n - 16 * t0)
            assert w.shape[0] == rows and torch.equal(w, want[16 * t0:16 * t0 + rows])
            assert out[rows:].isnan().all()  # past N (and past the slice): untouched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (and nvcc to build the extension)")
@pytest.mark.parametrize("symmetric", [False, True])
def test_large_m_matches_the_reference_in_slices(symmetric, monkeypatch):
    """Above LARGE_M: the product of x with the dequantized rows, slice by slice (a small slice budget forces
    several, the last one partial), against the dequantized reference; a 32B gate_up prefill of 8192 tokens
    runs (the decode kernel's counters would not cover its blocks)."""
    dev = torch.device("cuda")
    n, k, group = 1000, 1024, 128
    packed, scales, zeros = checkpoint(n, k, group, symmetric, seed=7)
    st = L.repack(packed.to(dev), scales.to(dev), None if zeros is None else zeros.to(dev), group)
    ref_w = reference(packed, scales, zeros, group).to(dev)
    for budget in (twin_cuda.DEQUANT_SLICE_BYTES, 16 * k * 2 * 7):  # one slice; 7 tiles a slice (9 slices)
        monkeypatch.setattr(twin_cuda, "DEQUANT_SLICE_BYTES", budget)
        for m in (twin_cuda.LARGE_M + 1, 300, 2048):
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            y = twin_cuda.w4a16_mm(x, st)
            ref = x.float() @ ref_w.t()
            assert y.shape == (m, n) and y.dtype == torch.bfloat16
            assert float((y.float() - ref).abs().max() / ref.abs().max()) < 8e-3, (budget, m)
    monkeypatch.undo()
    n, k = 51200, 5120  # the 32B twin's gate_up
    packed, scales, zeros = checkpoint(n, k, group, symmetric, seed=8)
    st = L.repack(packed.to(dev), scales.to(dev), None if zeros is None else zeros.to(dev), group)
    x = torch.randn(8192, k, device=dev).to(torch.bfloat16)
    y = twin_cuda.w4a16_mm(x, st)
    rows = torch.arange(0, n, 997, device=dev)
    ref = x[:64].float() @ twin_cuda.dequant(st)[rows].float().t()
    assert float((y[:64, rows].float() - ref).abs().max() / ref.abs().max()) < 8e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (and nvcc to build the extension)")
def test_silu_mul_kernels_match_their_emulation():
    """silu(gate) * up over a paired layout's output and over a merged [gate | up] output (the hybrid's Marlin
    path): the layout emulation's math, within one bf16 rounding (expf against torch.exp), for M 1-2048; a slice
    of a wider buffer too."""
    dev = torch.device("cuda")
    for m, n in ((1, 64), (16, 24576), (80, 2048), (2048, 512)):
        h = (torch.randn(m, n, device=dev) * 4).to(torch.bfloat16)
        for got, want in ((twin_cuda.silu_mul_halves(h), L.silu_mul_halves(h)),
                          (twin_cuda.silu_mul_pairs(h), L.silu_mul(h))):
            assert got.shape == (m, n // 2) and got.dtype == torch.bfloat16
            diff = (got.float() - want.float()).abs()
            assert float((diff / want.float().abs().clamp_min(1e-3)).max()) <= 2 ** -7, (m, n)
    wide = (torch.randn(16, 1024, device=dev) * 4).to(torch.bfloat16)[:, :512]
    assert torch.allclose(twin_cuda.silu_mul_halves(wide).float(), L.silu_mul_halves(wide).float(), rtol=2 ** -7,
                          atol=1e-3)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH: the walk probe is a host program")
def test_the_walk_probe_builds(tmp_path):
    """benchmarks/int4_walk_probe.cu, whose output backs the x staging (results/int4-probe), builds as its
    header says (the GPU host runs it)."""
    src = Path(__file__).resolve().parents[1] / "benchmarks" / "int4_walk_probe.cu"
    res = subprocess.run(["nvcc", "-O3", "-std=c++17", "-arch=sm_90a", "-o", str(tmp_path / "probe"), str(src)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "nvcc -O3 -std=c++17 -arch=sm_90a -o int4_walk_probe benchmarks/int4_walk_probe.cu" in src.read_text()
