"""The explorer notebook in a real browser: JupyterLab + headless Debian chromium via Playwright.

One JupyterLab and one page for the module: the page opens notebooks/explorer.ipynb over copies of run
folders the workbench made (committed under results/: E2, a γ ladder; E6, three drafters; E18, serving
legs), runs all cells once, and the tests drive it as a researcher does: switch runs, move the τ
(relax_logtau) and γ sliders with the keyboard, and assert on what the page shows: each leg's colour and
legend name, the readout's row for every spec leg, the controls a run has (hidden where it has one value),
the τ slider's value and the figures it moves after switches, no annotation or text of the run before.
Screenshots are kept (the folder is printed; ``WB_BROWSER_ARTEFACTS`` names another).
Never downloads a browser: it drives the system chromium.
"""

from __future__ import annotations

import contextlib
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


# Run folders the workbench made (committed under results/).
E2_RUN = REPO / "results" / "E2" / "20261205T025758Z-b2b8e909"     # γ 2/3/4, tiny smoke: tie notes on the τ plot
E6_RUN = REPO / "results" / "E6" / "20261203T083606Z-40a8cb70"     # three drafters, organism profile, 40 prompts
E18_RUN = REPO / "results" / "E18" / "20261205T041848Z-edbaff6b"   # serving legs on an H200: no trace, no τ
DRAFTERS = {"strict_twin": "int4 twin", "strict_small-vlm": "small VLM", "strict_text-draft": "text draft"}
E2_LEGS = {"strict_g2": 2, "strict_g3": 3, "strict_g4": 4}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab over copies of the E2, E6 and E18 run folders (E18 is the newest: the page opens on it)."""
    _require_browser()
    tmp_path = tmp_path_factory.mktemp("lab")
    for run in (E2_RUN, E6_RUN, E18_RUN):
        if not run.is_dir():
            pytest.skip(f"the run folder {run.relative_to(REPO)} is not in this checkout")
        shutil.copytree(run, tmp_path / "results" / run.parent.name / run.name)
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
    # The explorer is up once its status line names a run (its τ control may rightly be hidden: a serving run).
    status = page.locator(".wb-status", has_text=" / ").first
    accepted = ("() => Array.from(document.querySelectorAll('.jp-CodeCell .jp-InputPrompt'))"
                ".some(e => /\\[\\d+\\]/.test(e.textContent))")   # a cell the kernel ran
    for attempt in range(2):  # once more should the first Run All be dropped by a settling kernel
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        try:
            # A Run All the kernel took is waited for, however loaded the host: sending another would run
            # every cell twice.
            page.wait_for_function(accepted, timeout=30_000)
        except PlaywrightTimeout:
            if attempt == 1:
                raise
            continue
        status.wait_for(state="visible", timeout=120_000)
        break


def _artefacts(tmp_path: Path) -> Path:
    out = Path(os.environ.get("WB_BROWSER_ARTEFACTS") or tmp_path / "artefacts")
    out.mkdir(parents=True, exist_ok=True)
    print(f"browser test screenshots: {out}")
    return out


class _Page:
    """The explorer page of the module, opened once: ``opened`` is what it showed right after Run All."""

    def __init__(self, page, shots: Path, lab_dir: Path):
        self.page, self.shots, self.lab_dir, self.opened = page, shots, lab_dir, {}

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(self.shots / f"{name}.png"), full_page=True)

    @contextlib.contextmanager
    def evidence(self, name: str):
        """A failure inside leaves the page's screenshot and says where the lab log is."""
        try:
            yield self.page
        except Exception:
            self.shot(f"failure-{name}")
            print(f"screenshots: {self.shots}; lab log: {self.lab_dir / 'lab.log'}")
            raise


@pytest.fixture(scope="module")
def explorer_page(lab):
    from playwright.sync_api import sync_playwright

    base, token, tmp_path = lab
    shots = _artefacts(tmp_path)
    pw = sync_playwright().start()
    browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(90_000)    # a CI host of 2 cores, shared
    ep = _Page(page, shots, tmp_path)
    try:
        _open_and_run_all(page, base, token)
        _wait_run(page, "E18", E18_RUN.name)
        ep.opened = {**page.evaluate(_STATE), "experiments": _experiment_values(page)}
        ep.shot("0-opened")
        yield ep
    except Exception:
        ep.shot("failure-opening")
        print(f"screenshots: {shots}; lab log: {tmp_path / 'lab.log'}")
        raise
    finally:
        browser.close()
        pw.stop()


# --------------------------------------------------------------------------- what the page shows

_STATE = """() => { const q = s => document.querySelector(s);
  const shown = s => { const e = q(s); return !!e && e.offsetParent !== null; };
  const text = s => ((q(s) || {}).textContent || '').replace(/\\u00a0/g, ' ');
  return {status: text('.wb-status'),
    tau_shown: shown('.wb-relax-slider'), gamma_shown: shown('.wb-gamma-slider'),
    tau: (q('.wb-relax-slider .noUi-handle') || {getAttribute: () => null}).getAttribute('aria-valuenow'),
    tau_readout: text('.wb-relax-slider .widget-readout'), gamma: text('.wb-gamma-slider .widget-readout'),
    readout_head: text('.wb-readout .wb-readout-head'),
    rows: Array.from(document.querySelectorAll('.wb-readout tr[data-leg]')).map(r => ({leg: r.dataset.leg,
      label: r.cells[0].textContent, colour: r.cells[0].querySelector('span').style.background,
      dim: r.style.opacity !== '1'})),
    boxes: Object.fromEntries(Array.from(document.querySelectorAll('[class*=wb-fig-]')).map(e =>
      [Array.from(e.classList).find(c => c.startsWith('wb-fig-')).slice(7), e.offsetParent !== null]))}; }"""
_TRACES = """([sel, all]) => { const gd = document.querySelector(sel + ' .js-plotly-plot'); if (!gd) return null;
  return gd.data.filter(t => all || t.visible !== false).map(t => ({type: t.type, name: t.name,
    color: (t.type === 'bar' || t.type === 'box') ? t.marker.color : (t.line && t.line.color) || (t.marker && t.marker.color),
    dash: t.line && t.line.dash, leg: t.meta && t.meta.leg, role: t.meta && t.meta.role,
    gamma: t.meta && t.meta.gamma, x: t.x && Array.from(t.x), y: t.y && Array.from(t.y)})); }"""
_NOTES = """(sel) => { const gd = document.querySelector(sel + ' .js-plotly-plot');
  return {layout: ((gd.layout.annotations) || []).filter(a => a.visible !== false).map(a => a.text),
          drawn: Array.from(gd.querySelectorAll('.annotation-text')).map(e => e.textContent)}; }"""


def _state(page) -> dict:
    return page.evaluate(_STATE)


def _traces(page, box: str, all_gammas: bool = False) -> list[dict]:
    return page.evaluate(_TRACES, [f".wb-fig-{box}", all_gammas])


def _experiment_values(page) -> list[str]:
    return page.locator(".wb-experiment select option").evaluate_all("os => os.map(o => o.textContent.split(':')[0])")


def _wait_run(page, experiment: str, run_id: str) -> None:
    """Until the page shows the run whole: the status line names it, and the numbers cell, which the kernel
    updates after every figure of the run, says it."""
    page.wait_for_function("rid => (document.querySelector('.wb-status')?.textContent || '').includes(rid)",
                           arg=run_id)
    page.wait_for_function("r => Array.from(document.querySelectorAll('.jp-OutputArea-output'))"
                           ".some(e => e.textContent.includes(r))", arg=f"{experiment}/{run_id}")
    page.wait_for_timeout(400)   # the figures' last messages, already sent, are drawn


def _switch(page, experiment: str, run_id: str) -> None:
    """Pick the experiment (the page then shows its newest run) and, where ``run_id`` is another, that run."""
    select = page.locator(".wb-experiment select").first
    labels = select.evaluate("s => Array.from(s.options).map(o => o.textContent)")
    select.select_option(label=next(l for l in labels if l == experiment or l.startswith(experiment + ":")))
    runs = page.locator(".wb-run select").first
    page.wait_for_function("e => (document.querySelector('.wb-status')?.textContent || '').startsWith(e + ' ')",
                           arg=experiment)
    wanted = next(l for l in runs.evaluate("s => Array.from(s.options).map(o => o.textContent)")
                  if l.endswith(f"[{run_id}]"))
    if runs.evaluate("s => s.options[s.selectedIndex].textContent") != wanted:
        runs.select_option(label=wanted)
    _wait_run(page, experiment, run_id)


def _move(page, slider: str, key: str, n: int) -> None:
    page.locator(f".wb-{slider}-slider .noUi-handle").first.focus()
    for _ in range(n):
        page.keyboard.press(key)


def _expected_tau_notes(run_dir: Path, gamma: int) -> list[str]:
    """The tie notes of the τ plot the page must show at ``gamma``: the workbench's figure for the run, the notes
    of the legs of that gamma (one per shown curve), and nothing else."""
    from workbench import analyses
    from workbench.results import load_run

    run = load_run(run_dir)
    leg_gamma = dict(zip(run.legs["leg"], run.legs["gamma"]))
    fig = analyses.view_figure(analyses.RunTables(run, teacher=False), "acceptance_vs_tau", gamma, 0.0)
    return [a.text for a in fig.layout.annotations if leg_gamma.get(a.name.partition(":")[2]) == gamma]


def _assert_tau_notes(page, run_dir: Path, gamma: int) -> None:
    want = _expected_tau_notes(run_dir, gamma)
    notes = page.evaluate(_NOTES, ".wb-fig-tau")
    assert notes["layout"] == want and sorted(notes["drawn"]) == sorted(want), (run_dir.name, notes, want)


def _assert_tau_at(page, x: float) -> None:
    """The τ control shows x, and the figures it moves are drawn at x: the τ plot's markers, the readout."""
    s = _state(page)
    assert s["tau_shown"] and float(s["tau"]) == pytest.approx(x) and s["tau_readout"] == f"{x:.2f}", s
    assert s["readout_head"].startswith(f"x = {x:.2f} "), s
    markers = [t["x"][0] for t in _traces(page, "tau") if t["role"] == "marker"]
    assert markers and all(m == pytest.approx(x) for m in markers), markers


def _assert_legs_apart(page, box: str, labels: set[str]) -> None:
    traces = _traces(page, box)
    measured = [t for t in traces if t["role"] == "measured"]
    assert {t["name"] for t in measured} == labels, traces
    assert len({t["color"] for t in measured}) == len(labels), measured
    colour = {t["leg"]: t["color"] for t in measured}
    for t in traces:                          # predicted of a leg: its colour, dotted
        if t["role"] == "predicted":
            assert t["color"] == colour[t["leg"]] and t["dash"] == "dot", t


def _readout_rows(page) -> dict[str, dict]:
    return {r["leg"]: r for r in _state(page)["rows"]}


# --------------------------------------------------------------------------- the tests


def test_the_page_opens_on_the_newest_run_with_only_the_controls_it_has(explorer_page):
    """E18, the newest run, a serving run: its five views, no τ or γ control (nothing they would move), the
    experiments in natural order, the legend naming the legs as a reader does."""
    opened = explorer_page.opened
    assert opened["experiments"] == ["E2", "E6", "E18"]           # by number, not E18 before E2
    assert opened["status"].startswith("E18 ") and E18_RUN.name in opened["status"]
    assert not opened["tau_shown"] and not opened["gamma_shown"]
    assert opened["rows"] == [] and opened["readout_head"] == ""
    shown = {box for box, on in opened["boxes"].items() if on}
    assert shown == {"serving-summary", "serving-speedup", "serving-latency", "serving-throughput",
                     "serving-acceptance"}, shown
    with explorer_page.evidence("opened") as page:
        _switch(page, "E18", E18_RUN.name)
        thr = _traces(page, "serving-throughput")
        assert [t["name"] for t in thr] == ["vanilla", "synthetic α = 0.9"]     # the twin at its drawn α
        assert len({t["color"] for t in thr}) == 2
        label = page.locator(".wb-run select option").first.text_content().replace("\xa0", " ")
        assert "8b-shape" in label and "full" in label and "gpu" in label and "complete" in label, label


def test_tau_moves_its_figures_and_stays_through_run_switches(explorer_page):
    """E6 (three drafters) → E18 (no τ) → E2 (γ ladder) → E6 → E2: the τ value set on E6 is the one the slider
    and the figures show on every run that has a τ; γ and its tie notes follow the γ slider, and the γ picked
    on E2 comes back with it; nothing of the run before stays."""
    with explorer_page.evidence("tau") as page:
        x = _drafters_and_a_tau_move(explorer_page)
        _switch(page, "E18", E18_RUN.name)            # no trace: τ hidden (its value kept), no leg table
        s = _state(page)
        assert not s["tau_shown"] and not s["gamma_shown"] and s["rows"] == [] and not s["boxes"]["tau"]
        explorer_page.shot("2-E18-serving")
        _gamma_ladder_at(explorer_page, x)
        _switch(page, "E6", E6_RUN.name)              # back to the drafters: τ still x, no note or γ of E2
        _assert_tau_at(page, x)
        _assert_tau_notes(page, E6_RUN, 6)
        assert not _state(page)["gamma_shown"]
        _assert_legs_apart(page, "per-position", set(DRAFTERS.values()))
        # the divergence text follows the leg dropdown
        page.locator(".jupyter-widget-Collapse-header", has_text="Divergence viewer").first.click()
        page.locator(".wb-divergence-leg select").first.select_option("strict_text-draft")
        page.wait_for_function("() => (document.querySelector('.wb-divergence')?.textContent || '')"
                               ".includes('strict_text-draft')")
        assert "strict_g" not in page.locator(".wb-divergence").first.text_content()
        explorer_page.shot("4-E6-again")
        _switch(page, "E2", E2_RUN.name)              # the γ picked on E2 comes back with it
        assert _state(page)["gamma"] == "2"
        _assert_tau_notes(page, E2_RUN, 2)


def _drafters_and_a_tau_move(ep: _Page) -> float:
    """E6: a colour and legend name per drafter, a readout row per drafter, no γ control; a τ move redraws the
    figures beside the slider, in view at 1400 x 1000 without scrolling. Returns the τ (x) set."""
    page = ep.page
    _switch(page, "E6", E6_RUN.name)
    s = _state(page)
    assert s["tau_shown"] and not s["gamma_shown"]                 # E6 has one γ
    _assert_legs_apart(page, "per-position", set(DRAFTERS.values()))
    speed = _traces(page, "speedup")
    assert {t["name"] for t in speed if t["role"] == "speedup"} == set(DRAFTERS.values())
    rows = _readout_rows(page)
    assert list(rows) == list(DRAFTERS) and [r["label"] for r in rows.values()] == list(DRAFTERS.values())
    assert len({r["colour"] for r in rows.values()}) == 3 and not any(r["dim"] for r in rows.values())
    _assert_tau_notes(page, E6_RUN, 6)

    page.evaluate("() => document.querySelector('.wb-controls').scrollIntoView({block: 'start'})")
    predicted = lambda: [t["y"] for t in _traces(page, "per-position") if t["role"] == "predicted"]  # noqa: E731
    before = predicted()
    _move(page, "relax", "ArrowRight", 20)
    x = round(float(s["tau"]) + 0.20, 2)
    page.wait_for_function("h => (document.querySelector('.wb-readout')?.textContent || '').includes(h)",
                           arg=f"x = {x:.2f} ")
    page.wait_for_function("x => document.querySelector('.wb-fig-tau .js-plotly-plot').data"
                           ".filter(t => t.meta && t.meta.role === 'marker').every(t => t.x[0] === x)", arg=x)
    _assert_tau_at(page, x)
    after = predicted()
    assert len(after) == len(before) == 3
    # a looser gate accepts at least as much at every position, strictly more somewhere
    assert all(a >= b - 1e-12 for ya, yb in zip(after, before) for a, b in zip(ya, yb))
    assert any(a > b + 1e-9 for ya, yb in zip(after, before) for a, b in zip(ya, yb))
    for box in ("tau", "per-position"):
        r = page.locator(f".wb-fig-{box} .js-plotly-plot").first.bounding_box()
        assert r and r["y"] >= 0 and r["y"] + r["height"] <= 1000, (box, r)
    page.screenshot(path=str(ep.shots / "1-E6-tau-move-in-view.png"))
    return x


def _gamma_ladder_at(ep: _Page, x: float) -> None:
    """E2 after a run without τ: the τ control back at x, the γ slider at the largest γ, its tie note only, a
    readout row per γ; a γ move to 2 moves the shown curves, the tie note and the readout's emphasis."""
    page = ep.page
    _switch(page, "E2", E2_RUN.name)
    _assert_tau_at(page, x)
    s = _state(page)
    assert s["gamma_shown"] and s["gamma"] == "4"                # several γ: the slider shows, at the largest
    assert list(_readout_rows(page)) == list(E2_LEGS)
    _assert_tau_notes(page, E2_RUN, 4)                           # γ 4's tie note, none of E6's
    _assert_legs_apart(page, "per-position", {"strict, γ = 4"})
    every = [t for t in _traces(page, "per-position", all_gammas=True) if t["role"] == "measured"]
    assert len({t["color"] for t in every}) == len(E2_LEGS)      # each γ its own shade
    text = page.locator(".wb-divergence").first.text_content()
    assert "strict_text-draft" not in text and "strict_g" in text    # E2's legs, not E6's
    ep.shot("3-E2-tau-kept")

    _move(page, "gamma", "ArrowLeft", 2)          # γ 4 -> 2
    page.wait_for_function("() => document.querySelector('.wb-gamma-slider .widget-readout').textContent === '2'")
    page.wait_for_function("() => { const r = document.querySelector(\".wb-readout tr[data-leg='strict_g2']\");"
                           " return r && r.style.opacity === '1'; }")
    _assert_legs_apart(page, "per-position", {"strict, γ = 2"})
    _assert_tau_notes(page, E2_RUN, 2)
    assert {leg for leg, r in _readout_rows(page).items() if not r["dim"]} == {"strict_g2"}
    _assert_tau_at(page, x)
