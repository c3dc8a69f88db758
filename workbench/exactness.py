"""The strict tier's exactness rule, stated once, for every device and CPU kind.

The strict tier promises the target's own greedy output. Whether two engine
runs of the same greedy decode agree token for token is, in reduced
precision, a property of the hardware, not of the drafting: a verification
step computes gamma + 1 tokens in one pass where vanilla decodes one, so the
GEMMs and attention reduce in another order, and where the target's two best
logits are closer than the dtype resolves, either may win. oneDNN picks its
bf16 GEMM by the CPU it runs on (native AVX-512-bf16/AMX, emulated AVX-512,
or ATen's fp32-accumulating fallback on AVX2), and the H200 has its own
kernels, so the same legs can be 13/13 equal on one machine and 11/13 on
another with every divergence at a near-tie.

The rule:

* **float32**: strict equals vanilla token for token. No divergence is
  excused (``threshold("float32") == 0``).
* **bfloat16 / float16**: strict equals vanilla, or every prompt where they
  differ is a **near-tie**: at the first differing position, the float32
  target's top-2 logit gap (teacher-forced on vanilla's prefix, with
  transformers' own model, not vLLM) is below ``NEAR_TIE`` = 0.1 logits
  (bf16 keeps 8 mantissa bits: logits of magnitude ~10 are resolved to
  ~0.05). A divergence at a larger gap is an **error**: the draft changed
  the output where the target was sure. A divergence that could not be
  classified (no teacher available) is **unclassified**, and fails too.

``classify`` applies it to two legs' outputs; ``Verdict.describe()`` is the
line a reader sees ("11/13 equal, 2 near-ties (gaps 0.03, 0.04)").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .metrics import first_divergence  # noqa: F401  (part of this module's vocabulary)
from .teacher_cache import TeacherCache

NEAR_TIE = 0.1
_THRESHOLDS = {"float32": 0.0, "bfloat16": NEAR_TIE, "float16": NEAR_TIE}
_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
            "torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}
RULE = (f"float32: equal; bfloat16/float16: equal, or every divergence a near-tie "
        f"(float32 target's top-2 gap < {NEAR_TIE} at the first differing token)")

NEAR_TIE_CLASS, ERROR_CLASS, UNCLASSIFIED = "near-tie", "error", "unclassified"
GAPS_CACHE = "top2_gaps.json"  # in a run folder: the teacher's gaps at its divergences


def canonical_dtype(dtype: Any) -> str:
    name = _ALIASES.get(str(dtype), str(dtype))
    if name not in _THRESHOLDS:
        raise ValueError(f"exactness rule: dtype must be one of {sorted(_THRESHOLDS)}, got {dtype!r} "
                         "(resolve 'auto' to the dtype the engine ran with)")
    return name


def threshold(dtype: Any) -> float:
    """The top-2 gap below which a divergence is a near-tie, in logits (0: none is excused)."""
    return _THRESHOLDS[canonical_dtype(dtype)]


@dataclass(frozen=True)
class Divergence:
    pid: str
    position: int
    top2_gap: float | None
    kind: str  # near-tie | error | unclassified


@dataclass
class Verdict:
    dtype: str
    n: int
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def n_exact(self) -> int:
        return self.n - len(self.divergences)

    def _of(self, kind: str) -> list[Divergence]:
        return [d for d in self.divergences if d.kind == kind]

    @property
    def near_ties(self) -> list[Divergence]:
        return self._of(NEAR_TIE_CLASS)

    @property
    def errors(self) -> list[Divergence]:
        return self._of(ERROR_CLASS)

    @property
    def unclassified(self) -> list[Divergence]:
        return self._of(UNCLASSIFIED)

    @property
    def ok(self) -> bool:
        return not self.errors and not self.unclassified

    def describe(self) -> str:
        """'11/13 equal, 2 near-ties (gaps 0.032, 0.037)'; errors name prompt, position and gap."""
        parts = [f"{self.n_exact}/{self.n} equal"]
        if self.near_ties:
            gaps = ", ".join(f"{d.top2_gap:.3g}" for d in self.near_ties)
            parts.append(f"{len(self.near_ties)} near-tie{'s' if len(self.near_ties) > 1 else ''} (gaps {gaps})")
        if self.errors:
            where = ", ".join(f"{d.pid} at token {d.position}, gap {d.top2_gap:.3g}" for d in self.errors)
            parts.append(f"{len(self.errors)} error{'s' if len(self.errors) > 1 else ''} ({where})")
        if self.unclassified:
            where = ", ".join(f"{d.pid} at token {d.position}" for d in self.unclassified)
            parts.append(f"{len(self.unclassified)} unclassified ({where})")
        return ", ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "threshold": threshold(self.dtype), "n": self.n, "n_exact": self.n_exact,
                "n_near_tie": len(self.near_ties), "n_error": len(self.errors),
                "n_unclassified": len(self.unclassified), "ok": self.ok, "classification": self.describe(),
                "divergences": [asdict(d) for d in self.divergences]}

    def check(self, what: str = "strict vs vanilla") -> None:
        """Raise AssertionError naming every divergence the rule does not excuse."""
        if not self.ok:
            raise AssertionError(f"{what} ({self.dtype}) breaks the exactness rule [{RULE}]: {self.describe()}")


GapFn = Callable[[str, Sequence[int]], float]


def classify(reference: Mapping[str, Sequence[int]], other: Mapping[str, Sequence[int]], dtype: Any,
             top2_gap: GapFn | None = None) -> Verdict:
    """Apply the rule to ``other`` (strict leg outputs by prompt id) against ``reference`` (vanilla's).

    ``top2_gap(pid, prefix_ids)`` is the float32 target's top-2 logit gap after
    the prompt and vanilla's first ``len(prefix_ids)`` tokens; called once per
    diverging prompt. In float32 it is still called (when given) so that a
    failure reports how far from a tie it was. A gap the function cannot
    give (no model, not in a cache) leaves that divergence unclassified.
    """
    dtype = canonical_dtype(dtype)
    missing = sorted(set(other) - set(reference))
    if missing:
        raise ValueError(f"exactness: prompts {missing[:5]} are in the compared leg but not in the reference")
    limit = threshold(dtype)
    divs = []
    for pid in sorted(other):
        ref_ids = list(reference[pid])
        i = first_divergence(ref_ids, list(other[pid]))
        if i is None:
            continue
        gap = _gap_or_none(top2_gap, pid, ref_ids[:i])
        if gap is None:
            kind = ERROR_CLASS if limit == 0 else UNCLASSIFIED
        else:
            kind = NEAR_TIE_CLASS if gap < limit else ERROR_CLASS
        divs.append(Divergence(pid, i, None if gap is None else round(gap, 5), kind))
    return Verdict(dtype, len(other), divs)


def _gap_or_none(top2_gap: GapFn | None, pid: str, prefix: Sequence[int]) -> float | None:
    if top2_gap is None:
        return None
    try:
        return float(top2_gap(pid, prefix))
    except (LookupError, OSError):
        return None


# --------------------------------------------------------------------------- the teacher's gaps


class TeacherGaps(TeacherCache):
    """``top2_gap`` from the float32 target (``workbench.teacher``), loaded on first use.

    With ``cache`` (a JSON file, one per run folder and so per target) every
    gap is kept under a key of the prompt id and prefix, so a run folder can be
    re-analysed, or opened on a machine without the model, without another
    forward pass.
    """

    purpose = "classify divergences"

    def _decode(self, value) -> float:
        return float(value)

    def _compute(self, teacher, prompt, prefix: list[int]) -> float:
        return teacher.top2_gap(prompt, prefix)

    def __call__(self, pid: str, prefix: Sequence[int]) -> float:
        return self._get(pid, prefix)
