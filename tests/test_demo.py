"""The demo's comparison is read from its run folder through the analysis registry."""

from __future__ import annotations

import re
import statistics

import pytest

from synthetic_runs import E1_LEGS, write_run
from workbench import demo, metrics
from workbench.results import load_run


def test_demo_report_quotes_the_run_folder(tmp_path):
    rdir = write_run(tmp_path, legs=E1_LEGS, n_prompts=6)
    text, exact = demo.report(rdir)
    assert exact
    assert f"run folder: {rdir}" in text
    assert "6/6 equal -> passes the exactness rule" in text
    rec = load_run(rdir).records
    spec = [r for r in rec.itertuples() if r.leg == "strict_g6"]
    accepted = sum(r.spec["accepted"] for r in spec)
    rate = metrics.acceptance_rate(accepted, sum(r.spec["draft_tokens"] for r in spec))
    length = metrics.acceptance_length(accepted, sum(r.spec["drafts"] for r in spec))
    assert f"acceptance: rate {rate:.3f}, length {length:.2f}" in text
    van = {leg: rec[rec["leg"] == leg].set_index("pid")["tok_s"] for leg in ("vanilla_0", "vanilla_1")}
    ratios = [r.tok_s / ((van["vanilla_0"][r.pid] + van["vanilla_1"][r.pid]) / 2) for r in spec]
    speedup = float(re.search(r"legs\): ([0-9.]+)x", text).group(1))
    assert speedup == pytest.approx(statistics.median(ratios), abs=0.005)
    # one line per leg, in run order, with the leg's tokens
    rows = [line.split() for line in text.splitlines() if line.split()[:1] and line.split()[0] in
            {leg["name"] for leg in E1_LEGS}]
    assert [r[0] for r in rows] == [leg["name"] for leg in E1_LEGS]
    assert all(int(r[3]) == 6 * 32 for r in rows)
