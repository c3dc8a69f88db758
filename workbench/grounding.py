"""Image-grounded tokens, defined by the target itself: its greedy choice changes with a blank picture.

A generated token is *image-grounded* when the target's greedy choice at that position changes when every
picture of the prompt is replaced by a blank (white) one of the same size, teacher-forced on the output
(one extra forward pass per output, `workbench.teacher.TeacherForcer.image_grounded`). This replaces the
vocabulary proxy (`metrics.image_word_token_ids`) in the token-class split wherever the target can be
loaded; the labels are cached in the run folder (``grounded.json``) like the top-2 gaps, so a copied run
folder re-opens without the model.
"""

from __future__ import annotations

from collections.abc import Sequence

from .teacher_cache import TeacherCache

CACHE = "grounded.json"
GROUNDED, OTHER = "image-grounded", "other"


class GroundedPositions(TeacherCache):
    """Per output: one bool per token (image-grounded or not), from the float32 target, cached."""

    purpose = "find image-grounded tokens"

    def _decode(self, value) -> list[bool]:
        return [bool(x) for x in value]

    def _compute(self, teacher, prompt, gen_ids: list[int]) -> list[bool]:
        return teacher.image_grounded(prompt, gen_ids)

    def __call__(self, pid: str, gen_ids: Sequence[int]) -> list[bool]:
        return self._get(pid, gen_ids)

    def labels(self, pid: str, gen_ids: Sequence[int]) -> list[str]:
        return [GROUNDED if g else OTHER for g in self(pid, gen_ids)]
