"""The experiment notebook, executed with papermill on E1 under the tiny profile (real legs, real engine)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import nbformat
import pytest

from workbench import notebook_params

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


def _papermill(out: Path, params: dict) -> Path:
    import papermill as pm

    pm.execute_notebook(str(NOTEBOOK), str(out), parameters=params, cwd=str(NOTEBOOK.parents[1]),
                        progress_bar=False, log_output=False)
    return out


@pytest.mark.vllm
def test_experiment_notebook_e1_tiny(tmp_path):
    """A misspelt parameter stops the notebook before anything is made; the corrected call makes a new run."""
    from papermill.exceptions import PapermillExecutionError

    results = tmp_path / "results"
    base = {"experiment": "E1", "profile": "tiny", "results_root": str(results), "smoke": True,
            "figure_formats": ["html"]}
    with pytest.raises(PapermillExecutionError) as err:
        _papermill(tmp_path / "typo.ipynb", dict(base, gamm=4))
    assert err.value.ename == "ParameterError" and "gamm" in err.value.evalue and "gamma" in err.value.evalue
    assert not results.exists()  # no run folder, complete-looking or not
    out = _papermill(tmp_path / "run.ipynb", base)
    (rdir,) = results.glob("E1/*")
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


def _params(**changes):
    ns = {"experiment": "E1", "profile": "tiny", "run_dir": None, "results_root": "results", "overrides": {},
          "smoke": True, "run_legs": True, "stop_on_failure": False, "allow_shared_host": False, "leg_timeout": None,
          "figure_formats": ["html"], "figure_width": 900, "figure_height": 500}
    ns.update(changes)
    return ns


def test_notebook_parameters_are_exactly_the_parameters_cell():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    ns: dict = {}
    exec(cell.source, ns)
    del ns["__builtins__"]
    assert set(ns) == set(notebook_params.PARAMETERS)
    assert notebook_params.check(ns)["run_legs"] is True


def test_a_typo_or_a_bad_value_is_named_before_anything_runs(tmp_path):
    def problems(**changes):
        with pytest.raises(notebook_params.ParameterError) as err:
            notebook_params.check(_params(**changes))
        return str(err.value)

    assert "gamm: not a parameter" in problems(gamm=4) and "knob gamma" in problems(gamm=4)
    assert "overrides" in problems(gamma=4)          # a knob is an override, not a notebook parameter
    assert "did you mean run_legs" in problems(run_leg=False)
    # papermill's -p run_legs false is the string "false" (true in Python): normalised, and "yes" refused
    assert notebook_params.check(_params(run_legs="false", smoke="True"))["run_legs"] is False
    assert "run_legs: takes true or false" in problems(run_legs="yes")
    assert "leg_timeout" in problems(leg_timeout=-5)
    assert "gif" in problems(figure_formats="png,gif")
    assert "figure_width" in problems(figure_width=0)
    assert "must be an integer 1..32, got 40" in problems(overrides="gamma=40")
    assert "unknown parameter 'gama'" in problems(overrides={"gama": 4})
    assert "experiment:" in problems(experiment="E99")
    # `-p overrides 'gamma=4 max_tokens=8'` as `workbench run -p` takes them
    assert notebook_params.check(_params(overrides="gamma=4 max_tokens=8"))["overrides"] == ["gamma=4", "max_tokens=8"]
    # a run_dir that is no run: named, with the folder it was probably meant to be
    (tmp_path / "E1" / "20261205T000000Z-0000abcd").mkdir(parents=True)
    (tmp_path / "E1" / "20261205T000000Z-0000abcd" / "run.json").write_text("{}")
    msg = problems(run_dir=str(tmp_path / "E1" / "20261205T000000Z-0000abdc"))
    assert "is not a run folder" in msg and "20261205T000000Z-0000abcd" in msg and "run_dir=None" in msg
    assert "nothing was prepared or run" in problems(gamm=4, leg_timeout=0).splitlines()[0]
