"""Issue 18: what the twin's W4A16 GEMV compiles to for Hopper (benchmarks/int4_sass.py), on any host.

Triton compiles for sm_90 without a GPU; the main loop's SASS is counted per int4 weight. These
tests pin the code generation the kernel's design relies on: 16-byte weight loads, and the inline-PTX
nibble conversion (``Config.asm``) issuing one logic op per weight where Triton's own code issues two.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import int4_sass  # noqa: E402

from vllm_patch import twin_gemv_kernel as tk  # noqa: E402


@pytest.fixture(scope="module")
def nvidia_tools():
    try:
        return int4_sass.tools()
    except FileNotFoundError as e:
        pytest.skip(f"triton's NVIDIA tools are not in this wheel: {e}")


def test_asm_nibbles_halve_the_logic_ops_and_keep_wide_loads(nvidia_tools):
    plain = int4_sass.profile(tk.Config("gemv", bm=1, bn=128, bkp=16, warps=4))
    asm = int4_sass.profile(tk.Config("gemv", bm=1, bn=128, bkp=16, warps=4, asm=True))
    for p in (plain, asm):
        assert p["loop_instructions"] > 100, p  # the main loop was found
        assert p["ops_per_weight"].get("LDG.128", 0) > 0, p  # weights arrive as 16-byte loads
        assert p["ops_per_weight"].get("FFMA", 0) >= 1.0, p  # one product a weight
    assert plain["ops_per_weight"]["LOP3"] >= 1.8, plain
    assert asm["ops_per_weight"]["LOP3"] <= 1.1, asm
    assert asm["instr_per_weight"] < plain["instr_per_weight"] - 0.8, (plain, asm)


def test_benchmark_writes_a_run_folder(nvidia_tools, tmp_path):
    assert int4_sass.main(["--configs", "default", "--out-root", str(tmp_path)]) == 0
    (run,) = tmp_path.iterdir()
    text = (run / "README.md").read_text()
    assert "sm_90" in text and "-asm" in text
    rows = (run / "configs.csv").read_text().splitlines()
    assert len(rows) == 1 + len(int4_sass.configs("default"))
