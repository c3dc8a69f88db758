"""The explorer notebook in a real browser: JupyterLab + headless Debian chromium via Playwright.

Runs all cells of notebooks/explorer.ipynb against a synthetic run, moves the
relax_logtau slider with the keyboard and checks that the kernel answered
(the readout) and that the plot in the page was redrawn with new data.
``test_explorer_switches_runs_as_a_researcher_does`` opens several real-shaped
runs one after another (three drafters, several gammas, a tie-rule note, serving
legs) and asserts on what the page shows; its screenshots are kept (the folder
is printed; ``WB_BROWSER_ARTEFACTS`` names another).
Never downloads a browser: it drives the system chromium.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from synthetic_runs import LADDER_LEGS, write_run  # noqa: E402
from test_serving_analyses import write_serving_run  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def _require_browser():
    problem = None
    if not CHROMIUM.exists():
        problem = f"{CHROMIUM} not found (Debian: apt-get install -y chromium)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError as exc:
            problem = f"python playwright not importable ({exc})"
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"the browser test must run in CI: {problem}")
        pytest.skip(problem)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """JupyterLab serving a temp folder with the explorer notebook and a synthetic run."""
    _require_browser()
    write_run(tmp_path / "results", legs=LADDER_LEGS, n_prompts=6)
    yield from _serve(tmp_path)


# Run folders the workbench made (committed under results/) and real-shaped synthetic ones.
E6_RUN = REPO / "results" / "E6" / "20261203T083606Z-40a8cb70"     # three drafters, organism profile
E1_RUN = REPO / "results" / "E1" / "20261201T085835Z-cb888cc4"     # tiny demo: the tie-rule note on the τ plot


@pytest.fixture
def lab_runs(tmp_path):
    """JupyterLab over E6 (three drafters), E1 (a τ-plot note), E2 (several gammas), E17 (serving legs)."""
    _require_browser()
    for run in (E6_RUN, E1_RUN):
        if not run.is_dir():
            pytest.skip(f"{run.relative_to(REPO)} not in this checkout")
        shutil.copytree(run, tmp_path / "results" / run.parent.name / run.name)
    write_run(tmp_path / "results", experiment="E2", run_id="20260102T000000Z-e2e2", legs=LADDER_LEGS, n_prompts=6)
    write_serving_run(tmp_path / "results", n=8)
    yield from _serve(tmp_path)


def _serve(tmp_path):
    (tmp_path / "notebooks").mkdir()
    shutil.copy(REPO / "notebooks" / "explorer.ipynb", tmp_path / "notebooks" / "explorer.ipynb")
    port, token = _free_port(), secrets.token_hex(16)
    home = tmp_path / "home"
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               JUPYTERLAB_SETTINGS_DIR=str(home / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(home / "ws"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"))
    (home / "settings" / "@jupyterlab" / "apputils-extension").mkdir(parents=True)
    # No news/update toasts over the notebook.
    (home / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        '{"fetchNews": "false", "checkForUpdates": false}')
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}",
         "--ServerApp.port_retries=0", "--allow-root", "--LabApp.news_url=",
         "--LabApp.extension_manager=readonly"],
        cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail("JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text()[-3000:])
                time.sleep(0.3)
        yield base, token, tmp_path
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _open_and_run_all(page, base: str, token: str):
    """Open notebooks/explorer.ipynb in JupyterLab, choose the Python kernel, Run All; wait for the explorer."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.goto(f"{base}/lab/tree/notebooks?token={token}")
    page.wait_for_selector(".jp-LauncherCard[data-category='Notebook']")
    page.locator(".jp-DirListing-item", has_text="explorer.ipynb").first.dblclick()
    page.wait_for_selector(".jp-Notebook .jp-Cell")
    # Whether JupyterLab starts a kernel on open depends on what it has loaded by then, and a
    # "Run All Cells" sent without one is dropped. So choose the kernel explicitly, then wait
    # for it to be idle before running.
    select_kernel = page.locator(".jp-Dialog", has_text="Select Kernel")

    def choose_python(dialog):
        dialog.locator("select").first.select_option(label="Python 3 (ipykernel)")
        dialog.locator(".jp-mod-accept").first.click()

    # JupyterLab may raise this dialog on its own as the notebook opens: answer it first.
    try:
        select_kernel.first.wait_for(state="visible", timeout=2_000)
        choose_python(select_kernel.first)
        select_kernel.first.wait_for(state="detached")
    except PlaywrightTimeout:
        pass
    page.locator(".lm-MenuBar-itemLabel", has_text="Kernel").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Change Kernel").first.click()
    select_kernel.first.wait_for(state="visible")
    choose_python(select_kernel.first)
    select_kernel.first.wait_for(state="detached")
    page.wait_for_function("() => /Python 3.*\\|\\s*Idle/.test("
                           "document.querySelector('#jp-main-statusbar')?.textContent || '')")
    handle = page.locator(".wb-relax-slider .noUi-handle").first
    for attempt in range(2):  # once more should the first Run All be dropped by a settling kernel
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        try:
            handle.wait_for(state="visible", timeout=25_000 if attempt == 0 else 45_000)
            break
        except PlaywrightTimeout:
            if attempt == 1:
                raise


def test_explorer_slider_redraws_plot(lab):
    from playwright.sync_api import sync_playwright

    base, token, tmp_path = lab
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(45_000)
            _open_and_run_all(page, base, token)
            handle = page.locator(".wb-relax-slider .noUi-handle").first
            plot = page.locator(".wb-fig-per-position .js-plotly-plot").first
            plot.wait_for(state="visible")
            readout = page.locator(".wb-readout").first
            page.wait_for_function("() => document.querySelector('.wb-readout')?.textContent.includes('x = 0.00')")

            def predicted_y():
                # The plotted data of the per-position figure's "predicted" trace, as the page holds it.
                return plot.evaluate(
                    "gd => gd.data.filter(t => t.visible !== false && t.meta && t.meta.role === 'predicted')"
                    ".map(t => Array.from(t.y))")

            def svg():
                return plot.evaluate("gd => Array.from(gd.querySelectorAll('.scatterlayer path.js-line'))"
                                     ".map(p => p.getAttribute('d')).join('|')")

            before_y, before_svg = predicted_y(), svg()
            assert before_y and before_svg, "the per-position plot has no predicted trace drawn"
            handle.focus()
            for _ in range(30):
                page.keyboard.press("ArrowRight")
            page.wait_for_function(
                "() => document.querySelector('.wb-readout')?.textContent.includes('x = 0.30')")
            page.wait_for_function(
                "prev => { const gd = document.querySelector('.wb-fig-per-position .js-plotly-plot');"
                " return Array.from(gd.querySelectorAll('.scatterlayer path.js-line'))"
                ".map(p => p.getAttribute('d')).join('|') !== prev; }", arg=before_svg)
            after_y = predicted_y()
            page.screenshot(path=str(tmp_path / "after-slider.png"), full_page=True)
            assert "x = 0.30" in readout.text_content()
            assert len(after_y) == len(before_y)
            # A looser gate accepts at least as much at every position, strictly more somewhere.
            assert all(a >= b - 1e-12 for ya, yb in zip(after_y, before_y) for a, b in zip(ya, yb))
            assert any(a > b for ya, yb in zip(after_y, before_y) for a, b in zip(ya, yb))
        except Exception:
            # Leave evidence next to the lab log for whoever reads the failure.
            page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
            print(f"screenshot: {tmp_path / 'failure.png'}; lab log: {tmp_path / 'lab.log'}")
            raise
        finally:
            browser.close()


# --------------------------------------------------------------------------- several runs, one after another

_TRACES = """(sel) => { const gd = document.querySelector(sel + ' .js-plotly-plot'); if (!gd) return null;
  return gd.data.filter(t => t.visible !== false).map(t => ({type: t.type, name: t.name,
    color: (t.type === 'bar' || t.type === 'box') ? t.marker.color : (t.line && t.line.color) || (t.marker && t.marker.color),
    dash: t.line && t.line.dash, leg: t.meta && t.meta.leg, role: t.meta && t.meta.role})); }"""
_NOTES = """(sel) => { const gd = document.querySelector(sel + ' .js-plotly-plot');
  return {layout: ((gd.layout.annotations) || []).map(a => a.text),
          drawn: Array.from(gd.querySelectorAll('.annotation-text')).map(e => e.textContent)}; }"""


def _expected_tau_notes(run_dir: Path, gamma, x: float) -> list[str]:
    """The τ plot's annotations as the workbench draws them for the run (what the page must show, and only that)."""
    from workbench import analyses
    from workbench.results import load_run

    tables = analyses.RunTables(load_run(run_dir), teacher=False)
    return [a.text for a in analyses.view_figure(tables, "acceptance_vs_tau", gamma, x).layout.annotations]


def _artefacts(tmp_path: Path) -> Path:
    out = Path(os.environ.get("WB_BROWSER_ARTEFACTS") or tmp_path / "artefacts")
    out.mkdir(parents=True, exist_ok=True)
    print(f"browser test screenshots: {out}")
    return out


def _switch(page, experiment: str, run_id: str) -> None:
    select = page.locator(".wb-experiment select").first
    labels = select.evaluate("s => Array.from(s.options).map(o => o.textContent)")
    select.select_option(label=next(l for l in labels if l == experiment or l.startswith(experiment + ":")))
    page.wait_for_function("rid => (document.querySelector('.wb-status')?.textContent || '').includes(rid)",
                           arg=run_id)
    page.wait_for_timeout(1500)   # the figures' messages follow the status line


def _assert_legs_apart(page, box: str, labels: set[str]) -> None:
    traces = page.evaluate(_TRACES, f".wb-fig-{box}")
    measured = [t for t in traces if t["role"] == "measured"]
    assert {t["name"] for t in measured} == labels, traces
    assert len({t["color"] for t in measured}) == len(labels), measured
    colour = {t["leg"]: t["color"] for t in measured}
    for t in traces:                          # predicted of a leg: its colour, dotted
        if t["role"] == "predicted":
            assert t["color"] == colour[t["leg"]] and t["dash"] == "dot", t


def _assert_tau_notes(page, run_dir: Path, gamma, x: float) -> None:
    want = _expected_tau_notes(run_dir, gamma, x)
    notes = page.evaluate(_NOTES, ".wb-fig-tau")
    assert notes["layout"] == want and sorted(notes["drawn"]) == sorted(want), (run_dir.name, notes, want)


def test_explorer_switches_runs_as_a_researcher_does(lab_runs):
    from playwright.sync_api import sync_playwright

    base, token, tmp_path = lab_runs
    shots = _artefacts(tmp_path)
    results = tmp_path / "results"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(45_000)
        try:
            _open_and_run_all(page, base, token)       # opens on the last experiment: E6, three drafters
            page.wait_for_function("() => (document.querySelector('.wb-status')?.textContent || '').includes('E6')")
            page.wait_for_timeout(1500)
            drafters = {"int4 twin", "small VLM", "text draft"}
            _assert_legs_apart(page, "per-position", drafters)
            speed = page.evaluate(_TRACES, ".wb-fig-speedup")
            assert {t["name"] for t in speed if t["role"] == "speedup"} == drafters
            readout = page.locator(".wb-readout").first.text_content()
            assert all(label in readout for label in drafters)
            assert page.locator(".wb-gamma-slider").first.is_hidden()      # E6 has one gamma
            run_label = page.locator(".wb-run select option").first.text_content().replace("\xa0", " ")
            assert "organism" in run_label and "40 prompts" in run_label and "complete" in run_label
            assert "E6: Drafter families" in page.locator(".wb-experiment select").first.text_content().replace("\xa0", " ")
            _assert_tau_notes(page, E6_RUN, 6, 0.0)
            # the divergence text follows the leg dropdown
            page.locator(".jupyter-widget-Collapse-header", has_text="Divergence viewer").first.click()
            page.locator(".wb-divergence-leg select").first.select_option("strict_text-draft")
            page.wait_for_function("() => (document.querySelector('.wb-divergence')?.textContent || '')"
                                   ".includes('strict_text-draft')")
            page.screenshot(path=str(shots / "1-E6-drafters.png"), full_page=True)

            # a τ move is visible in the figure next to the slider, at 1400 x 1000, without scrolling
            page.evaluate("() => document.querySelector('.wb-controls').scrollIntoView({block: 'start'})")
            page.wait_for_timeout(300)
            for box in ("tau", "per-position"):
                r = page.locator(f".wb-fig-{box} .js-plotly-plot").first.bounding_box()
                assert r and r["y"] >= 0 and r["y"] + r["height"] <= 1000, (box, r)
            marker_x = "() => document.querySelector('.wb-fig-tau .js-plotly-plot').data" \
                       ".filter(t => t.meta && t.meta.role === 'marker').map(t => t.x[0])"
            before = page.evaluate(marker_x)
            page.locator(".wb-relax-slider .noUi-handle").first.focus()
            for _ in range(20):
                page.keyboard.press("ArrowRight")
            page.wait_for_function(f"prev => JSON.stringify(({marker_x})()) !== prev", arg=json.dumps(before))
            r = page.locator(".wb-fig-tau .js-plotly-plot").first.bounding_box()
            assert r["y"] >= 0 and r["y"] + r["height"] <= 1000
            page.screenshot(path=str(shots / "2-E6-tau-move-in-view.png"))
            x = float(page.locator(".wb-relax-slider .widget-readout").first.text_content())

            # three switches and back: nothing of the run before stays
            _switch(page, "E1", E1_RUN.name)                  # the tiny demo: the tie-rule note
            _assert_tau_notes(page, E1_RUN, 6, x)
            assert page.locator(".wb-gamma-slider").first.is_hidden()
            page.screenshot(path=str(shots / "3-E1-demo.png"), full_page=True)
            e2 = results / "E2" / "20260102T000000Z-e2e2"
            _switch(page, "E2", e2.name)                       # several gammas: the slider shows
            _assert_tau_notes(page, e2, 6, x)
            assert page.locator(".wb-gamma-slider").first.is_visible()
            _assert_legs_apart(page, "per-position", {"strict, γ = 6", "relaxed x = 0.69, γ = 6"})
            text = page.locator(".wb-divergence").first.text_content()
            assert "strict_text-draft" not in text and "vs vanilla_0" in text    # E2's legs, not E6's
            page.screenshot(path=str(shots / "4-E2-gammas.png"), full_page=True)
            _switch(page, "E17", "20260101T000000Z-5e7e")      # serving legs: their views, no τ plot
            assert page.locator(".wb-fig-serving-throughput .js-plotly-plot").first.is_visible()
            assert page.locator(".wb-fig-tau").first.is_hidden()
            thr = page.evaluate(_TRACES, ".wb-fig-serving-throughput")
            assert len({t["color"] for t in thr}) == len(thr) == 3
            page.screenshot(path=str(shots / "5-E17-serving.png"), full_page=True)
            _switch(page, "E6", E6_RUN.name)
            _assert_tau_notes(page, E6_RUN, 6, x)
            _assert_legs_apart(page, "per-position", drafters)
            assert "strict_g" not in page.locator(".wb-divergence").first.text_content()
            page.wait_for_function("rid => Array.from(document.querySelectorAll('.jp-OutputArea-output'))"
                                   ".some(e => e.textContent.includes('E6/' + rid))", arg=E6_RUN.name)
            page.screenshot(path=str(shots / "6-E6-again.png"), full_page=True)
        except Exception:
            page.screenshot(path=str(shots / "failure.png"), full_page=True)
            print(f"screenshot: {shots / 'failure.png'}; lab log: {tmp_path / 'lab.log'}")
            raise
        finally:
            browser.close()
