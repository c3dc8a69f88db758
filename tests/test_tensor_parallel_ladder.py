"""Issue 22, continued: the cost ladder (benchmarks/cost_ladder.py) at tensor_parallel_size 2 on the tiny
models; tests/test_tensor_parallel.py has the legs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO
from tp_legs import needs_two_cores


@needs_two_cores
@pytest.mark.vllm
def test_cost_ladder_at_tp2_times_rank_0(tmp_path):
    """The ladder's rows come from rank 0's step timer (the workers are other processes), one row set per
    cell, and its engine report is the workers', naming TP 2."""
    out = tmp_path / "ladder"
    res = subprocess.run([sys.executable, "benchmarks/cost_ladder.py", "--sizes", "tiny", "--gammas", "2",
                          "--batches", "1", "--repeats", "1", "--tokens", "8", "--tensor-parallel-size", "2",
                          "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    steps = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    walls = [json.loads(x) for x in (out / "walls.jsonl").read_text().splitlines()]
    assert {s["tensor_parallel_size"] for s in steps} == {2}
    spec = [s for s in steps if s["kind"] == "spec" and not s["prefill"]]
    assert spec and all(s["draft_ms"] is not None for s in spec)
    # one timed generate per cell, and each step once (not once per rank): 8 tokens, gamma 2, alpha = 1
    cells = [w for w in walls if "wall_s" in w and w["kind"] == "spec"]
    assert len(cells) == 2  # graphs on and off (eager) at batch 1
    for w in cells:
        n = sum(1 for s in spec if s["draft_graphs"] == w["draft_graphs"])
        assert 1 <= n <= 8, n
    reports = [w["engine_report"] for w in walls if "engine_report" in w]
    assert all(r["tensor_parallel_size"] == 2 and r["tp_ranks"] == 2 for r in reports), reports
