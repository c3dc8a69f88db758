"""Issue 20, continued (tests/test_serving.py has the E17 run): a bounded load test of one serving leg, 320
fresh requests with images at concurrency 16 against the twin drafting (strict) and against a vanilla server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TINY_PROMPTS
from serving_checks import alive, records

pytestmark = pytest.mark.vllm


# enough requests that the server's memory is sampled at least 8 times (every 0.5 s) after its prime pass: 20
# waves of 16, each request its own (fresh: every image processed, every prompt prefilled)
N_LOAD = 320

def _load_prompts(path: Path, n: int) -> Path:
    base = [json.loads(line) for line in TINY_PROMPTS.read_text().splitlines()]
    with path.open("w") as f:
        for i in range(n):
            p = dict(base[i % len(base)])
            p["pid"] = f"{p['pid']}-r{i:03d}"
            p["images"] = [str((TINY_PROMPTS.parent / im).resolve()) for im in p["images"]]
            f.write(json.dumps(p) + "\n")
    return path


def test_bounded_load_strict_twin_at_concurrency_16(tmp_path, tiny_models):
    """320 fresh requests (images included) at concurrency 16, strict twin vs a vanilla server: every request
    answered, every output equal, counters = the per-request trace, the server's memory flat after warm-up."""
    from workbench.knobs import Knobs
    from workbench.leg import LegConfig

    prompts = _load_prompts(tmp_path / "load.jsonl", N_LOAD)
    summaries = {}
    for name, draft, knobs in (("vanilla", None, Knobs()),
                               ("strict", str(tiny_models["twin-dequant"]), Knobs(gamma=4))):  # float32, as in test_serving.py
        out = tmp_path / name
        out.mkdir()
        cfg = LegConfig(target=str(tiny_models["target"]), prompts=str(prompts), out=str(out), max_tokens=12,
                        draft=draft, knobs=knobs, max_model_len=1024, max_num_seqs=16, dtype="float32",
                        ignore_eos=True, leg=f"load_{name}", cpu_threads=2)
        (out / "leg.json").write_text(json.dumps(cfg.to_dict()))
        proc = subprocess.run([sys.executable, "-m", "workbench.serve_leg", "--config", str(out / "leg.json")],
                              cwd=REPO, capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stderr[-3000:]
        summaries[name] = json.loads((out / "summary.json").read_text())
        assert not alive(json.loads((out / "server.json").read_text())["pid"])
    for s in summaries.values():
        assert s["completed"] == s["n_requests"] == N_LOAD
    van = sorted(records(tmp_path / "vanilla"), key=lambda r: r["request_index"])
    spec = sorted(records(tmp_path / "strict"), key=lambda r: r["request_index"])
    assert [r["generated_text"] for r in spec] == [r["generated_text"] for r in van]
    assert all(r["output_tokens"] == 12 for r in spec)
    c = summaries["strict"]["spec"]
    assert sum(r["spec"]["accepted"] for r in spec) == c["num_accepted_tokens"] > 0
    assert sum(r["spec"]["drafts"] for r in spec) == c["num_drafts"]
    # memory: after the first quarter of the load, the server's resident memory stays within 10 % (and 100 MiB).
    # Measured here: flat for the first ~60 % of the load, then +4.5 % (184 MiB of 4096) by its end; one run of
    # three went past 5 %. Not yet explained (a candidate: the trace's per-step buffers, held until the flush).
    rss = summaries["strict"]["server"]["rss_mb"]
    assert len(rss) >= 8, rss
    t_end = rss[-1][0]
    warm = [mb for t, mb in rss if t >= t_end / 4]
    growth = max(warm) - warm[0]
    assert growth <= max(0.10 * warm[0], 100.0), f"server memory grew {growth:.0f} MiB under load: {rss}"
