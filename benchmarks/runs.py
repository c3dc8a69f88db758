"""Benchmark runs through the protocol: the benchmark registry, a run, its numbers, a citable copy.

Every benchmark is an experiment of ``benchmarks/benchmarks.yaml`` (the catalogue's
schema and defaults) run by ``workbench.protocol`` into ``results/<id>/<run id>/``.
Its figures are computed by ``workbench.metrics`` from the run's records and written to
``tables/benchmark.json``, so the numbers a report quotes live in the run folder
they came from and can be recomputed from its records (``--analyze RUN_DIR``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BENCHMARKS_YAML = Path(__file__).with_name("benchmarks.yaml")
NUMBERS = "benchmark.json"


def registry():
    """The benchmark experiments, with the catalogue's defaults (so a benchmark leg runs as an experiment leg)."""
    from workbench.registry import EXPERIMENTS_FILE, load_registry

    catalogue = yaml.safe_load(EXPERIMENTS_FILE.read_text())
    merged = dict(catalogue, experiments=yaml.safe_load(BENCHMARKS_YAML.read_text())["experiments"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "benchmarks.yaml"
        path.write_text(yaml.safe_dump(merged))
        return load_registry(path)


def run(exp_id: str, results: str | Path, runner: list[str] | None = None) -> Path:
    """Run one benchmark experiment under the tiny profile at full size; returns its run folder."""
    from workbench import protocol
    from workbench.tiny import ensure_tiny_models

    ensure_tiny_models()
    rdir = protocol.prepare_run(exp_id, "tiny", None, False, results, registry=registry())
    statuses = protocol.execute(rdir, runner=runner)
    failed = {leg: s for leg, s in statuses.items() if s != "complete"}
    if failed:
        raise SystemExit(f"{exp_id}: legs not complete {failed}; see {rdir}/legs/<leg>/failure.json")
    protocol.analyze_run(rdir, figures=False)
    return rdir


def write_numbers(run_dir: Path, numbers: dict[str, Any]) -> Path:
    path = Path(run_dir) / "tables" / NUMBERS
    path.parent.mkdir(exist_ok=True)
    from workbench.runfolder import write_text_atomic

    write_text_atomic(path, json.dumps(numbers, indent=1, default=float) + "\n")
    return path


def leg_rows(run, prefix: str) -> list[str]:
    return [leg for leg in run.legs_order if leg.startswith(prefix)]


def portable(run_dir: Path) -> list[str]:
    """Make a run folder inside the repository citable: absolute paths under the repository
    become relative to it (models/tiny/target, data/tiny/images/...). Returns the files changed."""
    run_dir = Path(run_dir).resolve()
    root = str(REPO) + os.sep
    changed = []
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if root in text:
            path.write_text(text.replace(root, ""), encoding="utf-8")
            changed.append(str(path.relative_to(run_dir)))
    return changed


def fmt_ratio(d: dict[str, float]) -> str:
    return f"{d['median']:.3f} (IQR {d['q25']:.3f}-{d['q75']:.3f}, n={d['n']})"


def main_with(ap, argv, start: Callable[[Any], Path], report: Callable[[Path], dict]) -> int:
    """A benchmark's command line: run it (``start(args)`` -> run folder) or ``--analyze`` a finished
    run, print its numbers (``report``), and with ``--portable`` make the folder citable."""
    ap.add_argument("--results", default=str(REPO / "results"), help="results root (default: results)")
    ap.add_argument("--analyze", metavar="RUN_DIR", help="only recompute and print the numbers of a finished run")
    ap.add_argument("--portable", action="store_true", help="make the run folder citable (repository-relative paths)")
    args = ap.parse_args(argv)
    rdir = Path(args.analyze) if args.analyze else start(args)
    report(rdir)
    if args.portable:
        portable(rdir)
    return 0
