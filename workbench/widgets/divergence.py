"""The divergence viewer: a spec leg's output next to the vanilla one at their first differing token."""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ipywidgets as W
import pandas as pd

from .. import metrics
from ..results import Run

MAX_PROMPT_OPTIONS = 2000


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
    leg_dd.add_class("wb-divergence-leg")
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
