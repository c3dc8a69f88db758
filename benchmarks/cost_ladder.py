"""GPU cost ladder: what a target verification step and a twin draft step cost, at real shapes.

    python benchmarks/cost_ladder.py --sizes 8b,32b --out results/cost-ladder/<run id>
    python benchmarks/cost_ladder.py --sizes tiny --out /tmp/ladder      # CPU rehearsal, tiny models
    python benchmarks/cost_ladder.py --analyze results/cost-ladder/<run id> [--static svg]

Per model size, engines run one after another, each in a process of its own
(a second engine in one process did not get the first one's GPU memory back),
with vLLM's in-process engine core, so the plugin's step timer is read directly:

* the target alone (vanilla): its decode step at batch b;
* the target with its int4 twin drafting, gamma in --gammas, the relaxed gate
  opened wide (``VLLM_SPEC_RELAX_LOGTAU`` = 1e9: every drafted token passes,
  so alpha = 1 with the twin really drafting). Each batch is run with the
  drafter's CUDA graphs on and off *in the same engine* (the drafter's
  dispatch forced to eager), alternating, so the two are measured side by side.

Times are engine-side (``VLLM_SPEC_STEP_TIMING``: CUDA events around the
target's forward pass, the drafter's ``propose`` and the propose's gamma-1
single-token steps), not the wall clock of a leg. Weights are random (``load_format="dummy"``): acceptance is meaningless,
step cost is not. The forced-acceptance wall-clock speedup of each cell is
measured beside the prediction S(1, gamma, c) = (gamma + 1) / (gamma c + 1),
c = (propose / gamma) / verification step, where propose / gamma
(``propose_per_token_ms``) is one gamma+1-token first pass, gamma-1
single-token passes and the sampling, per drafted token; the single-token
step alone is ``single_step_ms``. ``--draft-cudagraph-mode``,
``--draft-linear-kernel`` and ``--async-scheduling`` set the knobs of every
spec engine (each cell's rows carry them).

The engine code is ``workbench.ladder_engine``, shared with experiment E16
(``workbench run E16 --profile 8b-shape``), which runs the same engines through
the protocol into ``results/E16/<run id>/``.

Output (an ordinary run folder: ``run.json`` with ``runner: ladder`` and no legs):
``steps.jsonl`` (every timed step, tagged with its cell), ``walls.jsonl`` (every timed
generate call), ``env.json`` (``workbench.envcapture``), and the tables and figures of
the analysis registry (``workbench export``): ``tables/*.csv``, ``tables/summary.json``,
``figures/*.html`` (when plotly is present). ``--analyze DIR`` recomputes them from the
rows (a folder written before it had a ``run.json`` gets one), ``--static svg`` also
writes static figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from workbench import ladder_engine as le  # noqa: E402  (the engine code, shared with experiment E16)


def run_size(size: str, roles: dict[str, str], args, out: Path, cpu: bool) -> None:
    engines = [("vanilla", None)] + [("spec", g) for g in args.gammas]
    if args.only:
        engines = [e for e in engines if (e[0] if e[1] is None else str(e[1])) == args.only]
    with (out / "steps.jsonl").open("a") as steps_f, (out / "walls.jsonl").open("a") as walls_f:
        for kind, gamma in engines:
            le.run_engine(size=size, kind=kind, target=roles["target"],
                          draft=roles["twin"] if kind == "spec" else None, gamma=gamma, batches=args.batches,
                          repeats=args.repeats, tokens=args.tokens, cpu=cpu, dummy=(size != "tiny"),
                          steps_f=steps_f, walls_f=walls_f,
                          engine_args=_knobs(args, gamma or 1).engine_args(on_cuda=not cpu), eager=not args.no_eager,
                          tensor_parallel_size=args.tensor_parallel_size,
                          tag={"tensor_parallel_size": args.tensor_parallel_size,
                               **le.drafter_tags(_knobs(args, gamma or 1))})


def _knobs(args, gamma: int):
    """The engine knobs of every spec engine of this ladder: the relaxed gate opened wide, the issue-18 knobs."""
    from workbench.knobs import Knobs

    return Knobs(gamma=gamma, relax_logtau=float(le.RELAX_WIDE), trace=False,
                 draft_cudagraph_mode=args.draft_cudagraph_mode, draft_linear_kernel=args.draft_linear_kernel,
                 async_scheduling=args.async_scheduling)


ANALYSES = ["step_cost_vs_batch", "c_by_graphs", "speedup_curves"]   # E16's figures (experiments.yaml)


def _setup(env: dict) -> tuple:
    """What must match for rows to be appended to a folder: engine packages, plugin fingerprint, GPU."""
    from workbench.engine import VERSION_PACKAGES

    packages = env.get("packages") or {}
    gpus = (env.get("gpu") or {}).get("devices") or [{}]
    return ({k: packages.get(k) for k in VERSION_PACKAGES}, (env.get("patch") or {}).get("fingerprint"),
            gpus[0].get("name"))


def _env(out: Path, sizes: list[str]) -> None:
    """``env.json`` (the workbench's one writer, with this ladder's sizes and invocations)."""
    from workbench import envcapture
    from workbench.runfolder import read_json

    env = envcapture.capture()
    extra = {"sizes": sizes, "invocations": [env["captured"]]}
    earlier = out / "env.json"
    if earlier.exists():  # a second invocation into the same folder (rows are appended): keep both
        prev = read_json(earlier)
        if _setup(prev) != _setup(env):
            raise SystemExit(f"{out} holds rows from another setup ({_setup(prev)}); use a new --out")
        extra = {"sizes": list(dict.fromkeys([*prev.get("sizes", []), *sizes])),
                 "invocations": [*prev.get("invocations", [prev.get("captured")]), env["captured"]]}
    envcapture.write_env(earlier, extra)


def _run_json(out: Path, sizes: list[str]) -> None:
    """``run.json``: the folder is a run (``runner: ladder``, rows at its top, no legs) for the analysis registry."""
    from workbench.runfolder import RUN_JSON, read_json, write_json_atomic

    path = out / RUN_JSON
    prev = read_json(path) if path.is_file() else {}
    write_json_atomic(path, {
        "experiment": prev.get("experiment", "cost-ladder"), "run_id": out.name, "runner": "ladder",
        "title": "GPU cost ladder (benchmarks/cost_ladder.py)", "written_by": "benchmarks/cost_ladder.py",
        "sizes": list(dict.fromkeys([*prev.get("sizes", []), *sizes])), "legs": [], "analyses": ANALYSES})


def analyze(out: Path, static: tuple[str, ...] = ()) -> dict:
    """Tables and figures of a ladder folder, from its rows, through the analysis registry (``workbench export``)."""
    from workbench import analyses
    from workbench.runfolder import read_json

    if not (out / "run.json").is_file():
        _run_json(out, [])
    try:
        from workbench.export import export_run
    except ImportError:  # no plotting stack: the tables alone
        return analyses.analyze_run(out, figures=False)
    export_run(out, formats=("html", *static), width=1100, height=900)
    return read_json(out / "tables" / analyses.SUMMARY_JSON)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8b,32b", help="comma-separated: 8b, 32b, tiny")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--gammas", default="2,4,6")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    ap.add_argument("--shapes-root", type=Path, default=REPO / "models" / "shapes")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--analyze", type=Path, metavar="DIR",
                    help="only recompute a ladder folder's tables and figures from its rows")
    ap.add_argument("--static", default="", metavar="FORMATS",
                    help="with the figures also static files, e.g. svg or png,svg (needs Chromium)")
    ap.add_argument("--no-eager", action="store_true",
                    help="spec engines skip the eager-drafter cells (graphs-on cells only: piecewise, and "
                         "with --draft-cudagraph-mode full also full)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="tensor-parallel ranks of every engine (target and twin alike; one GPU per rank)")
    ap.add_argument("--only", help=argparse.SUPPRESS)  # one engine ("vanilla" or a gamma) in this process
    from vllm_patch.knobs import SWITCHES

    for name in ("draft_cudagraph_mode", "draft_linear_kernel"):
        ap.add_argument(SWITCHES[name].flag, dest=name, default="auto", help=SWITCHES[name].help)
    ap.add_argument("--async-scheduling", action="store_true", help=SWITCHES["async_scheduling"].help)
    args = ap.parse_args(argv)
    static = tuple(f for f in args.static.split(",") if f)
    if args.analyze is not None:
        _print_tables(analyze(args.analyze, static))
        return 0
    if args.out is None:
        ap.error("--out is required (or --analyze DIR)")
    try:
        knobs = _knobs(args, 1)  # bad values are refused here, naming the knob, before any engine starts
    except ValueError as exc:
        ap.error(str(exc))
    args.batches = [int(x) for x in args.batches.split(",")]
    args.gammas = [int(x) for x in args.gammas.split(",")]
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = set(sizes) - set(le.SIZES)
    if unknown:
        ap.error(f"unknown size(s) {sorted(unknown)}: use 8b, 32b or tiny")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)

    import torch

    cpu = not torch.cuda.is_available()
    # the engine's report, kept in the run folder (nothing left in the temp dir); a folder per process: each
    # engine process (--only) reads its own reports and step timers, never another engine's
    report_dir = tempfile.mkdtemp(prefix=f"engine-{args.only or 'ladder'}-", dir=out)
    le.set_process_env(cpu, report_dir, knobs.to_env())
    if not args.only:
        _env(out, sizes)
        _run_json(out, sizes)
        import subprocess

        from workbench.childproc import wrap

        for size in sizes:
            for only in ["vanilla"] + [str(g) for g in args.gammas]:
                cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                       "--sizes", size, "--only", only]
                # the engine process dies with this one: a killed ladder leaves no engine holding the GPU
                rc = subprocess.run(wrap(os.getpid(), cmd), cwd=REPO).returncode
                if rc != 0:
                    print(f"[ladder] {size} engine {only} failed (exit {rc}); going on", file=sys.stderr)
        _print_tables(analyze(out, static))
        return 0
    for size in sizes:
        from workbench.ladder_engine import bench_roles

        run_size(size, bench_roles(size, args.shapes_root), args, out, cpu)
    return 0


def _print_tables(summary: dict) -> None:
    import pandas as pd

    for name in ("step_costs", "cost_ratio"):
        rows = summary.get(name)
        print(f"\n== {name}\n{pd.DataFrame(rows).to_string(index=False) if rows else '(none)'}")


if __name__ == "__main__":
    raise SystemExit(main())
