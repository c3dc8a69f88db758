"""The speedup a serving leg's cost predicts, beside the one it measured.

For a synthetic-acceptance leg (``acceptance`` not ``real``) the acceptance profile is known: the
unconditional per-position rates vLLM drew against (``summary.speculative``), so a step yields
E[tokens] = 1 + Σ rates[:γ]. The cost side is the cost ladder's c = (propose / γ) / verify step at that
batch size and γ (E16: the table the leg's ``auto`` schedule priced that cell from, else the newest run folder
with that cell for the target's size made before the leg's run, measured on the leg's GPU where one is;
``c_source`` names the card when it is not the leg's), and
S(α, γ, c) = E[tokens] / (1 + γ c), the README's bound. Under a batch-size schedule γ is the schedule's
at the cell's concurrency. At γ 0 (speculation off) S = 1 with knob ``draft_idle=skip``; with vLLM's
``sync`` the draft's pass over the batch still runs, S = 1 / (1 + c).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from workbench.acceptance import IDLE_FREE, RESULTS_E16, _shown, run_card, source_card
from workbench.runfolder import PLACEMENT, read_json

__all__ = ["predicted_speedup"]


def _gamma_at(info: dict, concurrency: int) -> int:
    for lo, hi, g in info.get("gamma_schedule") or []:
        if lo <= concurrency <= hi:
            return int(g)
    return int(info.get("num_speculative_tokens") or 0)


_KERNELS = ("marlin", "machete", "humming", "exllama", "own")


def _same_kernel(label: str, kernel: str) -> bool:
    """A cost row's setup label ("32b [marlin full_all async int4-head]") runs ``kernel`` (auto: Marlin)."""
    named = [k for k in _KERNELS if k in label]
    return not named or (kernel if kernel in _KERNELS else "marlin") in named


def _cost_cell(size: str, batch: int, gamma: int, kernel: str = "auto", root: Path = RESULTS_E16,
               card: str | None = None, before: str | None = None) -> tuple[float, str] | None:
    """The lowest c of the newest E16 run with a (batch, γ) cell of ``size`` on the leg's draft kernel,
    measured on ``card`` (the leg's GPU) where one is, else on any; ``before`` (the leg's run id): only runs
    made before it (run ids sort by their UTC time), so that exporting a run again later gives the prediction
    it had, not one from a cost table measured after it."""
    tables = sorted((t for t in root.glob("*/tables/cost_ratio.csv") if before is None or t.parents[1].name < before),
                    reverse=True)
    if card is not None:
        tables = sorted(tables, key=lambda t: run_card(t.parents[1]) != card)  # stable: newest first in each
    for table in tables:
        with table.open() as f:
            cs = [float(r["c"]) for r in csv.DictReader(f)
                  if r.get("size", "").split(" ")[0] == size and str(r.get("draft_graphs")) == "True"
                  and int(r["batch"]) == batch and int(r["gamma"]) == gamma and _same_kernel(r["size"], kernel)]
        if cs:
            return min(cs), _shown(table.parents[1])
    return None


def _leg_card(leg_dir: Path) -> str | None:
    """The GPU a leg ran on (its ``placement.json``)."""
    try:
        gpus = read_json(leg_dir / PLACEMENT).get("gpus") or []
        return gpus[0].get("name") if gpus else None
    except (OSError, ValueError, AttributeError):
        return None


def _with_card(source: str, card: str | None) -> str:
    """``source`` (a run folder, maybe with a note) with the card it was measured on where that is not the
    leg's: a draft step's share of a target step differs by card."""
    measured = source_card(source.split(" (")[0])
    if measured and card and measured != card:
        return f"{source}; measured on {measured}, the leg ran on {card}"
    return source


def _schedule_cell(info: dict, batch: int, gamma: int) -> tuple[float, str] | None:
    """The c the leg's ``auto`` schedule priced (batch, γ) at (``gamma_schedule_table``), so that a serving
    cell's prediction reads the cost table its schedule was chosen from, not another one."""
    for row in info.get("gamma_schedule_table") or []:
        if row.get("batch") == batch and row.get("gamma") == gamma and row.get("c") is not None:
            return float(row["c"]), f"{row.get('source')} (the schedule's table)"
    return None


def predicted_speedup(leg_dir: Path, summary: dict[str, Any], concurrency: int) -> dict[str, Any]:
    """``{"S_predicted", "c", "c_source", "expected_tokens"}`` of one synthetic serving cell (NaN-free: empty
    when the leg is not synthetic or no cost cell exists)."""
    info = summary.get("speculative") or {}
    rates = info.get("synthetic_acceptance_rates")
    if summary.get("tier") != "synthetic" or not rates:
        return {}
    gamma = _gamma_at(info, concurrency)
    if gamma == 0 and info.get("draft_idle", "sync") in IDLE_FREE:
        return {"S_predicted": 1.0, "c": None, "c_source": "speculation off at this batch size, no draft pass",
                "expected_tokens": 1.0}
    try:
        target = json.loads((leg_dir / "leg.json").read_text())["target"]
    except (OSError, ValueError, KeyError):
        return {}
    kernel = str((summary.get("knobs") or {}).get("draft_linear_kernel") or "auto")
    size = Path(str(target)).name.split("-")[0]
    card = _leg_card(leg_dir)
    run_id = summary.get("run_id")
    before = str(run_id) if run_id else None
    if gamma == 0:  # vLLM's: the draft's pass over the batch still runs, about one draft step
        cell = next((c for g in range(1, 9) if (c := _cost_cell(size, concurrency, g, kernel, card=card,
                                                                 before=before))), None)
        if cell is None:
            return {}
        return {"S_predicted": 1.0 / (1.0 + cell[0]), "c": cell[0],
                "c_source": f"speculation off at this batch size, the draft's pass still runs; "
                            f"{_with_card(cell[1], card)}",
                "expected_tokens": 1.0}
    cell = (_schedule_cell(info, concurrency, gamma)
            or _cost_cell(size, concurrency, gamma, kernel, card=card, before=before))
    if cell is None:
        return {}
    c, source = cell
    tokens = 1.0 + sum(rates[:gamma])
    return {"S_predicted": tokens / (1.0 + gamma * c), "c": c, "c_source": _with_card(source, card),
            "expected_tokens": tokens}
