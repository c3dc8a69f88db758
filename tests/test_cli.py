"""CLI: listing, plans, and clear errors for bad input (no engine needed)."""

from __future__ import annotations

import json

import pytest

from workbench.cli import main


def test_list_shows_every_experiment(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for i in range(1, 17):
        assert f"E{i} " in out
    assert "Thinking vs Instruct" in out and "tiny" in out


def test_show_and_legs(capsys):
    assert main(["show", "E4"]) == 0
    out = capsys.readouterr().out
    assert "Relaxed tier, tau ladder" in out and "relaxed_lt0.105" in out and "relaxed_lt1.386" in out
    assert main(["legs", "E11", "--profile", "tiny", "-p", "gamma=3"]) == 0
    out = capsys.readouterr().out
    assert "strict_g3" in out and "relaxed_g3" in out and "not applicable on CPU" in out
    assert main(["legs", "E2", "--profile", "8b-thinking", "--smoke"]) == 0
    out = capsys.readouterr().out
    assert "strict_g3" in out and "strict_g8" not in out


def test_legs_table_shows_a_serving_servers_max_num_seqs():
    from workbench.planning import plan

    rows = plan("E18", "tiny", overrides={"legs": "twin_a1", "concurrencies": "1/4/16"}).table()
    assert {r["max_num_seqs"] for r in rows} == {16}  # the server takes the largest client concurrency


@pytest.mark.parametrize("argv, message", [
    (["show", "E42"], "unknown experiment 'E42'"),
    (["legs", "E1", "--profile", "huge"], "unknown profile 'huge'"),
    (["legs", "E1", "-p", "gamma"], "expected name=value"),
    (["legs", "E1", "-p", "gamma=abc"], "'gamma' must be an integer"),
    (["legs", "E1", "-p", "colour=red"], "unknown parameter 'colour'"),
    (["legs", "E12", "--profile", "8b-instruct"], "E12 runs under profile(s) 32b"),
    (["run", "E1", "--profile", "tiny", "--model-path", "twin"], "--model-path 'twin': expected NAME=VALUE"),
    (["run", "E1", "--profile", "tiny", "--resume", "does/not/exist"], "not a run folder"),
    (["export", "does/not/exist"], "not a run folder"),
    (["run", "E1", "--profile", "tiny", "--formats", "png,gif"], "--formats: unknown export format(s) ['gif']"),
])
def test_errors_name_the_problem(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_run_refuses_resume_of_another_experiment(tmp_path, capsys):
    from workbench import protocol
    rdir = protocol.prepare_run("E1", "tiny", None, True, tmp_path,
                                model_paths={"target": "fake/t", "twin": "fake/d"})
    assert main(["run", "E2", "--profile", "tiny", "--resume", str(rdir)]) == 2
    assert "that run is E1, not E2" in capsys.readouterr().err
    assert json.loads((rdir / "run.json").read_text())["experiment"] == "E1"


def test_data_subcommand_is_mounted(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["data", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "fetch" in out and "verify" in out


def test_resume_of_a_damaged_run_names_it(tmp_path, capsys):
    rdir = tmp_path / "E1" / "20260101T000000Z-00000000"
    rdir.mkdir(parents=True)
    (rdir / "run.json").write_text('{"experiment": "E1", "legs": [')
    assert main(["run", "E1", "--profile", "tiny", "--resume", str(rdir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --resume") and "damaged run folder" in err and "run.json: not valid JSON" in err


def test_run_without_plotly_is_refused_before_any_leg(tmp_path, monkeypatch, capsys):
    """A host without plotly (a bare GPU host) gets one line naming the package, and no run folder."""
    import sys

    import workbench

    monkeypatch.delitem(sys.modules, "workbench.export", raising=False)
    monkeypatch.delattr(workbench, "export", raising=False)  # `from workbench import export` looks here first
    monkeypatch.setitem(sys.modules, "plotly", None)  # import plotly... fails as if not installed
    rc = main(["run", "E1", "--profile", "tiny", "--smoke", "--results", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc != 0 and "'plotly'" in err and "pip install plotly" in err
    assert not any(tmp_path.rglob("run.json"))


@pytest.mark.parametrize("value", ["-5", "0", "nan", "x"])
def test_a_leg_timeout_that_cannot_hold_a_leg_is_refused_before_anything(tmp_path, capsys, value):
    root = tmp_path / "results"
    with pytest.raises(SystemExit) as err:
        main(["run", "E1", "--profile", "tiny", "--smoke", "--results", str(root), "--leg-timeout", value])
    assert err.value.code == 2 and "--leg-timeout" in capsys.readouterr().err
    assert not root.exists()


def test_without_a_browser_a_bad_input_error_comes_alone(tmp_path, capsys, monkeypatch):
    """The missing-browser warning is printed once the run's checks passed: a refused command prints only
    its error (a host without Chromium, as a fresh laptop is)."""
    from workbench import export

    def no_browser():
        raise export.BrowserError("none was found")

    monkeypatch.delenv("BROWSER_PATH", raising=False)
    monkeypatch.setattr(export, "find_browser", no_browser)
    assert main(["run", "E1", "--profile", "tiny", "--resume", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --resume") and "not a run folder" in err and "warning" not in err
    assert main(["export", str(tmp_path / "nowhere"), "--formats", "png"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "warning" not in err
    kept, warning = export.usable_formats("png,html")
    assert kept == ("html",) and "png figures skipped" in warning
