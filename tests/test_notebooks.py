"""The experiment notebook, executed with papermill on E1 under the tiny profile (real legs, real engine)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import nbformat
import pytest

from workbench import cli, protocol

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "experiment.ipynb"


def test_notebook_is_committed_clean_and_parameterised():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1
    for name in ("experiment", "profile", "run_dir", "overrides", "smoke"):
        assert f"{name} =" in tagged[0].source
    for c in nb.cells:
        if c.cell_type == "code":
            assert not c.outputs and c.execution_count is None, "commit the source notebook without outputs"


@pytest.mark.vllm
def test_experiment_notebook_e1_tiny(tmp_path):
    rdir = protocol.prepare_run("E1", "tiny", None, True, tmp_path / "results")
    cfg = json.loads((rdir / "run.json").read_text())
    params = {"experiment": "E1", "profile": "tiny", "run_dir": str(rdir), "overrides": cfg["overrides"],
              "smoke": True, "figure_formats": ["html"]}
    out = cli.run_notebook(rdir, params)
    executed = nbformat.read(out, as_version=4)
    assert any(c.get("outputs") for c in executed.cells if c.cell_type == "code")
    summary = json.loads((rdir / "tables" / "summary.json").read_text())
    assert summary["n_complete"] == 3 and summary["n_failed"] == 0, summary["legs"]
    exact = {r["leg"]: r for r in summary["exactness"]}
    # the strict tier reproduces vanilla's token ids, or in bf16 differs only at near-ties (workbench.exactness)
    assert exact["strict_g6"]["rule_ok"], exact["strict_g6"]["classification"]
    speed = {r["leg"]: r["speedup"] for r in summary["speedup"]}
    assert math.isfinite(speed["strict_g6"]) and speed["strict_g6"] > 0
    acc = {r["leg"]: r for r in summary["acceptance"]}
    assert acc["strict_g6"]["acceptance_rate"] > 0 and acc["strict_g6"]["acceptance_length"] > 1
    # the figures exported by the notebook
    assert (rdir / "figures" / "exactness_table.html").is_file()
    assert (rdir / "figures" / "speedup_distribution.html").is_file()
