"""The one prompt schema of the workbench and its JSONL (de)serialisation.

A prompt file holds one JSON object per line:

    {"pid": "tiny-001", "text": "...", "images": ["img/a.png"], "dataset": "tiny", "meta": {...}}

Relative image paths resolve against the folder of the prompt file, so a
prompt set can be moved or copied as one folder.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = [
    "Prompt",
    "PromptError",
    "load_prompts",
    "save_prompts",
    "select_prompts",
    "validate_prompt",
    "prompts_to_frame",
]

_FIELDS = ("pid", "text", "images", "dataset", "meta")


class PromptError(ValueError):
    """A prompt file or prompt is malformed, or refers to something missing."""


@dataclass
class Prompt:
    pid: str
    text: str
    images: list[str] = field(default_factory=list)
    dataset: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_images(self) -> int:
        return len(self.images)

    def to_dict(self, relative_to: str | os.PathLike | None = None) -> dict[str, Any]:
        """JSON-ready dict; image paths inside `relative_to` are written relative to it."""
        images = list(self.images)
        if relative_to is not None:
            base = Path(relative_to).resolve()
            images = [_relative_if_inside(Path(p), base) for p in images]
        return {"pid": self.pid, "text": self.text, "images": images,
                "dataset": self.dataset, "meta": self.meta}

    @classmethod
    def from_dict(cls, obj: Any, base_dir: str | os.PathLike | None = None,
                  where: str = "prompt") -> "Prompt":
        if not isinstance(obj, dict):
            raise PromptError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - set(_FIELDS))
        if unknown:
            raise PromptError(f"{where}: unknown field(s) {unknown}; allowed: {list(_FIELDS)}")
        for key in ("pid", "text"):
            if key not in obj:
                raise PromptError(f"{where}: missing required field {key!r}")
        pid = obj["pid"]
        if not isinstance(pid, str) or not pid:
            raise PromptError(f"{where}: 'pid' must be a non-empty string, got {pid!r}")
        if not isinstance(obj["text"], str):
            raise PromptError(f"{where} (pid {pid!r}): 'text' must be a string")
        images = obj.get("images", [])
        if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
            raise PromptError(f"{where} (pid {pid!r}): 'images' must be a list of path strings")
        meta = obj.get("meta", {})
        if not isinstance(meta, dict):
            raise PromptError(f"{where} (pid {pid!r}): 'meta' must be an object")
        dataset = obj.get("dataset", "")
        if not isinstance(dataset, str):
            raise PromptError(f"{where} (pid {pid!r}): 'dataset' must be a string")
        if base_dir is not None:
            base = Path(base_dir)
            images = [str(p if Path(p).is_absolute() else (base / p)) for p in images]
        return cls(pid=pid, text=obj["text"], images=list(images), dataset=dataset, meta=dict(meta))


def _relative_if_inside(path: Path, base: Path) -> str:
    resolved = path.resolve()
    try:
        return resolved.relative_to(base).as_posix()
    except ValueError:
        return str(resolved)


def validate_prompt(prompt: Prompt, check_readable: bool = True) -> None:
    """Raise PromptError naming the pid and path when an image is missing or unreadable."""
    for path in prompt.images:
        p = Path(path)
        if not p.is_file():
            raise PromptError(f"prompt {prompt.pid!r}: image file not found: {path}")
        if check_readable:
            _check_image_readable(prompt.pid, p)


def _check_image_readable(pid: str, path: Path) -> None:
    # Imported here so that reading prompt text never needs Pillow.
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im.verify()
    except Image.DecompressionBombError as exc:
        raise PromptError(f"prompt {pid!r}: image {path} is too large to decode ({exc})") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise PromptError(f"prompt {pid!r}: image is not a readable image file: {path} ({exc})") from exc


def select_prompts(prompts: Sequence[Prompt], pids: Iterable[str] | str | None = None,
                   n: int | None = None, source: str = "prompt set") -> list[Prompt]:
    """Pick prompts by id (in the order asked) and/or the first `n`.

    Asking for a pid that is not there is an error rather than a silent skip,
    because a leg that quietly runs fewer prompts would be compared unfairly.
    """
    chosen = list(prompts)
    if pids is not None:
        if isinstance(pids, str):
            pids = [p for p in pids.split(",") if p]
        wanted = [str(p) for p in pids]
        by_pid = {p.pid: p for p in chosen}
        missing = [p for p in wanted if p not in by_pid]
        if missing:
            shown = ", ".join(repr(m) for m in missing[:10])
            more = f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
            raise PromptError(f"unknown pid(s) requested from {source}: {shown}{more}")
        dup = sorted({p for p in wanted if wanted.count(p) > 1})
        if dup:
            raise PromptError(f"pid(s) requested more than once: {dup}")
        chosen = [by_pid[p] for p in wanted]
    if n is not None:
        if int(n) < 0:
            raise PromptError(f"n must be >= 0, got {n}")
        if int(n) > len(chosen):
            raise PromptError(f"n={n} requested but {source} has only {len(chosen)} prompt(s)")
        chosen = chosen[: int(n)]
    return chosen


def load_prompts(path: str | os.PathLike, pids: Iterable[str] | str | None = None,
                 n: int | None = None, check_images: bool = True) -> list[Prompt]:
    """Read a JSONL prompt file; relative image paths resolve against its folder.

    Selected prompts are validated: every image must exist and be a readable
    image (set `check_images=False` to skip the decode check, not the existence check).
    """
    path = Path(path)
    if not path.is_file():
        raise PromptError(f"prompt file not found: {path}")
    base = path.resolve().parent
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    with path.open("r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptError(f"{where}: not valid JSON ({exc.msg})") from exc
            prompt = Prompt.from_dict(obj, base_dir=base, where=where)
            if prompt.pid in seen:
                raise PromptError(f"{where}: duplicate pid {prompt.pid!r} (first on line {seen[prompt.pid]})")
            seen[prompt.pid] = lineno
            prompts.append(prompt)
    chosen = select_prompts(prompts, pids=pids, n=n, source=str(path))
    for prompt in chosen:
        validate_prompt(prompt, check_readable=check_images)
    return chosen


def save_prompts(prompts: Iterable[Prompt], path: str | os.PathLike) -> Path:
    """Write prompts as JSONL; images inside the file's folder are stored relative to it.

    Written to a temporary name and renamed, so a crash never leaves a short
    file that looks like a complete prompt set.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    base = path.resolve().parent
    prompts = list(prompts)
    seen: set[str] = set()
    for p in prompts:
        if not isinstance(p, Prompt):
            raise PromptError(f"save_prompts expects Prompt objects, got {type(p).__name__}")
        if p.pid in seen:
            raise PromptError(f"duplicate pid {p.pid!r} in prompts to save")
        seen.add(p.pid)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for p in prompts:
            fh.write(json.dumps(p.to_dict(relative_to=base), ensure_ascii=False, sort_keys=False))
            fh.write("\n")
    os.replace(tmp, path)
    return path


def prompts_to_frame(prompts: Iterable[Prompt]):
    """One row per prompt (pid, dataset, text, n_images, images, meta fields flattened as meta.*)."""
    import pandas as pd

    rows = []
    for p in prompts:
        row = {"pid": p.pid, "dataset": p.dataset, "text": p.text,
               "n_images": len(p.images), "images": list(p.images)}
        for k, v in p.meta.items():
            row[f"meta.{k}"] = v
        rows.append(row)
    return pd.DataFrame(rows)
