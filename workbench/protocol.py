"""The measurement protocol: plan bracketed legs, create the run folder, run legs, resume.

A leg is one process with one engine (`python -m workbench.leg`, or
`python -m workbench.score` for a scoring leg), so no state leaks between
configurations. Spec legs are bracketed by vanilla legs of the same engine
shape (vanilla, spec…, vanilla, spec…, vanilla): machine drift then shows up in
the vanilla legs and is divided out of each spec leg's speedup.

Public API:
    parse_overrides(["gamma=4", "relax_logtau=0.288,0.693"]) -> dict
    plan(experiment, profile=None, overrides=None, smoke=None, ...) -> Plan
    prepare_run(experiment, profile, overrides, smoke, results_root, run_dir=None, ...) -> Path
    execute(run_dir, stop_on_failure=False, leg_timeout=None, ...) -> dict[leg, status]
    run_experiment(...) -> Path                     (prepare_run + execute)
    leg_status(leg_dir) -> "complete" | "failed" | "incomplete" | "pending"
    analyze_run(run_dir) -> dict                    (key numbers -> tables/summary.json)
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable

from workbench.registry import (KNOBS, Experiment, Profile, Registry, RegistryError, load_registry,
                                parse_knob_text, split_role, template_fields, check_knob)

__all__ = [
    "ProtocolError", "PlannedLeg", "Plan", "parse_overrides", "plan", "prepare_run", "execute",
    "run_experiment", "leg_status", "leg_command", "resolve_models", "analyze_run", "REPO_ROOT",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
RUN_JSON, ENV_JSON, STATE_JSON, PROMPTS = "run.json", "env.json", "protocol.json", "prompts.jsonl"
# Knobs that shape the engine: a spec leg is compared only with vanilla legs that share them.
ENGINE_SHAPE = ("max_num_seqs", "max_tokens", "max_model_len", "n", "dtype", "gpu_memory_utilization")
SPEC_ONLY = ("gamma", "relax_logtau", "blind_mm", "draft_cudagraph")


class ProtocolError(RuntimeError):
    """The plan or the run folder is inconsistent; the message names the experiment/leg/file."""


# --- planning ----------------------------------------------------------------------------------

@dataclass
class PlannedLeg:
    index: int
    name: str
    kind: str                       # vanilla | spec | score
    tier: str                       # vanilla | strict | relaxed | score
    model: str                      # role reference ("target", "target@8b-instruct")
    draft: str | None = None
    reference: str | None = None    # score legs: the vanilla leg whose output is scored
    template: str | None = None
    knobs: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PlannedLeg":
        return cls(**{k: d.get(k) for k in ("index", "name", "kind", "tier", "model", "draft", "reference",
                                             "template")}, knobs=dict(d.get("knobs") or {}),
                   notes=dict(d.get("notes") or {}))

    def describe(self) -> str:
        k = self.knobs
        if self.kind == "vanilla":
            return f"vanilla {self.model}"
        if self.kind == "score":
            return f"score {self.model} on {self.reference}"
        extra = f" x={k['relax_logtau']}" if self.tier == "relaxed" else ""
        extra += " blind-mm" if k.get("blind_mm") else ""
        return f"{self.tier} {self.model}<-{self.draft} g={k.get('gamma')}{extra}"


@dataclass
class Plan:
    experiment: Experiment
    profile: Profile
    overrides: dict[str, Any]
    smoke: bool
    datasets: list[str]             # candidates in order; the first one that loads is used
    legs: list[PlannedLeg]

    @property
    def n(self) -> int:
        return max(int(l.knobs["n"]) for l in self.legs)

    def table(self) -> list[dict[str, Any]]:
        rows = []
        for l in self.legs:
            rows.append({"#": l.index, "leg": l.name, "kind": l.kind, "tier": l.tier, "model": l.model,
                         "draft": l.draft or "", "gamma": l.knobs.get("gamma"),
                         "relax_logtau": l.knobs.get("relax_logtau"), "blind_mm": l.knobs.get("blind_mm"),
                         "draft_cudagraph": l.knobs.get("draft_cudagraph"),
                         "max_num_seqs": l.knobs.get("max_num_seqs"), "max_tokens": l.knobs.get("max_tokens"),
                         "n": l.knobs.get("n"), "notes": "; ".join(f"{k}: {v}" for k, v in l.notes.items())})
        return rows

    def config(self) -> dict[str, Any]:
        return {"experiment": self.experiment.id, "title": self.experiment.title,
                "question": self.experiment.question, "profile": self.profile.name,
                "device": self.profile.device, "smoke": self.smoke, "overrides": self.overrides,
                "dataset_candidates": self.datasets, "analyses": self.experiment.analyses,
                "result_prefix": self.experiment.result_prefix,
                "definition": self.experiment.to_dict(),
                "legs": [l.to_dict() for l in self.legs]}


def parse_overrides(items: Iterable[str] | dict[str, Any] | None, experiment: Experiment | None = None
                    ) -> dict[str, Any]:
    """`["gamma=4", "relax_logtau=0.288,0.693"]` -> {"gamma": 4, "relax_logtau": [0.288, 0.693]}.

    A comma list is allowed only for a parameter the experiment sweeps (it replaces the sweep).
    """
    if items is None:
        return {}
    pairs: list[tuple[str, Any]] = []
    if isinstance(items, dict):
        pairs = list(items.items())
    else:
        for item in items:
            if "=" not in item:
                raise RegistryError(f"bad override {item!r}: expected name=value (e.g. gamma=4)")
            k, v = item.split("=", 1)
            pairs.append((k.strip(), v))
    out: dict[str, Any] = {}
    swept = set(experiment.sweep) if experiment else set()
    for key, value in pairs:
        where = f"override {key}={value}"
        if key in out:
            raise RegistryError(f"{where}: {key!r} given twice")
        if key == "dataset":
            from workbench.registry import DATASETS
            if value not in DATASETS:
                raise RegistryError(f"{where}: unknown dataset {value!r}; datasets: {', '.join(DATASETS)}")
            out[key] = value
            continue
        if key in ("draft", "model"):
            vals = value.split(",") if isinstance(value, str) else (value if isinstance(value, list) else [value])
            from workbench.registry import ROLES
            for v in vals:
                if split_role(v)[0] not in ROLES:
                    raise RegistryError(f"{where}: unknown role {v!r}; roles: {', '.join(ROLES)}")
            out[key] = vals if len(vals) > 1 else vals[0]
            continue
        if key not in KNOBS:
            raise RegistryError(f"{where}: unknown parameter {key!r}; known: dataset, draft, model, "
                                f"{', '.join(KNOBS)}")
        if isinstance(value, str):
            parts = [p for p in value.split(",")]
            vals = [parse_knob_text(key, p, where) for p in parts]
        elif isinstance(value, list):
            vals = [check_knob(key, v, where) for v in value]
        else:
            vals = [check_knob(key, value, where)]
        if len(vals) > 1 and experiment is not None and key not in swept:
            raise RegistryError(f"{where}: a list of values needs a swept parameter; "
                                f"{experiment.id} sweeps {sorted(swept) or 'nothing'}")
        out[key] = vals if len(vals) > 1 else vals[0]
    return out


def _render(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def plan(experiment: str | Experiment, profile: str | None = None, overrides: Any = None,
         smoke: bool | None = None, registry: Registry | None = None) -> Plan:
    """Expand an experiment into its ordered, bracketed legs (no side effects)."""
    reg = registry or load_registry()
    exp = experiment if isinstance(experiment, Experiment) else reg.experiment(experiment)
    if profile is None:
        profile = exp.profiles[0] if exp.profiles else "8b-thinking"
    prof = reg.profile(profile)
    if exp.profiles and not prof.stand_in and prof.name not in exp.profiles:
        raise RegistryError(f"{exp.id} runs under profile(s) {', '.join(exp.profiles)} (or a stand-in such as "
                            f"tiny), not {prof.name!r}")
    if smoke is None:
        smoke = prof.default_smoke
    ov = parse_overrides(overrides, exp)

    base = {k: v for k, v in reg.defaults.items() if k != "dataset"}
    base.update(exp.defaults)
    base.update(prof.engine)
    if smoke:
        base.update(reg.smoke_defaults)
        base.update(exp.smoke.knobs)
    base.setdefault("dtype", "auto")

    sweep = dict(exp.sweep)
    if smoke:
        sweep.update(exp.smoke.sweep)
    for key, val in ov.items():
        if key in sweep:
            sweep[key] = val if isinstance(val, list) else [val]
    plain_ov = {k: v for k, v in ov.items() if k not in sweep and k != "dataset"}

    templates = exp.legs
    if smoke and exp.smoke.legs:
        templates = [t for t in exp.legs if t.name in exp.smoke.legs]

    where = f"experiment {exp.id}"
    expanded: list[PlannedLeg] = []
    seen: set = set()
    keys = list(sweep)
    for combo in itertools.product(*(sweep[k] for k in keys)) if keys else [()]:
        values = dict(zip(keys, combo))
        for t in templates:
            used = {k: values[k] for k in template_fields(t.name) if k in values}
            ident = (t.name, tuple(sorted((k, repr(v)) for k, v in used.items())))
            if ident in seen:
                continue
            seen.add(ident)
            knobs = dict(base)
            knobs.update(t.knobs)
            model, draft = t.model, t.draft
            for k, v in list(used.items()) + list(plain_ov.items()):
                if k == "model":
                    model = v
                elif k == "draft":
                    draft = v if t.kind == "spec" else draft
                else:
                    knobs[k] = v
            lw = f"{where}, leg {t.name}"
            if t.kind == "spec":
                if t.tier == "strict":
                    knobs["relax_logtau"] = 0.0
                elif knobs.get("relax_logtau", 0.0) <= 0:
                    raise RegistryError(f"{lw}: a relaxed leg needs relax_logtau > 0 (set it on the leg, "
                                        f"sweep it, or pass -p relax_logtau=X)")
            else:
                for k in SPEC_ONLY:
                    knobs[k] = None
                knobs["trace"] = None
            fmt = dict(knobs)
            fmt.update(model=model, draft=draft)
            name = t.name.format(**{k: _render(v) for k, v in fmt.items()})
            leg = PlannedLeg(index=-1, name=name, kind=t.kind,
                             tier=t.tier if t.kind == "spec" else t.kind,
                             model=model, draft=draft if t.kind == "spec" else None,
                             reference=t.reference, template=t.name, knobs=knobs)
            expanded.append(leg)

    legs = _bracket(expanded, exp.bracket_every if not (smoke and exp.smoke.bracket_every is not True)
                    else exp.smoke.bracket_every)
    for i, leg in enumerate(legs):
        leg.index = i
        if prof.device == "cpu" and leg.kind == "spec":
            leg.notes["draft_cudagraph"] = (f"not applicable on CPU (requested: "
                                            f"{_render(leg.knobs['draft_cudagraph'])})")
    names = [l.name for l in legs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise RegistryError(f"{where}: planned leg names repeat: {dup}")

    if "dataset" in ov:
        datasets = [ov["dataset"]]
    elif prof.tiny:
        datasets = list(exp.smoke.datasets or ["tiny"])
    else:
        datasets = [exp.dataset]
    return Plan(experiment=exp, profile=prof, overrides=ov, smoke=bool(smoke), datasets=datasets, legs=legs)


def _shape(leg: PlannedLeg) -> tuple:
    return (leg.model,) + tuple(repr(leg.knobs.get(k)) for k in ENGINE_SHAPE)


def _vanilla_like(leg: PlannedLeg, number: int) -> PlannedLeg:
    knobs = dict(leg.knobs)
    for k in SPEC_ONLY:
        knobs[k] = None
    knobs["trace"] = None
    return PlannedLeg(index=-1, name=f"vanilla_{number}", kind="vanilla", tier="vanilla", model=leg.model,
                      knobs=knobs)


def _bracket(expanded: list[PlannedLeg], every: int | None) -> list[PlannedLeg]:
    """Insert vanilla legs: V spec.. V spec.. V, at most `every` spec legs between two vanilla legs.

    A spec leg's two neighbouring vanilla legs always share its engine shape (target, concurrency,
    max_tokens, ...), so the paired ratio compares like with like. Score legs go last because they read
    a vanilla leg's output.
    """
    spec = [l for l in expanded if l.kind == "spec"]
    score = [l for l in expanded if l.kind == "score"]
    explicit_vanilla = [l for l in expanded if l.kind == "vanilla"]
    if every is None:
        out = [l for l in expanded if l.kind != "score"]
    else:
        out = list(explicit_vanilla)
        n_van = 0
        prev_shape = None
        chunk: list[PlannedLeg] = []

        def flush():
            nonlocal n_van
            if chunk:
                out.extend(chunk)
                n_van += 1
                out.append(_vanilla_like(chunk[0], n_van))
                chunk.clear()

        for leg in spec:
            shape = _shape(leg)
            if shape != prev_shape:
                flush()
                n_van += 1
                out.append(_vanilla_like(leg, n_van))
                prev_shape = shape
            elif len(chunk) >= every:
                flush()
            chunk.append(leg)
        flush()
        if not spec and score:
            # A scoring-only plan still needs the reference output.
            n_van += 1
            out.append(_vanilla_like(score[0], n_van))
            out[-1].model = score[0].reference or "target"
    for s in score:
        ref = next((l for l in out if l.kind == "vanilla" and l.model == s.reference), None)
        if ref is None:
            raise RegistryError(f"score leg {s.name}: no vanilla leg of {s.reference!r} to score against")
        s.reference = ref.name
        s.tier = "score"
        out.append(s)
    return out


# --- run folder --------------------------------------------------------------------------------

def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, default=str)
        fh.write("\n")
    os.replace(tmp, path)


def _read_json(path: Path) -> Any:
    with path.open(encoding="utf-8") as fh:
        return json.load(fh)


def _new_run_id() -> str:
    try:
        from workbench.results import new_run_id
        return new_run_id()
    except ImportError:  # results.py belongs to another module owner; keep a compatible fallback
        import secrets
        return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(2)


def _env_key(ref: str) -> str:
    return "WORKBENCH_MODEL_" + ref.upper().replace("-", "_").replace("@", "_")


def resolve_models(p: Plan, model_paths: dict[str, str] | None = None,
                   registry: Registry | None = None) -> dict[str, str]:
    """Role reference -> checkpoint (folder or hub id). Order: --model-path, environment, profile."""
    reg = registry or load_registry()
    model_paths = dict(model_paths or {})
    refs: list[str] = []
    for l in p.legs:
        for r in (l.model, l.draft):
            if r and r not in refs:
                refs.append(r)
    unknown = sorted(set(model_paths) - set(refs) - {split_role(r)[0] for r in refs})
    if unknown:
        raise RegistryError(f"--model-path: role(s) {unknown} are not used by {p.experiment.id}; "
                            f"used: {', '.join(refs)}")
    out: dict[str, str] = {}
    tiny_dirs = None
    for ref in refs:
        role, other = split_role(ref)
        explicit = model_paths.get(ref) or os.environ.get(_env_key(ref))
        if not explicit and ref != role and p.profile.stand_in:
            # under a stand-in profile every profile's role is the same model, so a plain role override applies
            explicit = model_paths.get(role) or os.environ.get(_env_key(role))
        if explicit:
            out[ref] = str(explicit)
            continue
        prof = p.profile if (other is None or p.profile.stand_in) else reg.profile(other)
        if prof.tiny:
            if tiny_dirs is None:
                from workbench.tiny import ensure_tiny_models
                tiny_dirs = ensure_tiny_models()
            out[ref] = str(tiny_dirs[prof.roles[role]])
        else:
            out[ref] = prof.roles[role]
    return out


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


def prepare_run(experiment: str, profile: str | None = None, overrides: Any = None, smoke: bool | None = None,
                results_root: str | Path = "results", run_dir: str | Path | None = None,
                model_paths: dict[str, str] | None = None, dataset_sources: dict[str, str] | None = None,
                registry: Registry | None = None) -> Path:
    """Create the run folder (run.json, env.json, prompts.jsonl), or reuse an existing one.

    Reusing checks that the folder was made for the same experiment/profile/overrides/smoke, so a resume
    can never silently mix two configurations in one run.
    """
    if run_dir is not None and (Path(run_dir) / RUN_JSON).is_file():
        cfg = _read_json(Path(run_dir) / RUN_JSON)
        asked = {"experiment": experiment.upper() if isinstance(experiment, str) else experiment,
                 "profile": profile, "smoke": smoke}
        if overrides:
            asked["overrides"] = parse_overrides(overrides, load_registry().experiment(experiment)
                                                 if registry is None else registry.experiment(experiment))
        clash = {k: (v, cfg.get(k)) for k, v in asked.items() if v is not None and cfg.get(k) != v}
        if clash:
            raise ProtocolError(f"{run_dir} was created with a different configuration: "
                                + ", ".join(f"{k}: run.json has {b!r}, asked {a!r}" for k, (a, b) in clash.items()))
        return Path(run_dir)

    reg = registry or load_registry()
    p = plan(experiment, profile, overrides, smoke, registry=reg)
    run_id = Path(run_dir).name if run_dir is not None else _new_run_id()
    rdir = Path(run_dir) if run_dir is not None else Path(results_root) / p.experiment.id / run_id
    rdir.mkdir(parents=True, exist_ok=True)
    models = resolve_models(p, model_paths, reg)
    prompts, dinfo = _load_prompts(p, dataset_sources)
    from workbench.prompts import save_prompts
    save_prompts(prompts, rdir / PROMPTS)
    from workbench import envcapture
    _write_json_atomic(rdir / ENV_JSON, envcapture.capture())
    cfg = p.config()
    cfg.update(run_id=run_id, created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
               models=models, model_paths=dict(model_paths or {}), dataset=dinfo, prompts_file=PROMPTS)
    # run.json last: its presence marks a fully prepared folder
    _write_json_atomic(rdir / RUN_JSON, cfg)
    return rdir


# --- executing legs ----------------------------------------------------------------------------

def leg_status(folder: Path) -> str:
    folder = Path(folder)
    if not folder.is_dir():
        return "pending"
    if (folder / "failure.json").is_file():
        return "failed"
    summ = folder / "summary.json"
    if summ.is_file() and (folder / "records.jsonl").is_file():
        try:
            ok = _read_json(summ).get("status") == "complete"
        except (ValueError, AttributeError):
            ok = False
        return "complete" if ok else "incomplete"
    return "incomplete"


def leg_command(leg: PlannedLeg, cfg: dict[str, Any], run_dir: Path, python: str = sys.executable,
                runner: list[str] | None = None) -> list[str]:
    """The leg's command line (docs/architecture.md "Leg command line"); `runner` replaces
    `python -m workbench.leg|score` (protocol-mechanics tests use a fake leg there)."""
    k = leg.knobs
    out = run_dir / "legs" / leg.name
    prompts = run_dir / cfg.get("prompts_file", PROMPTS)
    models = cfg["models"]
    ident = ["--experiment", cfg["experiment"], "--leg", leg.name, "--run-id", cfg["run_id"]]
    dtype = [] if k.get("dtype") in (None, "auto") else ["--dtype", str(k["dtype"])]
    if leg.kind == "score":
        ref = run_dir / "legs" / leg.reference / "records.jsonl"
        return [*(runner or [python, "-m", "workbench.score"]), "--model", models[leg.model], "--reference", str(ref),
                "--prompts", str(prompts), "--max-model-len", str(k["max_model_len"]), *dtype, *ident,
                "--out", str(out)]
    cmd = [*(runner or [python, "-m", "workbench.leg"]), "--target", models[leg.model]]
    if leg.kind == "spec":
        cmd += ["--draft", models[leg.draft], "--gamma", str(k["gamma"])]
    cmd += ["--prompts", str(prompts), "--n", str(k["n"]), "--max-tokens", str(k["max_tokens"]),
            "--max-model-len", str(k["max_model_len"]), "--max-num-seqs", str(k["max_num_seqs"]), *dtype]
    if cfg.get("device") == "gpu" and k.get("gpu_memory_utilization") is not None:
        # on CPU the leg picks its own small host-memory share for the KV cache
        cmd += ["--gpu-memory-utilization", repr(float(k["gpu_memory_utilization"]))]
    if leg.kind == "spec":
        if k.get("relax_logtau"):
            cmd += ["--relax-logtau", repr(float(k["relax_logtau"]))]
        if k.get("blind_mm"):
            cmd += ["--blind-mm"]
        if k.get("draft_cudagraph") is False:
            cmd += ["--no-draft-cudagraph"]
        cmd += ["--trace"] if k.get("trace") else ["--no-trace"]
    return cmd + ident + ["--out", str(out)]


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


def _archive_attempt(run_dir: Path, folder: Path) -> None:
    """Move an unfinished/failed leg folder aside so the rerun starts clean but the evidence stays."""
    attempts = run_dir / "attempts"
    attempts.mkdir(exist_ok=True)
    k = 1
    while (attempts / f"{folder.name}.{k}").exists():
        k += 1
    shutil.move(str(folder), str(attempts / f"{folder.name}.{k}"))


def _run_one(cmd: list[str], folder: Path, timeout: float | None, env: dict[str, str]) -> tuple[int | None, str]:
    log = folder / "leg.log"
    with log.open("wb") as fh:
        fh.write(("$ " + " ".join(cmd) + "\n").encode())
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT), env=env,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout), ""
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return None, f"leg timed out after {timeout:g} s"
        except BaseException:
            _kill_group(proc)
            raise


def _kill_group(proc: subprocess.Popen) -> None:
    # vLLM spawns engine-core workers; the whole session goes, not only the leg's main process.
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
        os.replace(folder / "summary.json", folder / "summary.rejected.json")
    err = why or (f"leg process exited with code {rc} without writing summary.json" if rc
                  else "leg process exited 0 but left no complete summary.json + records.jsonl")
    _write_json_atomic(folder / "failure.json", {
        "status": "failed", "error": err, "returncode": rc, "leg": leg.name, "mode": leg.kind,
        "tier": leg.tier, "gamma": leg.knobs.get("gamma"), "written_by": "workbench.protocol",
        "stderr_tail": _tail(folder / "leg.log")})
    return "failed"


def execute(run_dir: str | Path, stop_on_failure: bool = False, leg_timeout: float | None = None,
            python: str = sys.executable, log: Callable[[str], None] | None = None,
            only: Iterable[str] | None = None, runner: list[str] | None = None) -> dict[str, str]:
    """Run every planned leg that is not complete yet; returns {leg name: status}.

    Finished legs (summary.json with status complete) are skipped, so calling this again resumes.
    A failed leg keeps its failure.json (written by the leg, or here from its exit code and log tail);
    the run continues unless `stop_on_failure`.
    """
    rdir = Path(run_dir)
    if not (rdir / RUN_JSON).is_file():
        raise ProtocolError(f"{rdir} is not a prepared run folder ({RUN_JSON} missing)")
    cfg = _read_json(rdir / RUN_JSON)
    legs = [PlannedLeg.from_dict(d) for d in cfg["legs"]]
    wanted = set(only) if only is not None else None
    if wanted is not None:
        unknown = sorted(wanted - {l.name for l in legs})
        if unknown:
            raise ProtocolError(f"unknown leg(s) {unknown} in {rdir}")
    emit = log or (lambda s: print(s, flush=True))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    (rdir / "legs").mkdir(exist_ok=True)
    statuses = {l.name: leg_status(rdir / "legs" / l.name) for l in legs}
    todo = [l for l in legs if statuses[l.name] != "complete" and (wanted is None or l.name in wanted)]
    state = {"state": "running", "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "legs": statuses}
    _write_json_atomic(rdir / STATE_JSON, state)
    emit(f"{cfg['experiment']} {cfg['run_id']}: {len(legs)} legs, {len(legs) - len(todo)} already complete, "
         f"{len(todo)} to run")
    t_run = time.monotonic()
    durations: list[float] = []
    stopped = False
    for i, leg in enumerate(todo):
        folder = rdir / "legs" / leg.name
        if folder.exists():
            _archive_attempt(rdir, folder)
        folder.mkdir(parents=True)
        cmd = leg_command(leg, cfg, rdir, python, runner)
        t0 = time.monotonic()
        rc, why = _run_one(cmd, folder, leg_timeout, env)
        dt = time.monotonic() - t0
        durations.append(dt)
        status = _finalise(folder, leg, rc, why)
        statuses[leg.name] = status
        _write_json_atomic(rdir / STATE_JSON, dict(state, legs=statuses))
        left = len(todo) - i - 1
        eta = (sum(durations) / len(durations)) * left
        msg = (f"[{leg.index + 1}/{len(legs)}] {leg.name:<24} {leg.describe():<40} {status:<8} {dt:6.1f} s"
               f"  elapsed {_fmt_s(time.monotonic() - t_run)}  ETA {_fmt_s(eta) if left else '-'}")
        if status == "failed":
            err = _read_json(folder / "failure.json").get("error", "")
            msg += f"\n      failure: {str(err).strip().splitlines()[-1] if str(err).strip() else '?'}" \
                   f" (see {folder / 'failure.json'})"
        emit(msg)
        if status == "failed" and stop_on_failure:
            stopped = True
            break
    n_failed = sum(1 for s in statuses.values() if s == "failed")
    final = "stopped" if stopped else ("finished_with_failures" if n_failed else
                                       ("finished" if all(s == "complete" for s in statuses.values())
                                        else "partial"))
    _write_json_atomic(rdir / STATE_JSON, dict(state, state=final, legs=statuses,
                                               finished=datetime.now(timezone.utc).isoformat(timespec="seconds")))
    emit(f"{cfg['experiment']} {cfg['run_id']}: {final} in {_fmt_s(time.monotonic() - t_run)} "
         f"({sum(s == 'complete' for s in statuses.values())}/{len(legs)} legs complete)")
    return statuses


def run_experiment(experiment: str, profile: str | None = None, overrides: Any = None,
                   smoke: bool | None = None, results_root: str | Path = "results",
                   resume: str | Path | None = None, stop_on_failure: bool = False,
                   model_paths: dict[str, str] | None = None, dataset_sources: dict[str, str] | None = None,
                   leg_timeout: float | None = None) -> Path:
    rdir = prepare_run(experiment, profile, overrides, smoke, results_root, run_dir=resume,
                       model_paths=model_paths, dataset_sources=dataset_sources)
    execute(rdir, stop_on_failure=stop_on_failure, leg_timeout=leg_timeout)
    return rdir


# --- analysis ----------------------------------------------------------------------------------

def analyze_run(run_dir: str | Path, figures: bool = True) -> dict[str, Any]:
    """Tables and key numbers of a run (``workbench.analyses.analyze_run``)."""
    from workbench.analyses import analyze_run as analyze
    return analyze(run_dir, figures)
