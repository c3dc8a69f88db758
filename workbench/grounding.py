"""Image-grounded tokens, defined by the target itself: its greedy choice changes with a blank picture.

A generated token is *image-grounded* when the target's greedy choice at that position changes when every
picture of the prompt is replaced by a blank (white) one of the same size, teacher-forced on the output
(one extra forward pass per output, `workbench.teacher.TeacherForcer.image_grounded`). This replaces the
vocabulary proxy (`metrics.image_word_token_ids`) in the token-class split wherever the target can be
loaded; the labels are cached in the run folder (``grounded.json``) like the top-2 gaps, so a copied run
folder re-opens without the model.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .runfolder import write_json_atomic

CACHE = "grounded.json"
GROUNDED, OTHER = "image-grounded", "other"


class GroundedPositions:
    """Per output: one bool per token (image-grounded or not), from the float32 target, cached."""

    def __init__(self, target_dir: str | os.PathLike, prompts: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
                 cache: str | os.PathLike | None = None, device: str | None = None, cache_only: bool = False):
        self.target_dir, self.prompts, self.device, self.cache_only = str(target_dir), prompts, device, cache_only
        self.cache_path = Path(cache) if cache else None
        self._cache: dict[str, list[bool]] = {}
        if self.cache_path and self.cache_path.is_file():
            try:
                self._cache = {k: [bool(x) for x in v] for k, v in json.loads(self.cache_path.read_text()).items()}
            except (ValueError, AttributeError, TypeError):
                self._cache = {}  # a damaged cache is only a cache
        self._teacher = None

    @staticmethod
    def _key(pid: str, gen_ids: Sequence[int]) -> str:
        return hashlib.sha256(json.dumps([pid, list(map(int, gen_ids))]).encode()).hexdigest()[:24]

    def available(self) -> bool:
        return not self.cache_only and (Path(self.target_dir) / "config.json").is_file()

    def cached(self, pid: str, gen_ids: Sequence[int]) -> bool:
        return self._key(pid, gen_ids) in self._cache

    def __call__(self, pid: str, gen_ids: Sequence[int]) -> list[bool]:
        key = self._key(pid, gen_ids)
        if key not in self._cache:
            if self._teacher is None:
                if not self.available():
                    raise FileNotFoundError(f"no target model at {self.target_dir} to find image-grounded tokens"
                                            + (" (cache only)" if self.cache_only else ""))
                from .teacher import TeacherForcer
                self._teacher = TeacherForcer(self.target_dir, dtype="float32", device=self.device)
            if callable(self.prompts):
                self.prompts = self.prompts()
            self._cache[key] = [bool(x) for x in self._teacher.image_grounded(self.prompts[pid], list(gen_ids))]
            if self.cache_path is not None:
                write_json_atomic(self.cache_path, dict(sorted(self._cache.items())))
        return self._cache[key]

    def labels(self, pid: str, gen_ids: Sequence[int]) -> list[str]:
        return [GROUNDED if g else OTHER for g in self(pid, gen_ids)]
