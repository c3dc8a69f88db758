"""ipywidgets around ``workbench.plots``: the run explorer and the divergence viewer.

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
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import ipywidgets as W
import numpy as np
import pandas as pd
import plotly.graph_objects as go

from . import analyses, metrics, plots
from .results import Run, list_runs, load_run

X_MAX = float(analyses.RELAX_GRID[-1])
X_STEP = 0.01
MAX_PROMPT_OPTIONS = 2000
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

        self.experiment_dd = W.Dropdown(description="experiment", options=[])
        self.run_dd = W.Dropdown(description="run", options=[], layout=W.Layout(width="360px"))
        self.gamma_slider = W.SelectionSlider(description="gamma", options=[0], value=0,
                                              continuous_update=True, disabled=True)
        self.gamma_slider.add_class("wb-gamma-slider")
        self.relax_slider = W.FloatSlider(description="relax_logtau", min=0.0, max=X_MAX, step=X_STEP,
                                          value=0.0, readout_format=".2f", continuous_update=True,
                                          style={"description_width": "initial"})
        self.relax_slider.add_class("wb-relax-slider")
        self.readout = W.HTML()
        self.readout.add_class("wb-readout")
        self.status = W.HTML()
        self.divergence = W.VBox()

        # One figure widget per declared view, in registry order, each in a box "wb-fig-<box>".
        self.views: dict[str, analyses.View] = analyses.views()
        self.figs: dict[str, go.FigureWidget] = {name: go.FigureWidget() for name in self.views}
        self.boxes: dict[str, W.Box] = {}
        for name, view in self.views.items():
            box = W.Box([self.figs[name]], layout=W.Layout(width="100%"))
            box.add_class(f"wb-fig-{view.box}")
            self.boxes[name] = box
        self._drawn: set[str] = set()            # views showing a figure of the run (not a placeholder)
        self._metas: dict[str, list[dict]] = {}  # per view: the shown traces' meta, indexed once per run
        self._divergence_box = W.Accordion([self.divergence], titles=("Divergence viewer",))
        self.widget = W.VBox([
            W.HBox([self.experiment_dd, self.run_dd]),
            W.HBox([self.gamma_slider, self.relax_slider]),
            self.readout, self.status, *(b for g in analyses.VIEW_GROUPS for b in self._group_boxes(g)),
            self._divergence_box,
        ])
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
            exps = sorted(runs["experiment"].unique())
            if experiment is not None and experiment not in exps:
                raise ValueError(f"experiment {experiment!r} has no runs under {self.results_root} (found {exps})")
            self._quiet = True
            self.experiment_dd.options = exps
            self._quiet = False
            self._pending_run_id = run_id
            self.experiment_dd.value = None
            self.experiment_dd.value = experiment or exps[-1]

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
        return [self.boxes[name] for name, view in self.views.items() if view.group == group]

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
        options = [(rid, path) for rid, path in zip(runs["run_id"], runs["path"])]
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
            self._replace(fw, _empty("run damaged: see above"))
        self._drawn, self._metas = set(), {}
        self.divergence.children = []
        self.gamma_slider.disabled = self.relax_slider.disabled = True
        # mark it in the picker, keeping it selected
        labelled = [(f"{label} (damaged)" if value == str(path) and not label.endswith("(damaged)") else label, value)
                    for label, value in self.run_dd.options]
        if labelled != list(self.run_dd.options):
            self._quiet = True
            self.run_dd.options = labelled
            self.run_dd.value = str(path)
            self._quiet = False

    # ------------------------------------------------------------------ building

    def set_run(self, run: Run) -> None:
        """Precompute and rebuild every figure for ``run`` (sliders only edit data afterwards)."""
        self.pre = pre = _Precomputed(run, self.bins)
        done = run.legs["status"].value_counts().to_dict()
        self.status.value = (f"<b>{html.escape(run.experiment)}</b> / {html.escape(run.run_id)}: "
                             + ", ".join(f"{v} {html.escape(str(k))}" for k, v in sorted(done.items()))
                             + f" legs; {len(run.records)} prompt records")

        # Only our own handler is detached: the slider keeps its internal value<->index sync.
        self.gamma_slider.unobserve(self._gamma_moved, "value")
        if pre.gammas:
            previous = self.gamma_slider.value
            self.gamma_slider.options = pre.gammas
            # Keep the gamma in view across runs; otherwise start at the largest.
            self.gamma_slider.value = previous if previous in pre.gammas else pre.gammas[-1]
            self.gamma_slider.disabled = False
        else:
            self.gamma_slider.options = [0]
            self.gamma_slider.disabled = True
        self.gamma_slider.observe(self._gamma_moved, "value")
        self.relax_slider.disabled = pre.trace is None

        gamma, x = self._values()
        # A cost-ladder run shows the "ladder" views in place of the per-prompt ones; any other run, the reverse.
        self._drawn, self._metas = set(), {}
        for name, view in self.views.items():
            shown = view.group == pre.group
            self.boxes[name].layout.display = None if shown else "none"
            if not shown:
                self._replace(self.figs[name], go.Figure())
                continue
            try:
                fig = analyses.view_figure(pre.tables, name, gamma, x)
            except (LookupError, ValueError):   # NotApplicable, or a table the run cannot make
                fig = _empty(view.empty)
            else:
                self._drawn.add(name)
            self._replace(self.figs[name], fig)
            self._metas[name] = [dict(t.meta or {}) for t in self.figs[name].data]
        self._divergence_box.layout.display = "none" if pre.is_ladder or pre.is_serving else None
        self.divergence.children = [divergence_viewer(run, verdicts=self.pre.verdicts)] if _has_divergence_pairs(run) else [
            W.HTML("<i>needs a vanilla leg and a spec leg with gen_ids</i>")]
        # The figures as at the sliders' values: each view's move rule, once.
        self._move(analyses.SLIDERS, redraw=False)
        self._show_readout()

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
                with fw.batch_update():
                    for trace, meta in zip(fw.data, self._metas[name]):
                        if "gamma" in meta and meta.get("role") not in view.always_shown:
                            visible = meta["gamma"] == gamma
                            if trace.visible is not visible:
                                trace.visible = visible

    def _show_readout(self, gamma: Any = None, x: float | None = None) -> None:
        """The line under the sliders: the cost ladder's c and S at gamma, or the acceptance predicted at x."""
        pre = self.pre
        if pre is None:
            return
        gamma, x = self._values(gamma, x)
        tau = math.exp(-x)
        if pre.is_ladder:
            self.readout.value = self._ladder_readout(gamma)
            return
        if pre.trace is None:
            self.readout.value = f"x = {x:.2f} (τ = {tau:.3f}); no acceptance trace in this run"
            return
        leg = pre.trace_leg_for_gamma.get(gamma) if pre.gammas else None
        if leg is None:
            self.readout.value = f"x = {x:.2f} (τ = {tau:.3f}); no traced leg at this γ"
            return
        c = pre.trace.curve(leg, [x]).iloc[0]
        self.readout.value = (
            f"x = {x:.2f} (τ = {tau:.3f}): predicted from <code>{html.escape(leg)}</code> trace: "
            f"acceptance length <b>{c['acceptance_length']:.3f}</b>, acceptance rate {c['acceptance_rate']:.3f} "
            f"<i>(first-order: replays recorded steps)</i>"
        )

    def _ladder_readout(self, gamma: int | None) -> str:
        return _ladder_readout_html(self.pre.tables.get("cost_ratio") if self.pre is not None else None, gamma)

    def _gamma_moved(self, change: dict) -> None:
        self.on_gamma(change["new"])

    @staticmethod
    def _replace(fw: go.FigureWidget, fig: go.Figure) -> None:
        stale = set(fw.layout.to_plotly_json()) - set(fig.layout.to_plotly_json())
        with fw.batch_update():
            fw.data = []
            fw.layout = fig.layout
            fw.add_traces(list(fig.data))
        if stale:
            # Assigning a layout sends only the new layout's keys: the page would keep the old figure's
            # annotations (the tau plot's tie note) and shapes. Resetting them takes explicit nulls.
            fw._send_relayout_msg({k: None for k in sorted(stale)})

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


# --------------------------------------------------------------------------- in-place edits of a shown figure


def _patch_props(patch: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, other properties) of an update: a plotly trace or a dict."""
    props = dict(patch.to_plotly_json() if hasattr(patch, "to_plotly_json") else patch)
    meta = props.pop("meta", None) or {}
    for k in ("type", "uid"):
        props.pop(k, None)
    return dict(meta), props


def _apply_patches(fw: go.FigureWidget, metas: Sequence[Mapping[str, Any]], patches: Any) -> None:
    """Every shown trace whose meta contains a patch's meta takes the patch's other properties, in place."""
    if patches is None:
        return
    patches = patches.data if hasattr(patches, "data") and not isinstance(patches, Mapping) else patches
    with fw.batch_update():
        for patch in patches:
            want, props = _patch_props(patch)
            for trace, meta in zip(fw.data, metas):
                if all(k in meta and _same(meta[k], v) for k, v in want.items()):
                    trace.update(props)


def _edit_to_match(fw: go.FigureWidget, fig: go.Figure) -> None:
    """Edit the shown figure into ``fig``: each trace and layout property that differs, in place (the whole
    figure where the traces are not the same kinds)."""
    if [t.type for t in fw.data] != [t.type for t in fig.data]:
        Explorer._replace(fw, fig)
        return
    with fw.batch_update():
        for shown, new in zip(fw.data, fig.data):
            old, props = shown.to_plotly_json(), new.to_plotly_json()
            for k in set(old) - set(props) - {"type", "uid"}:
                shown[k] = None
            for k, v in props.items():
                if k not in ("type", "uid") and not _same(old.get(k), v):
                    shown[k] = v
        old, props = fw.layout.to_plotly_json(), fig.layout.to_plotly_json()
        for k in set(old) - set(props):
            fw.layout[k] = None
        for k, v in props.items():
            if not _same(old.get(k), v):
                fw.layout[k] = v


def _same(a: Any, b: Any) -> bool:
    """Equal as plotly properties: dicts by key, sequences and arrays by element (NaN equal to NaN)."""
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return (isinstance(a, Mapping) and isinstance(b, Mapping) and a.keys() == b.keys()
                and all(_same(a[k], b[k]) for k in a))
    seq = (list, tuple, np.ndarray)
    if isinstance(a, seq) or isinstance(b, seq):
        if not (isinstance(a, seq) and isinstance(b, seq)) or len(a) != len(b):
            return False
        try:
            x, y = np.asarray(a), np.asarray(b)
        except ValueError:   # ragged
            x = y = None
        if x is not None and x.dtype.kind in "biuf" and y.dtype.kind in "biuf":
            return x.shape == y.shape and bool(np.array_equal(x, y, equal_nan=True))
        return all(_same(p, q) for p, q in zip(a, b))
    try:
        return bool(a == b) or (a != a and b != b)
    except (TypeError, ValueError):
        return False


def _fmt(v: Any, spec: str = ".2f") -> str:
    f = plots._num(v)
    return "–" if f is None else format(f, spec)


def _ladder_readout_html(ratios: pd.DataFrame | None, gamma: int | None) -> str:
    """One line per batch at ``gamma``: c with drafter graphs on / off, S(1,γ,c), measured S at α = 1
    (end to end, and decode only where the rows time the first token apart)."""
    if ratios is None or not len(ratios) or gamma is None:
        return "cost ladder: no complete spec leg yet"
    sel = ratios[ratios["gamma"].astype(int) == gamma]
    parts = []
    for (size, batch), d in sel.groupby(["size", "batch"], sort=True):
        on = d[d["draft_graphs"].astype(bool)]
        off = d[~d["draft_graphs"].astype(bool)]
        get = lambda part, col: part[col].iloc[0] if len(part) and col in part else None  # noqa: E731
        decode = plots._num(get(on, "S_measured_decode_alpha1"))  # rows that time the first token apart
        parts.append(f"{html.escape(str(size))} b={int(batch)}: c = <b>{_fmt(get(on, 'c'))}</b> graphs / "
                     f"{_fmt(get(off, 'c'))} eager, S(1,γ,c) = {_fmt(get(on, 'S_pred_alpha1'))}, "
                     f"measured at α=1 {_fmt(get(on, 'S_measured_alpha1'))}"
                     + (f" (decode only {_fmt(decode)})" if decode is not None else ""))
    return f"γ = {gamma}: " + "; ".join(parts)


def _empty(title: str) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=title, template=plots.TEMPLATE, height=200,
                      xaxis=dict(visible=False), yaxis=dict(visible=False))
    return fig


def explorer(results_root: str | Path = "results", experiment: str | None = None, run_id: str | None = None,
             **kwargs: Any) -> W.Widget:
    """The explorer widget (``Explorer(...).widget``), to display from a notebook."""
    ex = Explorer(results_root, experiment, run_id, **kwargs)
    ex.widget._explorer = ex  # keep the callbacks' owner alive with the widget
    return ex.widget


# --------------------------------------------------------------------------- divergence viewer


def _has_divergence_pairs(run: Run) -> bool:
    rec = run.records
    return bool(len(rec)) and rec["tier"].eq("vanilla").any() and rec["tier"].isin(metrics.SPEC_TIERS).any()


def _text_split(a: str, b: str) -> int:
    """First differing character, moved back to the start of its word so no word is cut in two."""
    n = min(len(a), len(b))
    c = next((i for i in range(n) if a[i] != b[i]), n)
    if c < n or len(a) != len(b):
        cut = max(a.rfind(" ", 0, c), a.rfind("\n", 0, c))
        c = cut + 1 if cut >= 0 else 0
    return c


def divergence_html(ref: pd.Series, other: pd.Series, decode: Callable[[Sequence[int]], str] | None = None,
                    window: int = 12) -> str:
    """Side-by-side HTML of two records at their first differing token.

    With ``decode`` (token ids -> text) the split is exact at the token; else
    with the records' ``text`` the split is at the first differing character;
    else the ids around the divergence are shown.
    """
    a, b = list(ref["gen_ids"]), list(other["gen_ids"])
    k = metrics.first_divergence(a, b)
    head = (f"<div><b>{html.escape(str(other['leg']))}</b> vs <b>{html.escape(str(ref['leg']))}</b>, "
            f"prompt <code>{html.escape(str(ref['pid']))}</code>: ")
    if k is None:
        return head + f"identical ({len(a)} tokens)</div>"
    tok = lambda ids, i: str(ids[i]) if i < len(ids) else "(end)"
    head += f"first differing token at index <b>{k}</b> (id {tok(a, k)} vs {tok(b, k)})</div>"

    def cell(prefix: str, rest: str) -> str:
        return (f"<td style='vertical-align:top;width:50%;font-family:monospace;white-space:pre-wrap'>"
                f"<span style='color:#888'>{html.escape(prefix)}</span>"
                f"<span style='background:#ffe0b2'>{html.escape(rest)}</span></td>")

    if decode is not None:
        pre_a, rest_a = decode(a[:k]), decode(a[k:])
        pre_b, rest_b = decode(b[:k]), decode(b[k:])
    elif isinstance(ref.get("text"), str) and isinstance(other.get("text"), str):
        c = _text_split(ref["text"], other["text"])
        pre_a, rest_a = ref["text"][:c], ref["text"][c:]
        pre_b, rest_b = other["text"][:c], other["text"][c:]
    else:
        lo = max(0, k - window)
        fmt = lambda ids: " ".join(map(str, ids))
        pre_a, rest_a = ("… " if lo else "") + fmt(a[lo:k]) + " ", fmt(a[k:k + window])
        pre_b, rest_b = ("… " if lo else "") + fmt(b[lo:k]) + " ", fmt(b[k:k + window])
    return (head + "<table style='width:100%;table-layout:fixed'><tr>"
            f"<th>{html.escape(str(ref['leg']))}</th><th>{html.escape(str(other['leg']))}</th></tr><tr>"
            + cell(pre_a, rest_a) + cell(pre_b, rest_b) + "</tr></table>")


def divergence_viewer(run: Run, ref_leg: str | None = None,
                      decode: Callable[[Sequence[int]], str] | None = None,
                      verdicts: Mapping[str, Any] | None = None) -> W.Widget:
    """Pick a spec leg and a prompt; see it next to the vanilla output at the first difference.

    Prompts are listed diverging first (earliest divergence first). With
    ``verdicts`` (``RunTables.verdicts``: strict leg -> the exactness rule's
    verdict) each divergence shows its class and the fp32 target's top-2 gap,
    and the leg's line says whether it passes the rule.
    """
    verdicts = verdicts or {}
    rec = run.records
    order = run.legs_order
    vanilla = [l for l in order if l in set(rec.loc[rec["tier"] == "vanilla", "leg"])]
    spec = [l for l in order if l in set(rec.loc[rec["tier"].isin(metrics.SPEC_TIERS), "leg"])]
    if not vanilla or not spec:
        raise ValueError(f"divergence viewer needs a vanilla and a spec leg with records in {run.path}")
    ref_leg = ref_leg or vanilla[0]
    if ref_leg not in vanilla + spec:
        raise ValueError(f"reference leg {ref_leg!r} has no records (legs: {vanilla + spec})")
    by_leg = {leg: rec[rec["leg"] == leg].set_index("pid") for leg in set(vanilla + spec)}
    leg_dd = W.Dropdown(description="leg", options=[l for l in spec if l != ref_leg])
    pid_dd = W.Dropdown(description="prompt", layout=W.Layout(width="420px"))
    out = W.HTML()
    out.add_class("wb-divergence")
    counts = W.HTML()

    def fill_pids(*_: Any) -> None:
        ex = metrics.exactness(rec, ref_leg, leg_dd.value)
        ex = ex.assign(_k=ex["first_divergence"].fillna(10**9)).sort_values(["_k", "pid"])
        n_div, n_all = int((~ex["exact"]).sum()), len(ex)
        # A dropdown of a hundred thousand entries helps nobody and is slow to send to the page.
        ex = ex.head(MAX_PROMPT_OPTIONS)
        verdict = verdicts.get(leg_dd.value)
        kinds = {d.pid: d for d in verdict.divergences} if verdict is not None else {}

        def label(p: str, k: Any) -> str:
            if pd.isna(k):
                return f"{p} — identical"
            d = kinds.get(p)
            cls = f" ({d.kind}" + (f", gap {d.top2_gap:.3g})" if d.top2_gap is not None else ")") if d else ""
            return f"{p} — diverges at {k}{cls}"

        pid_dd.options = [(label(p, k), p) for p, k in zip(ex["pid"], ex["first_divergence"])]
        rule = ""
        if verdict is not None:
            rule = (f"; exactness rule ({verdict.dtype}): {html.escape(verdict.describe())} — "
                    + ("passes" if verdict.ok else "<b>does not pass</b>"))
        counts.value = (f"{n_div} of {n_all} prompts diverge from {html.escape(ref_leg)}" + rule
                        + (f"; listing the first {MAX_PROMPT_OPTIONS}" if n_all > MAX_PROMPT_OPTIONS else ""))
        pid_dd.value = pid_dd.options[0][1] if pid_dd.options else None

    def show(*_: Any) -> None:
        if pid_dd.value is None or leg_dd.value is None:
            out.value = ""
            return
        r = by_leg[ref_leg].loc[pid_dd.value].copy()
        o = by_leg[leg_dd.value].loc[pid_dd.value].copy()
        r["pid"] = o["pid"] = pid_dd.value
        out.value = divergence_html(r, o, decode)

    # A new leg may keep the same first prompt (the pid value does not change): redraw the text anyway.
    leg_dd.observe(lambda *_: (fill_pids(), show()), "value")
    pid_dd.observe(show, "value")
    # Open on the first leg that diverges at all: that is the one worth looking at.
    diverging = [l for l in leg_dd.options if not metrics.exactness(rec, ref_leg, l)["exact"].all()]
    if diverging and leg_dd.value != diverging[0]:
        leg_dd.value = diverging[0]
    else:
        fill_pids()
    show()
    return W.VBox([W.HBox([leg_dd, pid_dd, counts]), out])
