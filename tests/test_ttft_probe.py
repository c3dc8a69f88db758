"""The TTFT probe (benchmarks/ttft_probe.py): bad options are refused before an engine starts; a CPU rehearsal
with the tiny models times each request from arrival to its first token's release, vanilla beside spec."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO

PROBE = REPO / "benchmarks" / "ttft_probe.py"


def _probe(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROBE), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_bad_knobs_and_sizes_are_refused_before_any_engine(tmp_path):
    bad = _probe("--gamma", "0", "--out", str(tmp_path / "a"), timeout=60)
    assert bad.returncode != 0 and "gamma" in bad.stderr
    assert not (tmp_path / "a").exists()
    short = _probe("--tokens", "1", "--out", str(tmp_path / "b"), timeout=60)
    assert short.returncode == 2 and "--tokens" in short.stderr


def test_the_cpu_rehearsal_times_each_first_token_and_finds_the_draft_in_the_spec_window(tmp_path):
    out = tmp_path / "probe"
    done = _probe("--size", "tiny", "--requests", "3", "--warmup", "1", "--tokens", "3", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for kind in ("vanilla", "spec"):
        raw = json.loads((out / f"probe_{kind}.json").read_text())
        # only the timed requests, each with its window: arrival before every event, release after
        assert raw["summary"]["requests"] == 3 and len(raw["requests"]) == 3
        for req in raw["requests"]:
            assert req["ttft_host_ms"] > 0
            assert all(0 <= ev[1] <= req["ttft_host_ms"] for ev in req["events"])
            assert req["ms_by_kind"]["execute_model"] > 0
    assert json.loads((out / "probe_spec.json").read_text())["knobs"]["gamma"] == 4
    # on CPU the drafter's prefill and first draft run inside sample_tokens, before the first token leaves
    assert summary["extra_ms_by_kind"]["sample_tokens"] > 0
    assert summary["spec"]["ttft_host_ms"]["median"] > summary["vanilla"]["ttft_host_ms"]["median"]
    assert "time to first token, host" in done.stdout
