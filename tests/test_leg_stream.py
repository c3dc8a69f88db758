"""A leg's records stream as prompts finish; a killed leg's finished prompts are reused on resume (#11)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, TINY_PROMPTS, run_leg_process

pytestmark = pytest.mark.vllm


def _kill_after_the_first_record(out, args, why: str):
    """Start a leg, SIGKILL it once its first record is in ``records.jsonl.partial``; that file's path."""
    proc = subprocess.Popen([sys.executable, "-m", "workbench.leg", "--out", str(out), *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = out / "records.jsonl.partial"
    try:
        deadline = time.monotonic() + 300
        while not (partial.is_file() and partial.read_text().count("\n") >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, why
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    return partial


def test_records_stream_and_a_resumed_leg_reuses_finished_prompts(tiny_models, tmp_path):
    out = tmp_path / "leg"
    args = ["--target", str(tiny_models["target"]), "--prompts", str(TINY_PROMPTS), "--n", "4",
            "--max-tokens", "1500", "--ignore-eos", "--dtype", "bfloat16"]
    partial = _kill_after_the_first_record(out, args, "no record streamed")
    streamed = [json.loads(l) for l in partial.read_text().splitlines()]
    assert 1 <= len(streamed) < 4 and not (out / "records.jsonl").exists() and not (out / "summary.json").exists()
    assert streamed[0]["pid"] == "tiny-001" and streamed[0]["gen_len"] == 1500

    res = run_leg_process(out, *args, "--resume-from", str(out)).ok()
    assert res.summary["n_resumed"] == len(streamed) and res.summary["n_prompts"] == 4
    assert [r["pid"] for r in res.records] == ["tiny-001", "tiny-002", "tiny-003", "tiny-004"]
    reused = res.records[: len(streamed)]
    assert [r["gen_ids"] for r in reused] == [r["gen_ids"] for r in streamed]
    assert all(r["resumed_from"] == str(out / "attempts" / "1") for r in reused)
    assert all("resumed_from" not in r for r in res.records[len(streamed):])
    assert (out / "attempts" / "1" / "records.jsonl.partial").is_file() and not partial.exists()

    # other engine settings: nothing is reused
    other = run_leg_process(tmp_path / "other", "--target", str(tiny_models["target"]), "--prompts",
                            str(TINY_PROMPTS), "--n", "1", "--max-tokens", "8", "--dtype", "bfloat16",
                            "--resume-from", str(out / "attempts" / "1")).ok()
    assert other.summary["n_resumed"] == 0 and "engine settings differ (ignore_eos, max_tokens)" in other.summary["resume"]


def test_records_stream_at_concurrency_above_one_and_a_killed_leg_resumes(tiny_models, tmp_path):
    """At max_num_seqs > 1 each request's record is appended as it finishes, not when the batch does (#19)."""
    out = tmp_path / "leg"
    args = ["--target", str(tiny_models["target"]), "--prompts", str(TINY_PROMPTS), "--n", "4",
            "--max-num-seqs", "2", "--max-tokens", "1500", "--ignore-eos", "--dtype", "bfloat16"]
    partial = _kill_after_the_first_record(out, args, "no record streamed before the leg ended")
    streamed = [json.loads(l) for l in partial.read_text().splitlines() if l.strip()]
    assert 1 <= len(streamed) < 4 and not (out / "records.jsonl").exists()
    assert all(r["gen_len"] == 1500 for r in streamed)

    res = run_leg_process(out, *args, "--resume-from", str(out)).ok()
    assert res.summary["n_resumed"] == len(streamed) and res.summary["n_prompts"] == 4
    assert [r["pid"] for r in res.records] == ["tiny-001", "tiny-002", "tiny-003", "tiny-004"]
    by_pid = {r["pid"]: r for r in res.records}
    assert all(by_pid[r["pid"]]["gen_ids"] == r["gen_ids"] for r in streamed)
