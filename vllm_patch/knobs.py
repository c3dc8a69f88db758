"""The knob table, and the engine switches parsed and validated once per process.

``Knob`` describes one knob: name, type, check, environment variable, leg
option, whether it only means something with a draft, whether it acts on a
CPU host, a leg default where it differs, and which result tables show it as a
column. ``SWITCHES`` are the knobs the engine reads from its environment;
``workbench.knobs`` adds the workload knobs (gamma, concurrency, ...) to make
the one table the workbench validates, builds leg options and environments
from. The plugin imports nothing from the workbench, so the table starts here.
The carriers are built from the table: ``EngineKnobs`` here and the workbench's
``Knobs`` (both :class:`KnobValues`), and :func:`tier_of` is the one tier rule.

The variable names are the ones researchers' scripts already use (see the
README): ``VLLM_SPEC_RELAX_LOGTAU``, ``VLLM_SPEC_DRAFT_BLIND_MM``,
``VLLM_SPEC_DISABLE_DRAFT_CUDAGRAPH``, ``VLLM_SPEC_TRACE``; issue 18 added
``VLLM_SPEC_DRAFT_CUDAGRAPH_MODE``, ``VLLM_SPEC_DRAFT_LINEAR_KERNEL`` and ``VLLM_SPEC_ASYNC_SCHEDULING``
(the last one only tells the engine's report what the leg asked: vLLM's own ``async_scheduling``
engine argument is what switches it). ``VLLM_SPEC_REPORT_DIR``
is where every engine process reports the knobs it actually read, and where
the trace goes. Whatever the workbench checked before, the engine checks its
environment again here: a script may set these variables by hand.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, MutableMapping
from typing import Any, ClassVar

ENV_RELAX = "VLLM_SPEC_RELAX_LOGTAU"
ENV_BLIND = "VLLM_SPEC_DRAFT_BLIND_MM"
ENV_NO_GRAPH = "VLLM_SPEC_DISABLE_DRAFT_CUDAGRAPH"
ENV_TRACE = "VLLM_SPEC_TRACE"
ENV_GRAPH_MODE = "VLLM_SPEC_DRAFT_CUDAGRAPH_MODE"
ENV_LINEAR_KERNEL = "VLLM_SPEC_DRAFT_LINEAR_KERNEL"
ENV_ASYNC = "VLLM_SPEC_ASYNC_SCHEDULING"
ENV_LM_HEAD = "VLLM_SPEC_DRAFT_LM_HEAD"
ENV_EARLY_OUTPUT = "VLLM_SPEC_EARLY_OUTPUT"
ENV_EARLY_RELEASE = "VLLM_SPEC_EARLY_RELEASE"
ENV_DRAFT_IDLE = "VLLM_SPEC_DRAFT_IDLE"
ENV_SCHEDULE_KEY = "VLLM_SPEC_GAMMA_SCHEDULE_KEY"
ENV_VISION_SHARE = "VLLM_SPEC_DRAFT_VISION_SHARE"
ENV_TARGET_GRAPHS = "VLLM_SPEC_TARGET_GRAPHS"
ENV_DRAFT_ATTENTION = "VLLM_SPEC_DRAFT_ATTENTION"
ENV_REPORT_DIR = "VLLM_SPEC_REPORT_DIR"

from .knob_type import _FALSE, _TRUE, Knob, KnobError  # noqa: F401 (the table's type, re-exported)


def _finite_nonneg(v: float) -> bool:
    return math.isfinite(v) and v >= 0


def _any(_: Any) -> bool:
    return True


DRAFT_CUDAGRAPH_MODES = ("auto", "none", "piecewise", "full", "full_all")
DRAFT_LINEAR_KERNELS = ("auto", "machete", "marlin", "humming", "exllama", "own", "own-cuda", "own-cuda+marlin",
                        "own-cuda+marlin+machete")
OWN_KERNEL_MODULES = {"own": "twin_gemv", "own-cuda": "twin_cuda", "own-cuda+marlin": "twin_hybrid",
                      "own-cuda+marlin+machete": "twin_hybrid"}
TARGET_GRAPHS = ("vllm", "full")  # under vLLM's γ schedule: its PIECEWISE target, or FULL graphs per length
SCHEDULE_KEYS = ("batch", "load")  # the γ schedule looked up by the scheduled requests (vLLM), or running + waiting
DRAFT_IDLE = ("sync", "skip", "skip_all")  # a step with γ 0: the draft's pass keeps its KV cache (vLLM), or none
# runs at a decode-only step (skip), or none at any step, prompt tokens included (skip_all)
DRAFT_ATTENTIONS = ("vllm", "twin")  # the draft's single-token decode attention: vLLM's backend, or vllm_patch's
DRAFT_LM_HEADS = ("model", "int4")  # model: as the checkpoint has it; int4: vllm_patch.draft_head


def own_kernel_available(value: str = "own") -> bool:
    """Whether the module of the project's own int4 kernel ``value`` (``own``: ``vllm_patch.twin_gemv``,
    ``own-cuda``: ``vllm_patch.twin_cuda``) exists in this install."""
    import importlib.util

    return importlib.util.find_spec(f"{__package__}.{OWN_KERNEL_MODULES[value]}") is not None


def check_combination(values: Mapping[str, Any], where: str = "") -> None:
    """Rules across knobs, the same in the workbench and in the engine; KnobError names the knobs."""
    pre = f"{where}: " if where else ""
    mode = values.get("draft_cudagraph_mode", "auto")
    if values.get("draft_cudagraph") is False and mode in ("piecewise", "full", "full_all"):
        raise KnobError(f"{pre}knob 'draft_cudagraph_mode' is {mode!r} but knob 'draft_cudagraph' is off; "
                        "turn draft_cudagraph on or use draft_cudagraph_mode 'none' / 'auto'")


SWITCHES: dict[str, Knob] = {k.name: k for k in [
    Knob("relax_logtau", float, 0.0, _finite_nonneg, "a finite number >= 0",
         "relaxed gate x = ln(1/tau); 0 = strict (e.g. 0.693 for tau=0.5)",
         env=ENV_RELAX, flag="--relax-logtau", spec_only=True, column="record"),
    Knob("blind_mm", bool, False, _any, "true or false", "draft decodes without image embeddings",
         env=ENV_BLIND, flag="--blind-mm", spec_only=True, column="record"),
    Knob("draft_cudagraph", bool, True, _any, "true or false", "capture the drafter's CUDA graphs",
         env=ENV_NO_GRAPH, env_inverted=True, flag="--draft-cudagraph", spec_only=True, applies_on_cpu=False,
         column="leg", leg_extra=("draft_cudagraph_applies",)),
    # an engine started by hand does not trace; a leg does unless told not to (--no-trace)
    Knob("trace", bool, False, _any, "true or false", "record the per-step acceptance trace",
         env=ENV_TRACE, flag="--trace", spec_only=True, leg_default=True),
    Knob("draft_cudagraph_mode", str, "auto", lambda v: v in DRAFT_CUDAGRAPH_MODES,
         "one of " + ", ".join(DRAFT_CUDAGRAPH_MODES),
         "drafter CUDA graphs: none, piecewise (vLLM's), full (FULL graph per single-token step), "
         "full_all (full, and the first pass of a uniform decode step too), "
         "auto (the best verified on the platform; none on CPU)",
         env=ENV_GRAPH_MODE, flag="--draft-cudagraph-mode", spec_only=True, applies_on_cpu=False,
         column="leg"),
    # 'own' is refused (naming the knob) where the module with TwinGemvLinearKernel is absent
    Knob("draft_linear_kernel", str, "auto",
         lambda v: v in DRAFT_LINEAR_KERNELS and (v not in OWN_KERNEL_MODULES or (
             own_kernel_available() if v == "own" else own_kernel_available(v))),
         "one of " + ", ".join(DRAFT_LINEAR_KERNELS) + " ('own' needs vllm_patch.twin_gemv with "
         "TwinGemvLinearKernel; this install must have it)",
         "W4A16 kernel of the draft's linear layers (the target's are vLLM's choice); auto: Marlin "
         "first on CUDA, vLLM's CPU kernels on CPU; own: vllm_patch.twin_gemv (Triton); own-cuda: "
         "vllm_patch.twin_cuda (CUDA C++, being measured against own; one of the two stays); own-cuda+marlin: "
         "vllm_patch.twin_hybrid (both layouts: own-cuda up to 4 tokens, Marlin above; the weights twice); "
         "own-cuda+marlin+machete: the same with Machete above 64 tokens (SM 9.0; the weights three times)",
         env=ENV_LINEAR_KERNEL, flag="--draft-linear-kernel", spec_only=True, applies_on_cpu=False,
         column="leg"),
    # issue 37: the draft's other work. Needs nvcc (vllm_patch.twin_attention is built at first use)
    Knob("draft_attention", str, "vllm", lambda v: v in DRAFT_ATTENTIONS, "one of " + ", ".join(DRAFT_ATTENTIONS),
         "the draft's attention in its single-token decode steps: vllm (the backend vLLM picks, FA3 on Hopper) or "
         "twin (vllm_patch.twin_attention: one launch a layer, split-KV, over vLLM's paged cache; bf16, head "
         "size 128; first passes and prefills stay vLLM's)",
         env=ENV_DRAFT_ATTENTION, flag="--draft-attention", spec_only=True, applies_on_cpu=False, column="leg"),
    Knob("draft_lm_head", str, "model", lambda v: v in DRAFT_LM_HEADS, "one of " + ", ".join(DRAFT_LM_HEADS),
         "the draft's lm_head: model (as its checkpoint has it, bf16 in a W4A16 twin) or int4 (quantized "
         "at load, round-to-nearest, group 128, on the draft's W4A16 kernel)",
         env=ENV_LM_HEAD, flag="--draft-lm-head", spec_only=True, column="leg"),
    Knob("async_scheduling", bool, False, _any, "true or false",
         "vLLM's async scheduling for the draft_model leg (asked explicitly; the padded drafter batch "
         "stays on); vLLM's CPU platform always turns it off",
         env=ENV_ASYNC, flag="--async-scheduling", spec_only=True, applies_on_cpu=False, column="leg"),
    # issue 36: TTFT. vLLM copies a step's sampled tokens to the host only after the drafter's work. Off by
    # default: on one H100 (8B, E18 20261206T091621Z-553b266a) it showed no TTFT gain and cost 1-3 % TPOT
    Knob("early_output", bool, False, _any, "true or false",
         "with async scheduling, copy each step's sampled tokens to the host as soon as the target has "
         "sampled, not after the drafter's passes (a new request's first token skips the draft's prefill)",
         env=ENV_EARLY_OUTPUT, flag="--early-output", spec_only=True, applies_on_cpu=False, column="leg"),
    # issue 36: TTFT. vLLM launches the next step before it hands over the step that gave a first token
    Knob("early_release", bool, False, _any, "true or false",
         "with async scheduling, a step that gives a request its first token (and queued a draft pass) is "
         "handed to the client before the engine launches the next step, not after it",
         env=ENV_EARLY_RELEASE, flag="--early-release", spec_only=True, applies_on_cpu=False, column="leg"),
    # issue 36: under a γ schedule with γ 0, vLLM still runs the draft's pass over the batch every step
    Knob("draft_idle", str, "sync", lambda v: v in DRAFT_IDLE, "one of " + ", ".join(DRAFT_IDLE),
         "a decode step where the γ schedule says 0: sync (vLLM's: the draft's pass over the batch still runs, "
         "to keep its KV cache; the step costs vanilla + one draft pass) or skip (no draft pass: the step "
         "costs what vanilla's does; the draft's KV misses those tokens, so drafts after such a stretch read "
         "stale entries: lower real acceptance, never a different output), or skip_all (no draft pass at a "
         "γ-0 step that admits prompt tokens either: such a step costs vanilla's too, and the draft's cache "
         "lacks those prompts when γ > 0 returns)",
         env=ENV_DRAFT_IDLE, flag="--draft-idle", spec_only=True, column="leg"),
    # issue 36: vLLM looks the schedule up by the requests scheduled, small while prompts wait for their prefill
    Knob("gamma_schedule_key", str, "batch", lambda v: v in SCHEDULE_KEYS, "one of " + ", ".join(SCHEDULE_KEYS),
         "what the batch-size γ schedule is looked up by: batch (vLLM's: the requests scheduled in the step) or "
         "load (running plus waiting: a step that schedules few while prompts wait is priced at the batch it "
         "is about to have; vllm_patch.schedule_key). No effect without a schedule",
         env=ENV_SCHEDULE_KEY, flag="--gamma-schedule-key", spec_only=True, column="leg"),
    # issue 36: TTFT. A twin's vision tower is the target's (not quantized): its outputs would be the target's
    Knob("draft_vision_share", bool, True, _any, "true or false",
         "the draft reads the target's image embeddings where its vision tower's weights equal the target's "
         "(checked at load; a W4A16 twin keeps the target's tower), instead of running its own tower",
         env=ENV_VISION_SHARE, flag="--draft-vision-share", spec_only=True, column="leg"),
    # issue 36: under a γ schedule vLLM's V1 runner runs the target on PIECEWISE graphs only
    Knob("target_graphs", str, "vllm", lambda v: v in TARGET_GRAPHS, "one of " + ", ".join(TARGET_GRAPHS),
         "the target's CUDA graphs under the batch-size γ schedule: vllm (vLLM's rule: PIECEWISE only) or full "
         "(FULL decode graphs kept, for steps of γ_max and for steps of one token per request, vllm_patch."
         "target_graphs; other lengths piecewise). No effect without a schedule or on CPU; H100, 8B: a step "
         "with speculation off at vanilla's speed (E18)",
         env=ENV_TARGET_GRAPHS, flag="--target-graphs", spec_only=True, applies_on_cpu=False, column="leg"),
]}

# --- test-only hook ---------------------------------------------------------------------------
# ``VLLM_SPEC_TEST_KNOBS`` (JSON list of {name, type, default, env, flag, spec_only, applies_on_cpu,
# column}) adds throwaway knobs to the table at import, in every process that inherits the variable
# (leg, engine core, workers). It exists for tests/test_knob_table.py, which checks that a knob added
# to the table alone reaches leg.json, the engine's environment and report, and the record columns.
# Never set it in a real run.
ENV_TEST_KNOBS = "VLLM_SPEC_TEST_KNOBS"
_TYPES = {"bool": bool, "int": int, "float": float, "str": str}


def knob_from_spec(spec: Mapping[str, Any]) -> Knob:
    """A ``Knob`` from a JSON-able description (test-only: see ``ENV_TEST_KNOBS``); any value of its type passes."""
    spec = dict(spec)
    kind = _TYPES[spec.pop("type")]
    rule = "true or false" if kind is bool else f"a {kind.__name__}"
    return Knob(spec.pop("name"), kind, spec.pop("default"), _any, rule, spec.pop("help", "test-only knob"),
                **spec)


for _spec in json.loads(os.environ.get(ENV_TEST_KNOBS) or "[]"):
    SWITCHES[_spec["name"]] = knob_from_spec(_spec)


def parse_relax_logtau(raw: str | None) -> float:
    """``x`` of the relaxed gate; unset or 0 is the strict tier."""
    return SWITCHES["relax_logtau"].read_env({ENV_RELAX: raw} if raw is not None else {})


def tier_of(knobs: Any) -> str:
    """The tier of a set of knobs (a mapping, or an object with the knobs as attributes).

    ``vanilla`` when gamma is there and None (no draft); ``synthetic`` when the workbench's
    ``acceptance`` knob is not ``real``; else ``relaxed`` when relax_logtau > 0, else
    ``strict``. The engine's switches carry no gamma (an engine with the plugin's gate runs a draft).
    """
    get = knobs.get if isinstance(knobs, Mapping) else (lambda name, d=None: getattr(knobs, name, d))
    if get("gamma", 0) is None:
        return "vanilla"
    if (get("acceptance", "real") or "real") != "real":
        return "synthetic"  # vLLM's synthetic sampler keeps drafted tokens by draw: a cost measurement
    return "relaxed" if (get("relax_logtau", 0.0) or 0.0) > 0 else "strict"


class KnobValues:
    """Values of the knobs of a table, as attributes: the carrier ``EngineKnobs`` and ``workbench.knobs.Knobs`` share.

    The fields are the table's entries at construction time (``_table()``), each defaulting to the
    knob's default (``_leg_defaults``: its leg default), plus ``_extra`` fields that are not knobs.
    Constructor keywords, attribute names, equality and ``as_dict`` are those of a frozen dataclass
    with these fields in table order.
    """

    _extra: ClassVar[dict[str, Any]] = {}
    _leg_defaults: ClassVar[bool] = False

    @classmethod
    def _table(cls) -> Mapping[str, Knob]:
        raise NotImplementedError

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Field name -> default, in table order (then the extra fields)."""
        d = {n: (k.leg_value if cls._leg_defaults else k.default) for n, k in cls._table().items()}
        d.update(cls._extra)
        return d

    def __init__(self, **values: Any):
        fields = self.defaults()
        unknown = [n for n in values if n not in fields]
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unexpected keyword argument(s) {unknown}; "
                            f"fields: {', '.join(fields)}")
        for name, default in fields.items():
            object.__setattr__(self, name, values.get(name, default))
        self._check()

    def _check(self) -> None:
        """Validation after construction (a subclass's rules)."""

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot delete {name!r}")

    def as_dict(self) -> dict:
        return dict(vars(self))

    def __eq__(self, other: Any) -> bool:
        return type(other) is type(self) and other.as_dict() == self.as_dict()

    def __hash__(self) -> int:
        return hash(tuple(self.as_dict().items()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.as_dict().items())})"

    @property
    def tier(self) -> str:
        return tier_of(self)


class EngineKnobs(KnobValues):
    """The switches an engine process read from its environment (``SWITCHES``), and its report directory."""

    _extra = {"report_dir": None}

    @classmethod
    def _table(cls) -> Mapping[str, Knob]:
        return SWITCHES


ENV_STEP_TIMING = "VLLM_SPEC_STEP_TIMING"
# where the trace and step timings go when no VLLM_SPEC_REPORT_DIR is given: below the working folder
DEFAULT_REPORT_DIR = "spec-trace"


def default_report_dir(env: MutableMapping[str, str] | None = None) -> str | None:
    """``VLLM_SPEC_TRACE=1`` (or ``VLLM_SPEC_STEP_TIMING=1``) without ``VLLM_SPEC_REPORT_DIR``: set it to
    ``./spec-trace`` of the working folder, as an absolute path in ``env`` so the engine's other processes
    (engine core, workers) write to the same folder. Returns the folder it set; None where the variable
    was set, nothing is recorded, or a switch's value is bad (``read_knobs`` refuses that)."""
    env = os.environ if env is None else env
    if env.get(ENV_REPORT_DIR):
        return None
    try:
        records = SWITCHES["trace"].read_env(env) or env.get(ENV_STEP_TIMING, "").strip().lower() in _TRUE
    except KnobError:
        return None
    if not records:
        return None
    folder = os.path.abspath(DEFAULT_REPORT_DIR)
    env[ENV_REPORT_DIR] = folder
    return folder


def read_knobs(env: Mapping[str, str] | None = None) -> EngineKnobs:
    env = os.environ if env is None else env
    knobs = EngineKnobs(**{name: k.read_env(env) for name, k in SWITCHES.items()},
                        report_dir=env.get(ENV_REPORT_DIR) or None)
    if knobs.trace and not knobs.report_dir:
        raise KnobError(f"{ENV_TRACE}=1 needs {ENV_REPORT_DIR}: the folder the trace is written to "
                        f"(the plugin sets ./{DEFAULT_REPORT_DIR} when it is unset: default_report_dir)")
    check_combination(knobs.as_dict(), where="engine environment")
    return knobs
