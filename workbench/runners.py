"""How one leg runs: its configuration (``leg.json``), its command, and the runner table.

How a leg runs is one entry of ``RUNNERS`` (name -> ``Runner``: its ``leg.json``, its command,
what the run does once every leg ran); ``runner_for`` is the one place a leg's runner is picked.
``leg`` (``python -m workbench.leg``) and ``score`` (``python -m workbench.score``) are the legs of
an ordinary experiment. An experiment whose ``runner`` is ``ladder`` (the cost ladder, E16) goes
through the same folder, lock, resume and failure records; only its legs differ: each is one
engine run by ``python -m workbench.ladder_engine`` (no prompt set; the rows are
``legs/<leg>/steps.jsonl`` and ``walls.jsonl``, written whole at the run's top once the legs ran).
An experiment whose ``runner`` is ``serve`` (E17) runs each leg behind vLLM's OpenAI server,
driven by vLLM's benchmark client (``python -m workbench.serve_leg``, the same ``leg.json``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from workbench.planning import PlannedLeg
from workbench.runfolder import LEG_JSON, LEGS, PROMPTS, RECORDS

__all__ = ["ProtocolError", "REPO_ROOT", "leg_tp", "leg_knobs", "leg_config", "ladder_leg_config", "Runner",
           "RUNNERS", "runner_for", "experiment_runner", "leg_command"]

REPO_ROOT = Path(__file__).resolve().parents[1]


class ProtocolError(RuntimeError):
    """The plan or the run folder is inconsistent; the message names the experiment/leg/file."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def leg_tp(knobs: dict[str, Any]) -> int:
    """A planned leg's tensor-parallel size (1 in a run planned before the knob existed)."""
    return int(knobs.get("tensor_parallel_size") or 1)



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
        serve_requests=str(k.get("serve_requests") or "fresh"),
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


def experiment_runner(name: str | None) -> Runner:
    """The runner of an experiment's engine legs (what decides its prompt set and its devices)."""
    return runner_for(None, name)


def leg_command(leg: PlannedLeg, cfg: dict[str, Any], run_dir: Path, python: str = sys.executable,
                runner: list[str] | None = None) -> list[str]:
    """The leg's command (its runner's, ``RUNNERS``); `runner` replaces `python -m <module>` (tests use a
    fake leg there). An engine leg reads legs/<leg>/leg.json; a score leg takes its options on the command line.
    """
    r = runner_for(leg, cfg.get("runner"))
    return [*(runner or [python, "-m", r.module]), *r.args(leg, cfg, run_dir)]

