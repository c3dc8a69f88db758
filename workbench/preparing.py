"""Preparing a run: every check that can be made before an engine starts, then the run folder.

    prepare_run(experiment, profile, overrides, smoke, results_root, ...) -> Path

``prepare_run`` checks everything that can be checked before an engine starts
(roles, model folders and configs, gamma against the context length, data
sources, prompt lengths with the target's own tokenizer, that the results
root is writable) and reports every problem in one message; only a run that
can start gets a folder. A profile on a GPU is refused before anything is created where the host
has no CUDA device.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

from workbench.planning import Plan, PlannedLeg, parse_overrides, plan
from workbench.registry import DATASETS, Registry, RegistryError, load_registry, split_role
from workbench.runfolder import (ENV_JSON, PREPARER, PREPARING_SUFFIX, PROMPTS, RUN_JSON, new_run_id,
                                 process_identity, read_json, remove_stale_preparing, write_json_atomic)
from workbench.runners import ProtocolError, _now, leg_tp, runner_for
from workbench.runners import experiment_runner as _experiment_runner

__all__ = ["prepare_run", "resolve_models", "preflight_problems", "device_problem"]

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
            out[ref] = local_path(explicit)
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


def local_path(value: str) -> str:
    """A checkpoint named on the command line or in the environment, as every leg finds it: a local folder
    made absolute (a leg runs in the repository, not in the folder the run was started from), a hub id as
    given."""
    path = Path(str(value)).expanduser()
    return os.path.abspath(path) if path.exists() else str(value)


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
    from workbench.combinations import combination_problems, kernel_problems
    from workbench.memory_plan import memory_problems

    engine_legs = [(l.name, l.knobs.get("dtype"), {"target": l.model, **({"draft": l.draft} if l.kind == "spec"
                                                                           and l.draft else {})})
                   for l in p.legs if runner_for(l, p.experiment.runner).engine_preflight]
    good = {ref: path for ref, path in models.items() if ref not in bad_models}
    problems += combination_problems(engine_legs, good, p.profile.device)
    problems += kernel_problems([(l.name, l.knobs) for l in p.legs if l.kind == "spec"
                                 and runner_for(l, p.experiment.runner).engine_preflight], p.profile.device)

    return problems + schedule_problems(p, models) + memory_problems(p, models, bad_models)


def schedule_problems(p: Plan, models: dict[str, str]) -> list[str]:
    """Spec legs whose ``acceptance`` (``from:RUN_DIR``) or ``gamma_schedule`` (``auto``: an E16 cost table of
    the target's size) cannot be resolved: found here, from the run folders' tables, before any leg runs,
    not inside the leg after the legs before it have run."""
    from workbench.acceptance import AcceptanceError
    from workbench.knobs import Knobs
    from workbench.planning import _server_seqs

    out: list[str] = []
    for l in p.legs:
        if l.kind != "spec" or l.knobs.get("gamma") is None:
            continue
        try:  # what the leg itself resolves when it builds its speculative config
            Knobs.from_planned(l.knobs, f"leg {l.name}").spec_config_extra(int(_server_seqs(l.knobs) or 1),
                                                                           models.get(l.model))
        except AcceptanceError as exc:
            out.append(f"leg {l.name}: {exc}")
    return out


def _check_resume_inputs(run_dir, cfg: dict[str, Any], model_paths: dict[str, str] | None,
                         dataset_sources: dict[str, str] | None) -> None:
    """A resumed run keeps the checkpoints and prompts it was prepared with: a leg decoded with other weights or
    prompts would sit beside the old ones as if they were comparable."""
    models, sources = cfg.get("models") or {}, (cfg.get("dataset") or {}).get("source")
    for ref, path in (model_paths or {}).items():
        had = models.get(ref, (cfg.get("model_paths") or {}).get(ref))
        if had is None:
            raise ProtocolError(f"cannot resume {run_dir} with --model-path {ref}={path}: the run has no "
                                f"role {ref!r} (roles: {', '.join(models) or 'none'})")
        if str(had) not in (str(path), local_path(path)):  # as given, or as a run keeps a local folder
            raise ProtocolError(f"cannot resume {run_dir} with --model-path {ref}={path}: the run was prepared "
                                f"with {ref}={had}; a resumed run keeps its checkpoints (start a new run "
                                f"for other weights)")
    for ref, had in models.items():  # the environment's checkpoints are held to the same rule
        key = _env_key(ref)
        path = os.environ.get(key)
        if path and str(had) not in (path, local_path(path)) and ref not in (model_paths or {}):
            raise ProtocolError(f"cannot resume {run_dir} with {key}={path}: the run was prepared with "
                                f"{ref}={had}; a resumed run keeps its checkpoints (unset {key}, or start "
                                f"a new run for other weights)")
    for name, src in (dataset_sources or {}).items():
        resolved = (cfg.get("dataset") or {}).get("resolved")
        if name != resolved or str(src) != str(sources):
            raise ProtocolError(f"cannot resume {run_dir} with --data-source {name}={src}: the run's prompts "
                                f"were prepared from {resolved}={sources}; a resumed run keeps its prompts")


def _resume(run_dir: Path, experiment: str, profile: str | None, overrides: Any, smoke: bool | None,
            model_paths: dict[str, str] | None, dataset_sources: dict[str, str] | None,
            registry: Registry | None) -> Path:
    """Reuse a prepared run folder: the same experiment/profile/overrides/smoke, the same inputs, a host that
    can run it; its missing shape stand-ins rebuilt."""
    try:
        cfg = read_json(Path(run_dir) / RUN_JSON)
    except ValueError as exc:
        raise ProtocolError(f"cannot resume {run_dir}: {exc}") from None
    _check_resume_inputs(run_dir, cfg, model_paths, dataset_sources)
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


def _new_run_problems(p: Plan, rdir: Path, reg: Registry, model_paths: dict[str, str] | None,
                      dataset_sources: dict[str, str] | None) -> tuple[list[str], Any, Any, Any]:
    """Every check of a new run, in one list of problems; the checkpoints, prompts and data set facts it
    resolved on the way (None where a check stopped it)."""
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
    return problems, models, prompts, dinfo


def _create_run_folder(rdir: Path, run_id: str, p: Plan, models, model_paths: dict[str, str] | None, prompts,
                       dinfo) -> None:
    """run.json, env.json and prompts.jsonl, built beside the folder's final name and renamed in one step: a run
    folder is complete or absent."""
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


def prepare_run(experiment: str, profile: str | None = None, overrides: Any = None, smoke: bool | None = None,
                results_root: str | Path = "results", run_dir: str | Path | None = None,
                model_paths: dict[str, str] | None = None, dataset_sources: dict[str, str] | None = None,
                registry: Registry | None = None, own_brackets: bool = False) -> Path:
    """Create the run folder (run.json, env.json, prompts.jsonl), or reuse a prepared one (resume).

    Reusing checks that the folder was made for the same experiment/profile/overrides/smoke, so a resume
    can never silently mix two configurations in one run. A new run is checked in full first; its folder
    appears only when every check passed, and never reuses an existing folder.
    """
    if run_dir is not None:
        remove_stale_preparing(Path(run_dir).parent)  # what a preparation killed with -9 left
    if run_dir is not None and (Path(run_dir) / RUN_JSON).is_file():
        return _resume(run_dir, experiment, profile, overrides, smoke, model_paths, dataset_sources, registry)

    reg = registry or load_registry()
    p = plan(experiment, profile, overrides, smoke, registry=reg, own_brackets=own_brackets)
    run_id = Path(run_dir).name if run_dir is not None else new_run_id()
    rdir = Path(run_dir) if run_dir is not None else Path(results_root) / p.experiment.id / run_id
    remove_stale_preparing(rdir.parent)

    problems, models, prompts, dinfo = _new_run_problems(p, rdir, reg, model_paths, dataset_sources)
    if problems:
        raise ProtocolError(f"{p.experiment.id} cannot start ({len(problems)} problem(s)); nothing was created:\n"
                            + "\n".join(f"  - {q}" for q in problems))
    _create_run_folder(rdir, run_id, p, models, model_paths, prompts, dinfo)
    return rdir
