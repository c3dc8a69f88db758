"""Execution: the run folder, its legs, resume, the lock, failures.

    prepare_run(experiment, profile, overrides, smoke, results_root, ...) -> Path
    execute(run_dir, stop_on_failure=False, leg_timeout=None, ...) -> {leg: status}

``prepare_run`` checks everything that can be checked before an engine starts
(roles, model folders and configs, gamma against the context length, data
sources, prompt lengths with the target's own tokenizer, that the results
root is writable) and reports every problem in one message; only a run that
can start gets a folder. ``execute`` holds the run's lock, starts each leg as
its own process group that dies with the run, records which leg process is
running, and on resume records what it found (a lock left by a killed run,
an interrupted leg) and refuses to run beside a leg process that is still
alive. File names and leg status: ``workbench.runfolder``.

How a leg runs is one entry of ``RUNNERS`` (name -> ``Runner``: its ``leg.json``, its command,
what the run does once every leg ran); ``runner_for`` is the one place a leg's runner is picked.
``leg`` (``python -m workbench.leg``) and ``score`` (``python -m workbench.score``) are the legs of
an ordinary experiment. An experiment whose ``runner`` is ``ladder`` (the cost ladder, E16) goes
through the same folder, lock, resume and failure records; only its legs differ: each is one
engine run by ``python -m workbench.ladder_engine`` (no prompt set; the rows are
``legs/<leg>/steps.jsonl`` and ``walls.jsonl``, written whole at the run's top once the legs ran).
A profile on a GPU is refused before anything is created where the host has no CUDA device.
An experiment whose ``runner`` is ``serve`` (E17) runs each leg behind vLLM's OpenAI server,
driven by vLLM's benchmark client (``python -m workbench.serve_leg``, the same ``leg.json``).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable

from workbench import childproc, shm
from workbench.planning import Plan, PlannedLeg, parse_overrides, plan
from workbench.registry import DATASETS, Registry, RegistryError, load_registry, split_role
from workbench.runfolder import (ENV_JSON, FAILURE, LEG_JSON, LEG_LOG, LEGS, PREPARER, PREPARING_SUFFIX, PROMPTS,
                                 RECORDS, RECORDS_PARTIAL, RUN_JSON, STATE_JSON, SUMMARY, RunFolderError, RunLock,
                                 archive_leg, failure_record, leg_status, new_run_id, process_alive,
                                 process_identity, process_start_ticks, read_json, records_problem,
                                 remove_stale_preparing, write_failure, write_json_atomic)

__all__ = ["ProtocolError", "RunInterrupted", "prepare_run", "execute", "resolve_models", "leg_config", "leg_command",
           "preflight_problems", "REPO_ROOT", "Runner", "RUNNERS", "runner_for"]

REPO_ROOT = Path(__file__).resolve().parents[1]


class ProtocolError(RuntimeError):
    """The plan or the run folder is inconsistent; the message names the experiment/leg/file."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# --- preparing a run ---------------------------------------------------------------------------

def _env_key(ref: str) -> str:
    return "WORKBENCH_MODEL_" + ref.upper().replace("-", "_").replace("@", "_")


def _model_refs(p: Plan) -> list[str]:
    refs: list[str] = []
    for l in p.legs:
        for r in (l.model, l.draft):
            if r and r not in refs:
                refs.append(r)
    return refs


def resolve_models(p: Plan, model_paths: dict[str, str] | None = None,
                   registry: Registry | None = None) -> dict[str, str]:
    """Role reference -> checkpoint (folder or hub id). Order: --model-path, environment, profile."""
    reg = registry or load_registry()
    model_paths = dict(model_paths or {})
    refs = _model_refs(p)
    unknown = sorted(set(model_paths) - set(refs) - {split_role(r)[0] for r in refs})
    if unknown:
        raise RegistryError(f"--model-path: role(s) {unknown} are not used by {p.experiment.id}; "
                            f"used: {', '.join(refs)}")
    out: dict[str, str] = {}
    tiny_dirs = shape_dirs = None
    for ref in refs:  # unbound roles are refused before anything is trained or built
        role = split_role(ref)[0]
        prof = reg.role_profile(p.profile, ref)
        if role not in prof.roles and not (model_paths.get(ref) or os.environ.get(_env_key(ref))):
            raise RegistryError(f"profile {prof.name} binds no {role!r} model, which {p.experiment.id} needs "
                                f"for {ref!r} (bound: {', '.join(prof.roles)}); give one with "
                                f"--model-path {ref}=<folder>")
    for ref in refs:
        role = split_role(ref)[0]
        explicit = model_paths.get(ref) or os.environ.get(_env_key(ref))
        prof = reg.role_profile(p.profile, ref)
        if not explicit and ref != role and prof.name == p.profile.name:
            # a stand-in profile standing in for another profile's role binds the same model, so a plain role
            # override applies (not where its stand_ins map that profile to another stand-in)
            explicit = model_paths.get(role) or os.environ.get(_env_key(role))
        if explicit:
            out[ref] = str(explicit)
            continue
        if prof.shapes:
            # configs of the published architecture, written on demand (no weights: load_format dummy)
            if shape_dirs is None:
                from workbench.shapes import build_shapes
                shape_dirs = build_shapes()
            out[ref] = str(shape_dirs[prof.roles[role]])
        elif prof.tiny:
            if tiny_dirs is None:
                from workbench.tiny import ensure_tiny_models
                tiny_dirs = ensure_tiny_models()
            out[ref] = str(tiny_dirs[prof.roles[role]])
        elif prof.organism:
            # the trained organism and its drafters, trained / built on first use (workbench.organism.models)
            from workbench.organism.models import ensure_organism_models
            out[ref] = str(ensure_organism_models(prof.organism)[prof.roles[role]])
        else:
            out[ref] = prof.roles[role]
    return out


def _rebuild_missing_models(run_dir: Path, cfg: dict[str, Any], reg: Registry) -> None:
    """Before a resume: a checkpoint the project builds (tiny models, shape stand-ins) whose folder is gone
    (a fresh host, a cleaned checkout) is built again, deterministically, at the path the run recorded;
    any other missing local checkpoint is an error naming it (a hub id is left to vLLM)."""
    missing = {ref: Path(str(path)) for ref, path in (cfg.get("models") or {}).items()
               if Path(str(path)).is_absolute() and not Path(str(path)).exists()}
    if not missing:
        return
    try:
        prof = reg.profile(cfg.get("profile"))
    except (RegistryError, KeyError):
        prof = None
    builds = prof is not None and (prof.shapes or prof.tiny or bool(prof.organism))
    if builds and prof.shapes:
        from workbench.shapes import build_shapes
        build_shapes()
    elif builds and prof.organism:
        from workbench.organism.models import ensure_organism_models
        for variant in sorted({reg.role_profile(prof, ref).organism for ref in missing} - {None}):
            ensure_organism_models(variant)
    elif builds:
        from workbench.tiny import ensure_tiny_models
        ensure_tiny_models()
    for ref, p in missing.items():
        if not p.exists():
            raise ProtocolError(f"cannot resume {run_dir}: role {ref!r} was prepared with the checkpoint {p}, "
                                "which is not on this host" + ("" if builds else
                                                              " (the profile's models are not built by the project)"))


def _load_prompts(p: Plan, dataset_sources: dict[str, str] | None) -> tuple[list, dict[str, Any]]:
    """First dataset candidate that loads wins; the run records which one and why the others did not."""
    from workbench.prompts import PromptError
    tried: list[dict[str, str]] = []
    for name in p.datasets:
        kw: dict[str, Any] = {"n": p.n}
        src = (dataset_sources or {}).get(name)
        if src:
            kw["source"] = src
        if name == "mathvista" and p.profile.tiny:
            # the tiny profile never has the real MathVista images; stand-ins keep the text and answers
            kw["stand_in_images"] = True
        try:
            from workbench.datasets import load_prompt_set
            prompts = load_prompt_set(name, **kw)
        except (PromptError, FileNotFoundError, OSError, ImportError, ValueError) as exc:
            tried.append({"dataset": name, "error": f"{type(exc).__name__}: {exc}"})
            continue
        info = {"requested": p.experiment.dataset, "candidates": p.datasets, "resolved": name,
                "source": str(src) if src else "default", "n": len(prompts), "pids": [q.pid for q in prompts],
                "stand_in_images": bool(kw.get("stand_in_images")), "not_used": tried}
        if name != p.experiment.dataset:
            info["note"] = (f"{p.experiment.dataset} requested; ran on {name!r} "
                            f"({'smoke/tiny fallback' if p.profile.tiny else 'override'})")
        return prompts, info
    raise ProtocolError(f"{p.experiment.id}: no prompt set could be loaded; tried "
                        + "; ".join(f"{t['dataset']}: {t['error']}" for t in tried))


def _writable_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot be created and written, or None (nothing is created to find out)."""
    probe = folder
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"results folder {folder}: {probe} exists and is not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"results folder {folder}: {probe} is not writable"
    return None


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def device_problem(p: Plan) -> str | None:
    """Why the plan cannot run on this host's devices, or None. Checked for the cost ladder, whose GPU
    profiles (random weights at full shape) must never fall back to a CPU."""
    if _experiment_runner(p.experiment.runner).gpu_profile_needs_cuda and p.profile.device == "gpu" \
            and not _cuda_available():
        return (f"profile {p.profile.name!r} runs on a CUDA GPU (device: gpu in profiles.yaml) and this host has "
                f"none (torch.cuda.is_available() is False). Rehearse on a CPU with --profile tiny; "
                f"`workbench doctor` says what this host can run")
    return None


def leg_tp(knobs: dict[str, Any]) -> int:
    """A planned leg's tensor-parallel size (1 in a run planned before the knob existed)."""
    return int(knobs.get("tensor_parallel_size") or 1)


def _tp_problems(tp: int, leg: PlannedLeg, models: dict[str, str], bad_models: set[str]) -> list[str]:
    """A leg's tensor-parallel size against its models' heads and this host's devices."""
    from workbench import leg as legmod

    roles = [("target", leg.model)] + ([("draft", leg.draft)] if leg.kind == "spec" and leg.draft else [])
    paths = {f"{role} ({ref})": None if ref in bad_models else models.get(ref) for role, ref in roles}
    return legmod.tensor_parallel_problems(tp, paths, _cuda_available())


def preflight_problems(p: Plan, models: dict[str, str], prompts: list | None) -> list[str]:
    """Model folders, configs, quantization configs and weight files' headers (``workbench.checkpoints``),
    gamma, prompt lengths with the real tokenizer, dtypes and quantized checkpoints the device has no kernel
    for (``workbench.combinations``), memory; one line per problem.

    Prompt lengths are checked only where ``prompts`` loaded and the model is a local folder.
    """
    from workbench import leg as legmod
    from workbench.checkpoints import file_problems

    problems: list[str] = []
    bad_models: set[str] = set()
    weights = p.profile.load_format != "dummy"  # the shape stand-ins hold configs only
    for ref, path in models.items():
        if legmod.is_local(path):
            try:
                config = legmod.read_model_config(path, f"role {ref}")
            except legmod.LegError as exc:
                problems.append(str(exc))
                bad_models.add(ref)
                continue
            bad = file_problems(path, config, weights)
            problems += [f"role {ref}: {msg}" for msg in bad]
            if bad:
                bad_models.add(ref)
    lengths_by: dict[str, list[int]] = {}
    groups: dict[tuple, list[str]] = {}
    for l in p.legs:
        if not runner_for(l, p.experiment.runner).engine_preflight:
            continue
        k = l.knobs
        bad = legmod.gamma_problem(k.get("gamma"), int(k["max_model_len"])) if l.kind == "spec" else None
        if bad:
            problems.append(f"leg {l.name}: {bad}")
        tp = leg_tp(k)
        if tp > 1:
            problems += [f"leg {l.name}: {msg}" for msg in _tp_problems(tp, l, models, bad_models)]
        path = models[l.model]
        if prompts is not None and l.model not in bad_models and legmod.is_local(path):
            # a hub id is resolved by the engine; its tokenizer is not fetched here
            groups.setdefault((path, int(k["max_model_len"]), int(k["n"])), []).append(l.name)
    if bad_models:
        groups.clear()  # a broken checkpoint is the run's problem: its lengths are checked once it loads
    for (path, max_len, n), names in groups.items():
        if path not in lengths_by:
            try:
                lengths_by[path] = legmod.prompt_lengths(path, prompts)
            except Exception as exc:  # a tokenizer that does not load is itself the problem
                problems.append(f"cannot load the tokenizer of {path} ({type(exc).__name__}: {exc})")
                lengths_by[path] = []
        if lengths_by[path]:
            for msg in legmod.length_problems(prompts[:n], lengths_by[path][:n], max_len, path):
                problems.append(f"leg(s) {', '.join(names)}: {msg}")
    from workbench.combinations import combination_problems
    from workbench.memory_plan import memory_problems

    engine_legs = [(l.name, l.knobs.get("dtype"), {"target": l.model, **({"draft": l.draft} if l.kind == "spec"
                                                                           and l.draft else {})})
                   for l in p.legs if runner_for(l, p.experiment.runner).engine_preflight]
    good = {ref: path for ref, path in models.items() if ref not in bad_models}
    problems += combination_problems(engine_legs, good, p.profile.device)
    return problems + memory_problems(p, models, bad_models)


def prepare_run(experiment: str, profile: str | None = None, overrides: Any = None, smoke: bool | None = None,
                results_root: str | Path = "results", run_dir: str | Path | None = None,
                model_paths: dict[str, str] | None = None, dataset_sources: dict[str, str] | None = None,
                registry: Registry | None = None) -> Path:
    """Create the run folder (run.json, env.json, prompts.jsonl), or reuse a prepared one (resume).

    Reusing checks that the folder was made for the same experiment/profile/overrides/smoke, so a resume
    can never silently mix two configurations in one run. A new run is checked in full first; its folder
    appears only when every check passed, and never reuses an existing folder.
    """
    if run_dir is not None:
        remove_stale_preparing(Path(run_dir).parent)  # what a preparation killed with -9 left
    if run_dir is not None and (Path(run_dir) / RUN_JSON).is_file():
        try:
            cfg = read_json(Path(run_dir) / RUN_JSON)
        except ValueError as exc:
            raise ProtocolError(f"cannot resume {run_dir}: {exc}") from None
        # A resumed run keeps the checkpoints and prompts it was prepared with: a leg decoded with
        # other weights or prompts would sit beside the old ones as if they were comparable.
        models, sources = cfg.get("models") or {}, (cfg.get("dataset") or {}).get("source")
        for ref, path in (model_paths or {}).items():
            had = models.get(ref, (cfg.get("model_paths") or {}).get(ref))
            if had is None:
                raise ProtocolError(f"cannot resume {run_dir} with --model-path {ref}={path}: the run has no "
                                    f"role {ref!r} (roles: {', '.join(models) or 'none'})")
            if str(path) != str(had):
                raise ProtocolError(f"cannot resume {run_dir} with --model-path {ref}={path}: the run was prepared "
                                    f"with {ref}={had}; a resumed run keeps its checkpoints (start a new run "
                                    f"for other weights)")
        for ref, had in models.items():  # the environment's checkpoints are held to the same rule
            key = _env_key(ref)
            path = os.environ.get(key)
            if path and str(path) != str(had) and ref not in (model_paths or {}):
                raise ProtocolError(f"cannot resume {run_dir} with {key}={path}: the run was prepared with "
                                    f"{ref}={had}; a resumed run keeps its checkpoints (unset {key}, or start "
                                    f"a new run for other weights)")
        for name, src in (dataset_sources or {}).items():
            resolved = (cfg.get("dataset") or {}).get("resolved")
            if name != resolved or str(src) != str(sources):
                raise ProtocolError(f"cannot resume {run_dir} with --data-source {name}={src}: the run's prompts "
                                    f"were prepared from {resolved}={sources}; a resumed run keeps its prompts")
        asked = {"experiment": experiment.upper() if isinstance(experiment, str) else experiment,
                 "profile": profile, "smoke": smoke}
        if overrides:
            asked["overrides"] = parse_overrides(overrides, load_registry().experiment(experiment)
                                                 if registry is None else registry.experiment(experiment))
        clash = {k: (v, cfg.get(k)) for k, v in asked.items() if v is not None and cfg.get(k) != v}
        if clash:
            raise ProtocolError(f"{run_dir} was created with a different configuration: "
                                + ", ".join(f"{k}: run.json has {b!r}, asked {a!r}" for k, (a, b) in clash.items()))
        if (_experiment_runner(cfg.get("runner")).gpu_profile_needs_cuda and cfg.get("device") == "gpu"
                and not _cuda_available()):
            raise ProtocolError(f"cannot resume {run_dir}: profile {cfg.get('profile')!r} runs on a CUDA GPU and "
                                f"this host has none (torch.cuda.is_available() is False)")
        _rebuild_missing_models(Path(run_dir), cfg, registry or load_registry())
        return Path(run_dir)

    reg = registry or load_registry()
    p = plan(experiment, profile, overrides, smoke, registry=reg)
    run_id = Path(run_dir).name if run_dir is not None else new_run_id()
    rdir = Path(run_dir) if run_dir is not None else Path(results_root) / p.experiment.id / run_id
    remove_stale_preparing(rdir.parent)

    problems: list[str] = []
    if rdir.exists():
        problems.append(f"run folder {rdir} already exists; a run never reuses a folder "
                        f"(resume a prepared run with --resume)")
    else:
        why = _writable_problem(rdir)
        if why:
            problems.append(why)
    reads_prompts = _experiment_runner(p.experiment.runner).reads_prompts
    device = device_problem(p)
    if device:
        problems.append(device)
    bad_sources = sorted(set(dataset_sources or {}) - set(DATASETS))
    if bad_sources:
        problems.append(f"--data-source: unknown data set(s) {bad_sources}; data sets: {', '.join(DATASETS)}")
    for name, src in (dataset_sources or {}).items():
        if name in DATASETS and not Path(src).exists():
            problems.append(f"--data-source {name}={src}: no such file or folder")
    models = None
    if not device:  # nothing is built (shape stand-ins, tiny models) for a run that cannot start
        try:
            models = resolve_models(p, model_paths, reg)
        except RegistryError as exc:
            problems.append(str(exc))
    prompts = dinfo = None
    if not reads_prompts:
        if dataset_sources:
            problems.append(f"--data-source: {p.experiment.id} decodes random prompt token ids; it reads no data set")
        dinfo = {"requested": None, "candidates": [], "resolved": None,
                 "note": "the cost ladder decodes random prompt token ids (ladder.prompt_len per request)"}
    elif not bad_sources:
        try:
            prompts, dinfo = _load_prompts(p, dataset_sources)
        except ProtocolError as exc:
            problems.append(str(exc))
    if models is not None:
        problems += preflight_problems(p, models, prompts)
    if problems:
        raise ProtocolError(f"{p.experiment.id} cannot start ({len(problems)} problem(s)); nothing was created:\n"
                            + "\n".join(f"  - {q}" for q in problems))

    # Built beside its final name and renamed in one step: a run folder is complete or absent.
    staging = rdir.parent / f".{rdir.name}{PREPARING_SUFFIX}"
    try:
        shutil.rmtree(staging, ignore_errors=True)  # left by a preparation that was killed
        staging.mkdir(parents=True)
        # who builds it: a later prepare, resume or listing removes it if this process dies meanwhile
        write_json_atomic(staging / PREPARER, process_identity())
        from workbench import envcapture
        from workbench.prompts import save_prompts
        if prompts is not None:
            save_prompts(prompts, staging / PROMPTS)
        # the tensor-parallel sizes the legs run at (each leg's records state the one its engine ran with)
        tps = sorted({leg_tp(l.knobs) for l in p.legs})
        envcapture.write_env(staging / ENV_JSON, {"tensor_parallel_sizes": tps})
        cfg = p.config()
        cfg.update(run_id=run_id, created=_now(), models=models, model_paths=dict(model_paths or {}),
                   dataset=dinfo, prompts_file=PROMPTS if prompts is not None else None)
        write_json_atomic(staging / RUN_JSON, cfg)
        (staging / PREPARER).unlink()
        os.rename(staging, rdir)  # refuses when rdir appeared meanwhile
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise ProtocolError(f"run folder {rdir} already exists; a run never reuses a folder") from None
        raise ProtocolError(f"cannot create run folder {rdir}: {exc.filename + ': ' if exc.filename else ''}"
                            f"{exc.strerror or exc}") from None
    return rdir


# --- one leg -----------------------------------------------------------------------------------

def leg_knobs(leg: PlannedLeg, vanilla):
    """The engine knobs of a planned spec leg (``workbench.knobs.Knobs``); ``vanilla`` for a vanilla one.

    Every leg knob of the table comes from the plan (``Knobs.from_planned``: one it lacks is an error,
    not a silent default).
    """
    from workbench.knobs import Knobs

    if leg.kind != "spec":
        return vanilla
    return Knobs.from_planned(leg.knobs, where=f"leg {leg.name}")


def leg_config(leg: PlannedLeg, cfg: dict[str, Any], run_dir: Path, resume_from: Path | None = None):
    """The leg's configuration (written as legs/<leg>/leg.json and read by `python -m workbench.leg`)."""
    from workbench.knobs import Knobs, parse_concurrencies
    from workbench.leg import LegConfig

    k = leg.knobs
    spec = leg.kind == "spec"
    knobs = leg_knobs(leg, vanilla=Knobs())
    gpu_mem = k.get("gpu_memory_utilization")
    concs = parse_concurrencies(k.get("concurrencies"))
    return LegConfig(
        target=cfg["models"][leg.model], draft=cfg["models"][leg.draft] if spec else None,
        prompts=str(run_dir / cfg.get("prompts_file", PROMPTS)), out=str(run_dir / LEGS / leg.name),
        max_tokens=int(k["max_tokens"]), knobs=knobs, n=int(k["n"]), max_model_len=int(k["max_model_len"]),
        max_num_seqs=max(concs) if concs else int(k["max_num_seqs"]), concurrencies=concs,
        dtype=str(k.get("dtype") or "auto"),
        tensor_parallel_size=leg_tp(k),
        # on CPU the leg picks its own small host-memory share for the KV cache
        gpu_memory_utilization=float(gpu_mem) if cfg.get("device") == "gpu" and gpu_mem is not None else None,
        experiment=cfg["experiment"], leg=leg.name, run_id=cfg["run_id"],
        load_format=cfg.get("load_format") or "auto",
        resume_from=str(resume_from) if resume_from else None)


def ladder_leg_config(leg: PlannedLeg, cfg: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """``legs/<leg>/leg.json`` of one cost-ladder engine (read by ``python -m workbench.ladder_engine``)."""
    from workbench.knobs import Knobs
    from workbench.ladder_engine import GPU_MEMORY_UTILIZATION

    k = leg.knobs
    spec = leg.kind == "spec"
    knobs = leg_knobs(leg, vanilla=Knobs(trace=False))
    ladder = cfg["ladder"]
    gpu_mem = k.get("gpu_memory_utilization")
    return {"runner": "ladder", "experiment": cfg["experiment"], "run_id": cfg["run_id"], "leg": leg.name,
            "kind": leg.kind, "size": ladder["size"], "target": cfg["models"][leg.model],
            "draft": cfg["models"][leg.draft] if spec else None, "gamma": k.get("gamma") if spec else None,
            "batches": list(ladder["batches"]), "repeats": int(ladder["repeats"]),
            "prompt_len": int(ladder["prompt_len"]), "eager": bool(ladder.get("eager", True)),
            "tensor_parallel_size": leg_tp(k),
            "tokens": int(k["max_tokens"]),
            "dtype": str(k.get("dtype") or "bfloat16"), "max_model_len": int(k["max_model_len"]),
            "gpu_memory_utilization": float(gpu_mem) if gpu_mem is not None else GPU_MEMORY_UTILIZATION,
            "load_format": cfg.get("load_format") or "auto", "device": cfg.get("device"),
            "knobs": knobs.as_dict(), "out": str(Path(run_dir) / "legs" / leg.name)}


# --- the runner table --------------------------------------------------------------------------

@dataclass(frozen=True)
class Runner:
    """How the protocol runs one kind of leg.

    ``module``: the leg process is ``python -m <module> <args>`` (a test's fake ``runner`` command
    replaces ``python -m <module>``); ``leg_json(leg, cfg, run_dir, folder, earlier)``: what goes to
    ``legs/<leg>/leg.json`` (None: no file; ``earlier``: the leg's previous attempt, moved aside);
    ``args(leg, cfg, run_dir)``: the command's arguments; ``finish(run_dir)``: what the run does once
    the legs ran. ``reads_prompts``: the run saves a prompt set for it; ``gpu_profile_needs_cuda``: a
    profile on a GPU never falls back to a CPU (refused before anything is created);
    ``engine_preflight``: its legs' gamma and prompt lengths are checked before the run starts.
    """

    name: str
    module: str
    leg_json: Callable[..., dict[str, Any] | None]
    args: Callable[[PlannedLeg, dict[str, Any], Path], list[str]]
    finish: Callable[[Path], Any] | None = None
    reads_prompts: bool = True
    gpu_profile_needs_cuda: bool = False
    engine_preflight: bool = True


def _config_args(leg: PlannedLeg, cfg: dict[str, Any], run_dir: Path) -> list[str]:
    return ["--config", str(run_dir / LEGS / leg.name / LEG_JSON)]


def _engine_leg_json(leg, cfg, run_dir, folder, earlier):
    reuse = earlier if earlier is not None and (earlier / LEG_JSON).is_file() else None
    return leg_config(leg, cfg, run_dir, reuse).to_file_dict(folder)


def _score_args(leg: PlannedLeg, cfg: dict[str, Any], run_dir: Path) -> list[str]:
    # a score leg takes its few options on the command line
    k = leg.knobs
    dtype = [] if k.get("dtype") in (None, "auto") else ["--dtype", str(k["dtype"])]
    ref = run_dir / LEGS / leg.reference / RECORDS
    return ["--model", cfg["models"][leg.model], "--reference", str(ref),
            "--prompts", str(run_dir / cfg.get("prompts_file", PROMPTS)),
            "--max-model-len", str(k["max_model_len"]), *dtype, "--experiment", cfg["experiment"],
            "--leg", leg.name, "--run-id", cfg["run_id"], "--out", str(run_dir / LEGS / leg.name)]


def _merge_ladder_rows(run_dir: Path) -> None:
    from workbench import ladder

    ladder.merge_rows(run_dir)  # every complete leg's rows at the run's top, as the benchmark script writes them


RUNNERS: dict[str, Runner] = {
    "leg": Runner("leg", "workbench.leg", _engine_leg_json, _config_args),
    "score": Runner("score", "workbench.score", lambda *a: None, _score_args, engine_preflight=False),
    # a serving leg: the same leg.json as an engine leg, run behind `vllm serve` (workbench.serve_leg)
    "serve": Runner("serve", "workbench.serve_leg", _engine_leg_json, _config_args, gpu_profile_needs_cuda=True),
    "ladder": Runner("ladder", "workbench.ladder_engine",
                     lambda leg, cfg, run_dir, folder, earlier: ladder_leg_config(leg, cfg, run_dir),
                     _config_args, finish=_merge_ladder_rows, reads_prompts=False, gpu_profile_needs_cuda=True),
}


def runner_for(leg: PlannedLeg | None, experiment_runner: str | None) -> Runner:
    """The one dispatch point: the runner of ``leg`` in an experiment whose ``runner`` (registry, run.json) is
    ``experiment_runner``. An experiment of ordinary legs (``legs``) runs engine legs and score legs."""
    name = experiment_runner or "legs"
    if name == "legs":
        name = "score" if leg is not None and leg.kind == "score" else "leg"
    try:
        return RUNNERS[name]
    except KeyError:
        raise ProtocolError(f"unknown runner {name!r}; runners: {', '.join(RUNNERS)}") from None


def _experiment_runner(name: str | None) -> Runner:
    """The runner of an experiment's engine legs (what decides its prompt set and its devices)."""
    return runner_for(None, name)


def leg_command(leg: PlannedLeg, cfg: dict[str, Any], run_dir: Path, python: str = sys.executable,
                runner: list[str] | None = None) -> list[str]:
    """The leg's command (its runner's, ``RUNNERS``); `runner` replaces `python -m <module>` (tests use a
    fake leg there). An engine leg reads legs/<leg>/leg.json; a score leg takes its options on the command line.
    """
    r = runner_for(leg, cfg.get("runner"))
    return [*(runner or [python, "-m", r.module]), *r.args(leg, cfg, run_dir)]


def _fmt_s(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def _tail(path: Path, n_chars: int = 4000) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - n_chars))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _run_one(cmd: list[str], folder: Path, timeout: float | None, env: dict[str, str],
             on_start: Callable[[subprocess.Popen], None]) -> tuple[int | None, str]:
    log = folder / LEG_LOG
    with log.open("ab") as fh:
        fh.write(("$ " + " ".join(cmd) + "\n").encode())
        fh.flush()
        # Own session and process group: the leg's engine processes can be stopped as one. The
        # trampoline arms the kernel's parent-death signal: if this process dies, the leg is told.
        proc = subprocess.Popen(childproc.wrap(os.getpid(), cmd), stdout=fh, stderr=subprocess.STDOUT,
                                cwd=str(REPO_ROOT), env=env, start_new_session=True)
        try:
            on_start(proc)
            rc = proc.wait(timeout=timeout)
            _wait_group_gone(proc.pid)  # engine workers exit after the leg: /dev/shm is cleaned after them
            return rc, ""
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return None, f"leg timed out after {timeout:g} s"
        except BaseException:
            _kill_group(proc)
            raise


def _wait_group_gone(pgid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)


def _kill_group(proc: subprocess.Popen) -> None:
    # vLLM spawns engine-core workers; the whole group goes, not only the leg's main process.
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _finalise(folder: Path, leg: PlannedLeg, rc: int | None, why: str) -> str:
    """Decide the leg's status from what is on disk; write failure.json where the leg could not."""
    status = leg_status(folder)
    if status == "complete" and rc == 0:
        return status
    if status == "failed":
        return status
    if status == "complete":  # a summary says complete but the process failed: do not trust it
        os.replace(folder / SUMMARY, folder / "summary.rejected.json")
        if (folder / RECORDS).is_file():
            os.replace(folder / RECORDS, folder / RECORDS_PARTIAL)
    err = why or (f"leg process exited with code {rc} without writing summary.json" if rc
                  else "leg process exited 0 but left no complete summary.json + records.jsonl")
    write_failure(folder, failure_record(
        error=err, returncode=rc, leg=leg.name, mode=leg.kind, tier=leg.tier, gamma=leg.knobs.get("gamma"),
        written_by="workbench.execution",
        partial_records=RECORDS_PARTIAL if (folder / RECORDS_PARTIAL).is_file() else None,
        stderr_tail=_tail(folder / LEG_LOG)))
    return "failed"


# --- a run -------------------------------------------------------------------------------------

def _previous_process(state: dict[str, Any]) -> dict[str, Any] | None:
    lp = state.get("leg_process")
    return lp if isinstance(lp, dict) and lp.get("pid") else None


def execute(run_dir: str | Path, stop_on_failure: bool = False, leg_timeout: float | None = None,
            python: str = sys.executable, log: Callable[[str], None] | None = None,
            only: Iterable[str] | None = None, runner: list[str] | None = None) -> dict[str, str]:
    """Run every planned leg that is not complete yet; returns {leg name: status}.

    Finished legs are skipped, so calling this again resumes. A failed or interrupted leg is moved under
    attempts/ and rerun; its finished prompts are reused when its engine settings match. The run folder
    is locked while this runs; a second writer is refused with the holder's PID and start time.
    """
    rdir = Path(run_dir)
    if not (rdir / RUN_JSON).is_file():
        raise ProtocolError(f"{rdir} is not a prepared run folder ({RUN_JSON} missing)")
    try:
        cfg = read_json(rdir / RUN_JSON)
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    legs = [PlannedLeg.from_dict(d) for d in cfg["legs"]]
    wanted = set(only) if only is not None else None
    if wanted is not None:
        unknown = sorted(wanted - {l.name for l in legs})
        if unknown:
            raise ProtocolError(f"unknown leg(s) {unknown} in {rdir}")
    try:
        lock = RunLock(rdir).acquire()
    except RunFolderError as exc:
        raise ProtocolError(str(exc)) from None
    try:
        return _execute_locked(rdir, cfg, legs, wanted, lock, stop_on_failure, leg_timeout, python, log, runner)
    finally:
        lock.release()


def _execute_locked(rdir, cfg, legs, wanted, lock, stop_on_failure, leg_timeout, python, log, runner):
    emit = log or (lambda s: print(s, flush=True))
    old_state: dict[str, Any] = {}
    if (rdir / STATE_JSON).is_file():
        try:
            old_state = read_json(rdir / STATE_JSON) or {}
        except ValueError:
            old_state = {"note": f"{STATE_JSON} was unreadable"}
    prev = _previous_process(old_state)
    if prev and process_alive(prev["pid"], prev.get("start_ticks")):
        raise ProtocolError(f"leg {prev.get('leg')} of an earlier run of {rdir} is still running as PID "
                            f"{prev['pid']} (started {prev.get('started')}); it would skew this run's timing. "
                            f"Stop it first (kill -- -{prev['pid']}) or wait for it")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    from workbench.leg import PARENT_ENV
    env[PARENT_ENV] = str(os.getpid())
    (rdir / LEGS).mkdir(exist_ok=True)
    shm_removed = _clean_shm(rdir)  # what a leg killed with -9 (its run with it) left in /dev/shm
    statuses = {l.name: leg_status(rdir / LEGS / l.name) for l in legs}
    # A leg that says it is complete is trusted only once its records read back whole: a torn line
    # (a crash, a full disk) would otherwise pass here and fail every analysis after. Such a leg is
    # run again; the attempt is kept and its whole records are reused (``leg.json`` resume_from).
    damaged = {}
    for l in legs:
        if statuses[l.name] == "complete" and (wanted is None or l.name in wanted):
            why = records_problem(rdir / LEGS / l.name)
            if why:
                damaged[l.name] = why
                statuses[l.name] = "damaged"
    todo = [l for l in legs if statuses[l.name] != "complete" and (wanted is None or l.name in wanted)]
    history = list(old_state.get("history", []))
    if old_state or damaged:
        found = {"at": _now(), "previous_state": old_state.get("state"),
                 "legs_found": dict(statuses), "to_run": [l.name for l in todo]}
        if damaged:
            found["damaged_legs"] = damaged
        if old_state.get("state") == "running":
            found["note"] = "the previous run stopped without finishing (killed or crashed)"
        if lock.previous:
            found["lock_taken_over_from"] = lock.previous
        if prev:
            found["interrupted_leg"] = dict(prev, alive=False)
        if shm_removed:
            found["shm_removed"] = shm_removed
        history.append(found)
    state = {"state": "running", "started": _now(), "pid": os.getpid(), "legs": statuses, "history": history,
             "leg_process": None}
    write_json_atomic(rdir / STATE_JSON, state)
    emit(f"{cfg['experiment']} {cfg['run_id']}: {len(legs)} legs, {len(legs) - len(todo)} already complete, "
         f"{len(todo)} to run" + (f", {len(damaged)} damaged ({', '.join(damaged)}: records unreadable, run "
                                  f"again)" if damaged else "")
         + ("" if not history else f" (resumed; {STATE_JSON} records what was found)"))
    for name, why in damaged.items():
        emit(f"  damaged: {why}")
    try:
        with _signals_as_exceptions():
            return _run_legs(rdir, cfg, legs, todo, statuses, state, stop_on_failure, leg_timeout, env, python,
                             runner, emit)
    except RunInterrupted:
        raise  # recorded where it happened
    except BaseException as exc:
        _record_stop(rdir, state, statuses, exc)
        sig = _signum(exc)
        if sig is not None:
            raise RunInterrupted(sig, rdir) from None
        raise


def _clean_shm(rdir: Path) -> dict[str, list[str]]:
    """Leg -> the /dev/shm entries its killed engine left, removed (legs whose snapshot is still there)."""
    out = {}
    for snap in sorted((rdir / LEGS).glob(f"*/{shm.SNAPSHOT}")):
        removed = shm.clean_after(snap.parent)
        if removed:
            out[snap.parent.name] = removed
    return out


def _signum(exc: BaseException) -> int | None:
    """The signal behind an exception: ours, or Python's own KeyboardInterrupt (SIGINT off the main thread)."""
    if isinstance(exc, _Signalled):
        return exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return int(signal.SIGINT)
    return None


class RunInterrupted(Exception):
    """The run was stopped by SIGINT or SIGTERM; the state and the leg in flight are recorded."""

    def __init__(self, signum: int, run_dir: Path, leg: str | None = None):
        self.signum, self.run_dir, self.leg = signum, run_dir, leg
        self.signal = signal.Signals(signum).name
        super().__init__(f"{self.signal} received")


class _Signalled(BaseException):
    # raised from the signal handler: a BaseException, so no ``except Exception`` on the way swallows it
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _signals_as_exceptions:
    """SIGINT and SIGTERM become an exception in the main thread while legs run, so the run records
    the stop (and its leg's process group is taken down) instead of dying with a raw traceback or
    without a word. Off the main thread (a notebook's worker) signals cannot be caught: no change.
    A SIGINT that was ignored when this started (a background job) stays ignored."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self):
        self.old = {}
        import threading
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.SIGNALS:
            prev = signal.getsignal(sig)
            if prev == signal.SIG_IGN:
                continue
            self.old[sig] = prev
            signal.signal(sig, self._raise)
        return self

    def _raise(self, signum, frame):
        # A second Ctrl-C while the leg's processes are being stopped must not cut that short.
        for sig in self.old:
            signal.signal(sig, signal.SIG_IGN)
        raise _Signalled(signum)

    def __exit__(self, *exc):
        for sig, prev in self.old.items():
            signal.signal(sig, prev)


def _record_stop(rdir: Path, state: dict[str, Any], statuses: dict[str, str], exc: BaseException) -> None:
    """The run stopped by a signal or an error (a full disk): say so in protocol.json where the disk lets us."""
    inflight = state.get("leg_process") or {}
    sig = _signum(exc)
    if sig is not None:
        state.update(state="interrupted", interrupted={"signal": signal.Signals(sig).name, "at": _now(),
                                                       "leg": inflight.get("leg")})
    else:
        state.update(state="error", error=f"{type(exc).__name__}: {exc}", at=_now())
    state.update(legs=statuses, leg_process=None, finished=_now())
    try:
        write_json_atomic(rdir / STATE_JSON, state)
    except OSError:
        pass  # the disk is still full: the error itself is reported by the caller


def _run_legs(rdir, cfg, legs, todo, statuses, state, stop_on_failure, leg_timeout, env, python, runner, emit):
    t_run = time.monotonic()
    durations: list[float] = []
    stopped = False
    for i, leg in enumerate(todo):
        folder = rdir / LEGS / leg.name
        earlier = archive_leg(folder) if folder.exists() else None
        folder.mkdir(parents=True)
        shm.snapshot(folder)  # before the engine starts: what /dev/shm held (workbench.shm)
        leg_runner = runner_for(leg, cfg.get("runner"))
        conf = leg_runner.leg_json(leg, cfg, rdir, folder, earlier)
        if conf is not None:
            write_json_atomic(folder / LEG_JSON, conf)
        cmd = leg_command(leg, cfg, rdir, python, runner)
        t0 = time.monotonic()

        def started(proc: subprocess.Popen, leg=leg) -> None:
            state["leg_process"] = {"leg": leg.name, "pid": proc.pid, "start_ticks": process_start_ticks(proc.pid),
                                    "started": _now()}
            write_json_atomic(rdir / STATE_JSON, state)

        try:
            rc, why = _run_one(cmd, folder, leg_timeout, env, started)
        except BaseException as exc:
            # the leg's process group is gone (_run_one); its folder gets a failure record
            shm.clean_after(folder)
            sig = _signum(exc)
            why = (f"interrupted by {signal.Signals(sig).name} while the leg ran" if sig is not None
                   else f"the run stopped while the leg ran: {type(exc).__name__}: {exc}")
            try:
                statuses[leg.name] = _finalise(folder, leg, None, why)
            except OSError:
                pass  # a full disk: the run's own error says so
            if sig is not None:
                _record_stop(rdir, state, statuses, exc)
                raise RunInterrupted(sig, rdir, leg.name) from None
            raise
        dt = time.monotonic() - t0
        durations.append(dt)
        shm.clean_after(folder)
        status = _finalise(folder, leg, rc, why)
        statuses[leg.name] = status
        state.update(legs=statuses, leg_process=None)
        write_json_atomic(rdir / STATE_JSON, state)
        left = len(todo) - i - 1
        eta = (sum(durations) / len(durations)) * left
        msg = (f"[{leg.index + 1}/{len(legs)}] {leg.name:<24} {leg.describe():<40} {status:<8} {dt:6.1f} s"
               f"  elapsed {_fmt_s(time.monotonic() - t_run)}  ETA {_fmt_s(eta) if left else '-'}")
        if status == "failed":
            err = read_json(folder / FAILURE).get("error", "")
            msg += f"\n      failure: {str(err).strip().splitlines()[-1] if str(err).strip() else '?'}" \
                   f" (see {folder / FAILURE})"
        emit(msg)
        if status == "failed" and stop_on_failure:
            stopped = True
            break
    finish = _experiment_runner(cfg.get("runner")).finish
    if finish is not None:
        finish(rdir)
    n_failed = sum(1 for s in statuses.values() if s == "failed")
    final = "stopped" if stopped else ("finished_with_failures" if n_failed else
                                       ("finished" if all(s == "complete" for s in statuses.values())
                                        else "partial"))
    write_json_atomic(rdir / STATE_JSON, dict(state, state=final, legs=statuses, finished=_now()))
    emit(f"{cfg['experiment']} {cfg['run_id']}: {final} in {_fmt_s(time.monotonic() - t_run)} "
         f"({sum(s == 'complete' for s in statuses.values())}/{len(legs)} legs complete)")
    return statuses
