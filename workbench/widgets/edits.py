"""In-place edits of a shown figure widget: a slider move changes trace data, never rebuilds the figure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go


def replace_figure(fw: go.FigureWidget, fig: go.Figure) -> None:
    """Show ``fig`` in ``fw`` whole: its traces and layout, and nothing of the figure shown before."""
    stale = set(fw.layout.to_plotly_json()) - set(fig.layout.to_plotly_json())
    with fw.batch_update():
        fw.data = []
        fw.layout = fig.layout
        fw.add_traces(list(fig.data))
    if stale:
        # Assigning a layout sends only the new layout's keys: the page would keep the old figure's
        # annotations (the tau plot's tie note) and shapes. Resetting them takes explicit nulls.
        fw._send_relayout_msg({k: None for k in sorted(stale)})


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
        replace_figure(fw, fig)
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
