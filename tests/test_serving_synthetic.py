"""Issue 36 on CPU: E18's serving ladder under the tiny profile — one server per leg swept over two
concurrencies, the twin at synthetic α 0.9 (vLLM's synthetic sampler; the plugin's CPU path), bracketed
by vanilla servers; the tables say "synthetic α" and pair each cell with the vanilla cells of its concurrency."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import REPO, workbench_cli

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def e18(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("e18")
    cmd = workbench_cli("run", "E18", "--profile", "tiny", "--smoke", "-p", "legs=twin_a0.9", "--results", str(root),
                        "--formats", "html", "--no-notebook")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return next(root.glob("E18/*/"))


def _leg(run, name):
    d = run / "legs" / name
    return json.loads((d / "summary.json").read_text()), [json.loads(l) for l in (d / "records.jsonl").read_text().splitlines()]


def test_one_server_per_leg_swept_over_the_concurrencies(e18):
    for name in ("vanilla_1", "twin_a0.9", "vanilla_2"):
        s, recs = _leg(e18, name)
        assert [c["concurrency"] for c in s["cells"]] == [1, 2]
        assert s["server"]["command"][s["server"]["command"].index("--max-num-seqs") + 1] == "2"
        # each cell's requests: the prompt set (4) at least twice the concurrency, ids by cell
        for c in (1, 2):
            cell = [r for r in recs if r["concurrency"] == c]
            assert len(cell) == 4 and all(r["request_id"].startswith(f"{name}-c{c}-") for r in cell)
            assert (e18 / "legs" / name / f"c{c}" / "bench.json").is_file()


def test_synthetic_leg_draws_its_acceptance_and_says_so(e18):
    import pandas as pd

    s, recs = _leg(e18, "twin_a0.9")
    assert s["tier"] == "synthetic" and {r["tier"] for r in recs} == {"synthetic"}
    assert s["speculative"]["synthetic_acceptance_rates"] == pytest.approx([0.9, 0.81, 0.729, 0.6561])
    for cell in s["cells"]:
        c = cell["spec"]
        assert 0 < c["num_accepted_tokens"] <= c["num_draft_tokens"]
        # per position the counts fall as the unconditional rates do (never more at a later position)
        assert all(a >= b for a, b in zip(c["accepted_per_pos"], c["accepted_per_pos"][1:]))
    t = pd.read_csv(e18 / "tables" / "serving_speedup.csv")
    assert sorted(t["concurrency"]) == [1, 2] and set(t["leg"]) == {"twin_a0.9"}
    assert set(t["acceptance"]) == {"synthetic α (alpha:0.9)"}
    assert (t["vanilla_before"] == "vanilla_1").all() and (t["vanilla_after"] == "vanilla_2").all()
