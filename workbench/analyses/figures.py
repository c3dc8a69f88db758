"""The figure registry: every analysis (``ANALYSES``), the tables it reads and the ``workbench.plots``
function that draws it, its explorer view; drawing them for a run.

``workbench.registry.analysis_names`` reads the names of ``ANALYSES`` from this file's source."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import pandas as pd

from .. import plots
from .base import Analysis, NotApplicable, View
from .runtables import RunTables
from .explorer import (_over_position_predicted, _over_position_view, _per_position_predicted, _per_position_view,
                    _rows, _speedup_selection, _tau_markers)


def _speedup_vs_gamma(speedup: pd.DataFrame, styles: plots.LegStyles | None = None):
    if not speedup["gamma"].notna().any():
        raise NotApplicable("no spec leg with a gamma in this run")
    return plots.speedup_vs_gamma(speedup, styles=styles)


ANALYSES: dict[str, Analysis] = {a.name: a for a in [
    Analysis("exactness_table", ("exactness",), plots.exactness_table,
             "exact-match rate and first divergence of each spec leg vs vanilla"),
    Analysis("speedup_vs_gamma", ("speedup",), _speedup_vs_gamma, "median speedup vs gamma with IQR bars",
             view=View("speedup", "Speedup vs γ: needs a vanilla and a spec leg", sliders=("gamma",),
                       update=_speedup_selection)),
    Analysis("speedup_distribution", ("prompt_speedups",), plots.speedup_distribution,
             "per-prompt bracketed speedup, one box per spec leg",
             view=View("distribution", "Per-prompt speedup: needs a vanilla and a spec leg", sliders=("gamma",),
                       by_gamma=True)),
    Analysis("per_position_acceptance", ("per_position_acceptance",), plots.per_position_acceptance,
             "accepted at draft position i / drafts, per spec leg",
             view=View("per-position", "Per-position acceptance: no spec leg", sliders=("gamma", "relax_logtau"),
                       figure=_per_position_view, update=_per_position_predicted, by_gamma=True)),
    Analysis("acceptance_vs_tau", ("acceptance", "counterfactual_acceptance"), plots.acceptance_vs_tau,
             "measured acceptance vs relax x, with the counterfactual curve from the trace",
             view=View("tau", "Acceptance vs τ: no spec leg", sliders=("gamma", "relax_logtau"),
                       args={"marker_x": "relax_logtau"}, update=_tau_markers, by_gamma=True,
                       always_shown=("measured_points",))),
    Analysis("acceptance_over_position", ("acceptance_over_position",), plots.acceptance_over_position,
             "acceptance vs output token position (needs the trace)",
             view=View("over-position", "Acceptance over output position: no trace (run legs with --trace)",
                       sliders=("gamma", "relax_logtau"), figure=_over_position_view, update=_over_position_predicted,
                       by_gamma=True)),
    Analysis("agreement_vs_acceptance", ("agreement",), plots.agreement_vs_acceptance,
             "E7: teacher-forced agreement vs realised acceptance per prompt, Pearson r"),
    Analysis("step_cost_vs_batch", ("step_costs",), plots.step_cost_vs_batch,
             "cost ladder: engine-side step cost vs batch per role (decode, verification, draft step), IQR bars",
             view=View("ladder-steps", "Step cost vs batch: no complete ladder leg", group="ladder")),
    Analysis("c_by_graphs", ("cost_ratio",), plots.cost_ratio_by_graphs,
             "cost ladder: c = draft step / verification step, drafter CUDA graphs on vs off",
             view=View("ladder-c", "c = draft step / verification step: needs a complete spec and vanilla leg",
                       group="ladder")),
    Analysis("speedup_curves", ("speedup_curve", "cost_ratio"), plots.speedup_curves,
             "cost ladder: predicted S(alpha) at the measured c, measured S at alpha = 1, the seed PR's and "
             "QuantSpec's operating points",
             view=View("ladder-speedup", "S(α): needs a complete spec leg", group="ladder", sliders=("gamma",),
                       by_gamma=True)),
    Analysis("serving_summary", ("serving_legs", "serving_speedup"), plots.serving_summary,
             "serving legs: latency percentiles, throughput, acceptance, bracketed TPOT speedup and throughput ratio",
             view=View("serving-summary", "Serving legs: no complete serving leg", group="serving")),
    Analysis("serving_speedup", ("serving_speedup",), plots.serving_speedup,
             "serving legs: TPOT speedup and TTFT ratio vs max concurrency per spec leg, 95 % request intervals, "
             "S from the cost table",
             view=View("serving-speedup", "Serving speedup: needs a spec serving leg between vanilla legs",
                       group="serving")),
    Analysis("serving_latency", ("serving_requests",), plots.serving_latency,
             "serving legs: per-request TPOT and TTFT, one box per tier at each max concurrency",
             view=View("serving-latency", "Serving latency: no complete serving leg", group="serving")),
    Analysis("serving_throughput", ("serving_legs",), plots.serving_throughput,
             "serving legs: output throughput vs max concurrency per tier",
             view=View("serving-throughput", "Serving throughput: no complete serving leg", group="serving")),
    Analysis("serving_acceptance", ("serving_legs",), plots.serving_acceptance,
             "serving legs: acceptance rate vs max concurrency per spec tier (server counters, per-request sums)",
             view=View("serving-acceptance", "Serving acceptance: no spec serving leg", group="serving")),
]}


def views(group: str | None = None) -> dict[str, View]:
    """Analysis name -> its explorer view, in registry order (of one group, or all)."""
    return {name: a.view for name, a in ANALYSES.items()
            if a.view is not None and (group is None or a.view.group == group)}


def check_names(names: Iterable[str], where: str) -> list[str]:
    """The analysis names of an experiment, refused with a message naming ``where`` if one is unknown."""
    names = list(names)
    unknown = [n for n in names if n not in ANALYSES]
    if unknown:
        raise ValueError(f"{where}: unknown analysis {unknown[0]!r}; analyses: {', '.join(ANALYSES)}")
    return names


def draw_one(tables: RunTables, name: str, **kwargs: Any):
    """The figure of one analysis (``kwargs`` go to its draw function); raises NotApplicable where its
    first table cannot be made or is empty."""
    a = ANALYSES[name]
    first, *optional = a.tables
    if "styles" in inspect.signature(a.draw).parameters:
        kwargs.setdefault("styles", tables.leg_styles)
    return a.draw(_rows(tables, first), *(tables.get(o) for o in optional), **kwargs)


def view_figure(tables: RunTables, name: str, gamma: int | None, x: float):
    """The explorer's figure of analysis ``name`` at slider values (gamma, x): its view's ``figure``, or its
    draw with the view's ``args``."""
    view = ANALYSES[name].view
    if view is None:
        raise KeyError(f"analysis {name!r} has no explorer view")
    if view.figure is not None:
        return view.figure(tables, gamma, x)
    values = {"gamma": gamma, "relax_logtau": x}
    return draw_one(tables, name, **{kw: values[slider] for kw, slider in view.args.items()})


def draw(tables: RunTables, names: Iterable[str] | None = None) -> dict[str, Any]:
    """Figures of the named analyses (default: every registered one) that the run supports.

    Where a named one cannot be drawn (or any one fails), the reason goes to
    ``tables.errors["figure:<name>"]``.
    """
    figs = {}
    for name in (ANALYSES if names is None else check_names(names, "draw")):
        try:
            figs[name] = draw_one(tables, name)
        except NotApplicable as exc:
            if names is not None:  # asked for by name: say why it is missing
                tables.errors[f"figure:{name}"] = f"{type(exc).__name__}: {exc}"
        except (LookupError, ValueError) as exc:
            tables.errors[f"figure:{name}"] = f"{type(exc).__name__}: {exc}"
    return figs
