"""#37: the own CUDA kernel's main loop counted from its SASS without a GPU (benchmarks/int4_cuda_sass.py).

NVRTC (the environment's CUDA wheels) compiles the kernel for sm_90a and Triton's nvdisasm lists it. The
tests pin what the tool's numbers rest on: the unrolled main loop covers the weight ring's chunks, the MMAs
per chunk are what ``step`` issues, the static listing is instruction for instruction the kernel an
Nsight Compute run profiled on a GPU (the committed run folders), and two revisions compare side by side.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import int4_cuda_sass as ics  # noqa: E402

from vllm_patch import twin_cuda, twin_cuda_compile as tcc  # noqa: E402

NCU_RUN = REPO / "results" / "int4-ncu-source" / "20261207T151500Z-h100"  # kernel of 0a119ac, M = 16
RING_RUN = REPO / "results" / "int4-ncu-source" / "20261207T191938Z-h100"  # x through a block ring (9a4042f)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    if tcc.compiler() is None:
        pytest.fail("no NVRTC in this environment: the CUDA wheels torch installs carry it (nvidia-cuda-nvrtc)")
    ics.nvdisasm()
    insts = [(1, 2, 4, True, False), (2, 1, 4, True, False), (4, 2, 4, False, False), (2, 1, 4, True, True)]
    return ics.compile_sass(tcc.CSRC, insts, tmp_path_factory.mktemp("sass"))[0]


def _have(rev: str) -> bool:
    return subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{rev}^{{commit}}"],
                          capture_output=True).returncode == 0


def test_the_main_loop_covers_the_weight_ring_and_issues_steps_mmas(compiled):
    for inst, ins in compiled.items():
        r, nt, _, _, deep = inst
        prof = ics.loop_profile(inst, ins)
        assert prof["chunks_per_iteration"] == twin_cuda.ring_depth(r) * (2 if deep else 1), inst
        assert prof["classes"]["mma"] == ics.mma_per_chunk(inst), inst
        # one 16-byte weight load a row tile and chunk, x's loads (none where x is staged: one token tile)
        assert prof["ops"]["LDG"] >= r, inst
        assert prof["per_chunk"] > prof["classes"]["mma"] + prof["classes"]["decode"], inst


def test_the_static_listing_is_the_kernel_nsight_compute_profiled(tmp_path):
    for run, rev in ((NCU_RUN, "0a119ac"), (RING_RUN, "9a4042f")):
        if not _have(rev):
            pytest.skip(f"commit {rev} is not in this checkout (a shallow clone): the committed ncu run's kernel")
        rows = ics.against(run, tmp_path)
        assert {r["gemm"] for r in rows} == {"qkv", "down"}
        for r in rows:
            assert r["same_opcodes"] == 1.0 and r["static_instructions"] == r["ran_instructions"], r
            assert r["loop_trips"] > 0 and r["loop_executed"] <= r["loop_static_x_trips"], r
    # the kernel on main: no branch inside its main loop, every instruction executes every trip
    assert [r["loop_executed"] == r["loop_static_x_trips"] for r in ics.against(NCU_RUN, tmp_path)] == [True, True]


def test_two_revisions_side_by_side_and_the_documented_command(tmp_path):
    if not _have("9a4042f"):
        pytest.skip("commit 9a4042f (the block ring of x) is not in this checkout (a shallow clone)")
    argv = ["--rev", "9a4042f", "--rev", "worktree", "--ms", "16", "--out-root", str(tmp_path)]
    assert ics.main(argv) == 0
    (out,) = tmp_path.iterdir()
    rows = {(r["rev"], r["instance"]): r for r in csv.DictReader(open(out / "instances.csv"))}
    ring, main = rows[("9a4042f", "r1-nt2-g128-zp")], rows[("worktree", "r1-nt2-g128-zp")]
    # the block ring's copy (a runtime division) and ring index math: more than twice the integer work a chunk
    assert float(ring["per_chunk"]) > 1.5 * float(main["per_chunk"])
    gemms = list(csv.DictReader(open(out / "gemms.csv")))
    assert {g["gemm"] for g in gemms} == {"qkv", "o", "gate_up", "down"} and len(gemms) == 8
    assert all(float(g["issue_floor_us"]) > 0 for g in gemms)
    assert "r1-nt2-g128-zp" in (out / "README.md").read_text() and (out / "env.json").is_file()


@pytest.mark.parametrize("argv, message", [
    (["--rev", "no-such-rev"], "--rev no-such-rev: not a revision"),
    (["--ms", "0"], "the decode kernel takes 1-64 tokens"),
    (["--sizes", "70b"], "unknown ['70b']"),
    (["--against", "/no/such/run"], "no such run folder"),
])
def test_bad_input_is_named_before_any_compile(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.setattr(ics, "compile_sass", lambda *a: pytest.fail("compiled before the input was checked"))
    try:
        rc = ics.main([*argv, "--out-root", str(tmp_path)])
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_names_and_opcodes():
    assert ics.instance_of("_ZN7twin_w412w4a16_decodeILi1ELi2ELi4ELb1ELb0EEEvNS_6ParamsE") == (1, 2, 4, True, False)
    assert ics.instance_of("void twin_w4::w4a16_decode<(int)4, (int)1, (int)2, (bool)0, (bool)1>(twin_w4::Params)") \
        == (4, 1, 2, False, True)
    assert ics.instance_of("w4a16_decode_pipe<1, 2>") is None
    assert ics.opcode("@!P0 LDG.E.128.CONSTANT R4, desc[UR4][R2.64]") == "LDG"
    assert ics.op_class("HADD2") == "decode" and ics.op_class("LDGSTS") == "shared" and ics.op_class("XYZ") == "other"
