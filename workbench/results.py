"""Read run folders (``results/<experiment>/<run id>/``) from their raw files.

Everything here is derived from ``run.json``, ``env.json`` and
``legs/<leg>/{records.jsonl,summary.json,failure.json}`` alone, so any table or
figure can be regenerated from a copied run folder.

Leg status is ``workbench.runfolder.leg_status`` (complete, failed, incomplete,
pending); only complete legs contribute records (a failed leg's
``records.jsonl.partial`` is evidence, not a result).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from .knobs import column_knobs
from .placement import placement_key
from .runfolder import (ENV_JSON, FAILURE, PLACEMENT, RECORDS, RUN_JSON, SUMMARY, check_name, leg_dir, leg_status,
                        new_run_id, read_json, records_problem, remove_stale_preparing)

__all__ = ["Run", "load_run", "list_runs", "run_dir", "leg_dir", "new_run_id", "DamagedRunWarning"]


class DamagedRunWarning(UserWarning):
    """A run folder under a results root cannot be read; it is left out, the others are listed."""

# Fields a record must carry for any metric to be meaningful.
REQUIRED_RECORD_FIELDS = ("pid", "mode", "tier", "tok_s")

# Record columns that always exist in Run.records, even for a run with no
# finished leg, so that callers can filter without checking.
# The knob part of both lists comes from the knob table (``Knob.column``; gamma, relax_logtau, blind_mm
# in records; the leg table adds the draft switches).
RECORD_KNOBS = column_knobs("record")
RECORD_COLUMNS = [
    "experiment", "run_id", "leg", "leg_index", "pid", "mode", "tier", *RECORD_KNOBS,
    "in_len", "gen_len", "t", "tok_s", "gen_ids",
    "text", "knobs", "spec", "trace",
]

LEG_KNOB_COLUMNS = column_knobs("leg")
LEG_COLUMNS = [
    "leg", "leg_index", "status", "mode", "tier", *LEG_KNOB_COLUMNS,
    "n_prompts", "engine_start_s", "wall_s",
    "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens",
    "spec_accepted_per_pos", "target", "draft", "dtype", "error", "path",
    "step_costs",  # the engine's step timer, summarised by the leg (workbench.leg.step_costs_of)
    "placement",   # the device the leg ran on (workbench.placement.placement_key); None: not recorded
]

@dataclass
class Run:
    """One run folder, loaded. ``records`` has one row per prompt per finished leg."""

    path: Path
    records: pd.DataFrame
    legs: pd.DataFrame
    config: dict[str, Any]
    env: dict[str, Any] = field(default_factory=dict)

    @property
    def experiment(self) -> str:
        return str(self.config.get("experiment") or self.path.parent.name)

    @property
    def run_id(self) -> str:
        return str(self.config.get("run_id") or self.path.name)

    @property
    def legs_order(self) -> list[str]:
        """Leg names in run order (planned order first, then any unplanned folders)."""
        return list(self.legs.sort_values("leg_index")["leg"])

    def leg_records(self, leg: str) -> pd.DataFrame:
        return self.records[self.records["leg"] == leg]


def run_dir(results_root: str | Path, experiment: str, run_id: str) -> Path:
    return Path(results_root) / check_name("experiment", experiment) / check_name("run id", run_id)


_read_json = read_json


def _planned_legs(config: dict[str, Any], run_json: Path) -> list[str]:
    """Leg names in planned order: ``run.json`` ``legs``, a list of objects with a ``name`` (as the protocol
    writes it; a benchmark run without legs has an empty list)."""
    planned = config.get("legs", [])
    if not isinstance(planned, list):
        raise ValueError(f"{run_json}: 'legs' must be a list, got {type(planned).__name__}")
    names = []
    for i, item in enumerate(planned):
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
            raise ValueError(f"{run_json}: planned leg #{i} has no name: {item!r}")
        names.append(item["name"])
    if len(set(names)) != len(names):
        raise ValueError(f"{run_json}: planned leg names repeat: {names}")
    return names


def read_leg_records(path: Path, leg: str, required: tuple[str, ...], what: str = "record") -> list[tuple[int, dict]]:
    """``(line number, record)`` of a leg's records.jsonl: each line a JSON object with the ``required``
    fields and the leg's own name (if it names one); a bad line raises a ValueError naming ``path:line``.
    ``what`` names the kind of record in those messages (a serving leg's: "serving record")."""
    out = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: a {what} must be a JSON object")
            missing = [f for f in required if f not in rec]
            if missing:
                raise ValueError(f"{path}:{lineno}: {what} lacks field(s) {missing}")
            if rec.get("leg") not in (None, leg):
                raise ValueError(
                    f"{path}:{lineno}: record says leg {rec['leg']!r} but lies in leg folder {leg!r}"
                )
            out.append((lineno, rec))
    return out


def leg_order(run_dir: Path, planned: list[str]) -> list[str]:
    """The run's legs: the planned ones in order, then unplanned folders (a leg added by hand, an older plan)."""
    legs_root = Path(run_dir) / "legs"
    on_disk = sorted(p.name for p in legs_root.iterdir() if p.is_dir()) if legs_root.is_dir() else []
    return planned + [name for name in on_disk if name not in planned]


def _read_records(path: Path, leg: str, leg_index: int) -> list[dict[str, Any]]:
    rows = []
    for _, rec in read_leg_records(path, leg, REQUIRED_RECORD_FIELDS):
        rec["leg"] = leg
        rec["leg_index"] = leg_index
        knobs = rec.get("knobs") or {}
        rec.setdefault("relax_logtau", knobs.get("relax_logtau", 0.0 if rec["mode"] == "spec" else None))
        for name in RECORD_KNOBS:  # the knob columns as the engine reported them; gamma the record states
            if name != "gamma":
                rec.setdefault(name, knobs.get(name))
        rows.append(rec)
    return rows


def _leg_row(folder: Path | None, leg: str, leg_index: int) -> dict[str, Any]:
    row: dict[str, Any] = {c: None for c in LEG_COLUMNS}
    row.update(leg=leg, leg_index=leg_index, path=str(folder) if folder else None)
    if folder is None or not folder.is_dir():
        row["status"] = "pending"
        return row
    if (folder / PLACEMENT).is_file():
        row["placement"] = placement_key(_read_json(folder / PLACEMENT))
    status = leg_status(folder)
    if status == "failed":
        info = _read_json(folder / FAILURE)
        row["status"] = "failed"
        row["error"] = str(info.get("error", "")) if isinstance(info, dict) else str(info)
        # A failure file may carry the leg's identity; keep what is there.
        if isinstance(info, dict):
            for key in ("mode", "tier", "gamma"):
                row[key] = info.get(key)
        return row
    if status != "complete":
        row["status"] = status
        return row
    info = _read_json(folder / SUMMARY)
    knobs = info.get("knobs") or {}
    spec = info.get("spec") or {}
    row.update({c: knobs.get(c) for c in LEG_KNOB_COLUMNS})  # the knob columns as the engine ran them
    row.update(
        status="complete",
        mode=info.get("mode"),
        tier=info.get("tier"),
        gamma=info.get("gamma"),  # as the leg states it
        n_prompts=info.get("n_prompts"),
        engine_start_s=info.get("engine_start_s"),
        wall_s=info.get("wall_s"),
        spec_num_drafts=spec.get("num_drafts"),
        spec_num_draft_tokens=spec.get("num_draft_tokens"),
        spec_num_accepted_tokens=spec.get("num_accepted_tokens"),
        spec_accepted_per_pos=spec.get("accepted_per_pos"),
        target=info.get("target"),
        draft=info.get("draft"),
        dtype=(info.get("engine_args") or {}).get("dtype"),
        step_costs=info.get("step_costs"),
    )
    return row


def _is_serving(folder: Path) -> bool:
    """A serving leg (``runner: serve``, E17): its records are per request, read by ``workbench.serving``."""
    info = _read_json(folder / SUMMARY)
    return isinstance(info, dict) and info.get("runner") == "serve"


def load_run(run_dir: str | Path, damaged: str = "raise") -> Run:
    """Load one run folder. Raises a ValueError/FileNotFoundError naming the bad file.

    ``damaged="mark"``: a leg that says it is complete but whose records cannot be read (a torn
    line, a count that disagrees with its summary) gets status ``damaged`` and the reason (file and
    line) in ``error``, and contributes no records; the other legs load. For repair and export,
    which must say what they left out; a reader that shows numbers as the run's keeps "raise".
    """
    if damaged not in ("raise", "mark"):
        raise ValueError(f"damaged must be 'raise' or 'mark', got {damaged!r}")
    path = Path(run_dir)
    run_json = path / RUN_JSON
    if not run_json.is_file():
        raise FileNotFoundError(f"{path} is not a run folder: {RUN_JSON} not found")
    config = _read_json(run_json)
    if not isinstance(config, dict):
        raise ValueError(f"{run_json}: must be a JSON object")
    env_json = path / ENV_JSON
    env = _read_json(env_json) if env_json.is_file() else {}

    order = leg_order(path, _planned_legs(config, run_json))
    legs_root = path / "legs"

    leg_rows, record_rows = [], []
    for index, name in enumerate(order):
        folder = legs_root / name
        row = _leg_row(folder if folder.is_dir() else None, name, index)
        leg_rows.append(row)
        # a cost-ladder leg has no records; a serving leg's (one per request, no tok_s) are workbench.serving's
        if row["status"] == "complete" and (folder / RECORDS).is_file() and not _is_serving(folder):
            try:
                recs = _read_records(folder / RECORDS, name, index)
                if row["n_prompts"] is not None and len(recs) != row["n_prompts"]:
                    raise ValueError(
                        f"{folder / RECORDS}: {len(recs)} records but {SUMMARY} says n_prompts={row['n_prompts']}"
                    )
                pids = [r["pid"] for r in recs]
                if len(set(pids)) != len(pids):
                    raise ValueError(f"{folder / RECORDS}: prompt ids repeat within the leg")
            except (ValueError, UnicodeDecodeError) as exc:
                if damaged == "raise":
                    raise
                row.update(status="damaged", error=str(exc))
                continue
            for rec in recs:  # each record says where its leg ran: a bracket is checked from the records alone
                rec["placement"] = row["placement"]
            record_rows.extend(recs)

    legs = pd.DataFrame(leg_rows, columns=LEG_COLUMNS)
    records = pd.DataFrame(record_rows)
    for col in RECORD_COLUMNS:
        if col not in records.columns:
            records[col] = None
    extra = [c for c in records.columns if c not in RECORD_COLUMNS]
    records = records[RECORD_COLUMNS + extra]
    if len(records):
        records["tok_s"] = pd.to_numeric(records["tok_s"], errors="raise")
    return Run(path=path, records=records.reset_index(drop=True), legs=legs, config=config, env=env)


def list_runs(results_root: str | Path, experiment: str | None = None) -> pd.DataFrame:
    """One row per run folder under ``results_root`` (newest last), with leg counts by status (``damaged``:
    a leg that says it is complete but whose records do not read back whole, not counted complete).

    A run folder that cannot be read (a corrupt run.json, say) is left out with a
    ``DamagedRunWarning`` naming it; the other runs are listed.
    """
    root = Path(results_root)
    cols = ["experiment", "run_id", "path", "profile", "smoke", "n_legs",
            "n_complete", "n_failed", "n_incomplete", "n_pending",
            "n_damaged", "n_spec", "n_prompts", "device", "title"]
    if not root.is_dir():
        raise FileNotFoundError(f"results root {root} not found")
    exp_dirs = [root / check_name("experiment", experiment)] if experiment else sorted(
        p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
    )
    rows = []
    for exp_dir in exp_dirs:
        if not exp_dir.is_dir():
            continue
        remove_stale_preparing(exp_dir)  # what a preparation killed with -9 left
        for rdir in sorted(p for p in exp_dir.iterdir() if (p / RUN_JSON).is_file()):
            try:
                rows.append(_run_row(exp_dir, rdir))
            except (OSError, ValueError) as exc:
                warnings.warn(f"skipping damaged run {rdir}: {exc}", DamagedRunWarning, stacklevel=2)
    return pd.DataFrame(rows, columns=cols)


def _run_row(exp_dir: Path, rdir: Path) -> dict[str, Any]:
    config = _read_json(rdir / RUN_JSON)
    if not isinstance(config, dict):
        raise ValueError(f"{rdir / RUN_JSON}: must be a JSON object, got {type(config).__name__}")
    planned = _planned_legs(config, rdir / RUN_JSON)
    legs_root = rdir / "legs"
    on_disk = [p.name for p in legs_root.iterdir() if p.is_dir()] if legs_root.is_dir() else []
    names = planned + [n for n in sorted(on_disk) if n not in planned]
    counts = {"complete": 0, "failed": 0, "incomplete": 0, "pending": 0, "damaged": 0}
    for n in names:
        status = leg_status(legs_root / n)
        # says complete, but its records do not read back or hold another number of lines than it says
        if status == "complete" and (records_problem(legs_root / n) or _record_count_disagrees(legs_root / n)):
            status = "damaged"
        counts[status] += 1
    tiers = [leg.get("tier") for leg in config.get("legs", []) if isinstance(leg, dict)]
    prompts = rdir / "prompts.jsonl"
    n_prompts = _count_lines(prompts) if prompts.is_file() else (config.get("overrides") or {}).get("n")
    return {"experiment": exp_dir.name, "run_id": rdir.name, "path": str(rdir),
            "profile": config.get("profile"), "smoke": config.get("smoke"), "n_legs": len(names),
            **{f"n_{k}": v for k, v in counts.items()},
            "n_spec": sum(t not in (None, "vanilla") for t in tiers), "n_prompts": n_prompts,
            "device": config.get("device"), "title": config.get("title")}


def _count_lines(path: Path) -> int:
    data = path.read_bytes()
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def _record_count_disagrees(folder: Path) -> bool:
    """A complete leg whose records.jsonl has another number of lines than its summary's n_prompts (a torn or
    truncated file): cheap enough for a listing; ``load_run`` says which line."""
    records = folder / RECORDS
    if not records.is_file():
        return False
    try:
        info = _read_json(folder / SUMMARY)
        if info.get("runner") in ("serve", "ladder"):   # records per request, or none per prompt
            return False
        n = info.get("n_prompts")
        return isinstance(n, int) and _count_lines(records) != n
    except (OSError, ValueError, AttributeError):
        return True
