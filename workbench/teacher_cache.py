"""One float32 teacher pass per (prompt, token ids), cached in a run folder's JSON file.

The divergence classifier (``exactness.TeacherGaps``: the top-2 gap at a prefix) and the token-class split
(``grounding.GroundedPositions``: which output tokens the picture decides) both ask the float32 target one
question per key. This base keeps the answers in one JSON file per run folder (and so per target), loads
the target only on the first miss, and loads the prompts only then, so a copied run folder re-opens on a
machine without the model.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .runfolder import write_json_atomic


class TeacherCache:
    """Subclasses set ``purpose`` (for the error message) and define ``_decode`` and ``_compute``."""

    purpose = "answer"

    def __init__(self, target_dir: str | os.PathLike, prompts: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
                 cache: str | os.PathLike | None = None, device: str | None = None, cache_only: bool = False):
        self.target_dir, self.prompts, self.device, self.cache_only = str(target_dir), prompts, device, cache_only
        self.cache_path = Path(cache) if cache else None
        self._cache: dict[str, Any] = {}
        if self.cache_path and self.cache_path.is_file():
            try:
                self._cache = {k: self._decode(v) for k, v in json.loads(self.cache_path.read_text()).items()}
            except (ValueError, AttributeError, TypeError):
                self._cache = {}  # a damaged cache is only a cache: recompute
        self._teacher = None

    # what a subclass defines
    def _decode(self, value: Any) -> Any:
        raise NotImplementedError

    def _compute(self, teacher, prompt, ids: list[int]) -> Any:
        raise NotImplementedError

    @staticmethod
    def _key(pid: str, ids: Sequence[int]) -> str:
        # A cache belongs to one run folder, and a run folder to one target: the key needs no model name
        # (so the folder can be opened where the model lives elsewhere, or nowhere).
        return hashlib.sha256(json.dumps([pid, list(map(int, ids))]).encode()).hexdigest()[:24]

    def available(self) -> bool:
        return not self.cache_only and (Path(self.target_dir) / "config.json").is_file()

    def cached(self, pid: str, ids: Sequence[int]) -> bool:
        return self._key(pid, ids) in self._cache

    def _get(self, pid: str, ids: Sequence[int]) -> Any:
        key = self._key(pid, ids)
        if key not in self._cache:
            if self._teacher is None:
                if not self.available():
                    raise FileNotFoundError(f"no target model at {self.target_dir} to {self.purpose} with"
                                            + (" (cache only)" if self.cache_only else ""))
                from .teacher import TeacherForcer
                self._teacher = TeacherForcer(self.target_dir, dtype="float32", device=self.device)
            if callable(self.prompts):  # loaded only when a forward pass is needed
                self.prompts = self.prompts()
            self._cache[key] = self._decode(self._compute(self._teacher, self.prompts[pid], list(ids)))
            self._save()
        return self._cache[key]

    def _save(self) -> None:
        if self.cache_path is not None:
            write_json_atomic(self.cache_path, dict(sorted(self._cache.items())))
