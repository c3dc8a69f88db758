"""`workbench run E1 --profile tiny` end to end: a complete run folder from one command; killed, it leaves
no leg behind and resumes alone; without a browser it still succeeds with HTML figures (#10)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from conftest import REPO

pytestmark = pytest.mark.vllm


def _env_without_browser(tmp_path: Path) -> dict:
    """This environment with every program on PATH except a Chromium-family browser."""
    from workbench.export import BROWSER_NAMES
    bin_dir = tmp_path / "bin-without-browser"
    bin_dir.mkdir()
    for folder in [str(Path(sys.executable).parent)] + os.environ.get("PATH", "").split(os.pathsep):
        if not folder or not Path(folder).is_dir():
            continue
        for prog in Path(folder).iterdir():
            if prog.name not in BROWSER_NAMES and not (bin_dir / prog.name).exists():
                (bin_dir / prog.name).symlink_to(prog)
    env = {k: v for k, v in os.environ.items() if k != "BROWSER_PATH"}
    env["PATH"] = str(bin_dir)
    return env


def test_workbench_run_e1_tiny_makes_a_complete_run_folder_without_a_browser(tmp_path, tiny_models):
    results = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "run", "E1", "--profile", "tiny",
                           "--results", str(results), "--formats", "png,html"], cwd=REPO, capture_output=True,
                          text=True, timeout=900, env=_env_without_browser(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    warnings = [l for l in proc.stderr.splitlines() if l.startswith("warning:")]
    assert len(warnings) == 1 and "png figures skipped" in warnings[0] and "apt-get install -y chromium" in warnings[0]
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
        assert json.loads((folder / "leg.json").read_text())["leg"] == leg["name"]
        assert not (folder / "records.jsonl.partial").exists()
    nb = nbformat.read(rdir / "notebook.ipynb", as_version=4)
    figure_outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                      if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert figure_outputs, "the executed notebook shows no figures"
    htmls = sorted((rdir / "figures").glob("*.html"))
    assert htmls and all(p.stat().st_size > 10000 for p in htmls)
    assert not list((rdir / "figures").glob("*.png"))
    summary = json.loads((rdir / "tables" / "summary.json").read_text())
    # the one exactness rule (workbench.exactness): equal, or in bf16 near-ties only
    verdicts = {r["leg"]: r for r in summary["exactness"]}
    print("\n" + "; ".join(f"{leg}: {r['classification']}" for leg, r in verdicts.items()))
    assert verdicts and all(r["rule_ok"] for r in verdicts.values()), verdicts
    # the speedup predicted from the measured step costs and acceptance, beside the measured one
    (model,) = summary["speedup_model"]
    assert model["leg"] == "strict_g6" and 0 < model["c"] and model["verify_ms"] > 0 and model["decode_ms"] > 0
    assert model["predicted_speedup"] == pytest.approx(model["acceptance_length"] / (6 * model["c"] + 1))
    assert model["measured_speedup"] > 0 and model["measured_over_predicted"] > 0
    # with the prefill steps' costs at the leg's mean output length
    n, length = model["mean_output_tokens"], model["acceptance_length"]
    vanilla = model["vanilla_prefill_ms"] + (n - 1) * model["decode_ms"]
    spec = model["prefill_ms"] + model["prefill_propose_ms"] + (n - 1) / length * (model["verify_ms"] + model["propose_ms"])
    assert model["predicted_with_prefill"] == pytest.approx(vanilla / spec)
    for leg in cfg["legs"]:
        sc = json.loads((rdir / "legs" / leg["name"] / "summary.json").read_text())["step_costs"]
        key = "verify_ms" if leg["name"].startswith("strict") else "decode_ms"
        assert sc[key]["n"] > 0 and sc[key]["median"] > 0, (leg["name"], sc)
    state = json.loads((rdir / "protocol.json").read_text())
    assert state["state"] == "finished" and state["leg_process"] is None
    assert (rdir / "run.lock").read_text() == ""


def test_kill_9_of_workbench_run_leaves_no_leg_and_the_resume_runs_alone(tmp_path, tiny_models):
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", "workbench.cli", "run", "E1", "--profile", "tiny", "--results", str(results),
           "-p", "max_tokens=32", "--no-notebook", "--formats", "html"]
    run = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        leg = None
        while leg is None:
            assert run.poll() is None and time.monotonic() < deadline, "no leg started"
            states = list(results.glob("E1/*/protocol.json"))
            if states:
                try:
                    leg = json.loads(states[0].read_text()).get("leg_process")
                except ValueError:
                    pass
            time.sleep(0.05)
        rdir = states[0].parent
        time.sleep(1.0)  # the leg is importing vLLM or decoding
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=30)
    finally:
        if run.poll() is None:
            run.kill()
    from workbench.runfolder import process_alive
    deadline = time.monotonic() + 10
    while process_alive(leg["pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(leg["pid"]), f"leg {leg['leg']} (PID {leg['pid']}) outlived `workbench run`"
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "run", "E1", "--profile", "tiny",
                           "--resume", str(rdir), "--no-notebook", "--formats", "html"], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = json.loads((rdir / "protocol.json").read_text())
    found = state["history"][-1]
    assert found["lock_taken_over_from"]["pid"] == run.pid
    assert found["interrupted_leg"]["pid"] == leg["pid"]
    assert state["state"] == "finished"


def test_a_leg_with_a_multiprocess_engine_dies_whole_with_its_parent(tmp_path, tiny_models):
    """vLLM's engine-core processes are in the leg's process group: kill -9 of the leg's parent ends them all."""
    from workbench.runfolder import process_alive
    out = tmp_path / "leg"
    code = (
        "import os, subprocess, sys, time\nfrom workbench import childproc\n"
        "env = dict(os.environ, WORKBENCH_PARENT_PID=str(os.getpid()))\n"
        f"cmd = [sys.executable, '-m', 'workbench.leg', '--target', {str(tiny_models['target'])!r}, '--prompts',"
        f" {str(REPO / 'data' / 'tiny' / 'prompts.jsonl')!r}, '--n', '13', '--max-tokens', '1500', '--ignore-eos',"
        f" '--dtype', 'bfloat16', '--no-in-process', '--out', {str(out)!r}]\n"
        "p = subprocess.Popen(childproc.wrap(os.getpid(), cmd), start_new_session=True, env=env,"
        " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.pid, flush=True)\ntime.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        leg = int(parent.stdout.readline())
        deadline = time.monotonic() + 300
        while not (out / "records.jsonl.partial").is_file():  # the engine is up and decoding
            assert time.monotonic() < deadline and process_alive(leg), "the leg did not start decoding"
            time.sleep(0.1)
        group = [int(p) for p in os.listdir("/proc") if p.isdigit() and process_alive(int(p))
                 and _pgid(int(p)) == leg]
        assert leg in group and len(group) >= 2, f"no engine process beside the leg: {group}"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while any(process_alive(p) for p in group) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [p for p in group if process_alive(p)] == []
    finally:
        if parent.poll() is None:
            parent.kill()


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
