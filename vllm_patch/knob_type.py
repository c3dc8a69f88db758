"""One knob of the table (``vllm_patch.knobs``): its name, type, rule, environment variable and leg option, and
how a value is checked, parsed from a string and written into an engine's environment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class KnobError(ValueError):
    """A knob has a value that is refused; the message names the knob (or variable) and the rule."""


@dataclass(frozen=True)
class Knob:
    name: str
    type: type                       # bool | int | float | str
    default: Any
    check: Callable[[Any], bool]
    rule: str                        # the check in words: "a float >= 0"
    help: str
    env: str | None = None           # engine environment variable
    env_inverted: bool = False       # the variable holds the negation (VLLM_SPEC_DISABLE_...)
    flag: str | None = None          # leg command-line option
    spec_only: bool = False          # means something only with a draft
    applies_on_cpu: bool = True      # False: accepted on CPU, recorded as having no effect
    leg_default: Any = ...           # a leg's default when it differs from the engine's (``...``: the same)
    column: str | None = None        # "record": a column of records, LEG_KEYS and the leg table; "leg": of the
    #                                  leg table only; None: no column (the value stays in the record's knobs)
    leg_extra: tuple[str, ...] = ()  # further leg-table columns the engine reports beside it (..._applies)

    @property
    def leg_value(self) -> Any:
        """The value a leg takes when nobody sets the knob."""
        return self.default if self.leg_default is ... else self.leg_default

    def validate(self, value: Any, where: str = "") -> Any:
        """``value`` if it has the knob's type and passes its check (ints widen to float); else KnobError."""
        if self.type is bool:
            ok = isinstance(value, bool)
        elif self.type is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.type is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ok:
                value = float(value)
        else:
            ok = isinstance(value, self.type)
        if not ok or not self.check(value):
            raise KnobError(f"{where + ': ' if where else ''}knob {self.name!r} must be {self.rule}, got {value!r}")
        return value

    def parse(self, text: str, where: str = "") -> Any:
        """Typed value of a string (command line, environment)."""
        raw = str(text).strip()
        try:
            if self.type is bool:
                low = raw.lower()
                if low not in _TRUE | _FALSE:
                    raise ValueError
                value: Any = low in _TRUE
            elif self.type is int:
                value = int(raw)
            elif self.type is float:
                value = float(raw)
            else:
                value = raw
        except ValueError:
            raise KnobError(f"{where + ': ' if where else ''}knob {self.name!r} must be {self.rule}, "
                            f"got {text!r}") from None
        return self.validate(value, where)

    def env_value(self, value: Any) -> str:
        """The string the engine's environment gets for ``value``."""
        if self.type is bool:
            return "1" if bool(value) != self.env_inverted else "0"
        return repr(float(value)) if self.type is float else str(value)

    def read_env(self, env: Mapping[str, str]) -> Any:
        """The knob's value from the engine's environment (unset or empty: the default)."""
        raw = env.get(self.env or "")
        if raw is None or raw.strip() == "":
            return self.default
        if self.type is bool:
            low = raw.strip().lower()
            if low not in _TRUE | _FALSE:
                raise KnobError(f"{self.env}={raw!r} is not a boolean (use 1/0, true/false)")
            return (low in _TRUE) != self.env_inverted
        try:
            return self.validate(self.type(raw.strip()))
        except (ValueError, KnobError):
            raise KnobError(f"{self.env}={raw!r} must be {self.rule} ({self.help})") from None
