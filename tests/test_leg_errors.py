"""Bad input fails fast with a message that names the problem, and leaves no result that looks complete."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, TINY_PROMPTS


def _assert_failed_cleanly(res, *needles):
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.failure is not None and res.failure["status"] == "failed"
    for needle in needles:
        assert needle in res.failure["error"], res.failure["error"]
        assert needle in res.stderr
    assert not (res.out / "records.jsonl").exists()
    assert not (res.out / "summary.json").exists()
    assert not list(res.out.glob("*.tmp"))


def test_vllm_version_check_names_both_versions():
    import vllm_patch

    with pytest.raises(vllm_patch.VersionMismatch) as err:
        vllm_patch.check_vllm_version("0.28.0")
    assert "0.27.1" in str(err.value) and "0.28.0" in str(err.value)
    assert vllm_patch.check_vllm_version("0.27.1+cpu") == "0.27.1+cpu"


def test_plugin_refuses_to_load_in_another_vllm():
    code = (
        "import vllm; vllm.__version__ = '0.26.2'\n"
        "import vllm_patch; vllm_patch.register()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "VersionMismatch" in proc.stderr
    assert "0.27.1" in proc.stderr and "0.26.2" in proc.stderr


def test_missing_checkpoint_path(run_leg, tmp_path):
    missing = tmp_path / "no-such-model"
    res = run_leg("--target", missing, "--prompts", TINY_PROMPTS, "--max-tokens", "4")
    _assert_failed_cleanly(res, "target checkpoint not found", str(missing))


def test_draft_vocabulary_larger_than_target(run_leg, tiny_models, tmp_path):
    big = tmp_path / "big-vocab-draft"
    shutil.copytree(tiny_models["twin-dequant"], big)
    cfg = json.loads((big / "config.json").read_text())
    target_vocab = cfg["text_config"]["vocab_size"]
    cfg["text_config"]["vocab_size"] = target_vocab + 64
    (big / "config.json").write_text(json.dumps(cfg))
    res = run_leg("--target", tiny_models["target"], "--draft", big, "--gamma", "2",
                  "--prompts", TINY_PROMPTS, "--max-tokens", "4")
    _assert_failed_cleanly(res, "draft vocabulary", str(target_vocab + 64), str(target_vocab))


def test_unreadable_image(run_leg, tiny_models, tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"pid": "bad-img", "text": "what?", "images": ["broken.png"]}) + "\n")
    res = run_leg("--target", tiny_models["target"], "--prompts", prompts, "--max-tokens", "4")
    _assert_failed_cleanly(res, "bad-img", "broken.png")


def test_unknown_pid(run_leg, tiny_models):
    res = run_leg("--target", tiny_models["target"], "--prompts", TINY_PROMPTS, "--pids", "tiny-001,nope-42",
                  "--max-tokens", "4")
    _assert_failed_cleanly(res, "nope-42")


def test_a_failed_rerun_does_not_leave_the_old_result_looking_current(run_leg, tiny_models, tmp_path):
    out = tmp_path / "leg"
    out.mkdir()
    (out / "records.jsonl").write_text('{"pid": "stale"}\n')
    res = run_leg("--target", tmp_path / "missing", "--prompts", TINY_PROMPTS, "--max-tokens", "4", out=out)
    _assert_failed_cleanly(res, "not found")


def test_gamma_without_draft_is_refused(run_leg, tiny_models):
    res = run_leg("--target", tiny_models["target"], "--gamma", "3", "--prompts", TINY_PROMPTS, "--max-tokens", "4")
    _assert_failed_cleanly(res, "--gamma given without --draft")
