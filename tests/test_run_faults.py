"""Run-folder faults a new user can walk into (#19 item 7): each test failed before its fix.

No engine starts here: legs are the fake leg of test_protocol.py, run folders the synthetic ones of
synthetic_runs.py.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from synthetic_runs import write_run
from test_protocol import FAKE_LEG, _prepare
from workbench import protocol, runfolder
from workbench.protocol import ProtocolError
from workbench.runfolder import RunLock, leg_status, process_alive


@pytest.fixture
def fake(tmp_path, monkeypatch):
    leg = tmp_path / "fake_leg.py"
    leg.write_text(FAKE_LEG)
    calls = tmp_path / "calls.txt"
    calls.write_text("")
    monkeypatch.setenv("FAKE_LEG_CALLS", str(calls))
    monkeypatch.setenv("FAKE_LEG_REPO", str(REPO))
    return [sys.executable, str(leg)], (lambda: [l for l in calls.read_text().splitlines() if l])


@pytest.fixture
def no_browser(monkeypatch):
    monkeypatch.delenv("BROWSER_PATH", raising=False)
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))


def _tear(path: Path, n_bytes: int = 25) -> int:
    """Cut the file mid-way through its last line, as a crash or a full disk leaves it; returns that line."""
    data = path.read_bytes()
    path.write_bytes(data[:-n_bytes])
    return data[:-n_bytes].count(b"\n") + 1


# --- one damaged records.jsonl -----------------------------------------------------------------

def test_a_damaged_run_is_shown_as_damaged_and_the_others_open(tmp_path):
    from workbench.widgets import Explorer
    write_run(tmp_path, run_id="20260101T000000Z-0001", n_prompts=3)
    bad = write_run(tmp_path, run_id="20260101T000000Z-0002", n_prompts=3)
    line = _tear(bad / "legs" / "strict_g6" / "records.jsonl")
    ex = Explorer(tmp_path, "E1")   # the newest run is the damaged one: it raised here
    assert "damaged" in ex.status.value and f"strict_g6/records.jsonl:{line}" in ex.status.value
    assert ex.pre is None and not any(len(f.data) for f in (ex.fig_speedup, ex.fig_dist, ex.fig_tau))
    labels = [o[0] for o in ex.run_dd.options]
    assert "20260101T000000Z-0001]" in labels[0] and "damaged" not in labels[0]
    assert "20260101T000000Z-0002]" in labels[1] and "· damaged" in labels[1]
    ex.run_dd.value = str(tmp_path / "E1" / "20260101T000000Z-0001")
    assert ex.pre is not None and len(ex.fig_speedup.data) and "damaged" not in ex.status.value
    ex.run_dd.value = str(bad)   # choosing it again: no exception, no figures of the previous run left
    assert ex.pre is None and not len(ex.fig_speedup.data) and "damaged" in ex.status.value


def test_export_of_a_damaged_run_names_the_line_and_writes_the_rest_marked_partial(tmp_path, capsys, no_browser):
    from workbench.cli import main
    rdir = write_run(tmp_path, n_prompts=3)
    line = _tear(rdir / "legs" / "strict_g6" / "records.jsonl")
    assert main(["export", str(rdir), "--formats", "html"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"strict_g6/records.jsonl:{line}" in err and "--resume" in err
    summary = json.loads((rdir / "tables" / "summary.json").read_text())
    assert summary["legs"]["strict_g6"] == "damaged" and summary["partial"] is True
    assert f"records.jsonl:{line}" in summary["damaged"]["strict_g6"]
    assert (rdir / "tables" / "legs_throughput.csv").is_file(), "what the intact legs allow is written"
    assert not (rdir / "tables" / "speedup.csv").exists()


def test_resume_reruns_a_leg_whose_records_are_damaged(tmp_path, fake):
    runner, calls = fake
    rdir = _prepare(tmp_path)
    protocol.execute(rdir, runner=runner, log=lambda s: None)
    line = _tear(rdir / "legs" / "strict_g6" / "records.jsonl")
    lines: list[str] = []
    st = protocol.execute(rdir, runner=runner, log=lines.append)
    assert st["strict_g6"] == "complete" and calls()[4:] == ["strict_g6"]
    assert "3 already complete, 1 to run" in lines[0] and "1 damaged" in lines[0]
    found = json.loads((rdir / "protocol.json").read_text())["history"][-1]
    assert f"records.jsonl:{line}" in found["damaged_legs"]["strict_g6"]
    kept = rdir / "attempts" / "strict_g6.1"
    assert (kept / "records.jsonl").is_file(), "the damaged attempt is kept as evidence"
    leg_json = json.loads((rdir / "legs" / "strict_g6" / "leg.json").read_text())
    assert (rdir / "legs" / "strict_g6" / leg_json["resume_from"]).resolve() == kept.resolve()
    from workbench.results import load_run
    assert set(load_run(rdir).records["leg"]) == {"vanilla_1", "strict_g6", "relaxed_lt0.693", "vanilla_2"}


def _leg_cfg(folder: Path, **kw):
    from workbench.leg import LegConfig
    return LegConfig(target="fake/target", prompts=str(folder.parent / "prompts.jsonl"), out=str(folder),
                     max_tokens=8, **kw)


def test_a_resumed_leg_reuses_the_intact_records_of_a_damaged_file(tmp_path):
    from workbench.leg import _resumable_records
    prev = tmp_path / "prev"
    prev.mkdir()
    runfolder.write_json_atomic(prev / "leg.json", _leg_cfg(prev).to_dict())
    rows = [json.dumps({"pid": f"p{i}", "gen_ids": [i]}) for i in range(4)]
    rows[1] = rows[1][:9]   # damaged in the middle
    (prev / "records.jsonl").write_text("\n".join(rows)[:-4])   # and a torn tail
    recs, note = _resumable_records(_leg_cfg(tmp_path / "cur", resume_from=str(prev)), ["p0", "p1", "p2", "p3"])
    assert [r["pid"] for r in recs] == ["p0", "p2"], "p1 (damaged) and p3 (torn tail) are decoded again"
    assert "reused 2" in note and "2 damaged line(s)" in note


# --- BROWSER_PATH --------------------------------------------------------------------------------

def test_a_bad_browser_path_is_refused_before_any_leg_runs(tmp_path, capsys, monkeypatch):
    from workbench.cli import main
    monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "no-such-chromium"))
    results = tmp_path / "results"
    assert main(["run", "E4", "--profile", "tiny", "--results", str(results), "--model-path", "target=fake/target",
                 "--model-path", "twin=fake/twin", "--formats", "png,html"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "BROWSER_PATH" in err and "no-such-chromium" in err
    assert not results.exists(), "nothing was created, no leg ran"
    rdir = write_run(tmp_path / "r", n_prompts=3)
    assert main(["export", str(rdir), "--formats", "png"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "BROWSER_PATH" in err and "Traceback" not in err
    assert main(["export", str(rdir), "--formats", "html"]) == 0, "html needs no browser"


# --- the notebook with a mistyped run_dir ---------------------------------------------------------

def test_the_notebook_refuses_a_run_dir_that_is_not_a_run_when_it_runs_no_legs(tmp_path):
    import papermill as pm
    typo = tmp_path / "results" / "E1" / "20260101T000000Z-typo"
    with pytest.raises(pm.PapermillExecutionError, match="not a run folder") as err:
        pm.execute_notebook(str(REPO / "notebooks" / "experiment.ipynb"), str(tmp_path / "out.ipynb"),
                            parameters={"experiment": "E1", "profile": "tiny", "run_dir": str(typo),
                                        "run_legs": False, "figure_formats": ["html"]},
                            kernel_name="python3", cwd=str(REPO), progress_bar=False)
    assert str(typo) in str(err.value)
    assert not typo.exists() and not (tmp_path / "results").exists()


# --- SIGINT / SIGTERM ---------------------------------------------------------------------------

@pytest.mark.parametrize("sig, rc", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_an_interrupted_run_is_recorded_and_says_so_in_one_line(tmp_path, fake, sig, rc):
    runner, calls = fake
    rdir = _prepare(tmp_path)
    code = ("import functools, signal, sys\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal\n"
            "from workbench import cli, protocol\n"
            f"protocol.execute = functools.partial(protocol.execute, runner={runner!r})\n"
            f"sys.exit(cli.main(['run', 'E4', '--resume', {str(rdir)!r}, '--no-notebook', '--formats', 'html']))\n")
    env = {**os.environ, "FAKE_LEG_BAD": "strict_g6", "FAKE_LEG_MODE": "hang"}
    orch = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        pids = rdir / "legs" / "strict_g6" / "pids.txt"
        deadline = time.monotonic() + 60
        while not (pids.is_file() and pids.read_text().endswith("\n")):
            assert orch.poll() is None and time.monotonic() < deadline, orch.stderr.read() if orch.poll() else ""
            time.sleep(0.05)
        leg_pid, engine_pid = map(int, pids.read_text().split())
        orch.send_signal(sig)
        out, err = orch.communicate(timeout=30)
    finally:
        if orch.poll() is None:
            orch.kill()
    assert orch.returncode == rc, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    said = [l for l in err.splitlines() if l.strip()]
    assert len(said) == 1 and said[0].startswith("interrupted:") and "--resume" in said[0], err
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (process_alive(leg_pid) or process_alive(engine_pid)):
        time.sleep(0.05)
    assert not process_alive(leg_pid) and not process_alive(engine_pid), "the leg's engine process outlived the run"
    state = json.loads((rdir / "protocol.json").read_text())
    assert state["state"] == "interrupted" and state["leg_process"] is None
    assert state["interrupted"]["signal"] == signal.Signals(sig).name and state["interrupted"]["leg"] == "strict_g6"
    fail = json.loads((rdir / "legs" / "strict_g6" / "failure.json").read_text())
    assert fail["status"] == "failed" and "interrupted" in fail["error"] and signal.Signals(sig).name in fail["error"]
    assert leg_status(rdir / "legs" / "relaxed_lt0.693") == "pending"


# --- a full disk --------------------------------------------------------------------------------

def _full_disk_after(monkeypatch, name: str, n_ok: int):
    """Writes of ``<name>.tmp`` fail with ENOSPC after ``n_ok`` good ones, once (the disk frees up after)."""
    real_open = Path.open
    seen = {"n": 0}

    class Full:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def opener(self, mode="r", *a, **k):
        fh = real_open(self, mode, *a, **k)
        if self.name == name + ".tmp" and "w" in mode:
            seen["n"] += 1
            if seen["n"] == n_ok + 1:
                return Full(fh)
        return fh
    monkeypatch.setattr(Path, "open", opener)


def test_an_atomic_write_on_a_full_disk_names_the_file_and_leaves_no_temp_file(tmp_path, monkeypatch):
    target = tmp_path / "protocol.json"
    runfolder.write_json_atomic(target, {"state": "finished"})
    _full_disk_after(monkeypatch, "protocol.json", 0)
    with pytest.raises(OSError) as err:
        runfolder.write_json_atomic(target, {"state": "running"})
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(target)
    assert not (tmp_path / "protocol.json.tmp").exists()
    assert json.loads(target.read_text()) == {"state": "finished"}, "the old file stands"


def test_the_leg_file_writers_are_atomic_and_say_their_status(tmp_path, monkeypatch):
    """One writer each for summary.json, failure.json, JSONL files and env.json, all through the atomic writer."""
    from workbench import envcapture

    leg = tmp_path / "legs" / "x"
    leg.mkdir(parents=True)
    assert runfolder.write_summary(leg, {"leg": "x", "status": "ignored"}) == {"status": "complete", "leg": "x"}
    assert json.loads((leg / "summary.json").read_text()) == {"status": "complete", "leg": "x"}
    try:
        raise ValueError("bad input")
    except ValueError as exc:
        rec = runfolder.failure_record(exc, leg="x", mode="spec")
    assert rec["status"] == "failed" and rec["error"] == "ValueError: bad input" and "Traceback" in rec["traceback"]
    assert runfolder.failure_record(error="exited 1", returncode=1) == {"status": "failed", "error": "exited 1",
                                                                       "returncode": 1}
    runfolder.write_failure(tmp_path / "new", rec)
    assert json.loads((tmp_path / "new" / "failure.json").read_text())["leg"] == "x"
    runfolder.write_jsonl_atomic(leg / "records.jsonl", [{"pid": "a"}, {"pid": "b"}])
    assert runfolder.read_jsonl(leg / "records.jsonl") == [{"pid": "a"}, {"pid": "b"}]
    _full_disk_after(monkeypatch, "records.jsonl", 0)
    with pytest.raises(OSError) as err:
        runfolder.write_jsonl_atomic(leg / "records.jsonl", [{"pid": "c"}])
    assert err.value.filename == str(leg / "records.jsonl") and not (leg / "records.jsonl.tmp").exists()
    assert runfolder.read_jsonl(leg / "records.jsonl") == [{"pid": "a"}, {"pid": "b"}], "the old file stands"
    monkeypatch.setattr(envcapture, "capture", lambda: {"captured": "now", "packages": {}})
    assert envcapture.write_env(tmp_path / "env.json", {"sizes": ["tiny"]}) == {
        "captured": "now", "packages": {}, "sizes": ["tiny"]}
    assert json.loads((tmp_path / "env.json").read_text())["sizes"] == ["tiny"]


def test_a_full_disk_during_a_run_is_a_clear_error_with_its_own_exit_status(tmp_path, fake, capsys, monkeypatch):
    from workbench.cli import main
    runner, calls = fake
    rdir = _prepare(tmp_path)
    monkeypatch.setattr(protocol, "execute", functools.partial(protocol.execute, runner=runner))
    _full_disk_after(monkeypatch, "protocol.json", 1)   # state "running" written; full as leg 1 starts
    rc = main(["run", "E4", "--resume", str(rdir), "--no-notebook", "--formats", "html"])
    err = capsys.readouterr().err
    assert rc == 74, err
    assert f"error: {rdir / 'protocol.json'}: No space left on device" in err
    assert not list(rdir.glob("*.tmp"))
    state = json.loads((rdir / "protocol.json").read_text())
    assert state["state"] == "error" and "No space left on device" in state["error"]
    assert state["leg_process"] is None and leg_status(rdir / "legs" / "vanilla_1") == "failed"


# --- summary.json lists only figures that were written -------------------------------------------

def test_summary_lists_only_figures_that_were_written(tmp_path, capsys, no_browser):
    from workbench import analyses, export
    from workbench.cli import main
    rdir = write_run(tmp_path, n_prompts=3)
    assert main(["export", str(rdir), "--formats", "png"]) == 0   # no browser: no png, so no figure at all
    summary = json.loads((rdir / "tables" / "summary.json").read_text())
    assert summary["figures"] == [] and not list((rdir / "figures").glob("*.png"))
    # the notebook's way: analyze_run lists what it drew, export_figures writes them (or not)
    cfg = json.loads((rdir / "run.json").read_text())
    (rdir / "run.json").write_text(json.dumps(dict(cfg, analyses=["speedup_distribution", "exactness_table"])))
    analysis = analyses.analyze_run(rdir)
    figs = analysis.pop("_figures")
    assert figs
    with pytest.warns(export.MissingBrowserWarning):
        export.export_figures(figs, rdir / "figures", formats=["png"])
    assert json.loads((rdir / "tables" / "summary.json").read_text())["figures"] == []
    export.export_figures(figs, rdir / "figures", formats=["html"])
    summary = json.loads((rdir / "tables" / "summary.json").read_text())
    assert sorted(summary["figures"]) == sorted(figs) and all((rdir / "figures" / f"{n}.html").is_file() for n in figs)


# --- --resume with --model-path -------------------------------------------------------------------

def test_resume_refuses_a_changed_model_path(tmp_path, capsys):
    from workbench.cli import main
    rdir = _prepare(tmp_path)
    assert main(["run", "E4", "--resume", str(rdir), "--model-path", "target=other/target"]) == 2
    err = capsys.readouterr().err
    assert "--model-path" in err and "other/target" in err and "fake/target" in err
    with pytest.raises(ProtocolError, match="--data-source"):
        protocol.prepare_run("E4", run_dir=rdir, dataset_sources={"mmvet": str(tmp_path)})
    # the same paths again are what the run has: accepted
    assert protocol.prepare_run("E4", run_dir=rdir, model_paths={"target": "fake/target"}) == rdir


def test_resume_refuses_a_changed_workbench_model_variable(tmp_path, capsys, monkeypatch):
    """#38: WORKBENCH_MODEL_<ROLE> was silently ignored on --resume; it is refused like --model-path."""
    from workbench.cli import main
    rdir = _prepare(tmp_path)
    monkeypatch.setenv("WORKBENCH_MODEL_TWIN", "other/twin")
    monkeypatch.setattr(protocol, "execute", lambda *a, **k: pytest.fail("a leg was started"))
    assert main(["run", "E4", "--resume", str(rdir)]) == 2
    err = capsys.readouterr().err
    assert "WORKBENCH_MODEL_TWIN=other/twin" in err and "twin=fake/twin" in err and "unset" in err
    monkeypatch.setenv("WORKBENCH_MODEL_TWIN", "fake/twin")  # what the run has: accepted
    assert protocol.prepare_run("E4", run_dir=rdir) == rdir
    monkeypatch.setenv("WORKBENCH_MODEL_TWIN", "other/twin")  # --model-path names it: that rule decides
    assert protocol.prepare_run("E4", run_dir=rdir, model_paths={"twin": "fake/twin"}) == rdir


# --- a copied or moved run ---------------------------------------------------------------------

def test_a_moved_run_reuses_the_finished_prompts_of_a_failed_leg(tmp_path, fake, monkeypatch):
    from workbench.leg import _resumable_records, load_leg_config
    runner, calls = fake
    monkeypatch.setenv("FAKE_LEG_BAD", "strict_g6")
    monkeypatch.setenv("FAKE_LEG_MODE", "partial-crash")
    rdir = _prepare(tmp_path)
    protocol.execute(rdir, runner=runner, log=lambda s: None)
    leg_json = json.loads((rdir / "legs" / "strict_g6" / "leg.json").read_text())
    assert not os.path.isabs(leg_json["prompts"]) and not os.path.isabs(leg_json["out"])
    moved = tmp_path / "elsewhere" / rdir.name
    moved.parent.mkdir()
    shutil.move(str(rdir), moved)
    monkeypatch.delenv("FAKE_LEG_BAD")
    st = protocol.execute(moved, runner=runner, log=lambda s: None)
    assert st["strict_g6"] == "complete"
    cfg = load_leg_config(moved / "legs" / "strict_g6" / "leg.json")
    assert Path(cfg.prompts) == moved / "prompts.jsonl" and Path(cfg.out) == moved / "legs" / "strict_g6"
    assert Path(cfg.resume_from) == moved / "attempts" / "strict_g6.1"
    recs, note = _resumable_records(cfg, ["p0", "tiny-001"])
    assert [r["pid"] for r in recs] == ["p0"], note


# --- export while the run is running --------------------------------------------------------------

def test_export_during_a_running_run_says_the_tables_are_partial(tmp_path, capsys, no_browser):
    from workbench.cli import main
    rdir = write_run(tmp_path, n_prompts=3, pending=("vanilla_1",))
    runfolder.write_json_atomic(rdir / "protocol.json", {"state": "running", "pid": os.getpid()})
    with RunLock(rdir):
        assert main(["export", str(rdir), "--formats", "html"]) == 0
    err = capsys.readouterr().err
    assert "still running" in err and "partial" in err and "2/3 legs complete" in err
    summary = json.loads((rdir / "tables" / "summary.json").read_text())
    assert summary["partial"] is True and "running" in summary["partial_reason"]
    # finished: not partial, no warning
    write_run(tmp_path, n_prompts=3)
    assert main(["export", str(rdir), "--formats", "html"]) == 0
    assert "partial" not in capsys.readouterr().err
    assert json.loads((rdir / "tables" / "summary.json").read_text())["partial"] is False


# --- a preparation killed with -9 -------------------------------------------------------------

def test_stale_preparing_folders_are_removed_by_the_next_prepare_and_list(tmp_path):
    from workbench.results import list_runs
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    exp = tmp_path / "results" / "E4"
    stale, live = exp / ".20260101T000000Z-dead.preparing", exp / ".20260101T000000Z-live.preparing"
    for folder, pid in ((stale, dead.pid), (live, os.getpid())):
        folder.mkdir(parents=True)
        (folder / runfolder.PREPARER).write_text(json.dumps(runfolder.process_identity(pid)))
    rdir = _prepare(tmp_path)
    assert not stale.exists() and live.is_dir(), "only a preparation whose process is dead is removed"
    stale.mkdir()
    (stale / runfolder.PREPARER).write_text(json.dumps({"pid": dead.pid, "start_ticks": 1}))
    list_runs(tmp_path / "results")
    assert not stale.exists() and live.is_dir() and rdir.is_dir()


def test_a_run_with_a_failed_leg_is_marked_partial_when_no_figure_applies(tmp_path):
    """#38: the analysis `workbench run` makes after its legs marks the tables partial, as export does."""
    from workbench import analyses
    rdir = write_run(tmp_path, n_prompts=3, failed=("strict_g6",))
    out = analyses.analyze_run(rdir)
    assert out["_figures"] == {}  # run.json names no analyses: no figure applies
    summary = json.loads((rdir / "tables" / "summary.json").read_text())
    assert summary["partial"] is True and "strict_g6 (failed)" in summary["partial_reason"]
    whole = write_run(tmp_path, run_id="20260101T000000Z-0001", n_prompts=3)
    analyses.analyze_run(whole)
    assert json.loads((whole / "tables" / "summary.json").read_text())["partial"] is False


def test_a_browser_that_cannot_render_is_refused_before_any_leg_runs(tmp_path, capsys, monkeypatch):
    """#38: BROWSER_PATH=/bin/false passed the check (an executable file); the legs ran, then kaleido failed."""
    from workbench import export
    from workbench.cli import main
    monkeypatch.setenv("BROWSER_PATH", "/bin/false")
    monkeypatch.setattr(protocol, "execute", lambda *a, **k: pytest.fail("a leg was started"))
    results = tmp_path / "results"
    assert main(["run", "E4", "--profile", "tiny", "--results", str(results), "--formats", "png,html"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "BROWSER_PATH='/bin/false' did not render" in err, err
    assert not results.exists()
    from workbench.cli import _formats
    assert _formats("html") == (("html",), None)  # html needs no browser (and no warning)
    assert export.browser_problem("/bin/false").startswith("did not render an empty page headless (exit status 1")


# --- a full disk after the legs ------------------------------------------------------------------

@pytest.fixture
def ran(tmp_path, monkeypatch):
    """`workbench run` over a synthetic run folder whose legs are done (no leg runs)."""
    rdir = write_run(tmp_path, n_prompts=3)
    cfg = json.loads((rdir / "run.json").read_text())
    (rdir / "run.json").write_text(json.dumps(dict(cfg, analyses=["per_position_acceptance"])))
    monkeypatch.setattr(protocol, "prepare_run", lambda *a, **k: rdir)
    monkeypatch.setattr(protocol, "execute", lambda *a, **k: {leg["name"]: "complete" for leg in cfg["legs"]})
    return rdir


def test_a_full_disk_while_writing_figures_exits_74_naming_the_file(ran, capsys, monkeypatch, no_browser):
    """#38: rc 1 and a traceback naming no file; now rc 74 and the figure's own path."""
    import plotly.graph_objects as go
    from workbench.cli import main

    def full(self, path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(go.Figure, "write_html", full)
    assert main(["run", "E1", "--no-notebook", "--formats", "html"]) == 74
    err = capsys.readouterr().err
    want = ran / "figures" / "per_position_acceptance.html"
    assert f"error: {want}: No space left on device" in err and "Traceback" not in err, err
    assert f"workbench export {ran}" in err


def test_a_full_disk_inside_the_notebook_exits_74_naming_the_file(ran, capsys, monkeypatch):
    from papermill.exceptions import PapermillExecutionError
    from workbench import cli

    def notebook(*a, **k):
        raise PapermillExecutionError(3, 3, "export_figures(...)", "OSError",
                                      "[Errno 28] No space left on device: '/r/figures/speedup.png'", [])

    monkeypatch.setattr(cli, "run_notebook", notebook)
    assert cli.main(["run", "E1", "--formats", "html"]) == 74
    assert "error: /r/figures/speedup.png: No space left on device" in capsys.readouterr().err
    monkeypatch.setattr(cli, "run_notebook", lambda *a, **k: (_ for _ in ()).throw(ValueError("bad table")))
    assert cli.main(["run", "E1", "--formats", "html"]) == 1  # any other analysis error stays rc 1


def test_list_runs_does_not_count_a_damaged_leg_as_complete(tmp_path):
    """#38: a leg whose summary says complete but whose records.jsonl is torn was counted complete."""
    from workbench.results import list_runs
    rdir = write_run(tmp_path, n_prompts=3)
    _tear(rdir / "legs" / "strict_g6" / "records.jsonl")
    (row,) = list_runs(tmp_path).to_dict("records")
    assert row["n_damaged"] == 1 and row["n_complete"] == row["n_legs"] - 1


def test_a_serving_leg_stopped_by_a_signal_names_it_in_its_failure_record(tmp_path):
    """#38: a serving leg stopped by the run's Ctrl-C recorded `SystemExit: 143`."""
    from workbench.runfolder import failure_record
    from workbench.serve_leg import LegStopped
    try:
        raise LegStopped(signal.SIGTERM)
    except SystemExit as exc:  # still an exit: the leg's status is 128 + the signal
        assert exc.code == 143
        rec = failure_record(exc)
    assert rec["error"] == "LegStopped: stopped by SIGTERM (exit status 143)"
    assert "SystemExit: 143" not in json.dumps(rec)
    assert str(LegStopped(signal.SIGINT)) == "stopped by SIGINT (exit status 130)"
