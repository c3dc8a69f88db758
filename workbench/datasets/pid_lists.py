"""Prompt-id lists kept as data (data/pid_lists/*.json) and the rules that made them."""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from pathlib import Path

from workbench.datasets._common import DatasetError, data_root

SEED20_NAME = "mathvista_testmini_seed20"
SEED20_SALT = "mathvista-testmini-seed20"
SEED20_RULE = (
    "Stratify testmini by (question_type, answer_type, precision). Give every stratum one pid, "
    "then share the remaining slots in proportion to the pids each stratum has left (largest remainder, ties to the "
    "larger stratum). Inside a stratum take the pids with the smallest "
    "sha256('mathvista-testmini-seed20:' + pid) hex digest. Listed in that digest order within "
    "strata, strata sorted by name. Built by workbench.datasets.pid_lists.mathvista_seed20()."
)


def _key(pid: str, salt: str) -> str:
    return hashlib.sha256(f"{salt}:{pid}".encode()).hexdigest()


def balanced_sample(rows, n: int, stratum, salt: str) -> list[str]:
    """Deterministic stratified sample of pids: every stratum represented, the rest proportional."""
    strata: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        strata[stratum(r)].append(r["pid"])
    if n < len(strata):
        raise DatasetError(f"cannot give each of {len(strata)} strata a pid with n={n}")
    total = sum(len(v) for v in strata.values())
    alloc = {k: 1 for k in strata}
    left = n - len(strata)
    rest_total = sum(len(v) - 1 for v in strata.values())
    shares = {k: left * (len(v) - 1) / rest_total if rest_total else 0.0 for k, v in strata.items()}
    for k in strata:
        alloc[k] += int(shares[k])
    remaining = n - sum(alloc.values())
    order = sorted(strata, key=lambda k: (-(shares[k] - int(shares[k])), -len(strata[k]), k))
    for k in order[:remaining]:
        alloc[k] += 1
    picked = []
    for k in sorted(strata):
        if alloc[k] > len(strata[k]):
            raise DatasetError(f"stratum {k!r} has {len(strata[k])} pids, {alloc[k]} requested")
        picked += sorted(strata[k], key=lambda p: _key(p, salt))[: alloc[k]]
    assert len(picked) == n and total >= n
    return picked


def mathvista_stratum(row: dict) -> str:
    prec = row.get("precision")
    return f"{row['question_type']}/{row['answer_type']}" + (f"/precision{int(prec)}" if prec is not None else "")


def mathvista_seed20(rows) -> list[str]:
    return balanced_sample(rows, 20, mathvista_stratum, SEED20_SALT)


def pid_list_path(name: str) -> Path:
    p = Path(name)
    if p.suffix == ".json" and p.exists():
        return p
    return data_root() / "pid_lists" / f"{name}.json"


def load_pid_list(name: str) -> list[str]:
    """The pids of a stored list (by name in data/pid_lists/ or by path)."""
    path = pid_list_path(name)
    if not path.is_file():
        raise DatasetError(f"pid list {name!r} not found (looked for {path})")
    obj = json.loads(path.read_text(encoding="utf-8"))
    pids = obj.get("pids") if isinstance(obj, dict) else None
    if not isinstance(pids, list) or not all(isinstance(p, str) for p in pids):
        raise DatasetError(f"{path}: expected an object with a 'pids' list of strings")
    return pids


def write_seed20(rows, path: Path | None = None) -> Path:
    path = path or pid_list_path(SEED20_NAME)
    path.parent.mkdir(parents=True, exist_ok=True)
    pids = mathvista_seed20(rows)
    by = {r["pid"]: r for r in rows}
    obj = {
        "dataset": "mathvista",
        "split": "testmini",
        "n": len(pids),
        "rule": SEED20_RULE,
        "note": ("The seed runs used a fixed list of 20 pids that is not available; this list "
                 "replaces it, so results are comparable among workbench runs, not with the seed's."),
        "strata": {p: mathvista_stratum(by[p]) for p in pids},
        "pids": pids,
    }
    path.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
    return path
