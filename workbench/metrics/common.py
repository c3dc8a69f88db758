"""Shared by every metric: leg keys and order, the spec tiers, and the acceptance formulas (the only place
they are written: ``acceptance_rate``, ``acceptance_length``, ``position_acceptance``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from ..knobs import column_knobs


LEG_KEYS = ["leg", "leg_index", "tier", *column_knobs("record")]


# --------------------------------------------------------------------------- helpers


def _require(records: pd.DataFrame, cols: Iterable[str], what: str) -> None:
    missing = [c for c in cols if c not in records.columns]
    if missing:
        raise ValueError(f"{what}: records lack column(s) {missing}")


def _leg_order(records: pd.DataFrame, legs_order: Sequence[str] | None) -> list[str]:
    present = list(dict.fromkeys(records["leg"]))
    if legs_order is None:
        if "leg_index" in records.columns:
            firsts = records.groupby("leg", sort=False)["leg_index"].first()
            return list(firsts.sort_values(kind="stable").index)
        return present
    order = list(legs_order)
    unknown = [leg for leg in present if leg not in order]
    if unknown:
        raise ValueError(f"legs {unknown} have records but are not in legs_order {order}")
    return order


def _leg_meta(records: pd.DataFrame) -> pd.DataFrame:
    cols = [c for c in LEG_KEYS if c in records.columns]
    return records[cols].drop_duplicates("leg").set_index("leg")


SPEC_TIERS = ("strict", "relaxed", "synthetic")


# --------------------------------------------------------------------------- acceptance vocabulary


def _per(num: Any, den: Any) -> Any:
    """num / den where den > 0: NaN elsewhere (arrays, Series), None for a scalar with den 0."""
    if np.ndim(num) == 0 and np.ndim(den) == 0 and not isinstance(num, pd.Series) and not isinstance(den, pd.Series):
        return float(num) / float(den) if den and float(den) > 0 else None
    n, d = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(d > 0, n / np.where(d > 0, d, 1.0), np.nan)
    index = next((x.index for x in (num, den) if isinstance(x, pd.Series)), None)
    return out if index is None else pd.Series(out, index=index)


def acceptance_rate(accepted: Any, draft_tokens: Any) -> Any:
    """Acceptance rate (vLLM's): accepted / draft tokens. Scalars, arrays or Series."""
    return _per(accepted, draft_tokens)


def position_acceptance(accepted_at_position: Any, drafts: Any) -> Any:
    """Per-position acceptance (vLLM's): accepted at draft position i / drafts."""
    return _per(accepted_at_position, drafts)


def acceptance_length(accepted: Any, drafts: Any) -> Any:
    """Acceptance length (vLLM's): 1 + accepted / drafts, tokens emitted per target step."""
    ratio = _per(accepted, drafts)
    return None if ratio is None else 1 + ratio


def _is_vanilla(records: pd.DataFrame) -> pd.Series:
    return records["tier"].eq("vanilla")


def _is_spec(records: pd.DataFrame) -> pd.Series:
    # Other record kinds (e.g. tier "score" from a teacher-forced scoring pass) are neither.
    return records["tier"].isin(SPEC_TIERS)
