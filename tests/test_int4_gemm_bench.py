"""benchmarks/int4_gemm.py on a CPU: the README's header names the rate its byte floors divide by."""
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("int4_gemm_bench", REPO / "benchmarks" / "int4_gemm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_floor_divides_by_the_read_rate_and_names_the_copy_rate_beside_it():
    bench = _bench()
    facts = {"gpu": "GPU", "copy_tbps": 2.75, "read_tbps": 4.21, "repeats": 5, "group": 128,
             "flavour": "uint4 with zero points", "skipped": {}}
    head = bench.markdown([], [], [1], facts).splitlines()[2]
    assert head.startswith("Read: 4.21 TB/s (a reduction over 1 GiB); floor = int4 bytes / that.")
    assert "Device copy: 2.75 TB/s (read + write of 1 GiB, for reference)" in head


def test_the_cuda_sweep_times_every_own_kernel_variant_beside_the_default():
    """``--cuda-sweep``: the default launch plan, its row tiles x CTA targets, the deep scale ring, the staged
    kernel, the plain launch (the default is a programmatic dependent launch) and the TMA-fed kernel's plans,
    each its own row (what docs/benchmarks.md's tables name); ``--bulk-sweep``: the default and the TMA-fed
    kernel's plans alone."""
    int4_gemm = _bench()
    ks, _ = int4_gemm._kernels({"own-cuda"}, cuda_sweep=True)
    names = [k.name for k in ks]
    bulk = ["own-cuda[bulk]"] + [f"own-cuda[r{r}-w{w:g}-bulk]" for r in (1, 2, 4) for w in (1.5, 3.0, 6.0)]
    assert names[0] == "own-cuda" and len(names) == len(set(names)) == 18 + len(bulk) and set(bulk) <= set(names)
    assert all(k.bulk == k.name.endswith("bulk]") for k in ks)
    only = [k.name for k in int4_gemm._kernels({"own-cuda"}, cuda_sweep=False, bulk_sweep=True)[0]]
    assert only == ["own-cuda"] + bulk
    assert {"own-cuda[deep]", "own-cuda[r2-deep]", "own-cuda[pipe]", "own-cuda[r1-pipe]", "own-cuda[plain]"} <= set(names)
    plain = next(k for k in ks if k.name == "own-cuda[plain]")
    assert (plain.pdl, plain.r, plain.waves, plain.deep, plain.pipe) == (False, None, None, False, False)
    assert ks[0].pdl is None  # the default row launches as the engine does (twin_cuda.plan's default)
    assert [k.name for k in int4_gemm._kernels({"own-cuda"}, cuda_sweep=False)[0]] == ["own-cuda"]
