"""`workbench run E1 --profile tiny` end to end: a complete run folder from one command."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from conftest import REPO

pytestmark = pytest.mark.vllm


def test_workbench_run_e1_tiny_makes_a_complete_run_folder(tmp_path, tiny_models):
    results = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "run", "E1", "--profile", "tiny",
                           "--results", str(results)], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = list((results / "E1").iterdir())
    assert len(runs) == 1
    rdir = runs[0]
    cfg = json.loads((rdir / "run.json").read_text())
    env = json.loads((rdir / "env.json").read_text())
    assert env["patch"]["fingerprint"]
    for leg in cfg["legs"]:
        folder = rdir / "legs" / leg["name"]
        assert (folder / "records.jsonl").is_file() and (folder / "summary.json").is_file(), leg["name"]
        assert json.loads((folder / "summary.json").read_text())["status"] == "complete"
    nb = nbformat.read(rdir / "notebook.ipynb", as_version=4)
    figure_outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                      if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert figure_outputs, "the executed notebook shows no figures"
    pngs = sorted((rdir / "figures").glob("*.png"))
    assert pngs and all(p.stat().st_size > 1000 for p in pngs)
    for p in pngs:
        head = p.read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = struct.unpack(">II", head[16:24])
        assert width >= 400 and height >= 300
    assert sorted((rdir / "figures").glob("*.html"))
    summary = json.loads((rdir / "tables" / "summary.json").read_text())
    exact = {r["leg"]: r["match_rate"] for r in summary["exactness"]}
    assert exact and all(v == 1.0 for v in exact.values())
