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


def _layer_row(kernel, m, us):
    return {"model": "32b", "scope": "layer", "gemm": "qkv+o+gate_up+down", "kernel": kernel, "m": m,
            "us_median": us, "iqr_us": 0.1, "tbps": 1.0, "floor_us": 80.0, "check_rel_err": ""}


def test_the_report_names_the_fastest_int4_kernel_per_m_beside_the_hybrids_choice():
    """The layer set's fastest int4 kernel per M (cuBLAS on bf16 weights and the sweep's variants left out) and the
    layout each hybrid takes there, from the H100's figures (results/int4-gemm/20261207T011059Z-h100)."""
    bench = _bench()  # puts benchmarks/ on the path
    import int4_gemm_report as report

    figures = {16: (352.3, 162.8, 132.8, 178.4), 80: (375.4, 243.8, 373.9, 866.6), 2048: (2607.2, 2849.0, 6309.6, 3514.8)}
    rows = [_layer_row(k, m, us) for m, t in figures.items()
            for k, us in zip(("cublas-bf16", "machete", "marlin", "own-cuda"), t)]
    rows.append(_layer_row("own-cuda[plain]", 16, 1.0))  # a variant: never the pick
    best = {r["m"]: r for r in report.fastest_per_m(rows, "32b")}
    assert [(best[m]["fastest"], best[m]["next"]) for m in (16, 80, 2048)] == [
        ("marlin", "machete"), ("machete", "marlin"), ("machete", "own-cuda")]
    assert [best[m]["hybrid"] for m in (16, 80, 2048)] == ["marlin", "marlin", "own-cuda"]
    assert [best[m]["hybrid_machete"] for m in (16, 80, 2048)] == ["marlin", "machete", "machete"]
    facts = {"gpu": "GPU", "copy_tbps": 2.4, "read_tbps": 3.0, "repeats": 3, "group": 128,
             "flavour": "uint4 with zero points", "skipped": {}}
    md = bench.markdown(rows, [], [16, 80, 2048], facts)
    assert "| 80 | machete | 243.8 | marlin | 373.9 | marlin | machete |" in md
    one = bench.markdown([r for r in rows if r["kernel"] in ("cublas-bf16", "marlin")], [], [16], facts)
    assert "fastest int4 kernel" not in one  # one int4 kernel timed: no pick to show
