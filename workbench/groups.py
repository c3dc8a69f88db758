"""Bracket groups: the unit a run's legs are placed on a GPU by.

A spec leg's speedup divides by the vanilla legs that bracket it (``metrics.bracketing_vanilla``: the
nearest vanilla leg before and after it in run order), so a spec leg and those two vanilla legs must
run on one GPU, in order. A bracket group is the smallest set of legs closed under that: each spec leg
with its bracketing vanilla legs, each score leg with the vanilla leg it scores; legs keep run order.

Where two brackets share a vanilla leg (V s s V s s V, the plan's default) they are one group: the
shared leg cannot run on two GPUs. A plan with ``own_brackets`` (``workbench run --executor ray``)
gives each bracket its own vanilla legs (V s s V V s s V): one more vanilla leg per bracket, and
each bracket is a group of its own.

    bracket_groups(legs) -> [BracketGroup(index, legs, tp), ...]    (pure)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from workbench.planning import PlannedLeg

__all__ = ["BracketGroup", "bracket_groups"]


@dataclass(frozen=True)
class BracketGroup:
    index: int                # 0-based, in the order of each group's first leg
    legs: tuple[str, ...]     # in run order
    tp: int                   # GPUs the group holds: its legs' largest tensor_parallel_size

    def to_dict(self) -> dict:
        return {"group": self.index, "legs": list(self.legs), "tensor_parallel_size": self.tp}


def _tp(leg: PlannedLeg) -> int:
    return int(leg.knobs.get("tensor_parallel_size") or 1)


def bracket_groups(legs: Sequence[PlannedLeg]) -> list[BracketGroup]:
    """The run's legs (run order) as bracket groups, each in run order; every leg in exactly one."""
    names = [l.name for l in legs]
    parent = {n: n for n in names}

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    def join(a: str | None, b: str | None) -> None:
        if a in parent and b in parent:
            parent[find(a)] = find(b)

    vanilla = [i for i, l in enumerate(legs) if l.kind == "vanilla"]
    for i, leg in enumerate(legs):
        if leg.kind == "score":
            join(leg.name, leg.reference)
        elif leg.kind != "vanilla":
            before = max((j for j in vanilla if j < i), default=None)
            after = min((j for j in vanilla if j > i), default=None)
            for j in (before, after):
                if j is not None:
                    join(leg.name, names[j])
    members: dict[str, list[PlannedLeg]] = {}
    for leg in legs:
        members.setdefault(find(leg.name), []).append(leg)
    return [BracketGroup(k, tuple(l.name for l in group), max(_tp(l) for l in group))
            for k, group in enumerate(members.values())]
