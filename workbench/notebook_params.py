"""The experiment notebook's parameters, checked before anything is prepared or run.

papermill injects every ``-p NAME VALUE`` it is given, known or not, and only warns ("Passed unknown
parameter") about a name the notebook does not have: ``-p gamm 4`` would run the default legs and leave
a complete-looking run that is not the one asked for. ``check(globals())``, the notebook's first step,
refuses that, and a value of the wrong kind (``-p run_legs false`` is the string "false", which is
true), naming every problem in one message; nothing is created.

    check(namespace) -> {name: value}    the parameters, normalised (a ParameterError otherwise)
"""

from __future__ import annotations

import difflib
import math
import types
from pathlib import Path
from typing import Any

__all__ = ["PARAMETERS", "ParameterError", "check"]

# name -> what it takes (the notebook's tagged `parameters` cell has exactly these names)
PARAMETERS: dict[str, str] = {
    "experiment": "an experiment id (workbench list)",
    "profile": "a profile name, or None for the experiment's default",
    "run_dir": "None (a new run under results_root), or an existing run folder (resumed; with run_legs=False, read)",
    "results_root": "the folder new runs go under",
    "overrides": "knob and workload overrides: a dict ({'gamma': 4}), or 'name=value ...' as `workbench run -p`",
    "smoke": "true, false or None (the profile's default)",
    "run_legs": "true or false",
    "stop_on_failure": "true or false",
    "allow_shared_host": "true or false (run beside another run on this host's GPUs)",
    "leg_timeout": "None, or seconds above 0",
    "figure_formats": "a list or a comma list of png, svg, pdf, html",
    "figure_width": "pixels, an integer above 0",
    "figure_height": "pixels, an integer above 0",
}
_BOOLS = ("run_legs", "stop_on_failure", "allow_shared_host")


class ParameterError(ValueError):
    """A notebook parameter that is unknown or has a value of the wrong kind; the message names each."""


def _user_names(namespace: dict[str, Any]) -> list[str]:
    """The names a parameters cell (or papermill's injected cell) defined: not IPython's own, no modules."""
    hidden: set[str] = set()
    ip = namespace.get("get_ipython")
    if callable(ip):
        try:
            hidden = set(ip().user_ns_hidden)
        except Exception:  # not inside IPython
            hidden = set()
    return [k for k, v in namespace.items()
            if not k.startswith("_") and k not in hidden and k not in ("In", "Out", "get_ipython", "exit", "quit")
            and not isinstance(v, (types.ModuleType, types.FunctionType, type))]


def _unknown(name: str) -> str:
    from workbench.knobs import KNOBS  # every override: engine knobs and workload (max_tokens, n, dtype, ...)

    knobs = set(KNOBS) | {"dataset", "draft", "model", "batches", "repeats", "prompt_len", "eager"}
    if name in knobs:
        return (f"{name}: not a parameter of this notebook; {name} is a knob, given in overrides "
                f"(-p overrides '{name}=VALUE', or -y 'overrides: {{{name}: VALUE}}')")
    close = difflib.get_close_matches(name, list(PARAMETERS), n=1, cutoff=0.75)
    if close:
        return f"{name}: not a parameter of this notebook; did you mean {close[0]}?"
    close = difflib.get_close_matches(name, sorted(knobs), n=1, cutoff=0.75)
    if close:
        return (f"{name}: not a parameter of this notebook; did you mean the knob {close[0]} "
                f"(-p overrides '{close[0]}=VALUE')?")
    return f"{name}: not a parameter of this notebook (parameters: {', '.join(PARAMETERS)})"


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f"takes true or false, got {value!r}")


def _overrides(value: Any) -> Any:
    if value is None or isinstance(value, dict):
        return value or {}
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            import yaml

            parsed = yaml.safe_load(text)
            if not isinstance(parsed, dict):
                raise ValueError(f"{value!r} is not a mapping")
            return parsed
        return text.split()  # 'gamma=4 max_tokens=8', as `workbench run -p` takes each
    raise ValueError(f"takes a dict or 'name=value ...', got {value!r}")


def _number(value: Any, name: str, integer: bool) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise ValueError(f"takes {PARAMETERS[name]}, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"takes {PARAMETERS[name]}, got {value!r}")
    return value


def _formats(value: Any) -> list[str]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
        raise ValueError(f"takes {PARAMETERS['figure_formats']}, got {value!r}")
    from workbench import export

    try:
        fmts, skipped = export.usable_formats(",".join(v.strip() for v in items))
    except export.BrowserError as exc:
        raise ValueError(str(exc)) from None
    if skipped:
        print(f"warning: {skipped}")
    return list(fmts)


def _run_dir(value: Any, run_legs: bool) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, Path)) or not str(value).strip():
        raise ValueError(f"takes {PARAMETERS['run_dir']}, got {value!r}")
    rdir = Path(value)
    if (rdir / "run.json").is_file():
        return str(value)
    what = "does not exist" if not rdir.exists() else "has no run.json"
    hint = ""
    if rdir.parent.is_dir():
        close = difflib.get_close_matches(rdir.name, [p.name for p in rdir.parent.iterdir() if p.is_dir()], n=1)
        if close:
            hint = f"; did you mean {rdir.parent / close[0]}?"
    use = ("a new run goes under results_root with run_dir=None" if run_legs
           else "run_legs=False reads the legs of an existing run")
    raise ValueError(f"{value} is not a run folder ({what}){hint} ({use})")


def _value(name: str, value: Any, run_legs: bool) -> Any:
    if name in _BOOLS:
        return _bool(value)
    if name == "smoke":
        return None if value is None else _bool(value)
    if name in ("experiment", "results_root"):
        if not isinstance(value, (str, Path)) or not str(value).strip():
            raise ValueError(f"takes {PARAMETERS[name]}, got {value!r}")
        return str(value)
    if name == "profile":
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ValueError(f"takes {PARAMETERS[name]}, got {value!r}")
        return value
    if name == "overrides":
        return _overrides(value)
    if name == "leg_timeout":
        return None if value is None else _number(value, name, integer=False)
    if name in ("figure_width", "figure_height"):
        return _number(value, name, integer=True)
    if name == "figure_formats":
        return _formats(value)
    if name == "run_dir":
        return _run_dir(value, run_legs)
    return value


def _plan_problems(experiment: str, overrides: Any) -> list[str]:
    """The experiment id and every override checked as `workbench run` checks them (name, range)."""
    from workbench.planning import parse_overrides
    from workbench.registry import RegistryError, load_registry

    try:
        exp = load_registry().experiment(experiment)
    except RegistryError as exc:
        return [f"experiment: {exc}"]
    try:
        parse_overrides(overrides, exp)
    except RegistryError as exc:
        return [f"overrides: {exc}"]
    return []


def check(namespace: dict[str, Any]) -> dict[str, Any]:
    """The notebook's parameters from ``namespace`` (its globals), each normalised; a ParameterError naming
    every unknown parameter and every bad value otherwise."""
    problems = [_unknown(k) for k in _user_names(namespace) if k not in PARAMETERS]
    missing = [k for k in PARAMETERS if k not in namespace]
    problems += [f"{k}: missing (the notebook's parameters cell defines it)" for k in missing]
    out: dict[str, Any] = {}
    try:
        run_legs = _bool(namespace.get("run_legs", True))
    except ValueError:
        run_legs = True  # reported below
    for name in PARAMETERS:
        if name in missing:
            continue
        try:
            out[name] = _value(name, namespace[name], run_legs)
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
    if "experiment" in out and "overrides" in out:
        problems += _plan_problems(out["experiment"], out["overrides"])
    if problems:
        raise ParameterError(f"{len(problems)} bad notebook parameter(s); nothing was prepared or run:\n"
                             + "\n".join(f"  - {p}" for p in problems))
    return out
