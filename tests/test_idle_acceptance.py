"""The real-acceptance price of ``draft_idle`` (benchmarks/idle_acceptance.py): bad options are refused before any
engine starts; a CPU run with the tiny models (float32, strict tier) counts the skipped passes of each mode,
drafts where the batch has shrunk, and keeps every output equal to vanilla's."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "benchmarks" / "idle_acceptance.py"


def _run(*args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_bad_options_are_refused_before_any_engine(tmp_path):
    for bad, said in [(["--lengths", "8,x"], "--lengths"), (["--modes", "sync,often"], "--modes"),
                      (["--off-from", "9"], "--off-from"), (["--lengths", "8,8,8"], "outlast"),
                      (["--target", str(tmp_path)], "go together")]:
        done = _run(*bad, "--out", str(tmp_path / "out"), timeout=60)
        assert done.returncode == 2 and said in done.stderr, (bad, done.stderr[-500:])
    assert not (tmp_path / "out").exists()


def test_skipped_passes_are_counted_drafting_resumes_and_outputs_stay_vanillas(tmp_path):
    out = tmp_path / "idle"
    done = _run("--lengths", "4,6,24", "--off-from", "2", "--gamma", "2", "--prompt-len", "24",
                "--modes", "sync,skip_all", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"sync", "skip_all"}
    sync, lean = summary["sync"], summary["skip_all"]
    # the strict tier: every output is the target's own (float32), whatever the draft's cache lacks
    assert sync["outputs_equal_to_vanilla"] == lean["outputs_equal_to_vanilla"] == 3
    # sync runs every draft pass; skip_all skipped the admitting step (3 prompts at batch 3: γ 0) and decode steps
    assert sync["draft_idle_skips"] == 0
    assert lean["draft_idle_prompt_skips"] >= 1 and lean["draft_idle_skips"] > lean["draft_idle_prompt_skips"]
    # once one request is left the schedule says γ 2 and both drafted, the target judging
    for s in (sync, lean):
        assert s["drafts"] > 0 and s["draft_tokens"] == 2 * s["drafts"] and 1 <= s["acceptance_length"] <= 3
    assert json.loads((out / "skip_all.json").read_text())["spec_config_extra"][
        "num_speculative_tokens_per_batch_size"] == [[1, 1, 2], [2, 3, 0]]
    assert "acc. length" in done.stdout
