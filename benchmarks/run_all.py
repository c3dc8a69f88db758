"""Regenerate every figure the README quotes: the demo run and the benchmark runs (`make bench`).

    python benchmarks/run_all.py [--results results]

Runs, one after another, each into its own run folder under ``--results``: the demo
(E1 on the tiny models, ``python -m workbench.demo``), E101 (strict vs vanilla), E102
(trace cost), E103/E104 (leg vs bare generate) and the explorer timing. Each folder is
made citable (paths relative to the repository) and its numbers are printed with the
run id that the README names beside them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import bench_explorer
import bench_legs
import bench_overhead
from runs import NUMBERS, REPO, portable


def _newest(results: Path, experiment: str) -> Path:
    return sorted((results / experiment).iterdir())[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(REPO / "results"))
    args = ap.parse_args(argv)
    results = Path(args.results)

    from workbench import demo

    if demo.main(["--results", str(results)]) != 0:
        raise SystemExit("the demo's strict tier was not exact")
    cited = {"demo": _newest(results, demo.EXPERIMENT)}
    for what in ("spec", "trace"):
        bench_legs.main([what, "--results", str(results)])
        cited[what] = _newest(results, bench_legs.EXPERIMENTS[what])
    for spec in (False, True):
        bench_overhead.main((["--spec"] if spec else []) + ["--results", str(results)])
        cited[f"overhead_{'spec' if spec else 'vanilla'}"] = _newest(results, bench_overhead.EXPERIMENTS[spec])
    bench_explorer.main(["--results", str(results)])
    cited["explorer"] = _newest(results, "explorer_bench")

    print("\nrun folders the README cites:")
    for name, rdir in cited.items():
        portable(rdir)
        numbers = rdir / "tables" / NUMBERS
        extra = json.loads(numbers.read_text()).get("ratio", {}).get("median") if numbers.is_file() else None
        print(f"  {name:<18} {rdir.relative_to(results.parent) if results.is_absolute() else rdir}"
              + (f"  median ratio {extra:.3f}" if extra is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
