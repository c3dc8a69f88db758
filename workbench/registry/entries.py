"""What the registry holds: leg templates, smoke settings, experiments, profiles, the ``Registry``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .checks import RegistryError, split_role


# --- data classes ------------------------------------------------------------------------------

@dataclass(frozen=True)
class LegTemplate:
    name: str
    kind: str
    model: str = "target"
    draft: str | None = None
    tier: str | None = None
    reference: str | None = None
    knobs: dict[str, Any] = field(default_factory=dict)
    named_only: bool = False  # run only when `-p legs=` names it (an A/B not worth a server in every run)

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "kind": self.kind, "model": self.model}
        for k in ("draft", "tier", "reference"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.named_only:
            d["named_only"] = True
        d.update(self.knobs)
        return d


@dataclass(frozen=True)
class Smoke:
    knobs: dict[str, Any] = field(default_factory=dict)
    sweep: dict[str, list] = field(default_factory=dict)
    legs: list[str] | None = None
    datasets: list[str] | None = None
    bracket_every: int | None | bool = True  # True: keep the experiment's bracketing
    ladder: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {"knobs": self.knobs, "sweep": self.sweep, "legs": self.legs, "dataset": self.datasets}
        if self.ladder:
            out["ladder"] = self.ladder
        return out


@dataclass(frozen=True)
class Experiment:
    id: str
    title: str
    question: str
    dataset: str
    legs: list[LegTemplate]
    sweep: dict[str, list]
    defaults: dict[str, Any]
    analyses: list[str]
    smoke: Smoke
    bracket_every: int | None  # None: legs are run exactly as listed, no vanilla legs added
    profiles: list[str]
    result_prefix: str | None = None
    notes: str | None = None
    runner: str = "legs"
    ladder: dict[str, Any] = field(default_factory=dict)

    def summary_row(self) -> dict[str, Any]:
        sweep = "; ".join(f"{k}={','.join(map(str, v))}" for k, v in self.sweep.items())
        return {"id": self.id, "title": self.title, "dataset": self.dataset,
                "legs": ", ".join(t.name for t in self.legs), "sweep": sweep,
                "profiles": ", ".join(self.profiles) or "any"}

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "title": self.title, "question": self.question, "dataset": self.dataset,
                "legs": [t.to_dict() for t in self.legs], "sweep": self.sweep, "defaults": self.defaults,
                "analyses": self.analyses, "smoke": self.smoke.to_dict(),
                "bracket_every": self.bracket_every, "profiles": self.profiles,
                "result_prefix": self.result_prefix, "runner": self.runner,
                **({"ladder": self.ladder} if self.runner == "ladder" else {})}


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    device: str
    roles: dict[str, str]
    engine: dict[str, Any]
    tiny: bool = False
    stand_in: bool = False
    default_smoke: bool = False
    shapes: bool = False              # roles are workbench.shapes stand-ins (configs only), built on demand
    load_format: str | None = None    # vLLM load_format; "dummy": random weights
    organism: str | None = None       # the trained organism's variant (workbench.organism), built on demand
    # a stand-in profile's `role@other` references resolve to the profile named here for `other` (E14 under
    # the organism: 8b-thinking -> organism-thinking), to this profile itself for any other profile
    stand_ins: dict[str, str] = field(default_factory=dict)


@dataclass
class Registry:
    experiments: dict[str, Experiment]
    profiles: dict[str, Profile]
    defaults: dict[str, Any]
    smoke_defaults: dict[str, Any]
    source: str = ""

    def ids(self) -> list[str]:
        return list(self.experiments)

    def experiment(self, exp_id: str) -> Experiment:
        key = str(exp_id).strip().upper()
        if key not in self.experiments:
            raise RegistryError(f"unknown experiment {exp_id!r}; known: {', '.join(self.experiments)}")
        return self.experiments[key]

    def profile(self, name: str) -> Profile:
        if name not in self.profiles:
            raise RegistryError(f"unknown profile {name!r}; known: {', '.join(self.profiles)}")
        return self.profiles[name]

    def table(self) -> list[dict[str, Any]]:
        return [e.summary_row() for e in self.experiments.values()]

    def role_profile(self, profile: "Profile | str", ref: str) -> Profile:
        """The profile whose binding the role reference ``ref`` ("twin", "twin@8b-instruct") takes in a run
        under ``profile``: that profile for a plain role; under a stand-in profile, the one its
        ``stand_ins`` names for the referenced profile, else itself; otherwise the referenced profile."""
        prof = self.profile(profile) if isinstance(profile, str) else profile
        other = split_role(ref)[1]
        if other is None:
            return prof
        if prof.stand_in:
            return self.profile(prof.stand_ins.get(other, prof.name))
        return self.profile(other)
