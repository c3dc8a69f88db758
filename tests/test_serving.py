"""Issue 20: serving legs, the patched engine behind `vllm serve`, measured by vLLM's own benchmark client.

One E17 smoke run (vanilla, strict, relaxed, vanilla; each one server driven at concurrency 2, the run's one
cell, images included, float32 so that
strict must equal vanilla), killed while its second leg's server is up and then resumed. The bounded load
test is tests/test_serving_load.py's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from serving_checks import alive as _alive, records as _records

pytestmark = pytest.mark.vllm

SPEC_LEGS = ("strict_g6", "relaxed_g6")
VANILLA_LEGS = ("vanilla_1", "vanilla_2")


@pytest.fixture(scope="module")
def e17(tmp_path_factory, tiny_models):
    """The E17 smoke run: interrupted during the strict leg (its server up), then resumed."""
    root = tmp_path_factory.mktemp("serving")
    # float32 with the twin's int4 values dequantized: vLLM's CPU int4 kernel (AVX-512 hosts) has no
    # float32 path, so an int4 twin in float32 would run only where the plugin's fallback does (AVX2)
    cmd = [sys.executable, "-m", "workbench.cli", "run", "E17", "--profile", "tiny", "--smoke", "-p",
           "dtype=float32", "--model-path", f"twin={tiny_models['twin-dequant']}", "--results", str(root),
           "--formats", "html", "--no-notebook"]
    log = (root / "first.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
    killed_server = None
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None:
        found = list(root.glob("E17/*/legs/strict_g6/server.json"))
        if found:
            killed_server = json.loads(found[0].read_text())
            break
        time.sleep(1)
    assert killed_server is not None, (root / "first.log").read_text()[-3000:]
    proc.send_signal(signal.SIGTERM)            # the workbench, mid-leg
    first_rc = proc.wait(timeout=180)
    log.close()
    run_dir = next(root.glob("E17/*/"))
    after_kill = {
        "rc": first_rc,
        "server_alive": _alive(killed_server["pid"]),
        "failure": json.loads((run_dir / "legs" / "strict_g6" / "failure.json").read_text())
        if (run_dir / "legs" / "strict_g6" / "failure.json").is_file() else None,
        "vanilla_1_summary": (run_dir / "legs" / "vanilla_1" / "summary.json").read_bytes(),
    }
    resumed = subprocess.run([*cmd[:-1], "--resume", str(run_dir), "--no-notebook"], cwd=REPO,
                             capture_output=True, text=True, timeout=1800)
    (root / "resume.log").write_text(resumed.stdout + "\n--- stderr\n" + resumed.stderr)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    return {"run": run_dir, "after_kill": after_kill, "resume": resumed}


def test_killed_mid_leg_leaves_no_server_and_a_failure_record(e17):
    k = e17["after_kill"]
    assert k["rc"] != 0
    assert not k["server_alive"], "the interrupted leg's server outlived the workbench"
    assert k["failure"] is not None and k["failure"]["status"] == "failed"
    # #38: the leg names the signal that stopped it, not `SystemExit: 143`
    assert k["failure"]["error"].startswith("LegStopped: stopped by SIGTERM"), k["failure"]["error"]


def test_resume_redoes_only_the_interrupted_leg(e17):
    run = e17["run"]
    out = e17["resume"].stdout + e17["resume"].stderr
    assert "1 already complete, 3 to run" in out, out[-2000:]
    # the leg that had finished was not run again
    assert (run / "legs" / "vanilla_1" / "summary.json").read_bytes() == e17["after_kill"]["vanilla_1_summary"]
    for leg in (*VANILLA_LEGS, *SPEC_LEGS):
        s = json.loads((run / "legs" / leg / "summary.json").read_text())
        assert s["status"] == "complete" and s["completed"] == s["n_requests"] == 6, leg
        # no leg's server outlived its leg
        assert not _alive(json.loads((run / "legs" / leg / "server.json").read_text())["pid"]), leg


def test_spec_counters_equal_the_per_request_trace(e17):
    """The server's own /metrics counters (difference over the leg) = the sum of the per-request trace."""
    for leg in SPEC_LEGS:
        d = e17["run"] / "legs" / leg
        s, recs = json.loads((d / "summary.json").read_text()), _records(d)
        assert [cell["concurrency"] for cell in s["cells"]] == [2] and {r["concurrency"] for r in recs} == {2}
        s = s["cells"][0]
        c = s["spec"]
        assert c["num_drafts"] > 0
        assert sum(r["spec"]["drafts"] for r in recs) == c["num_drafts"]
        assert sum(r["spec"]["draft_tokens"] for r in recs) == c["num_draft_tokens"]
        assert sum(r["spec"]["accepted"] for r in recs) == c["num_accepted_tokens"]
        per_pos = [sum(r["spec"]["accepted_per_pos"][i] for r in recs) for i in range(len(c["accepted_per_pos"]))]
        assert per_pos == c["accepted_per_pos"]
        # and vLLM's benchmark client read the same counters off the server
        assert s["client"]["spec_decode_accepted_tokens"] == c["num_accepted_tokens"]


def test_percentiles_are_the_benchmark_clients(e17):
    """Percentiles recomputed from the per-request records equal vLLM's benchmark client's summary."""
    for leg in (*VANILLA_LEGS, *SPEC_LEGS):
        d = e17["run"] / "legs" / leg
        s = json.loads((d / "summary.json").read_text())["cells"][0]
        bench = json.loads((d / "c2" / "bench.json").read_text())
        for metric in ("ttft", "tpot", "itl", "e2el"):
            ours = s["percentiles"][f"{metric}_ms"]
            for stat in ("mean", "median", "p50", "p90", "p99"):
                assert ours[stat] == pytest.approx(bench[f"{stat}_{metric}_ms"], rel=1e-9, abs=1e-9), (leg, metric, stat)
        assert s["output_throughput"] == bench["output_throughput"]


def test_strict_serving_is_exact_and_relaxed_accepts_more(e17):
    run = e17["run"]
    texts = {leg: [r["generated_text"] for r in sorted(_records(run / "legs" / leg), key=lambda r: r["request_index"])]
             for leg in (*VANILLA_LEGS, *SPEC_LEGS)}
    assert texts["vanilla_1"] == texts["vanilla_2"]
    assert texts["strict_g6"] == texts["vanilla_1"], "strict serving leg differs from the vanilla server (fp32)"
    n_images = {r["n_images"] for r in _records(run / "legs" / "strict_g6")}
    assert max(n_images) >= 1, "the smoke prompts include images"
    acc = {leg: json.loads((run / "legs" / leg / "summary.json").read_text())["cells"][0]["spec"]["acceptance_rate"]
           for leg in SPEC_LEGS}
    assert acc["relaxed_g6"] > acc["strict_g6"]


def test_serving_tables_pair_each_spec_leg_with_its_vanilla_brackets(e17):
    import pandas as pd

    t = pd.read_csv(e17["run"] / "tables" / "serving_speedup.csv")
    assert sorted(t["leg"]) == sorted(SPEC_LEGS)
    assert (t["n_pairs"] == 2).all()
    assert set(t["vanilla_before"]) == {"vanilla_1"} and set(t["vanilla_after"]) == {"vanilla_2"}
    assert (e17["run"] / "figures" / "serving_latency.html").is_file()


def test_every_server_sees_each_distinct_prompt_once_before_its_first_cell(e17):
    """The prime pass: each prompt once, one at a time, a few tokens, before the first cell, so that no cell
    (and no leg that happens to run first) pays for the first sight of an input shape."""
    import re

    from workbench.serve_prime import PRIME_TOKENS

    for leg in (*VANILLA_LEGS, *SPEC_LEGS):
        folder = e17["run"] / "legs" / leg
        requests = (folder / "requests.jsonl").read_text().splitlines()
        n_prompts = len(set(requests))  # distinct by content: what the server receives
        log = (folder / "prime.log").read_text()
        assert int(re.search(r"Successful requests:\s+(\d+)", log).group(1)) == n_prompts, (leg, log[-2000:])
        assert "max_concurrency=1," in log and f"custom_output_len={PRIME_TOKENS}," in log, leg
        assert not (folder / "prime-requests.jsonl").exists(), "the prime's dataset is derived, not kept"
        # before the first cell: the prime's log is older than the first cell's warm-up
        first = min(folder.glob("c*/warmup.log"), key=lambda f: f.stat().st_mtime)
        assert (folder / "prime.log").stat().st_mtime <= first.stat().st_mtime, leg


def test_every_server_meets_each_shape_class_before_its_first_cell(e17):
    """The shape pass (workbench.serve_prime): after the prime, a prompt of each length class alone, then a
    burst at each batch class up to max_num_seqs, before the first cell; the engine's own step log shows a
    prefill step of exactly each length (token-id prompts, no template) and the cells' counters none of it.
    On CPU no Triton kernel compiles, so every step's ``jit_compiles`` is 0 and the cells show 0."""
    import pandas as pd

    from workbench.serve_prime import prefill_lengths

    for leg in (*VANILLA_LEGS, *SPEC_LEGS):
        folder = e17["run"] / "legs" / leg
        summary = json.loads((folder / "summary.json").read_text())
        shapes = summary["shape_pass"]
        assert shapes["prefill_lengths"] == prefill_lengths(1024) and 257 in shapes["prefill_lengths"], leg
        assert shapes["bursts"] == [2] and shapes["requests"] == len(shapes["prefill_lengths"]) + 2, leg
        steps = [json.loads(x) for f in folder.glob("engine-*/steps-*.jsonl") for x in f.read_text().splitlines()]
        alone = {r["tokens"] for r in steps if r["prefill"] and r["reqs"] == 1}
        assert set(shapes["prefill_lengths"]) <= alone, (leg, sorted(alone))
        assert all(r.get("jit_compiles") == 0 for r in steps), leg
        # the pass precedes the first cell's counters: the cell's prefix cache saw only its own prompts
        assert summary["cells"][0]["caches"]["prefix_cache_hit_rate"] in (0, 0.0, None), leg
    table = pd.read_csv(e17["run"] / "tables" / "serving_legs.csv")
    assert (table["jit_compiles"] == 0).all()


def test_every_cell_sends_fresh_requests_that_no_cache_holds(e17):
    """Fresh requests (the default, knob serve_requests): a cell's requests are each its own and the same for every
    leg of the run (pairs stay paired), and neither vLLM's prefix cache nor its multimodal cache served any of
    them over the cell (the server's counters), where before every cell re-sent its warm-up's prompts. On a CPU
    a KV block is 128 tokens, longer than these prompts, so there the prefix cache holds nothing of a repeated
    prompt either; the multimodal cache tells them apart (the E17 smoke with serve_requests=repeat: every
    image a hit). That fresh requests share no KV block on a GPU (16 tokens): tests/test_serve_requests.py."""
    import pandas as pd

    sent: dict[int, set] = {}
    for leg in (*VANILLA_LEGS, *SPEC_LEGS):
        folder = e17["run"] / "legs" / leg
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["serve_requests"] == "fresh", leg
        for cell in summary.get("cells") or [summary]:
            where = folder / f"c{cell['concurrency']}" if "cells" in summary else folder
            lines = (where / "requests-sent.jsonl").read_text().splitlines()
            assert len(lines) == cell["n_requests"] == len(set(lines)), leg
            sent.setdefault(cell["concurrency"], set()).add(tuple(lines))
            caches = cell["caches"]
            assert caches["prefix_cache_queries"] > 0 and caches["prefix_cache_hits"] == 0, (leg, caches)
            assert caches["mm_cache_queries"] > 0 and caches["mm_cache_hits"] == 0, (leg, caches)
            assert not (where / "warmup-requests.jsonl").exists(), "the warm-up's requests are derived, not kept"
    assert sent and all(len(v) == 1 for v in sent.values()), "legs sent different requests in one cell"
    table = pd.read_csv(e17["run"] / "tables" / "serving_legs.csv")
    assert (table["serve_requests"] == "fresh").all() and (table["prefix_cache_hit_rate"] == 0).all()


def test_serving_ladder_plans_under_the_shape_profiles_with_random_weights():
    """The H200 serving ladder (E17 under 32b-shape / 8b-shape): the plan is accepted, one server per
    configuration swept over the concurrencies, and each leg's server loads random weights (load_format dummy)."""
    from workbench.knobs import Knobs
    from workbench.leg import LegConfig
    from workbench.planning import plan
    from workbench.serve_leg import server_command

    p = plan("E17", "32b-shape", ["dataset=tiny", "relax_logtau=1e9", "gamma=4", "concurrencies=1/4/16/32"])
    assert p.config()["load_format"] == "dummy"
    names = [leg.name for leg in p.legs]
    assert names == ["vanilla_1", "strict_g4", "relaxed_g4", "vanilla_2"]
    assert {leg.knobs["concurrencies"] for leg in p.legs} == {"1/4/16/32"}
    cfg = LegConfig(target="/m/32b-target", prompts="/p.jsonl", out="/o", max_tokens=8, draft="/m/32b-twin",
                    knobs=Knobs(gamma=4), load_format="dummy", max_num_seqs=16)
    cmd = server_command(cfg, 8000, on_cuda=True)
    assert cmd[cmd.index("--load-format") + 1] == "dummy"
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == {
        "method": "draft_model", "model": "/m/32b-twin", "num_speculative_tokens": 4}
    assert "--enforce-eager" not in cmd and cmd[cmd.index("--max-num-seqs") + 1] == "16"


def test_every_server_times_its_steps_and_the_table_shows_where_the_first_token_goes(e17):
    """The plugin's step timer runs in every server (vanilla's too): per cell, the prefill steps' target forward,
    and in a spec server the drafter's work after it (its own prefill and first draft); the warm-up's steps
    left out. serving_legs.csv shows the medians."""
    import pandas as pd

    for leg in (*VANILLA_LEGS, *SPEC_LEGS):
        costs = json.loads((e17["run"] / "legs" / leg / "summary.json").read_text())["cells"][0]["step_costs"]
        assert costs["prefill_ms"]["n"] >= 1 and costs["prefill_ms"]["median"] > 0, leg
        # 6 requests at concurrency 2 (the cell; 2 more in its warm-up): a step at least per output token
        assert costs["steps"] >= 6, leg
        if leg in SPEC_LEGS:
            assert costs["prefill_propose_ms"]["median"] > 0 and costs["verify_ms"]["n"] >= 1, leg
            assert costs["propose_ms"]["median"] > 0, leg
        else:
            assert costs["prefill_propose_ms"] is None and costs["decode_ms"]["n"] >= 1, leg
    table = pd.read_csv(e17["run"] / "tables" / "serving_legs.csv").set_index("leg")
    assert (table.loc[list(SPEC_LEGS), "prefill_draft_ms"] > 0).all()
    assert table.loc[list(VANILLA_LEGS), "prefill_draft_ms"].isna().all()
    assert (table["prefill_target_ms"] > 0).all() and (table["step_target_ms"] > 0).all()


def test_the_prime_dataset_is_each_distinct_request_once_in_order(tmp_path):
    from workbench.serve_prime import prime_dataset

    src, dst = tmp_path / "requests.jsonl", tmp_path / "prime.jsonl"
    lines = ['{"content": "a"}', '{"content": "b"}', '{"content": "a"}', '{"content": "c"}', '{"content": "b"}']
    src.write_text("\n".join(lines) + "\n")
    assert prime_dataset(src, dst) == 3
    assert dst.read_text().splitlines() == ['{"content": "a"}', '{"content": "b"}', '{"content": "c"}']
