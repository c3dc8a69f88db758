"""Synthetic acceptance and the batch-size γ schedule: what a leg asks of vLLM's own mechanisms.

Two knobs (``workbench.knobs``) resolve here into vLLM 0.27.1's ``speculative_config`` fields:

``acceptance`` — the acceptance a leg is *measured at*, through vLLM's synthetic rejection sampler
(``rejection_sample_method: "synthetic"``, ``synthetic_acceptance_rates``: per position, the
unconditional probability that the first i+1 drafted tokens are all accepted). The twin still drafts
every token and the target still verifies every step, so the leg's cost is real; which tokens are
kept is drawn, so its output is not the target's and it is never judged for exactness: a synthetic
leg is a cost measurement and says "synthetic α" wherever it is shown.

* ``real`` (default): the target judges (strict or relaxed gate).
* ``alpha:A``: a conditional acceptance A at every position (unconditional A, A², A³, ...).
* ``rates:R1/R2/...``: vLLM's unconditional per-position rates as given ('/'-separated: a comma
  would make ``-p`` a sweep), non-increasing, at least γ of them (the first γ are used).
* ``length:L``: a mean acceptance length L (1 + accepted per draft) as the geometric profile of that
  length (vLLM's own conversion of a length gives a step profile [1, 1, f, 0] no drafter produces).
* ``from:RUN_DIR[:LEG]``: the per-position acceptance a recorded spec leg measured (accepted at
  position i / drafts, from its records), e.g. the organism twin's; positions past the recorded γ
  continue its last conditional rate.

``gamma_schedule`` — γ by batch size, vLLM's ``num_speculative_tokens_per_batch_size``
(inclusive batch-size ranges; γ 0 turns speculation off for that range):

* ``none`` (default): the leg's fixed γ.
* ``LO-HI:G/LO-HI:G/...``: explicit ranges, e.g. ``1-4:4/5-16:2/17-64:0``.
* ``auto``: ``auto:`` the E16 run folder under the repository's ``results/E16`` whose cost table has rows
  of the target's size (``32b`` for ``models/shapes/32b-target``) at two or more batch sizes, measured on
  the GPU model here where one is (else another card's, said on stderr and in the records), that measured
  the leg's draft kernel, that reaches the server's largest batch, of the fastest drafter setup, the newest
  (:func:`default_cost_run`); read at the leg's kernel's setup where the table has several.
* ``auto:RUN_DIR``: from a cost-ladder run folder (E16: ``ladder_rows.jsonl`` / ``tables/cost_ratio.csv``,
  one row per batch and γ) and the leg's acceptance profile, the γ per batch size that maximises the
  predicted speedup; 0 where that is predicted faster than every γ. A step at γ 0 is not free under vLLM:
  its draft still runs one pass over the batch (knob ``draft_idle``: ``sync``, vLLM's; ``skip`` runs none).
  See :func:`auto_schedule` and :func:`off_speedup`.
"""

from __future__ import annotations

import csv
import functools
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["AcceptanceError", "check_acceptance", "check_schedule", "unconditional_rates", "rates_from_run",
           "parse_schedule", "auto_schedule", "spec_config_extra", "expected_tokens", "schedule_table",
           "max_gamma"]


class AcceptanceError(ValueError):
    """An ``acceptance`` or ``gamma_schedule`` value that cannot be used; the message names the knob."""


_KINDS = ("real", "alpha", "rates", "length", "from")


def _split(spec: str) -> tuple[str, str]:
    spec = str(spec).strip()
    if spec == "real":
        return "real", ""
    kind, sep, arg = spec.partition(":")
    if not sep or kind not in _KINDS[1:] or not arg.strip():
        raise AcceptanceError(f"knob 'acceptance' must be real, alpha:A, rates:R1/R2/..., length:L or "
                              f"from:RUN_DIR[:LEG], got {spec!r}")
    return kind, arg.strip()


def _float(text: str, what: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise AcceptanceError(f"knob 'acceptance': {what} must be a number, got {text!r}") from None
    if not math.isfinite(v):
        raise AcceptanceError(f"knob 'acceptance': {what} must be finite, got {text!r}")
    return v


def check_acceptance(spec: str) -> bool:
    """Syntax check (the knob table's): True, or AcceptanceError naming the problem. Files are read later."""
    kind, arg = _split(spec)
    if kind == "alpha":
        a = _float(arg, "alpha")
        if not 0 <= a <= 1:
            raise AcceptanceError(f"knob 'acceptance': alpha must be in [0, 1], got {a}")
    elif kind == "rates":
        _rates_list(arg)
    elif kind == "length":
        if _float(arg, "length") < 1:
            raise AcceptanceError(f"knob 'acceptance': length must be >= 1, got {arg}")
    return True


def _rates_list(arg: str) -> list[float]:
    rates = [_float(r, "a rate") for r in arg.split("/") if r.strip()]
    if not rates or any(not 0 <= r <= 1 for r in rates):
        raise AcceptanceError(f"knob 'acceptance': rates must be numbers in [0, 1] separated by '/', got {arg!r}")
    if any(b > a + 1e-12 for a, b in zip(rates, rates[1:])):
        raise AcceptanceError(f"knob 'acceptance': unconditional rates must be non-increasing, got {rates}")
    return rates


def _geometric_alpha(length: float, gamma: int) -> float:
    """The conditional α whose geometric profile has mean acceptance length ``length`` at ``gamma``."""
    if length > gamma + 1 + 1e-9:
        raise AcceptanceError(f"knob 'acceptance': length {length} exceeds gamma + 1 = {gamma + 1}")
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if expected_tokens([mid ** (i + 1) for i in range(gamma)]) < length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def expected_tokens(rates: list[float]) -> float:
    """Mean tokens per verify step (acceptance length) of unconditional per-position rates."""
    return 1.0 + float(sum(rates))


def rates_from_run(arg: str) -> tuple[list[float], str]:
    """Unconditional per-position rates a recorded spec leg measured, and which leg they came from."""
    path, leg = run_path(arg), None
    if not (path / "legs").is_dir() and ":" in arg:
        head, _, leg = arg.rpartition(":")
        path = run_path(head)
    legs_dir = path / "legs"
    if not legs_dir.is_dir():
        raise AcceptanceError(f"knob 'acceptance': from:{arg}: {path} is not a run folder (no legs/)")
    if leg is None:
        spec_legs = [d.name for d in sorted(legs_dir.iterdir()) if (d / "records.jsonl").is_file()
                     and _leg_tier(d) in ("strict", "relaxed")]
        if len(spec_legs) != 1:
            raise AcceptanceError(f"knob 'acceptance': from:{arg}: name the leg (from:RUN_DIR:LEG); spec legs "
                                  f"with records: {', '.join(spec_legs) or 'none'}")
        leg = spec_legs[0]
    rec = legs_dir / leg / "records.jsonl"
    if not rec.is_file():
        raise AcceptanceError(f"knob 'acceptance': from:{arg}: {rec} does not exist")
    accepted: list[float] = []
    drafts = 0.0
    for line in rec.read_text().splitlines():
        spec = (json.loads(line) or {}).get("spec") or {}
        per = spec.get("accepted_per_pos") or []
        accepted += [0.0] * (len(per) - len(accepted))
        for i, v in enumerate(per):
            accepted[i] += float(v)
        drafts += float(spec.get("drafts") or 0)
    if not drafts or not accepted:
        raise AcceptanceError(f"knob 'acceptance': from:{arg}: {rec} has no drafts with per-position counts")
    return [a / drafts for a in accepted], f"{path.name}:{leg}"


def _leg_tier(leg_dir: Path) -> str | None:
    for line in (leg_dir / "records.jsonl").read_text().splitlines()[:1]:
        return (json.loads(line) or {}).get("tier")
    return None


def unconditional_rates(spec: str, gamma: int) -> list[float] | None:
    """vLLM's ``synthetic_acceptance_rates`` for ``spec`` at draft length ``gamma`` (None: ``real``)."""
    kind, arg = _split(spec)
    if kind == "real":
        return None
    if kind == "alpha":
        a = _float(arg, "alpha")
        return [a ** (i + 1) for i in range(gamma)]
    if kind == "length":
        a = _geometric_alpha(_float(arg, "length"), gamma)
        return [a ** (i + 1) for i in range(gamma)]
    rates = _rates_list(arg) if kind == "rates" else rates_from_run(arg)[0]
    if kind == "rates" and len(rates) < gamma:
        raise AcceptanceError(f"knob 'acceptance': {len(rates)} rates for gamma {gamma}; give at least {gamma}")
    rates = list(rates)
    while len(rates) < gamma:  # a recorded leg of a shorter γ: continue its last conditional rate
        last = rates[-1] / rates[-2] if len(rates) > 1 and rates[-2] > 0 else rates[-1]
        rates.append(rates[-1] * last)
    out = rates[:gamma]
    for i in range(1, len(out)):  # measured rates can wobble upwards by a count; vLLM wants them monotone
        out[i] = min(out[i], out[i - 1])
    return out


# --------------------------------------------------------------------------- the γ schedule
@dataclass(frozen=True)
class Range:
    lo: int
    hi: int
    gamma: int

    def as_vllm(self) -> list[int]:
        return [self.lo, self.hi, self.gamma]


def check_schedule(spec: str) -> bool:
    spec = str(spec).strip()
    if spec == "none":
        return True
    if spec == "auto" or (spec.startswith("auto:") and spec[5:].strip()):
        return True
    parse_schedule(spec)
    return True


def parse_schedule(spec: str) -> list[Range]:
    """``LO-HI:G/...`` as ranges, contiguous from batch size 1."""
    out: list[Range] = []
    for part in [p for p in str(spec).split("/") if p.strip()]:
        try:
            span, g = part.split(":")
            lo, hi = (int(x) for x in span.split("-"))
            gamma = int(g)
        except ValueError:
            raise AcceptanceError(f"knob 'gamma_schedule' must be none, auto:RUN_DIR or LO-HI:G/LO-HI:G/... "
                                  f"(e.g. 1-4:4/5-16:2/17-64:0), got {spec!r}") from None
        if lo < 1 or hi < lo or not 0 <= gamma <= 32:
            raise AcceptanceError(f"knob 'gamma_schedule': range {part!r} needs 1 <= LO <= HI and 0 <= G <= 32")
        if out and lo != out[-1].hi + 1:
            raise AcceptanceError(f"knob 'gamma_schedule': range {part!r} must start at {out[-1].hi + 1}")
        out.append(Range(lo, hi, gamma))
    if not out or out[0].lo != 1:
        raise AcceptanceError(f"knob 'gamma_schedule': the ranges must start at batch size 1, got {spec!r}")
    if max(r.gamma for r in out) < 1:
        raise AcceptanceError("knob 'gamma_schedule': speculation is off at every batch size; run a vanilla leg")
    return out


def max_gamma(ranges: list[Range]) -> int:
    return max(r.gamma for r in ranges)


def _cost_rows(run_dir: Path) -> list[dict[str, Any]]:
    """(batch, γ) -> the cells of a cost-ladder run: vanilla per-token ms, and the measured S at α = 1."""
    table = run_dir / "tables" / "cost_ratio.csv"
    if not table.is_file():
        raise AcceptanceError(f"knob 'gamma_schedule': auto:{run_dir}: no {table} (a finished E16 run folder; "
                              f"`workbench export` writes its tables)")
    rows = []
    with table.open() as f:
        for r in csv.DictReader(f):
            if str(r.get("draft_graphs")) not in ("True", "true", "1"):
                continue
            # decode-only first (what TPOT sees): the decode timed apart from the first token, else the
            # step times' ratio, else (an old table) the end-to-end ratio, which holds the prefill
            basis = next((k for k in ("S_measured_decode_alpha1", "S_steps_alpha1", "S_measured_alpha1")
                          if r.get(k) not in (None, "")), None)
            try:
                rows.append({"size": r["size"], "batch": int(r["batch"]), "gamma": int(r["gamma"]),
                             "c": float(r["c"]), "verify_ms": float(r["verify_ms"]),
                             "propose_ms": float(r["propose_ms"]), "decode_ms": float(r["decode_ms"]),
                             "S1": float(r[basis]), "basis": basis})
            except (KeyError, ValueError, TypeError):
                continue
    if not rows:
        raise AcceptanceError(f"knob 'gamma_schedule': auto:{run_dir}: {table} has no drafter-graph rows")
    return rows


def schedule_table(run_dir: Path, rates_of, max_batch: int, kernel: str | None = None) -> list[dict[str, Any]]:
    """Predicted speedup of every measured (batch, γ) cell at the leg's acceptance.

    Each cell's real step time comes from the measurement at α = 1 (all γ + 1 tokens kept):
    T_step(b, γ) = (γ + 1) · T_vanilla(b) / S_measured(b, γ, α = 1), so the verify step's growth with
    batch × (γ + 1) tokens is in it, not only the draft's c. At the leg's acceptance a step yields
    E[tokens](α, γ) = 1 + Σ rates, so S(α) = E[tokens] · T_vanilla / T_step = E[tokens] / (γ + 1) · S_measured.
    ``rates_of(γ)``: the leg's unconditional per-position rates at γ; ``kernel``: the leg's draft kernel, whose
    setup is read where the table has one.
    """
    rows = _cost_rows(run_dir)
    sizes = sorted({r["size"] for r in rows})
    # one drafter setup (the label names it: kernel, graph mode, ...), never a mix of setups per cell
    setup = _pick_setup(rows, kernel)
    best = {(r["batch"], r["gamma"]): r for r in rows if r["size"] == setup}
    out = []
    for (b, g), r in sorted(best.items()):
        tokens = expected_tokens(rates_of(g))
        out.append({"batch": b, "gamma": g, "setup": r["size"], "source": _shown(run_dir), "c": r["c"],
                    "S_measured_alpha1": r["S1"], "S_basis": r["basis"],
                    "expected_tokens": tokens, "S_predicted": tokens / (g + 1) * r["S1"]})
    if not out:
        raise AcceptanceError(f"knob 'gamma_schedule': auto:{run_dir}: no cells (sizes {sizes})")
    return out


IDLE_FREE = ("skip", "skip_all")  # draft_idle values whose γ-0 decode step runs no draft pass


def off_speedup(cells: list[dict[str, Any]], idle: str) -> float:
    """Predicted S of a step at γ 0 at one batch size (``cells``: that batch's measured cells).

    ``skip`` (knob ``draft_idle``): no draft pass runs, the step costs a vanilla step, S = 1. ``sync``
    (vLLM's): the draft's pass over the batch still runs to keep its KV cache, so the step costs a vanilla
    step plus about one draft step, S = 1 / (1 + c) with c of the smallest measured γ at that batch
    (the ratio of a draft step to the verify step; the verify step of a small γ is close to vanilla's).
    """
    if idle in IDLE_FREE:
        return 1.0
    c = min(cells, key=lambda r: r["gamma"])["c"]
    return 1.0 / (1.0 + float(c))


def auto_schedule(run_dir: Path, rates_of, max_batch: int, min_gain: float = 1.0, idle: str = "sync",
                  kernel: str | None = None) -> tuple[list[Range], list[dict]]:
    """The γ per batch-size range that maximises predicted S; 0 (speculation off) where that is predicted
    faster than every γ (``off_speedup``: free only with ``draft_idle=skip``, whose threshold is ``min_gain``).

    Between two measured batch sizes the smaller one's choice holds up to the larger's midpoint. Past the
    largest measured batch nothing was measured and the verify step's cost grows with the batch (an 8B
    table measured at batch 1 and 4 held γ 4 up to 32, where the twin ran at 0.80x vanilla's TPOT on the
    H200): with ``skip`` speculation is off there; with ``sync`` an off step still pays a draft pass, so the
    largest measured batch's choice holds.
    """
    cells = schedule_table(run_dir, rates_of, max_batch, kernel)
    batches = sorted({c["batch"] for c in cells})
    choice: dict[int, dict] = {}
    for b in batches:
        cand = [c for c in cells if c["batch"] == b]
        top = max(cand, key=lambda c: c["S_predicted"])
        s_off = off_speedup(cand, idle)
        bar = min_gain if idle in IDLE_FREE else s_off
        choice[b] = top if top["S_predicted"] > bar else dict(top, gamma=0, S_predicted=s_off)
        for c in cand:
            c["S_off_predicted"] = s_off
    ranges: list[Range] = []
    lo = 1
    for i, b in enumerate(batches):
        last = i == len(batches) - 1
        hi = (max_batch if idle not in IDLE_FREE else b) if last else max(lo, (b + batches[i + 1]) // 2)
        hi = min(hi, max_batch)
        if lo > max_batch:
            break
        g = int(choice[b]["gamma"])
        if ranges and ranges[-1].gamma == g:
            ranges[-1] = Range(ranges[-1].lo, hi, g)
        else:
            ranges.append(Range(lo, hi, g))
        lo = hi + 1
    if lo <= max_batch:  # past the largest measured batch under skip: off
        if ranges[-1].gamma == 0:
            ranges[-1] = Range(ranges[-1].lo, max_batch, 0)
        else:
            ranges.append(Range(lo, max_batch, 0))
    table = [dict(c, chosen=(choice[c["batch"]]["gamma"] == c["gamma"])) for c in cells]
    if max(r.gamma for r in ranges) < 1 or max(ch["S_predicted"] for ch in choice.values()) <= min_gain:
        raise AcceptanceError(f"knob 'gamma_schedule': auto:{run_dir}: no γ is predicted to pay at any batch "
                              f"size at this acceptance (best S {max(c['S_predicted'] for c in cells):.2f}); "
                              f"run vanilla")
    return ranges, table


REPO = Path(__file__).resolve().parents[1]
RESULTS_E16 = REPO / "results" / "E16"


def run_path(text: str) -> Path:
    """A run folder named by ``from:`` or ``auto:``: a relative one is read from the repository, where legs run
    (the catalogue's own defaults are written so), wherever the run was started."""
    path = Path(text)
    return path if path.is_absolute() else REPO / path


def _shown(path: Path) -> str:
    """A run folder as records keep it: relative to the repository when it is inside it."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def setup_kernel_matches(label: str, kernel: str | None) -> bool:
    """Whether an E16 setup label (``8b [marlin full_all]``) names the draft kernel ``kernel`` (a leg's
    ``draft_linear_kernel``; ``auto`` drafts on Marlin, and the first tables named it ``auto``)."""
    m = re.search(r"\[(\S+)", label)
    if kernel is None or m is None:
        return False
    return m.group(1) in (("auto", "marlin") if kernel == "auto" else (kernel,))


def _pick_setup(rows: list[dict[str, Any]], kernel: str | None = None) -> str:
    """The setup a table is read at: the leg's kernel's where the table has it (the ``auto`` schedule of a leg
    drafting on Marlin read an own-cuda table and predicted own-cuda's S), then the one measured at the most
    cells, then the fastest on average."""
    by_setup: dict[str, list[dict]] = {}
    for r in rows:
        by_setup.setdefault(r["size"], []).append(r)
    return max(by_setup, key=lambda k: (setup_kernel_matches(k, kernel), len(by_setup[k]),
                                        sum(r["S1"] for r in by_setup[k]) / len(by_setup[k])))


def _setup_speed(rows: list[dict[str, Any]], kernel: str | None = None) -> float:
    """How fast a table's drafter setup is: its best measured S(α = 1) at its smallest batch, over the setup
    ``schedule_table`` would read."""
    setup = _pick_setup(rows, kernel)
    cells = [r for r in rows if r["size"] == setup]
    b0 = min(r["batch"] for r in cells)
    return max(r["S1"] for r in cells if r["batch"] == b0)


def run_card(run_dir: Path) -> str | None:
    """The GPU a run folder was measured on (its ``env.json``), None where it names none."""
    try:
        env = json.loads((Path(run_dir) / "env.json").read_text())
        return (env.get("gpu") or {}).get("devices", [{}])[0].get("name") or None
    except (OSError, ValueError, AttributeError, IndexError, TypeError):
        return None


@functools.lru_cache(maxsize=1)
def host_card() -> str | None:
    """The GPU a leg here runs on (the first that CUDA_VISIBLE_DEVICES leaves), None without one."""
    from workbench import placement

    gpus = placement.capture("local").get("gpus") or []
    return gpus[0].get("name") if gpus else None


def default_cost_run(target: str | None, root: Path | None = None, max_batch: int | None = None,
                     card: str | None = None, kernel: str | None = None) -> Path:
    """The E16 run folder with cells of ``target``'s size at two or more batch sizes, measured on ``card``
    (the GPU here) where such a folder exists: a draft step's share of a target step differs by card (8B
    shape: the twin at α 1, γ 4 behind a server on an H100 paid 1.59× at concurrency 4 where the H200's
    table measured 1.03×). Among those, the one that reaches ``max_batch`` (the server's largest batch),
    or else reaches furthest (past a table's largest batch the schedule turns speculation off); then the
    one whose drafter setup is fastest at its smallest batch (an older table of a slower kernel or graph
    mode predicts that nothing pays), then the newest. Before reach: a table that measured the leg's draft
    ``kernel`` (an own-cuda table priced a Marlin leg's schedule: 8B H100, E18 20261207T235605Z-869510a1)."""
    size = Path(str(target or "")).name.split("-")[0]
    root = RESULTS_E16 if root is None else root
    found: list[tuple[bool, bool, int, float, Path]] = []  # same card, leg's kernel, reach, speed, folder
    for run in sorted(root.glob("*/tables/cost_ratio.csv"), reverse=True):
        try:
            rows = [r for r in _cost_rows(run.parents[1]) if r["size"].split(" ")[0] == size]
        except AcceptanceError:
            continue
        batches = {r["batch"] for r in rows}
        if len(batches) >= 2:
            reach = max(batches) if max_batch is None else min(max(batches), max_batch)
            same = card is not None and run_card(run.parents[1]) == card
            match = any(setup_kernel_matches(r["size"], kernel) for r in rows)
            found.append((same, match, reach, _setup_speed(rows, kernel), run.parents[1]))
    if found:
        return max(found, key=lambda f: f[:4])[4]  # max keeps the first (newest) of equal keys
    raise AcceptanceError(f"knob 'gamma_schedule': auto found no E16 run of size {size!r} with two or more "
                          f"batch sizes under {root}; name one: auto:RUN_DIR")


def resolve_schedule(spec: str, gamma: int, acceptance: str, max_batch: int, target: str | None = None,
                     idle: str = "sync", card: str | None = None, kernel: str | None = None
                     ) -> tuple[list[Range] | None, list[dict] | None]:
    """The schedule's ranges (None: fixed γ) and, for ``auto``, the table it was chosen from (``card``: the GPU
    here, whose own table bare ``auto`` prefers)."""
    spec = str(spec).strip()
    if spec == "none":
        return None, None
    if spec == "auto":
        spec = f"auto:{default_cost_run(target, max_batch=max_batch, card=card, kernel=kernel)}"
    if spec.startswith("auto:"):
        def rates_of(g: int) -> list[float]:
            if acceptance == "real":
                raise AcceptanceError("knob 'gamma_schedule': auto needs an acceptance profile to predict "
                                      "from (knob 'acceptance': alpha:A, rates:..., length:L or from:RUN_DIR)")
            return unconditional_rates(acceptance, g) or []
        return auto_schedule(run_path(spec[5:].strip()), rates_of, max_batch, idle=idle, kernel=kernel)
    ranges = parse_schedule(spec)
    if max_gamma(ranges) > gamma:
        raise AcceptanceError(f"knob 'gamma_schedule': {spec!r} asks for γ {max_gamma(ranges)} above the leg's "
                              f"gamma {gamma} (vLLM caps every range at num_speculative_tokens)")
    return ranges, None


def source_card(source: str | None) -> str | None:
    """``run_card`` of a run folder as records name it (``_shown``: relative to the repository, or absolute)."""
    return run_card(Path(source) if Path(source).is_absolute() else REPO / source) if source else None


def _card_check(source: str | None, card: str | None) -> dict[str, Any]:
    """Which GPU the schedule's cost table was measured on against the GPU here; a warning where they differ
    (said once per process and table)."""
    table_card = source_card(source)
    same = None if table_card is None or card is None else table_card == card
    if same is False:
        _warn_once(f"gamma_schedule auto: the cost table {source} was measured on {table_card}, this leg runs on "
                   f"{card}; a draft step's share of a target step differs by card, so its choice of γ may not "
                   f"hold here (run E16 on this card and the schedule reads that table)")
    return {"gamma_schedule_card": table_card, "gamma_schedule_host_card": card, "gamma_schedule_same_card": same}


_WARNED: set[str] = set()


def _warn_once(text: str) -> None:
    if text not in _WARNED:
        _WARNED.add(text)
        print(f"warning: {text}", file=sys.stderr, flush=True)


def spec_config_extra(gamma: int, acceptance: str, schedule: str, max_batch: int, target: str | None = None,
                      idle: str = "sync", kernel: str | None = None) -> tuple[dict[str, Any], dict]:
    """The ``speculative_config`` fields these two knobs add, and what was resolved (for the records).

    With a schedule, ``num_speculative_tokens`` is the schedule's largest γ (vLLM's lookup caps every
    range at it), and the synthetic rates are given for that many positions.
    """
    extra: dict[str, Any] = {}
    info: dict[str, Any] = {}
    card = host_card() if str(schedule).strip().startswith("auto") else None
    ranges, table = resolve_schedule(schedule, gamma, acceptance, max_batch, target, idle, card, kernel)
    g = gamma
    if ranges is not None:
        g = max_gamma(ranges) if schedule.startswith("auto") else gamma
        extra["num_speculative_tokens"] = g
        if len(ranges) == 1 and ranges[0].gamma == g:
            # one γ at every batch size is no schedule: handing it to vLLM would only switch the target's
            # CUDA graphs from FULL to PIECEWISE ("dynamic speculative decoding"), a slower verify step
            info["gamma_schedule_constant"] = True
        else:
            extra["num_speculative_tokens_per_batch_size"] = [r.as_vllm() for r in ranges]
        info["gamma_schedule"] = [r.as_vllm() for r in ranges]
        info["draft_idle"] = idle  # what a γ-0 step costs: a draft pass (sync) or none (skip)
        if table is not None:
            info["gamma_schedule_table"] = table
            info["gamma_schedule_source"] = table[0].get("source")
            info.update(_card_check(table[0].get("source"), card))
    info["num_speculative_tokens"] = g
    rates = unconditional_rates(acceptance, g)
    if rates is not None:
        extra["rejection_sample_method"] = "synthetic"
        extra["synthetic_acceptance_rates"] = [round(r, 6) for r in rates]
        info["synthetic_acceptance_rates"] = extra["synthetic_acceptance_rates"]
        info["synthetic_acceptance_length"] = expected_tokens(rates)
        if acceptance.startswith("from:"):
            info["synthetic_acceptance_source"] = rates_from_run(acceptance[5:])[1]
    return extra, info
