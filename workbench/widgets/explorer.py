"""The run explorer: pickers, the gamma and relax_logtau sliders with the readout, the figures under them.

The explorer's figures are the explorer views declared in the analysis
registry (``workbench.analyses.ANALYSES``, ``Analysis.view``): it loops over
them, one figure widget per view, built once per run with the same plot
functions as the exported figures, and a slider move applies each view's
declared rule (its ``update``, a redraw at the new values, traces shown per
gamma) by editing trace data in place inside ``batch_update``. Adding a figure
to the explorer is an entry in that registry; nothing here names a figure.

Everything a slider needs is precomputed when the run is loaded: the run's
tables, and the acceptance trace's presorted running maxima
(``metrics.TraceIndex``), so a move of the ``relax_logtau`` slider is a
handful of ``searchsorted`` calls whatever the number of prompts (see
benchmarks/bench_explorer.py).

A run of serving legs (E17) shows the views of the "serving" group (its legs table, latency
boxes, throughput and acceptance vs concurrency) the same way.

A cost-ladder run (E16) has no prompt records; the explorer shows the views
of the "ladder" group instead (step cost vs batch, c with and without drafter
graphs, S(α) with the published operating points), and the ``gamma`` slider
picks the gamma whose S(α) curves are shown.

Layout: the pickers and a line saying what the run is; then the controls (the
sliders, hidden where the run gives them one value, and the readout: a table of
every spec leg) directly above the figures they move, two a row, the figures
the relax_logtau slider moves first. Every leg has one label and colour in all
of them (``RunTables.leg_styles``).
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import ipywidgets as W
import plotly.graph_objects as go

from .. import analyses, metrics, plots
from ..results import Run, list_runs, load_run
from .divergence import _has_divergence_pairs, divergence_viewer
from .edits import _apply_patches, _edit_to_match, replace_figure
from .picker import default_experiment, experiment_options, picker_options, sorted_experiments
from .readout import _ladder_readout_html, legs_readout_html, legs_readout_table

X_MAX = float(analyses.RELAX_GRID[-1])
X_STEP = 0.01
FIG_HEIGHT = 430        # px: two figures a row under the controls stay within a laptop screen (1400 x 1000)
FIG_WIDTH = 470
# Views that read better across the whole row (wide tables, a long note under the axis).
FULL_ROW = ("serving-summary", "serving-latency", "ladder-speedup", "ladder-steps")
# Earlier names of the explorer's figure widgets (``Explorer.fig_speedup`` ...) -> their view's box.
_FIG_ATTRS = {"fig_speedup": "speedup", "fig_dist": "distribution", "fig_pos": "per-position", "fig_tau": "tau",
              "fig_over": "over-position", "fig_ladder_steps": "ladder-steps", "fig_ladder_c": "ladder-c",
              "fig_ladder_curves": "ladder-speedup"}


def _gamma(v: Any) -> int | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else int(round(f))


class _Precomputed:
    """What the explorer reads of one run, computed once per run: its tables (``analyses.RunTables``),
    the gammas it has, the traced leg that predicts each gamma, the exactness verdicts.

    A table is an attribute too: ``pre.speedup`` is ``pre.tables.get("speedup")``.
    """

    def __init__(self, run: Run, bins: int):
        self.run = run
        # the explorer never loads a model: divergences are classified from the run's gap cache
        self.tables = tables = analyses.RunTables(run, bins, teacher=False)
        spec = tables.records[tables.records["tier"].isin(metrics.SPEC_TIERS)] if tables.has_spec else None
        self.gammas = sorted({g for g in (spec["gamma"].map(_gamma) if spec is not None else []) if g is not None})
        self.trace = tables.trace
        self.is_ladder = tables.get("step_costs") is not None
        self.is_serving = not self.is_ladder and tables.get("serving_legs") is not None
        try:
            self.verdicts = tables.verdicts if tables.has_spec and tables.has_vanilla else {}
        except (LookupError, ValueError, OSError):
            self.verdicts = {}
        cost_ratio = tables.get("cost_ratio")
        if not self.gammas and cost_ratio is not None and len(cost_ratio):
            self.gammas = sorted({int(g) for g in cost_ratio["gamma"]})
        self.trace_leg_for_gamma: dict[int, str] = {}
        if self.trace is not None:
            meta = self.trace.prompts.drop_duplicates("leg").set_index("leg")
            # Counterfactual per gamma: prefer a strict leg's trace (it predicts relaxed from exact drafts).
            for leg in sorted(self.trace.legs, key=lambda l: (meta.loc[l, "tier"] != "strict", l)):
                g = _gamma(meta.loc[leg, "gamma"])
                if g is not None:
                    self.trace_leg_for_gamma.setdefault(g, leg)
        self.styles = tables.leg_styles
        self.readout_table = legs_readout_table(tables, self.styles) if self.group == "legs" else None

    def __getattr__(self, name: str) -> Any:
        if name in analyses.TABLES:
            return self.tables.get(name)
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    @property
    def group(self) -> str:
        """The views this run shows (``analyses.View.group``)."""
        return "ladder" if self.is_ladder else "serving" if self.is_serving else "legs"


class Explorer:
    """Interactive view of one run: experiment/run dropdowns, gamma and relax_logtau sliders.

    ``Explorer(results_root, experiment, run_id)`` (pickers list the runs
    under ``results_root``) or ``Explorer(run=load_run(path))``. ``.widget``
    is the box to display; ``figs`` maps each explorer view (analysis name,
    ``analyses.views()``) to its figure widget and ``boxes`` to its box;
    ``on_gamma`` / ``on_relax`` are what the sliders call (exposed so they can
    be timed and tested without a browser).
    """

    def __init__(self, results_root: str | Path | None = None, experiment: str | None = None,
                 run_id: str | None = None, *, run: Run | None = None, bins: int = 10):
        if run is None and results_root is None:
            raise ValueError("Explorer needs results_root (to pick a run) or run=")
        self.results_root = Path(results_root) if results_root is not None else None
        self.bins = bins
        self.pre: _Precomputed | None = None
        self._quiet = False
        self._wanted_gamma: int | None = None   # the gamma the user last picked: kept where a run has it

        self.experiment_dd = W.Dropdown(description="experiment", options=[])
        self.experiment_dd.add_class("wb-experiment")
        self.run_dd = W.Dropdown(description="run", options=[], layout=W.Layout(width="760px"))
        self.run_dd.add_class("wb-run")
        self.gamma_slider = W.SelectionSlider(description="gamma", options=[0], value=0,
                                              continuous_update=True, disabled=True)
        self.gamma_slider.add_class("wb-gamma-slider")
        self._numbers_display: Any = None
        self.relax_slider = W.FloatSlider(description="relax_logtau", min=0.0, max=X_MAX, step=X_STEP,
                                          value=0.0, readout_format=".2f", continuous_update=True,
                                          style={"description_width": "initial"})
        self.relax_slider.add_class("wb-relax-slider")
        self.readout = W.HTML()
        self.readout.add_class("wb-readout")
        self.status = W.HTML()
        self.status.add_class("wb-status")
        self.divergence = W.VBox()

        # One figure widget per declared view, in registry order, each in a box "wb-fig-<box>".
        self.views: dict[str, analyses.View] = analyses.views()
        self.figs: dict[str, go.FigureWidget] = {name: go.FigureWidget() for name in self.views}
        self.boxes: dict[str, W.Box] = {}
        for name, view in self.views.items():
            box = W.Box([self.figs[name]])
            box.add_class(f"wb-fig-{view.box}")
            self.boxes[name] = box
        self._drawn: set[str] = set()            # views showing a figure of the run (not a placeholder)
        self._metas: dict[str, list[dict]] = {}  # per view: the shown traces' meta, indexed once per run
        self._divergence_box = W.Accordion([self.divergence], titles=("Divergence viewer",))
        self.controls = W.HBox([W.VBox([self.gamma_slider, self.relax_slider], layout=W.Layout(min_width="380px")),
                                self.readout], layout=W.Layout(width="100%", align_items="flex-start"))
        self.controls.add_class("wb-controls")
        self.grids = {g: W.VBox(_rows_of_two(self._group_boxes(g), self.views, self.boxes))
                      for g in analyses.VIEW_GROUPS}
        for g, grid in self.grids.items():
            grid.add_class(f"wb-grid-{g}")
        self.widget = W.VBox([W.HBox([self.experiment_dd, self.run_dd]), self.status, self.controls,
                              *self.grids.values(), self._divergence_box])
        self.widget.add_class("wb-explorer")

        self.experiment_dd.observe(self._experiment_changed, "value")
        self.run_dd.observe(self._run_changed, "value")
        self.gamma_slider.observe(self._gamma_moved, "value")
        self.relax_slider.observe(lambda ch: self.on_relax(ch["new"]), "value")

        if run is not None:
            self.experiment_dd.options = [run.experiment]
            self.run_dd.options = [(run.run_id, str(run.path))]
            self.experiment_dd.disabled = self.run_dd.disabled = True
            self.set_run(run)
        else:
            runs = list_runs(self.results_root)
            if runs.empty:
                raise FileNotFoundError(f"no run folders under {self.results_root}")
            self._runs = runs
            exps = sorted_experiments(runs)
            if experiment is not None and experiment not in exps:
                raise ValueError(f"experiment {experiment!r} has no runs under {self.results_root} (found {exps})")
            self._quiet = True
            self.experiment_dd.options = experiment_options(runs)
            self._quiet = False
            self._pending_run_id = run_id
            self.experiment_dd.value = None
            self.experiment_dd.value = experiment or default_experiment(runs)

    def __getattr__(self, name: str) -> Any:
        # fig_speedup, fig_pos, ...: the figure widget of the view with that box
        box = _FIG_ATTRS.get(name)
        if box is not None:
            figs = self.__dict__.get("figs", {})
            views = self.__dict__.get("views", {})
            found = next((figs[n] for n, v in views.items() if v.box == box), None)
            if found is not None:
                return found
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    def _group_boxes(self, group: str) -> list[W.Box]:
        """The boxes of a group's views: those the relax_logtau slider moves first (next to it), then the others."""
        names = [name for name, view in self.views.items() if view.group == group]
        names.sort(key=lambda n: "relax_logtau" not in self.views[n].sliders)
        return [self.boxes[name] for name in names]

    @property
    def _leg_boxes(self) -> list[W.Box]:
        return self._group_boxes("legs")

    @property
    def _ladder_boxes(self) -> list[W.Box]:
        return self._group_boxes("ladder")

    # ------------------------------------------------------------------ pickers

    def _experiment_changed(self, change: dict) -> None:
        if self._quiet or change["new"] is None:
            return
        runs = self._runs[self._runs["experiment"] == change["new"]]
        options = picker_options(runs)
        want = getattr(self, "_pending_run_id", None)
        self._pending_run_id = None
        if want is not None and want not in set(runs["run_id"]):
            raise ValueError(f"run {want!r} not found for experiment {change['new']!r} "
                             f"(runs: {list(runs['run_id'])})")
        self._quiet = True
        self.run_dd.options = options
        self.run_dd.value = None
        self._quiet = False
        target = dict(options)[want] if want is not None else options[-1][1]
        self.run_dd.value = target

    def _run_changed(self, change: dict) -> None:
        if self._quiet or change["new"] is None:
            return
        try:
            run = load_run(change["new"])
        except (OSError, ValueError) as exc:
            # One damaged file (a torn records.jsonl line) must not lock the explorer out of the
            # experiment's other runs, nor leave the previous run's figures under this run's name.
            self.show_damaged(change["new"], exc)
            return
        self.set_run(run)

    def show_damaged(self, path: str | Path, exc: BaseException) -> None:
        """Say which file (and line) of the run at ``path`` cannot be read; clear every figure."""
        self.pre = None
        path = Path(path)
        self.status.value = (f"<b>damaged</b> run {html.escape(path.parent.name)} / {html.escape(path.name)}: "
                             f"{html.escape(str(exc))}<br><i>the other runs open; "
                             f"<code>workbench run {html.escape(path.parent.name)} --resume {html.escape(str(path))}"
                             f"</code> re-runs a leg whose records are damaged</i>")
        self.readout.value = ""
        for fw in self.figs.values():
            replace_figure(fw, _empty("run damaged: see above"))
        self._drawn, self._metas = set(), {}
        self.divergence.children = []
        self._show_numbers()
        self.gamma_slider.disabled = self.relax_slider.disabled = True
        # mark it in the picker, keeping it selected
        labelled = [(_damaged(label) if value == str(path) else label, value) for label, value in self.run_dd.options]
        if labelled != list(self.run_dd.options):
            self._quiet = True
            self.run_dd.options = labelled
            self.run_dd.value = str(path)
            self._quiet = False

    # ------------------------------------------------------------------ building

    def set_run(self, run: Run) -> None:
        """Precompute and rebuild every figure for ``run`` (sliders only edit data afterwards): nothing of the
        run shown before stays (figures, annotations, readout, divergence text, the numbers cell)."""
        self.pre = pre = _Precomputed(run, self.bins)
        done = run.legs["status"].value_counts().to_dict()
        title = run.config.get("title")
        self.status.value = (f"<b>{html.escape(run.experiment)}</b>"
                             + (f" ({html.escape(str(title))})" if title else "")
                             + f" / {html.escape(run.run_id)}: "
                             + ", ".join(f"{v} {html.escape(str(k))}" for k, v in sorted(done.items()))
                             + f" legs; {len(run.records)} prompt records")
        self._set_sliders(pre)
        self._draw_views(pre)
        self._divergence_box.layout.display = "none" if pre.is_ladder or pre.is_serving else None
        self.divergence.children = [divergence_viewer(run, verdicts=self.pre.verdicts)] if _has_divergence_pairs(run) else [
            W.HTML("<i>needs a vanilla leg and a spec leg with gen_ids</i>")]
        # The figures as at the sliders' values: each view's move rule, once.
        self._move(analyses.SLIDERS, redraw=False)
        self._show_readout()
        self._show_numbers()

    def _set_sliders(self, pre: _Precomputed) -> None:
        """The sliders of the run: its gammas (hidden where it has one or none), relax_logtau where it has a trace.

        A run switch keeps what the user chose: relax_logtau keeps its value (hidden on a run without a trace, it
        comes back at that value; every figure and the readout are drawn at it), the gamma the user last picked
        is shown where the run has it, else the run's largest.
        """
        # Only our own handler is detached: the slider keeps its internal value<->index sync.
        self.gamma_slider.unobserve(self._gamma_moved, "value")
        if pre.gammas:
            wanted = self._wanted_gamma
            self.gamma_slider.options = pre.gammas
            self.gamma_slider.value = wanted if wanted in pre.gammas else pre.gammas[-1]
            self.gamma_slider.disabled = False
        else:
            self.gamma_slider.options = [0]
            self.gamma_slider.disabled = True
        self.gamma_slider.observe(self._gamma_moved, "value")
        self.gamma_slider.layout.display = None if len(pre.gammas) > 1 else "none"
        self.relax_slider.disabled = pre.trace is None
        self.relax_slider.layout.display = None if pre.trace is not None else "none"

    def _draw_views(self, pre: _Precomputed) -> None:
        """Every view of the run's group drawn anew (a placeholder where the run cannot draw it); the others
        emptied and hidden."""
        gamma, x = self._values()
        self._drawn, self._metas = set(), {}
        for g, grid in self.grids.items():
            grid.layout.display = None if g == pre.group else "none"
        for name, view in self.views.items():
            shown = view.group == pre.group
            self.boxes[name].layout.display = None if shown else "none"
            if not shown:
                replace_figure(self.figs[name], go.Figure())
                continue
            try:
                fig = analyses.view_figure(pre.tables, name, gamma, x)
            except (LookupError, ValueError):   # NotApplicable, or a table the run cannot make
                fig = _empty(view.empty)
            else:
                self._drawn.add(name)
                _fit(fig, view.box in FULL_ROW)
            replace_figure(self.figs[name], fig)
            self._metas[name] = [dict(t.meta or {}) for t in self.figs[name].data]

    def _values(self, gamma: Any = None, x: float | None = None) -> tuple[int | None, float]:
        """Slider values as the views take them, (gamma or None, x): those given, else the sliders'."""
        if gamma is None:
            gamma = self.gamma_slider.value if self.pre is not None and self.pre.gammas else None
        return _gamma(gamma), float(self.relax_slider.value if x is None else x)

    def _move(self, sliders: Iterable[str], gamma: Any = None, x: float | None = None,
              redraw: bool = True) -> None:
        """Apply the declared rule of every drawn view that one of ``sliders`` drives, at (gamma, x)
        (default: the sliders' values)."""
        pre = self.pre
        if pre is None:
            return
        gamma, x = self._values(gamma, x)
        moved = set(sliders)
        for name in self.views:
            view = self.views[name]
            if name not in self._drawn or not moved & set(view.sliders):
                continue
            fw = self.figs[name]
            if view.redraws:
                if redraw:
                    try:
                        fig = analyses.view_figure(pre.tables, name, gamma, x)
                    except (LookupError, ValueError):
                        continue
                    _edit_to_match(fw, fig)
                    self._metas[name] = [dict(t.meta or {}) for t in fw.data]
            elif view.update is not None:
                try:
                    patches = view.update(pre.tables, gamma, x)
                except (LookupError, ValueError):   # e.g. no trace: the shown figure stays as it is
                    patches = ()
                _apply_patches(fw, self._metas[name], patches)
            if view.by_gamma and "gamma" in moved:
                _show_gamma(fw, self._metas[name], view.always_shown, gamma)

    def _show_readout(self, gamma: Any = None, x: float | None = None) -> None:
        """The table beside the sliders: every spec leg's measured acceptance and speedup and the acceptance its
        own trace predicts at x (legs of another gamma greyed); the cost ladder's c and S at gamma."""
        pre = self.pre
        if pre is None:
            return
        gamma, x = self._values(gamma, x)
        if pre.is_ladder:
            self.readout.value = self._ladder_readout(gamma)
            return
        if pre.readout_table is None:
            self.readout.value = ""
            return
        predicted = {}
        if pre.trace is not None:
            for leg in pre.trace.legs:
                c = pre.trace.curve(leg, [x]).iloc[0]
                predicted[leg] = (float(c["acceptance_length"]), float(c["acceptance_rate"]))
        self.readout.value = legs_readout_html(pre.readout_table, predicted, x, gamma if len(pre.gammas) > 1 else None)
        if pre.trace is None:
            self.readout.value += f"<i>no acceptance trace in this run: nothing predicted at x = {x:.2f}</i>"

    def _ladder_readout(self, gamma: int | None) -> str:
        return _ladder_readout_html(self.pre.tables.get("cost_ratio") if self.pre is not None else None, gamma)

    def _gamma_moved(self, change: dict) -> None:
        self._wanted_gamma = _gamma(change["new"])
        self.on_gamma(change["new"])

    _replace = staticmethod(replace_figure)

    # ------------------------------------------------------------------ the numbers cell

    def numbers(self) -> dict[str, Any]:
        """The numbers behind the figures of the shown run (its tables as records), for the notebook's numbers
        cell and for papermill runs that read them back."""
        import json

        pre = self.pre
        rows = lambda df: [] if df is None else json.loads(df.to_json(orient="records"))  # noqa: E731
        if pre is None:
            return {"run": None, "speedup": [], "acceptance": [], "cost_ratio": []}
        return {"run": f"{pre.run.experiment}/{pre.run.run_id}", "speedup": rows(pre.speedup),
                "acceptance": rows(pre.acceptance), "cost_ratio": rows(pre.cost_ratio)}

    def show_numbers(self) -> None:
        """Display the shown run's numbers (as JSON) where this is called; a run switch updates that output."""
        from IPython.display import JSON, display

        self._numbers_display = display(JSON(self.numbers()), display_id=True)

    def _show_numbers(self) -> None:
        if self._numbers_display is not None:
            from IPython.display import JSON

            self._numbers_display.update(JSON(self.numbers()))

    # ------------------------------------------------------------------ callbacks (slider -> in-place edits)

    def on_gamma(self, gamma: int) -> None:
        """Show the legs of one gamma: every view the gamma slider drives, and the readout."""
        if self.pre is None:
            return
        self._move(["gamma"], gamma=gamma)
        self._show_readout()   # (at the slider's gamma, as the page shows it)

    def on_relax(self, x: float) -> None:
        """Counterfactual acceptance at relax x from the traces: every view the relax slider drives, and the readout."""
        if self.pre is None:
            return
        self._move(["relax_logtau"], x=x)
        self._show_readout(x=x)


def _show_gamma(fw: go.FigureWidget, metas: list[dict], always_shown: Iterable[str], gamma: int | None) -> None:
    """Show the traces of one gamma (those whose meta has a gamma, but for the roles in ``always_shown``) and the
    annotations that belong to a leg of that gamma (named ``"<what>:<leg>"``, as the τ plot's tie notes are)."""
    leg_gamma = {m["leg"]: m["gamma"] for m in metas if m.get("leg") is not None and m.get("gamma") is not None}
    with fw.batch_update():
        for trace, meta in zip(fw.data, metas):
            if "gamma" in meta and meta.get("role") not in always_shown:
                visible = meta["gamma"] == gamma
                if trace.visible is not visible:
                    trace.visible = visible
        for note in fw.layout.annotations:
            leg = str(note.name or "").partition(":")[2]
            if leg in leg_gamma:
                visible = leg_gamma[leg] == gamma
                if (note.visible is not False) is not visible:
                    note.visible = visible


def _empty(title: str) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=title, template=plots.TEMPLATE, height=200,
                      xaxis=dict(visible=False), yaxis=dict(visible=False))
    return fig


def _rows_of_two(boxes: list[W.Box], views: dict, by_name: dict[str, W.Box]) -> list[W.HBox]:
    """The figure boxes two a row, in order; a view of ``FULL_ROW`` alone on its row."""
    box_of = {id(b): views[n].box for n, b in by_name.items()}
    rows: list[list[W.Box]] = []
    for b in boxes:
        if box_of[id(b)] in FULL_ROW or not rows or len(rows[-1]) == 2 or box_of[id(rows[-1][0])] in FULL_ROW:
            rows.append([b])
        else:
            rows[-1].append(b)
    return [W.HBox(r) for r in rows]


def _damaged(label: str) -> str:
    """A picker label (``picker.run_label``) saying the run is damaged."""
    if "damaged" in label:
        return label
    head, sep, run = label.rpartition("  [")
    if not sep:
        return f"{label} (damaged)"
    parts = head.split(" · ")
    if parts[-1] == "complete" or parts[-1].startswith("partial"):
        parts[-1] = "damaged"
    else:
        parts.append("damaged")
    return " · ".join(parts) + sep + run


def _fit(fig: go.Figure, full_row: bool) -> None:
    """The explorer's size of a figure: fixed, two a row at a laptop's width (plotly cannot measure a column the
    page has not laid out yet); the title wrapped to it, the legend under the plot."""
    import textwrap

    width = FIG_WIDTH * 2 + 10 if full_row else FIG_WIDTH
    title = fig.layout.title.text or ""
    if fig.data and all(t.type == "table" for t in fig.data) and fig.layout.height is None:
        rows = max(len(t.cells.values[0]) if t.cells.values else 0 for t in fig.data)
        fig.update_layout(height=150 + 22 * rows)
    fig.update_layout(width=fig.layout.width or width, height=fig.layout.height or FIG_HEIGHT + (90 if full_row else 0),
                      title=dict(text="<br>".join(textwrap.wrap(title, width // 8)), font=dict(size=13)))
    if not full_row and fig.layout.legend.orientation is None:
        fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.22, xanchor="left", x=0),
                          margin=dict(b=110, t=70 if len(title) > width // 8 else 50))


def explorer(results_root: str | Path = "results", experiment: str | None = None, run_id: str | None = None,
             **kwargs: Any) -> W.Widget:
    """The explorer widget (``Explorer(...).widget``), to display from a notebook."""
    ex = Explorer(results_root, experiment, run_id, **kwargs)
    ex.widget._explorer = ex  # keep the callbacks' owner alive with the widget
    return ex.widget
