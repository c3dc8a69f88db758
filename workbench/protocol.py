"""The measurement protocol, one import for notebooks and scripts; each phase has its own module.

- planning (``workbench.planning``, pure): ``parse_overrides``, ``plan`` -> ``Plan`` of bracketed legs;
- execution (``workbench.execution``): ``prepare_run`` (checks, then the run folder: ``workbench.preparing``),
  ``execute`` (legs as processes, lock, resume, failure records; ``executor="ray"``: bracket groups as
  Ray tasks, ``workbench.ray_executor``);
- the run-folder contract (``workbench.runfolder``): file names, ``leg_status``, atomic writes;
- analysis (``workbench.analyses``): ``analyze_run``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench.execution import (REPO_ROOT, ProtocolError, RunInterrupted, execute, leg_command, leg_config,
                                 prepare_run, resolve_models)
from workbench.planning import ENGINE_SHAPE, SPEC_ONLY, Plan, PlannedLeg, parse_overrides, plan, template_fields
from workbench.runfolder import ENV_JSON, PROMPTS, RUN_JSON, STATE_JSON, leg_status

__all__ = [
    "ProtocolError", "RunInterrupted", "require_run", "require_host", "PlannedLeg", "Plan", "parse_overrides", "plan", "prepare_run", "execute",
    "leg_status", "leg_command", "leg_config", "resolve_models", "analyze_run", "REPO_ROOT",
    "ENGINE_SHAPE", "SPEC_ONLY", "template_fields", "RUN_JSON", "ENV_JSON", "STATE_JSON", "PROMPTS",
]


def analyze_run(run_dir: str | Path, figures: bool = True) -> dict[str, Any]:
    """Tables and key numbers of a run (``workbench.analyses.analyze_run``)."""
    from workbench.analyses import analyze_run as analyze
    return analyze(run_dir, figures)


def require_run(run_dir: str | Path | None, why: str = "") -> Path:
    """``run_dir`` if it is a prepared run folder; else a ProtocolError naming it (nothing is created).

    For callers that only read a run (the notebook with ``run_legs=False``): a mistyped folder must
    be an error, not a fresh empty run prepared there.
    """
    if run_dir is None:
        raise ProtocolError(f"no run_dir given{why}")
    rdir = Path(run_dir)
    if not (rdir / RUN_JSON).is_file():
        what = "does not exist" if not rdir.exists() else f"has no {RUN_JSON}"
        raise ProtocolError(f"{rdir} is not a run folder ({what}){why}")
    return rdir


def require_host(experiment: str, profile: str | None = None, overrides: Any = None, smoke: bool | None = None,
                 run_dir: str | Path | None = None, allow_shared_host: bool = False, executor: str = "local") -> None:
    """A ProtocolError when the run asked for (``run_dir``: resumed) would share a GPU with another run of
    this host (``workbench.hostruns.decide``), unless ``allow_shared_host``; nothing is created. Where the
    run may go ahead, ``execute`` warns and records it when the legs start."""
    from workbench import hostruns, placement
    from workbench.runfolder import read_json

    if allow_shared_host:
        return
    found = hostruns.others(run_dir)
    if not found:
        return
    if run_dir is not None and (Path(run_dir) / RUN_JSON).is_file():
        try:
            device = (read_json(Path(run_dir) / RUN_JSON) or {}).get("device")
        except (OSError, ValueError, AttributeError):
            return  # a damaged run folder: its own check names it
    else:
        try:
            device = plan(experiment, profile, overrides, smoke).profile.device
        except Exception:  # bad input: prepare_run names every problem in one message
            return
    why = hostruns.decide(found, device, placement.capture(executor), allow=False)[0]
    if why:
        raise ProtocolError(f"{experiment} not started: {why}")
