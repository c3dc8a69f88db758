"""`workbench` command line.

    workbench list                                   the experiment catalogue
    workbench show E4                                one experiment in full, with its planned legs
    workbench legs E1 --profile tiny [-p gamma=4]    dry run: the legs a run would execute
    workbench run E11 --profile tiny -p gamma=4 [--smoke|--full] [--results results/] [--resume RUN_DIR]
                                          [--formats png,html] [--allow-shared-host]
    workbench export RUN_DIR [--formats png,svg,pdf,html]   tables + figures recomputed from the records
    workbench data fetch|verify ...                  prompt data sets
    workbench doctor [--json]                        what this host can run, and what to do about the rest

Exit status: 0 done; 1 a leg or the analysis failed, or export left a damaged leg out; 2 bad input
(nothing was run); 74 an I/O error of the host (a full or read-only disk), the message names the
file; 130 / 143 the run was interrupted by SIGINT / SIGTERM (recorded; `--resume` continues it).
"""

from __future__ import annotations

import argparse
import errno
import json
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from workbench.datasets.cli import add_cli as add_data_cli
from workbench.registry import RegistryError, load_registry

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "experiment.ipynb"


EXIT_IO = 74  # sysexits.h EX_IOERR: the host's disk failed us, not the input


class CliError(Exception):
    pass


def _positive_seconds(text: str) -> float:
    """argparse type of --leg-timeout: a number of seconds above 0 (a leg cannot time out before it starts)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, got {text!r}")
    return value


_HOST_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EIO}
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^:]+): '(.+)'")


def host_io_error(exc: BaseException) -> str | None:
    """``FILE: reason`` when ``exc`` is the host's disk failing (full, read-only, quota, I/O), raised here
    or inside the executed notebook (papermill re-raises it as text); None for any other error."""
    if isinstance(exc, OSError) and exc.errno in _HOST_ERRNOS:
        return f"{exc.filename or '(file not named by the system)'}: {exc.strerror or exc}"
    if type(exc).__name__ == "PapermillExecutionError":
        m = _ERRNO_TEXT.search(str(getattr(exc, "evalue", "")))
        if m and int(m.group(1)) in _HOST_ERRNOS:
            return f"{m.group(3)}: {m.group(2)}"
    return None


def _table(rows: list[dict[str, Any]], cols: Sequence[str] | None = None, max_width: int = 60) -> str:
    if not rows:
        return "(none)"
    cols = list(cols or rows[0].keys())

    def cell(v: Any) -> str:
        s = "" if v is None else str(v)
        return s if len(s) <= max_width else s[: max_width - 1] + "…"

    widths = {c: max(len(c), *(len(cell(r.get(c))) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols), "  ".join("-" * widths[c] for c in cols)]
    lines += ["  ".join(cell(r.get(c)).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _pairs(items: Sequence[str] | None, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        if "=" not in item:
            raise CliError(f"{what} {item!r}: expected NAME=VALUE")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def cmd_list(args) -> int:
    reg = load_registry()
    rows = [dict(r, question=e.question) for r, e in zip(reg.table(), reg.experiments.values())]
    print(_table(rows, ["id", "title", "dataset", "sweep", "profiles", "question"], max_width=70))
    print(f"\nprofiles: {', '.join(reg.profiles)}   (workbench show EID for details)")
    return 0


def _smoke_flag(args) -> bool | None:
    return True if args.smoke else (False if args.full else None)


def cmd_legs(args) -> int:
    from workbench import protocol

    ray = getattr(args, "executor", "local") == "ray"
    p = protocol.plan(args.experiment, args.profile, args.param, _smoke_flag(args), own_brackets=ray)
    data = (f"dataset {' -> '.join(p.datasets)}" if p.experiment.runner != "ladder" else
            "cost ladder: " + ", ".join(f"{k} {v}" for k, v in p.ladder.items())
            + f", load_format {p.profile.load_format or 'auto'}, random prompt token ids")
    print(f"{p.experiment.id} {p.experiment.title} | profile {p.profile.name} | "
          f"{'smoke' if p.smoke else 'full'} | {data} | {len(p.legs)} legs")
    rows = p.table()
    from workbench.groups import bracket_groups
    group_of = {name: g.index + 1 for g in bracket_groups(p.legs) for name in g.legs}
    for row in rows:
        row["group"] = group_of[row["leg"]]
    print(_table(rows, ["#", "group", "leg", "kind", "tier", "model", "draft", "gamma", "relax_logtau", "blind_mm",
                        "draft_cudagraph", "max_num_seqs", "max_tokens", "n", "notes"]))
    return 0


def cmd_show(args) -> int:
    reg = load_registry()
    e = reg.experiment(args.experiment)
    data = e.dataset if e.runner != "ladder" else "none (random prompt token ids)"
    print(f"{e.id}: {e.title}\n  question : {e.question}\n  dataset  : {data}")
    if e.runner != "legs":
        print(f"  runner   : {e.runner} {json.dumps(e.ladder)}")
    print(f"  profiles : {', '.join(e.profiles) or 'any'} (tiny always)")
    if e.result_prefix:
        print(f"  prefix   : {e.result_prefix}")
    print(f"  defaults : {json.dumps(e.defaults)}")
    print(f"  sweep    : {json.dumps(e.sweep)}")
    print(f"  bracket  : {'as listed' if e.bracket_every is None else f'at most {e.bracket_every} spec legs between vanilla legs'}")
    print(f"  analyses : {', '.join(e.analyses)}")
    print(f"  smoke    : {json.dumps(e.smoke.to_dict())}")
    print("  legs:")
    for t in e.legs:
        print(f"    - {json.dumps(t.to_dict())}")
    print()
    args.param, args.smoke, args.full = [], False, False
    return cmd_legs(args)


def run_notebook(run_dir: Path, params: dict[str, Any], notebook: Path = NOTEBOOK) -> Path:
    import papermill as pm

    out = run_dir / "notebook.ipynb"
    pm.execute_notebook(str(notebook), str(out), parameters=params, cwd=str(notebook.parents[1]),
                        progress_bar=False, log_output=True)
    return out


def _formats(text: str) -> tuple[tuple[str, ...], str | None]:
    """Formats this host can write, and the warning to print when static ones are skipped for want of a
    browser (printed by the caller once its other checks passed: an error comes first, alone).

    A BROWSER_PATH that points nowhere is refused here, before anything runs.
    """
    try:
        from workbench import export
    except ModuleNotFoundError as exc:  # figures are part of every run: refuse before any leg starts
        top = (exc.name or "plotly").split(".")[0]
        raise CliError(f"figures need {top!r}, which is not installed here "
                       f"(pip install {top}, or the project's environment.yml)") from None

    try:
        fmts, skipped = export.usable_formats(text)
    except ValueError as exc:
        raise CliError(f"--formats: {exc}") from None
    except export.BrowserError as exc:
        raise CliError(f"--formats {text}: {exc}") from None
    return fmts, skipped


def _warn(skipped: str | None) -> None:
    if skipped:
        print(f"warning: {skipped}", file=sys.stderr)


def _read_run_json(rdir: Path, what: str) -> dict[str, Any]:
    from workbench.runfolder import read_json

    if not (rdir / "run.json").is_file():
        raise CliError(f"{what} {rdir}: not a run folder (run.json missing)")
    try:
        cfg = read_json(rdir / "run.json")
    except (OSError, ValueError) as exc:
        raise CliError(f"{what} {rdir}: damaged run folder: {exc}") from None
    if not isinstance(cfg, dict) or "experiment" not in cfg:
        raise CliError(f"{what} {rdir}: damaged run folder: run.json is not a run configuration")
    return cfg


def cmd_run(args) -> int:
    from workbench import protocol

    model_paths = _pairs(args.model_path, "--model-path")
    sources = _pairs(args.data_source, "--data-source")
    smoke = _smoke_flag(args)
    if args.executor != "ray" and (args.address or args.gpus is not None):
        raise CliError("--address and --gpus go with --executor ray")
    if args.executor == "ray" and args.address and args.gpus is not None:
        raise CliError("--gpus sizes the local Ray instance a run starts; a cluster (--address) has its own GPUs")
    if args.executor == "ray":
        from workbench.ray_executor import require_ray
        require_ray()  # before a run folder is made
    # with the other pre-flight checks: a browser that is not there is found now, not after the legs
    formats, skipped = _formats(args.formats)
    if args.resume:
        rdir = Path(args.resume)
        cfg = _read_run_json(rdir, "--resume")
        if args.experiment.upper() != cfg["experiment"]:
            raise CliError(f"--resume {rdir}: that run is {cfg['experiment']}, not {args.experiment}")
        protocol.require_host(cfg["experiment"], run_dir=rdir, allow_shared_host=args.allow_shared_host,
                              executor=args.executor)  # another run on this host's GPUs (workbench.hostruns)
        rdir = protocol.prepare_run(cfg["experiment"], args.profile, args.param or None, smoke,
                                    run_dir=rdir, model_paths=model_paths, dataset_sources=sources)
    else:
        # another run on this host's GPUs: refused before a run folder is made (workbench.hostruns)
        protocol.require_host(args.experiment, args.profile, args.param, smoke, None, args.allow_shared_host,
                              args.executor)
        # under Ray each bracket gets vanilla legs of its own, so that brackets can run on different GPUs
        rdir = protocol.prepare_run(args.experiment, args.profile, args.param, smoke, args.results,
                                    model_paths=model_paths, dataset_sources=sources,
                                    own_brackets=args.executor == "ray")
    cfg = json.loads((rdir / "run.json").read_text())
    _warn(skipped)
    print(f"run folder: {rdir}", flush=True)
    # The legs run here, as children of this process: they stop when it stops, however it stops.
    statuses = protocol.execute(rdir, stop_on_failure=args.stop_on_failure, leg_timeout=args.leg_timeout,
                                executor=args.executor, address=args.address, gpus=args.gpus,
                                allow_shared_host=args.allow_shared_host)
    failed = [k for k, v in statuses.items() if v != "complete"]
    rc = 0
    try:
        if args.no_notebook:
            from workbench import analyses, export

            analysis = analyses.analyze_run(rdir)
            figs = analysis.pop("_figures", {})
            if figs:
                export.export_figures(figs, rdir / "figures", formats=formats)
        else:
            params = {"experiment": cfg["experiment"], "profile": cfg["profile"], "run_dir": str(rdir.resolve()),
                      "overrides": cfg["overrides"], "smoke": cfg["smoke"], "run_legs": False,
                      "stop_on_failure": bool(args.stop_on_failure), "leg_timeout": args.leg_timeout,
                      "figure_formats": list(formats)}
            nb = run_notebook(rdir, params)
            print(f"executed notebook: {nb}")
    except Exception as exc:  # the legs' records stand; the analysis can be redone with `workbench export`
        disk = host_io_error(exc)
        if disk:  # a full or read-only disk while writing tables, figures or the notebook
            print(f"error: {disk}\n  the legs' records are kept; rerun the analysis with "
                  f"`workbench export {rdir}` once the disk has room", file=sys.stderr)
            rc = EXIT_IO
        else:
            print(f"error: analysis of {rdir} failed: {type(exc).__name__}: {str(exc).strip()[-2000:]}\n"
                  f"  the legs' records are kept; rerun the analysis with `workbench export {rdir}`", file=sys.stderr)
            rc = 1
    if failed:
        print(f"legs not complete: {', '.join(failed)}", file=sys.stderr)
        return rc if rc == EXIT_IO else 1
    return rc


def cmd_export(args) -> int:
    from workbench import export

    rdir = Path(args.run_dir)
    _read_run_json(rdir, "export")
    # every table and every figure of the analysis registry that the run's records support
    formats, skipped = _formats(args.formats)
    _warn(skipped)
    out = export.export_run(rdir, formats=formats)
    removed = out.pop("removed", [])
    for name, paths in sorted(out.items()):
        print(f"{name}: " + ", ".join(p.name for p in paths))
    if removed:
        print(f"removed (their records are gone): {', '.join(str(p.relative_to(rdir)) for p in removed)}")
    from workbench.runfolder import read_json
    summary = read_json(rdir / "tables" / "summary.json")
    damaged = summary.get("damaged") or {}
    for leg, why in damaged.items():
        print(f"error: leg {leg} left out, its records are damaged: {why}", file=sys.stderr)
    if damaged:
        print(f"  `workbench run {summary.get('experiment')} --resume {rdir}` runs the damaged leg(s) again, "
              f"reusing their whole records", file=sys.stderr)
    if summary.get("partial"):
        print(f"warning: these tables are partial: {summary.get('partial_reason')}", file=sys.stderr)
    return 1 if damaged else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="workbench", description="Twin-draft speculative decoding workbench")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the experiment catalogue E1-E18").set_defaults(func=cmd_list)

    def plan_args(p, smoke=True):
        p.add_argument("experiment", help="experiment id, e.g. E4")
        p.add_argument("--profile", default=None,
                       help="model profile (tiny, 8b-thinking, 8b-instruct, 32b; 8b-shape, 32b-shape for E16)")
        p.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                       help="override a knob or sweep (gamma=4, relax_logtau=0.288,0.693, n=5, dataset=mmvet)")
        if smoke:
            g = p.add_mutually_exclusive_group()
            g.add_argument("--smoke", action="store_true", help="shrink to the experiment's smoke size")
            g.add_argument("--full", action="store_true", help="full size even under a smoke-default profile")

    p = sub.add_parser("show", help="one experiment in full")
    p.add_argument("experiment")
    p.add_argument("--profile", default=None)
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("legs", help="dry run: the planned legs and their bracket groups")
    plan_args(p)
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="plan as `workbench run --executor` does (ray: each bracket with vanilla legs of its own)")
    p.set_defaults(func=cmd_legs)
    p = sub.add_parser("run", help="run an experiment into results/<experiment>/<run id>/")
    plan_args(p)
    p.add_argument("--results", default="results", help="results root (default: results)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue a run: finished legs are skipped")
    p.add_argument("--stop-on-failure", action="store_true", help="stop at the first failed leg")
    p.add_argument("--model-path", action="append", default=[], metavar="ROLE=PATH",
                   help="use a local checkpoint for a role (also WORKBENCH_MODEL_<ROLE>)")
    p.add_argument("--data-source", action="append", default=[], metavar="DATASET=PATH",
                   help="load a prompt set from a local copy (mmvet=path/to/mm-vet)")
    p.add_argument("--leg-timeout", type=_positive_seconds, default=None, metavar="S",
                   help="kill a leg after S seconds (S > 0)")
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="local: legs one after another here (default); ray: each bracket group a Ray task on "
                        "GPUs of its own (docs/ray.md; pip install '.[ray]')")
    p.add_argument("--address", default=None, metavar="auto|HOST:PORT",
                   help="with --executor ray: the Ray cluster to join (default: start a local instance)")
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="with --executor ray and no --address: the local instance's GPUs (default: this host's; "
                        "on a CPU host logical GPUs, to rehearse groups side by side)")
    p.add_argument("--allow-shared-host", action="store_true",
                   help="run even where another run is active on this host's GPUs (refused by default on a GPU, a "
                        "warning on a CPU); the run is marked as disturbed either way")
    p.add_argument("--no-notebook", action="store_true", help="run legs + tables without the notebook")
    p.add_argument("--formats", "--figure-formats", dest="formats", default="png,html", metavar="FMT,...",
                   help="figure formats for <run>/figures: png, svg, pdf, html (default png,html; "
                        "without a browser only html is written)")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("export", help="recompute tables and figures of a run folder from its records")
    p.add_argument("run_dir")
    p.add_argument("--formats", default="png,html", metavar="FMT,...",
                   help="figure formats: png, svg, pdf, html (default png,html; without a browser only html)")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("doctor", help="what this host can run (vLLM, plugin, int4 path, GPUs, Chromium, models, data)")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=lambda a: __import__("workbench.doctor", fromlist=["main"]).main(["--json"] if a.json else []))
    p = sub.add_parser("data", help="prompt data sets (fetch, verify)")
    add_data_cli(p.add_subparsers(dest="data_command", required=True))
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C outside a run's legs (preparing, analysing): nothing to record
        print("interrupted", file=sys.stderr)
        return 130
    except (RegistryError, CliError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from workbench.protocol import ProtocolError, RunInterrupted
        from workbench.prompts import PromptError
        from workbench.runfolder import RunFolderError
        if isinstance(exc, RunInterrupted):  # recorded in protocol.json and the leg's failure.json
            where = f" during leg {exc.leg}" if exc.leg else ""
            print(f"interrupted: {exc.run_dir} stopped by {exc.signal}{where}; recorded in protocol.json; "
                  f"continue with `workbench run {args.experiment} --resume {exc.run_dir}`", file=sys.stderr)
            return 128 + exc.signum
        if isinstance(exc, (ProtocolError, PromptError, RunFolderError, FileNotFoundError, ValueError)):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if isinstance(exc, OSError):  # a read-only or full disk: say which file, not a traceback
            print(f"error: {exc.filename or '(file not named by the system)'}: {exc.strerror or exc}",
                  file=sys.stderr)
            return EXIT_IO
        raise


if __name__ == "__main__":
    sys.exit(main())
