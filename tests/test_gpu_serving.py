"""The strict tier behind `vllm serve` on CUDA (``pytest -m gpu``; skipped where CUDA is absent).

One E17 run under the tiny profile, as a user types it, in float32 with the twin's int4 values dequantized
(FlashAttention has no float32; vLLM picks its Triton attention): vanilla server, strict twin server (the
plugin's real gate, async scheduling and the early output copy on, the CUDA defaults), vanilla server, each
driven by vLLM's benchmark client at concurrency 1 and 8. The strict server's every answer must be the
vanilla servers' text, at both concurrencies. The second run does the same under a batch-size γ schedule
(γ 6 at batch 1-2, off from 3, no draft pass when off) with the target's FULL graphs kept (knob
``target_graphs=full``: a one-token step runs a vanilla engine's FULL graph, a γ 6 step vLLM's own).
Nothing here is a timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from workbench import childproc

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on a GPU host)")]


def _texts(leg: Path) -> dict[tuple[int, int], str]:
    out = {}
    for line in (leg / "records.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[(int(r.get("concurrency") or 0), int(r["request_index"]))] = r["generated_text"]
    return out


SCHEDULED = ["-p", "gamma_schedule=1-2:6/3-8:0", "-p", "draft_idle=skip", "-p", "target_graphs=full"]


@pytest.mark.parametrize("extra", [[], SCHEDULED], ids=["fixed-gamma", "schedule-full-graphs"])
def test_strict_serving_on_cuda_equals_vanilla_at_concurrency_1_and_8(tiny_models, tmp_path, extra):
    cmd = [sys.executable, "-m", "workbench.cli", "run", "E17", "--profile", "tiny", "-p", "dtype=float32",
           "-p", "legs=strict_g{gamma}", "-p", "concurrencies=1/8", "-p", "n=13", "-p", "max_tokens=64",
           *extra, "--model-path", f"twin={tiny_models['twin-dequant']}", "--results", str(tmp_path),
           "--formats", "html", "--no-notebook"]
    # behind the parent-death trampoline: a pytest ended by a job's time limit takes the run (and its servers) along
    proc = subprocess.run(childproc.wrap(os.getpid(), cmd), cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = next(tmp_path.glob("E17/*/"))
    van1, strict, van2 = (_texts(run / "legs" / leg) for leg in ("vanilla_1", "strict_g6", "vanilla_2"))
    assert {c for c, _ in strict} == {1, 8} and len(strict) >= 26
    assert van1 == van2, "the two vanilla servers disagree (fp32)"
    diffs = sorted(k for k in strict if strict[k] != van1.get(k))
    assert not diffs, f"strict serving differs from vanilla at (concurrency, request) {diffs}"
    summary = json.loads((run / "legs" / "strict_g6" / "summary.json").read_text())
    report = summary["engine_report"]
    assert report["async_scheduling"] is True and (report.get("early_output_steps") or 0) >= 1
    assert summary["cells"] and all(c["spec"]["num_drafts"] > 0 for c in summary["cells"])
    if extra:
        assert report["target_cudagraph_mode"] == "FULL_AND_PIECEWISE" and report["gamma_schedule_dynamic"]
        assert report["target_single_token_graphs"] > 0 and report.get("draft_idle_skips", 0) > 0
