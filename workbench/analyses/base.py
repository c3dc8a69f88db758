"""What the analysis registry is made of: a ``Table``, an ``Analysis`` and its explorer ``View``, and the
run-independent constants (``RELAX_GRID``, ``SUMMARY_JSON``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from .. import metrics

SUMMARY_JSON = "summary.json"
# The relax x grid of counterfactual acceptance (table and explorer curves): x up to 3 (τ = 0.05)
# covers the τ ladders of E4/E13.
# x = 0+ (metrics.ZERO_PLUS) is on the grid so that the jump of the tie rule is drawn as a jump.
RELAX_GRID = np.unique(np.concatenate([np.round(np.linspace(0.0, 3.0, 151), 4), [metrics.ZERO_PLUS]]))
OVER_POSITION_BINS = 10


class NotApplicable(LookupError):
    """The run lacks what a table or figure needs (no spec leg, no trace, no score leg, ...)."""


@dataclass(frozen=True)
class Table:
    name: str
    compute: Callable[["RunTables"], pd.DataFrame]
    doc: str
    in_summary: bool = True       # also in tables/summary.json (the key numbers), not only as csv


SLIDERS = ("gamma", "relax_logtau")
VIEW_GROUPS = ("legs", "ladder", "serving")


@dataclass(frozen=True)
class View:
    """How the run explorer shows an analysis: one figure, in a box of CSS class ``wb-fig-<box>``.

    Functions of a view take ``(tables, gamma, x)``: the run's ``RunTables``,
    the gamma slider's value (an int, or None where the run has no gamma)
    and the relax_logtau slider's x; they raise ``NotApplicable`` where the
    run lacks what they need.

    - ``empty``: title of the placeholder shown where the run cannot draw it.
    - ``group``: which runs show it: ``"legs"`` (a run of prompt legs) or
      ``"ladder"`` (a cost-ladder run, E16) or ``"serving"`` (a run of serving legs,
      E17); the explorer shows one group.
    - ``sliders``: the sliders that drive it (of ``SLIDERS``); none: drawn
      once per run.
    - ``args``: draw keyword -> slider: the figure is the analysis's own draw
      (as exported) called with these slider values, e.g.
      ``{"marker_x": "relax_logtau"}``.
    - ``figure``: ``figure(tables, gamma, x) -> Figure``, where the figure
      needs more than ``args`` (default: the analysis's draw with ``args``).
    - ``update``: ``update(tables, gamma, x) -> traces`` (plotly traces or
      dicts, or a figure), what a move of one of its sliders changes: each
      carries a ``meta``, and every shown trace whose meta contains it takes
      its other properties, in place. Without one, a view with ``args`` or
      ``figure`` is redrawn at the new slider values and the shown figure is
      edited to match ("redraw with these arguments").
    - ``by_gamma``: traces whose meta has a gamma are shown only at the gamma
      slider's value, except those of the roles in ``always_shown``.
    """
    box: str
    empty: str
    group: str = "legs"
    sliders: tuple[str, ...] = ()
    args: Mapping[str, str] = field(default_factory=dict)
    figure: Callable[..., Any] | None = None
    update: Callable[..., Any] | None = None
    by_gamma: bool = False
    always_shown: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.group not in VIEW_GROUPS:
            raise ValueError(f"view {self.box!r}: group must be one of {VIEW_GROUPS}, got {self.group!r}")
        unknown = [s for s in (*self.sliders, *self.args.values()) if s not in SLIDERS]
        if unknown:
            raise ValueError(f"view {self.box!r}: unknown slider {unknown[0]!r}; sliders: {', '.join(SLIDERS)}")
        missing = [s for s in self.args.values() if s not in self.sliders]
        if self.by_gamma and "gamma" not in self.sliders:
            missing.append("gamma")
        if missing:
            raise ValueError(f"view {self.box!r}: depends on slider {missing[0]!r}; list it in sliders")

    @property
    def redraws(self) -> bool:
        """A slider move redraws the figure (no ``update`` of its own, and the figure depends on a slider)."""
        return self.update is None and bool(self.sliders) and (self.figure is not None or bool(self.args))


@dataclass(frozen=True)
class Analysis:
    name: str
    tables: tuple[str, ...]       # what it reads; the first one is required, the others optional
    draw: Callable[..., Any]      # workbench.plots function: draw(*tables) -> Figure
    doc: str
    view: View | None = None      # its figure in the run explorer (None: exported only)
