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


def test_a_leg_without_max_tokens_names_the_option():
    from workbench.leg import LegError, build_parser, config_from_args

    args = build_parser().parse_args(["--target", "t", "--prompts", "p.jsonl", "--out", "o"])
    with pytest.raises(LegError, match="missing option.s. --max-tokens"):
        config_from_args(args)


def test_vllm_version_check_names_both_versions():
    import vllm_patch

    with pytest.raises(vllm_patch.VersionMismatch) as err:
        vllm_patch.check_vllm_version("0.28.0")
    assert "0.27.1" in str(err.value) and "0.28.0" in str(err.value)
    assert vllm_patch.check_vllm_version("0.27.1+cpu") == "0.27.1+cpu"


def test_a_serving_legs_own_checks_import_no_vllm(tiny_models):
    """A serving leg's process checks its leg as an offline leg does, but its server imports vLLM, not it: the
    version from the package metadata, the drafted-token limit from the rejection sampler's source."""
    code = ("import sys\nfrom workbench.leg import LegConfig, installed_vllm_version, preflight\n"
            "from workbench.knobs import Knobs\n"
            f"cfg = LegConfig(target={str(tiny_models['target'])!r}, draft={str(tiny_models['twin-int4'])!r}, "
            f"knobs=Knobs(gamma=4), prompts={str(TINY_PROMPTS)!r}, out='unused', max_tokens=4, n=2)\n"
            "prompts, _, lengths = preflight(cfg, import_vllm=False)\n"
            "assert len(prompts) == len(lengths) == 2 and min(lengths) > 0\n"
            "assert installed_vllm_version().split('+')[0] == '0.27.1'\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "[]", res.stdout


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


# --------------------------------------------------------------------------- a finished leg is never lost (#10)
def _finished_leg(folder):
    """A leg folder as a finished leg leaves it (the failing commands below never get to an engine)."""
    folder.mkdir(parents=True)
    (folder / "records.jsonl").write_text('{"pid": "tiny-001", "mode": "vanilla", "tier": "vanilla", "tok_s": 1.0}\n')
    (folder / "summary.json").write_text(json.dumps({"status": "complete", "n_prompts": 1}))
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_failing_command_never_touches_a_finished_leg(run_leg, tiny_models, tmp_path):
    out = tmp_path / "done"
    before = _finished_leg(out)
    typo = run_leg("--target", tiny_models["target"], "--draft", tiny_models["twin-int4"], "--gamma", "0",
                   "--prompts", TINY_PROMPTS, "--max-tokens", "4", out=out)
    assert typo.returncode == 2 and "'gamma' must be an integer 1..32, got 0" in typo.stderr
    assert "the finished leg in" in typo.stderr and "is unchanged" in typo.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    forced = run_leg("--target", tiny_models["target"], "--prompts", tmp_path / "missing.jsonl",
                     "--max-tokens", "4", "--force", out=out)
    assert forced.returncode == 2 and "prompt file not found" in forced.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before, "--force moved the leg before checking"
    again = run_leg("--target", tiny_models["target"], "--prompts", TINY_PROMPTS, "--max-tokens", "4", out=out)
    assert again.returncode == 2 and "already holds a finished leg" in again.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.vllm
def test_force_keeps_the_replaced_leg_under_attempts(run_leg, tiny_models, tmp_path):
    out = tmp_path / "done"
    before = _finished_leg(out)
    res = run_leg("--target", tiny_models["target"], "--prompts", TINY_PROMPTS, "--n", "1", "--max-tokens", "4",
                  "--dtype", "bfloat16", "--force", out=out).ok()
    assert res.summary["status"] == "complete" and len(res.records) == 1
    assert {p.name: p.read_bytes() for p in (out / "attempts" / "1").iterdir()} == before


def test_config_json_that_is_a_list(run_leg, tmp_path):
    model = tmp_path / "list-model"
    model.mkdir()
    (model / "config.json").write_text("[]")
    res = run_leg("--target", model, "--prompts", TINY_PROMPTS, "--max-tokens", "4")
    _assert_failed_cleanly(res, "config.json holds a JSON list, not an object", str(model))


def test_gamma_beyond_the_limit_is_refused_before_an_engine_starts(run_leg, tiny_models):
    res = run_leg("--target", tiny_models["target"], "--draft", tiny_models["twin-int4"], "--gamma", "100000",
                  "--prompts", TINY_PROMPTS, "--max-tokens", "4")
    _assert_failed_cleanly(res, "'gamma' must be an integer 1..32, got 100000")
    assert "Loading safetensors" not in res.stderr
    from workbench.leg import gamma_problem, spec_len_limit
    assert spec_len_limit() == 128  # vLLM 0.27.1's rejection sampler
    assert spec_len_limit(import_vllm=False) == 128  # read from its source (a serving leg's process)
    assert "vLLM's limit of 128" in gamma_problem(200, 4096, spec_len_limit())
    assert "does not fit max_model_len=16" in gamma_problem(20, 16, 128)
    assert gamma_problem(6, 4096, 128) is None


def test_prompt_longer_than_max_model_len_is_refused_before_any_prompt_is_decoded(run_leg, tiny_models):
    res = run_leg("--target", tiny_models["target"], "--prompts", TINY_PROMPTS, "--n", "4",
                  "--max-model-len", "42", "--max-tokens", "4")
    _assert_failed_cleanly(res, "do not fit max_model_len=42", "'tiny-002' (42 tokens)", "'tiny-004' (48 tokens)")
    assert "'tiny-001'" not in res.failure["error"]
    assert "Loading safetensors" not in res.stderr and not (res.out / "records.jsonl.partial").exists()


def test_huge_image_names_the_prompt(run_leg, tiny_models, tmp_path):
    from PIL import Image
    Image.new("L", (20000, 20000)).save(tmp_path / "huge.png")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"pid": "big-picture", "text": "what?", "images": ["huge.png"]}) + "\n")
    res = run_leg("--target", tiny_models["target"], "--prompts", prompts, "--max-tokens", "4")
    _assert_failed_cleanly(res, "big-picture", "huge.png", "too large")


def test_unwritable_leg_folder_is_reported_not_a_traceback(run_leg, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip("cannot mount a read-only folder here")
    else:
        ro.chmod(0o555)
    try:
        res = run_leg("--target", tmp_path / "missing", "--prompts", TINY_PROMPTS, "--max-tokens", "4",
                      out=ro / "leg")
        assert res.returncode == 2
        assert "target checkpoint not found" in res.stderr and "could not write" in res.stderr
        assert "Traceback" not in res.stderr
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], check=False)
        else:
            ro.chmod(0o755)


def test_kv_cache_bytes_must_be_positive(run_leg, tiny_models):
    res = run_leg("--target", str(tiny_models["target"]), "--prompts", str(TINY_PROMPTS), "--max-tokens", "4",
                  "--kv-cache-memory-bytes", "0")
    _assert_failed_cleanly(res, "kv_cache_memory_bytes")
