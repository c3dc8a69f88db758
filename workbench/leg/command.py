"""One leg: one process, one engine, one configuration, every prompt decoded greedily.

    python -m workbench.leg --config legs/<leg>/leg.json          (what the protocol runs)
    python -m workbench.leg --target DIR [--draft DIR --gamma N] --prompts FILE.jsonl \
        --max-tokens N --out DIR [--relax-logtau X] [--blind-mm] [--no-draft-cudagraph]
        [--draft-cudagraph-mode M] [--draft-linear-kernel K] [--async-scheduling] ...

Both routes build the same ``LegConfig``. Every input that can be checked
before an engine starts is checked first (``preflight``). Records stream into
``records.jsonl.partial`` as prompts finish and are renamed ``records.jsonl``
when the leg completes, next to ``summary.json``; a failure writes
``failure.json`` and keeps the partial records beside it. A finished leg is
never changed by a later command that fails; ``--force`` moves it under
``attempts/`` only once the new leg's inputs have passed the checks. See
docs/architecture.md for the formats.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import MISSING
from pathlib import Path
from typing import Any

from ..childproc import set_parent_death_signal
from ..knobs import KNOBS, Knobs
from ..runfolder import (FAILURE, RECORDS, RECORDS_PARTIAL, SUMMARY, failure_record, leg_status, read_json,
                         read_jsonl, write_failure as write_failure_file)
from .config import LegConfig, LegError, PARENT_ENV, WORKLOAD_KNOBS, load_leg_config
from .run import run_leg


def write_failure(out: Path, exc: BaseException, cfg: LegConfig | None = None) -> None:
    """failure.json; records of prompts that finished stay in records.jsonl.partial beside it."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in (RECORDS, RECORDS + ".tmp", SUMMARY):
        (out / stale).unlink(missing_ok=True)
    for d in glob.glob(str(out / "engine-*")):
        shutil.rmtree(d, ignore_errors=True)
    partial = out / RECORDS_PARTIAL
    n_done = len(read_jsonl(partial, tolerate_torn_tail=True)) if partial.is_file() else 0
    write_failure_file(out, failure_record(
        exc,
        leg=cfg.leg if cfg else None,
        experiment=cfg.experiment if cfg else None,
        run_id=cfg.run_id if cfg else None,
        mode=cfg.mode if cfg else None,
        tier=cfg.knobs.tier if cfg else None,
        gamma=cfg.knobs.gamma if cfg else None,
        n_prompts_done=n_done,
        partial_records=RECORDS_PARTIAL if n_done else None,
    ))


# --------------------------------------------------------------------------- #
# Dying with the run                                                           #
# --------------------------------------------------------------------------- #
def _stop_own_group(*_: Any) -> None:
    # The leg leads its process group (the protocol starts it in a new session): engine-core and
    # worker processes are in it too, and go with it.
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(143)


def die_with_parent() -> None:
    """When the process that started this leg dies, by any signal, the leg and its engine stop.

    Three layers: the kernel's parent-death signal (prctl PR_SET_PDEATHSIG), a SIGTERM handler that
    takes the leg's whole process group down, and a watchdog thread for the window before prctl and
    for a main thread stuck in native code.
    """
    raw = os.environ.get(PARENT_ENV)
    if not raw:
        return  # started by hand: the terminal owns it
    parent = int(raw)
    signal.signal(signal.SIGTERM, _stop_own_group)
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:
        _stop_own_group()

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                _stop_own_group()
            time.sleep(0.5)

    threading.Thread(target=watch, name="leg-parent-watch", daemon=True).start()


# --------------------------------------------------------------------------- #
# Command line                                                                 #
# --------------------------------------------------------------------------- #
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m workbench.leg", description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="leg.json written by the protocol (replaces every other option but --force)")
    ap.add_argument("--target", help="target checkpoint (folder or HF id)")
    ap.add_argument("--draft", help="draft checkpoint; omit for a vanilla leg")
    ap.add_argument("--prompts", help="prompt file (JSONL, workbench prompt schema)")
    ap.add_argument("--pids", help="comma-separated prompt ids to run, in this order")
    for name in WORKLOAD_KNOBS:  # from the knob table; defaults are LegConfig's (None: a required option)
        k, f = KNOBS[name], LegConfig.__dataclass_fields__[name]
        ap.add_argument(k.flag, dest=name, type=k.type, default=None if f.default is MISSING else f.default,
                        help=k.help)
    ap.add_argument("--max-num-batched-tokens", type=int)
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--attention-backend", help="vLLM attention backend, e.g. TRITON_ATTN (default: vLLM's choice)")
    ap.add_argument("--kv-cache-memory-bytes", type=int,
                    help="GPU only: KV cache size in bytes; skips vLLM's memory profile so legs can share a GPU")
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--limit-images", type=int, default=4, help="max images per prompt")
    Knobs.add_leg_options(ap)
    ap.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=None,
                    help="run engine core and worker inside the leg process (default: on CPU)")
    ap.add_argument("--cpu-threads", type=int, default=1,
                    help="OpenMP threads of an in-process CPU engine (unless OMP_NUM_THREADS is set)")
    ap.add_argument("--ignore-eos", action="store_true", help="always decode max_tokens tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experiment")
    ap.add_argument("--leg")
    ap.add_argument("--run-id")
    ap.add_argument("--out", help="leg folder")
    ap.add_argument("--force", action="store_true",
                    help="redo a finished leg (it is moved under attempts/ once the new inputs pass the checks)")
    ap.add_argument("--resume-from", help="an earlier failed attempt of this leg: reuse its finished prompts")
    return ap


def config_from_args(args: argparse.Namespace) -> LegConfig:
    if args.config:
        cfg = load_leg_config(args.config)
        if args.force:
            cfg.force = True
        return cfg
    missing = [f"--{n.replace('_', '-')}" for n in ("target", "prompts", "max_tokens", "out")
               if getattr(args, n) is None]
    if missing:
        raise LegError(f"missing option(s) {', '.join(missing)} (or give --config leg.json)")
    return LegConfig(
        target=args.target,
        draft=args.draft,
        prompts=args.prompts,
        out=args.out,
        max_tokens=args.max_tokens,
        knobs=Knobs.from_leg_args(args),
        pids=[p for p in args.pids.split(",") if p] if args.pids else None,
        n=args.n,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        tensor_parallel_size=args.tensor_parallel_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        enable_prefix_caching=args.prefix_caching,
        enable_chunked_prefill=args.chunked_prefill,
        limit_images=args.limit_images,
        in_process=args.in_process,
        cpu_threads=args.cpu_threads,
        seed=args.seed,
        experiment=args.experiment,
        leg=args.leg,
        run_id=args.run_id,
        ignore_eos=args.ignore_eos,
        force=args.force,
        resume_from=args.resume_from,
    )


def _out_of(args: argparse.Namespace) -> Path | None:
    if args.out:
        return Path(args.out)
    if args.config:
        try:
            # read raw: a config that fails its checks still names the folder its failure goes to
            return Path(args.config).parent / read_json(args.config)["out"]
        except (OSError, ValueError, KeyError, TypeError):
            return Path(args.config).parent
    return None


def is_environment_error(exc: BaseException) -> bool:
    """A failure of the host's install (vLLM, the plugin, a kernel op, a switch), not of the leg's input."""
    import vllm_patch

    # an Int4FallbackError can only come from a loaded cpu_int4 (importing it here would import torch)
    int4 = sys.modules.get("vllm_patch.cpu_int4")
    kinds = (ImportError, vllm_patch.VersionMismatch) + ((int4.Int4FallbackError,) if int4 is not None else ())
    text = str(exc)  # a kernel op missing from vLLM's library; the plugin not registered
    return (isinstance(exc, kinds)
            or "_OpNamespace" in text or "plugin is not installed" in text)


def report_failure(out: Path | None, exc: BaseException, cfg: LegConfig | None) -> str:
    """failure.json where it may go; a finished leg is never touched. Returns the message printed."""
    msg = f"leg failed: {type(exc).__name__}: {exc}"
    if is_environment_error(exc):
        msg += "\n  this looks like the host, not the leg: run `workbench doctor` to see what this host can run"
    if out is None:
        return msg
    if leg_status(out) == "complete":
        # The failure came before --force moved the finished leg aside: it stays as it was.
        return msg + f"\n  the finished leg in {out} is unchanged"
    try:
        write_failure(out, exc, cfg)
    except OSError as err:
        msg += f"\n  could not write {out / FAILURE}: {err.strerror or err}"
    return msg


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    die_with_parent()
    cfg = None
    out = _out_of(args)
    try:
        cfg = config_from_args(args)
        out = Path(cfg.out)
        summary = run_leg(cfg)  # sets the process environment before torch or vLLM is imported
    except Exception as exc:
        print(report_failure(out, exc, cfg), file=sys.stderr)
        return 2
    spec = summary.get("spec") or {}
    line = (
        f"leg {summary['leg'] or summary['mode']}: {summary['n_prompts']} prompts, "
        f"{summary['gen_tokens']} tokens in {summary['wall_s']:.2f}s "
        f"(engine start {summary['engine_start_s']:.1f}s)"
    )
    if spec:
        line += f", acceptance length {spec.get('acceptance_length')}"
    if summary.get("resume"):
        line += f"; {summary['resume']}"
    print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
