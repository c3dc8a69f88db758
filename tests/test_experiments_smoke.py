"""Experiments E1–E8 end to end at smoke size under the tiny profile (tests/smoke_runs.py says how; E9–E15:
tests/test_experiments_smoke_e9_e15.py)."""

from __future__ import annotations

import pytest

from smoke_runs import IDS as ALL_IDS
from smoke_runs import check_smoke, run_smoke

IDS = ALL_IDS[: ALL_IDS.index("E8") + 1]


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """Every experiment of IDS run to the end, two at a time (tests/smoke_runs.py)."""
    return run_smoke(tmp_path_factory, IDS)


@pytest.mark.vllm
@pytest.mark.parametrize("exp_id", IDS)
def test_experiment_smoke(smoke_runs, exp_id):
    check_smoke(smoke_runs, exp_id)
