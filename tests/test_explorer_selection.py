"""The explorer as a researcher uses it (no browser): the readout covers every spec leg, a selection changes
what depends on it and nothing else, a control with one value is hidden, the run picker says what each run is."""

from __future__ import annotations

import re

import pytest

from synthetic_runs import LADDER_LEGS, write_run
from test_legstyle import DRAFTERS, SPEC

ONE_GAMMA = [{"name": "vanilla_0", "tier": "vanilla"}, {"name": "strict_g4", "tier": "strict", "gamma": 4},
             {"name": "vanilla_1", "tier": "vanilla"}]


@pytest.fixture
def root(tmp_path):
    write_run(tmp_path, experiment="E6", run_id="20260102T030400Z-0006", legs=DRAFTERS, n_prompts=5)
    write_run(tmp_path, experiment="E2", run_id="20260102T030500Z-0002", legs=LADDER_LEGS, n_prompts=5)
    write_run(tmp_path, experiment="E1", run_id="20260102T030600Z-0001", legs=ONE_GAMMA, n_prompts=4,
              trace=False)
    return tmp_path


def _rows(html: str) -> list[str]:
    return re.findall(r"data-leg='([^']+)'", html)


def test_readout_gives_every_spec_leg(root):
    from workbench.widgets import Explorer

    ex = Explorer(root, "E6")
    assert _rows(ex.readout.value) == list(SPEC)
    for label in SPEC.values():
        assert label in ex.readout.value
    ex.relax_slider.value = 0.5
    assert "x = 0.50" in ex.readout.value and _rows(ex.readout.value) == list(SPEC)
    ex2 = Explorer(root, "E2")
    assert _rows(ex2.readout.value) == [leg["name"] for leg in LADDER_LEGS if leg["tier"] != "vanilla"]


def test_a_control_with_one_value_is_hidden(root):
    from workbench.widgets import Explorer

    ex = Explorer(root, "E2")
    assert ex.gamma_slider.layout.display is None and ex.relax_slider.layout.display is None
    ex.experiment_dd.value = "E6"            # one gamma
    assert ex.gamma_slider.layout.display == "none" and ex.relax_slider.layout.display is None
    ex.experiment_dd.value = "E1"            # one gamma, no trace
    assert ex.gamma_slider.layout.display == "none" and ex.relax_slider.layout.display == "none"
    ex.experiment_dd.value = "E2"
    assert ex.gamma_slider.layout.display is None


def test_a_tau_move_changes_only_what_depends_on_it(root):
    from workbench.widgets import Explorer

    ex = Explorer(root, "E2")
    import plotly.io as pio

    snap = lambda fw: pio.to_json(fw.to_dict())  # noqa: E731
    before = {name: snap(fw) for name, fw in ex.figs.items()}
    ex.relax_slider.value = 0.8
    changed = {name for name, fw in ex.figs.items() if snap(fw) != before[name]}
    moved_by_tau = {name for name, v in ex.views.items() if "relax_logtau" in v.sliders and name in ex._drawn}
    assert changed and changed <= moved_by_tau
    assert "speedup_vs_gamma" not in changed and "speedup_distribution" not in changed


class _Handle:
    def __init__(self):
        self.shown = []

    def update(self, obj):
        self.shown.append(obj.data)


def test_the_numbers_cell_follows_the_run(root):
    from workbench.widgets import Explorer

    ex = Explorer(root, "E2")
    ex._numbers_display = handle = _Handle()
    assert ex.numbers()["run"] == "E2/20260102T030500Z-0002"
    ex.experiment_dd.value = "E6"
    assert handle.shown[-1]["run"] == "E6/20260102T030400Z-0006"
    assert {r["leg"] for r in handle.shown[-1]["speedup"]} == set(SPEC)


def test_the_run_picker_says_what_each_run_is(root):
    from workbench.widgets import Explorer

    (root / "E6" / "20260102T030400Z-0006" / "legs" / "strict_twin" / "summary.json").unlink()
    ex = Explorer(root, "E6")
    label = ex.run_dd.options[0][0]
    for part in ("2026-01-02 03:04", "tiny", "smoke", "5 legs (3 spec)", "partial (1 incomplete)",
                 "[20260102T030400Z-0006]"):
        assert part in label, (part, label)
    ex.experiment_dd.value = "E2"
    assert "· complete" in ex.run_dd.options[0][0]
    from workbench.widgets import experiment_options
    runs = ex._runs.assign(title=[("Drafter families" if e == "E6" else None) for e in ex._runs["experiment"]])
    assert experiment_options(runs) == [("E1", "E1"), ("E2", "E2"), ("E6: Drafter families", "E6")]


def test_the_controls_sit_right_above_the_figures_the_relax_slider_moves(root):
    from workbench.widgets import Explorer

    ex = Explorer(root, "E2")
    kids = list(ex.widget.children)
    grid = ex.grids["legs"]
    assert kids.index(grid) == kids.index(ex.controls) + 1
    assert ex.relax_slider in ex.controls.children[0].children
    first_two = [b for row in grid.children for b in row.children if b.layout.display != "none"][:2]
    names = {n for n, b in ex.boxes.items() if b in first_two}
    assert all("relax_logtau" in ex.views[n].sliders for n in names)


def test_every_view_of_legs_follows_the_gamma_slider(root):
    from workbench.widgets import Explorer

    ex = Explorer(root, "E2")
    for gamma in (2, 6):
        ex.gamma_slider.value = gamma
        for name in ("per_position_acceptance", "acceptance_over_position", "speedup_distribution"):
            shown = {t.meta.get("gamma") for t in ex.figs[name].data if t.visible is not False and t.meta.get("leg")}
            assert shown == {gamma}, (name, gamma, shown)
        rows = re.findall(r"data-leg='([^']+)' style='opacity:([0-9.]+)'", ex.readout.value)
        assert {leg for leg, o in rows if o == "1"} == {leg["name"] for leg in LADDER_LEGS if leg.get("gamma") == gamma}


def test_a_leg_whose_records_disagree_with_its_summary_marks_the_run_damaged(root):
    from workbench.results import list_runs
    from workbench.widgets import run_label

    records = root / "E6" / "20260102T030400Z-0006" / "legs" / "strict_twin" / "records.jsonl"
    records.write_text("".join(records.read_text().splitlines(keepends=True)[:-1]))   # a line lost
    row = list_runs(root, "E6").iloc[0]
    assert row["n_damaged"] == 1 and "· damaged  [" in run_label(row)


def test_experiments_in_natural_order_the_page_opens_on_the_newest_run(root):
    from workbench.widgets import Explorer

    write_run(root, experiment="E18", run_id="20260102T030700Z-0018", legs=ONE_GAMMA, n_prompts=3, trace=False)
    write_run(root, experiment="E6", run_id="20260102T030800Z-0106", legs=DRAFTERS, n_prompts=3)
    ex = Explorer(root)
    assert [v for _, v in ex.experiment_dd.options] == ["E1", "E2", "E6", "E18"]      # not E1, E18, E2, E6
    assert ex.experiment_dd.value == "E6" and ex.pre.run.run_id == "20260102T030800Z-0106"   # the newest run
    ex.experiment_dd.value = "E18"
    assert ex.pre.run.run_id == "20260102T030700Z-0018"
    ex.experiment_dd.value = "E6"                       # an experiment opens on its newest run
    assert ex.pre.run.run_id == "20260102T030800Z-0106"
    from workbench.widgets.picker import experiment_key
    assert sorted(["cost-ladder", "E10", "E9", "E101", "E1", "explorer_bench"], key=experiment_key) == \
        ["E1", "E9", "E10", "E101", "cost-ladder", "explorer_bench"]


def _tau_marker_x(ex) -> set[float]:
    return {round(float(t.x[0]), 6) for t in ex.figs["acceptance_vs_tau"].data
            if (t.meta or {}).get("role") == "marker" and t.visible is not False}


def test_a_run_switch_keeps_tau_and_the_gamma_the_user_picked(root):
    from workbench.widgets import Explorer

    ex = Explorer(root, "E2")
    ex.relax_slider.value = 0.4
    ex.gamma_slider.value = 2
    ex.experiment_dd.value = "E1"                 # no trace: the τ control is hidden, its value kept
    assert ex.relax_slider.layout.display == "none" and ex.relax_slider.value == 0.4
    assert "x = 0.40" in ex.readout.value
    ex.experiment_dd.value = "E6"                 # a trace again: τ shows at 0.40, the figures drawn at it
    assert ex.relax_slider.layout.display is None and not ex.relax_slider.disabled
    assert _tau_marker_x(ex) == {0.4} and "x = 0.40" in ex.readout.value
    assert ex.gamma_slider.value == 6             # E6's only gamma
    ex.experiment_dd.value = "E2"                 # back: the gamma the user picked, not E6's
    assert ex.gamma_slider.value == 2 and _tau_marker_x(ex) == {0.4}
    shown = {t.meta.get("gamma") for t in ex.figs["per_position_acceptance"].data if t.visible is not False}
    assert shown == {2}


def test_the_tau_plot_shows_the_tie_notes_of_the_gamma_shown():
    from pathlib import Path

    from workbench.results import load_run
    from workbench.widgets import Explorer

    e2 = Path(__file__).resolve().parents[1] / "results" / "E2" / "20261205T025758Z-b2b8e909"
    if not e2.is_dir():
        pytest.skip(f"the committed E2 run folder {e2.name} is not in this checkout")
    ex = Explorer(run=load_run(e2))
    fw = ex.figs["acceptance_vs_tau"]

    def shown_notes():
        return [a.name.partition(":")[2] for a in fw.layout.annotations if a.visible is not False]

    assert len(fw.layout.annotations) == 3 and ex.gamma_slider.value == 4
    assert shown_notes() == ["strict_g4"]         # one tie note: the curve shown, not every gamma's
    ex.gamma_slider.value = 2
    assert shown_notes() == ["strict_g2"]
