"""The cost experiment E16 (GPU cost ladder): registry, profiles, bad options, the analysis, one CPU rehearsal.

The analysis is checked on synthetic rows with known step times (c, S(1, gamma, c), S(alpha), the measured
forced-acceptance speedup, end to end and decode only), through the analysis registry as `workbench export`
and the explorer use it.
The one end-to-end test runs `workbench run E16 --profile tiny` (two tiny engines, two batches, one gamma).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from conftest import REPO, workbench_cli
from workbench import analyses, ladder, planning
from workbench.cli import main
from workbench.registry import EXPERIMENTS_FILE, PROFILES_FILE, RegistryError, load_registry
from workbench.results import load_run
from workbench.runfolder import leg_status

GAMMA = 4
DECODE_MS, VERIFY_MS = 10.0, 12.0
DRAFT_STEP_MS = {True: 3.0, False: 6.0}      # propose / gamma: drafter graphs on / off
SINGLE_STEP_MS = {True: 2.0, False: 5.0}     # one single-token step of the propose
BATCHES = (1, 4)
# walls that time the first token apart: seconds to the first token of a batch (the prefill; in a spec cell
# the draft's prefill and first propose too), and decode seconds per output token after the first
FIRST_S = {"vanilla": 0.02, True: 0.10, False: 0.15}
TOKEN_S = {"vanilla": 0.018, True: 0.012, False: 0.015}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# --------------------------------------------------------------------------- registry and profiles


def test_registry_declares_the_cost_experiment_and_its_profiles():
    reg = load_registry()
    e = reg.experiment("E16")
    assert e.runner == "ladder" and e.title == "GPU cost ladder"
    assert e.profiles == ["8b-shape", "32b-shape"] and e.sweep == {"gamma": [2, 4, 6]}
    assert e.ladder == {"batches": [1, 4, 16, 32], "repeats": 3, "prompt_len": 128, "eager": True}
    assert set(e.analyses) == {"step_cost_vs_batch", "c_by_graphs", "speedup_curves"} <= set(analyses.ANALYSES)
    for size in ("8b", "32b"):
        prof = reg.profile(f"{size}-shape")
        assert prof.shapes and prof.load_format == "dummy" and prof.device == "gpu"
        assert prof.roles == {"target": f"{size}-target", "twin": f"{size}-twin",
                              "small-vlm": "2b-vlm", "text-draft": "0.6b-text"}  # the seed PR's drafters

    full = planning.plan("E16", "32b-shape")
    assert [l.name for l in full.legs] == ["vanilla", "forced_g2", "forced_g4", "forced_g6"]
    assert full.ladder == {"batches": [1, 4, 16, 32], "repeats": 3, "prompt_len": 128, "eager": True, "size": "32b"}
    assert all(l.knobs["relax_logtau"] >= 1e9 and l.tier == "relaxed" for l in full.legs if l.kind == "spec")
    assert all(l.knobs["max_num_seqs"] == 32 for l in full.legs)  # the largest batch
    cfg = full.config()
    assert cfg["runner"] == "ladder" and cfg["load_format"] == "dummy" and cfg["device"] == "gpu"

    tiny = planning.plan("E16", "tiny")
    assert tiny.smoke and [l.name for l in tiny.legs] == ["vanilla", "forced_g2"]
    assert tiny.ladder["batches"] == [1, 4] and tiny.ladder["size"] == "tiny" and tiny.datasets == []
    over = planning.plan("E16", "8b-shape", ["batches=1,2", "repeats=5", "gamma=4"])
    assert over.ladder["batches"] == [1, 2] and over.ladder["repeats"] == 5
    assert [l.name for l in over.legs] == ["vanilla", "forced_g4"]
    assert over.ladder["eager"] is True
    lean = planning.plan("E16", "32b-shape", ["eager=false", "gamma=4"])
    assert lean.ladder["eager"] is False  # graphs-on cells only (the eager drafter's cost is known)
    from workbench.runners import ladder_leg_config

    cfg = {**lean.config(), "run_id": "r", "models": {"target": "t", "twin": "d"}}
    assert ladder_leg_config(lean.legs[1], cfg, Path("/nonexistent"))["eager"] is False  # what the leg engine reads


@pytest.mark.parametrize("mutate, message", [
    (lambda e, p: e["experiments"]["E16"]["legs"].append({"name": "s", "kind": "score", "model": "twin"}),
     r"E16: leg s: a ladder experiment has vanilla and spec legs only"),
    (lambda e, p: e["experiments"]["E16"].pop("ladder"), r"E16: runner ladder needs a 'ladder' mapping"),
    (lambda e, p: e["experiments"]["E16"]["ladder"].update(batches=[1, 1]), r"E16.ladder.batches: .*distinct"),
    (lambda e, p: e["experiments"]["E16"]["ladder"].update(repeats=0), r"E16.ladder.repeats: .*integer >= 1"),
    (lambda e, p: e["experiments"]["E16"].update(runner="fast"), r"E16.runner: must be one of legs, ladder"),
    (lambda e, p: e["experiments"]["E2"].update(ladder={"repeats": 1}), r"E2.ladder: only an experiment with runner"),
    (lambda e, p: p["profiles"]["8b-shape"]["roles"].update(target="70b-target"),
     r"profile 8b-shape.roles.target: '70b-target' is not a workbench.shapes stand-in"),
    (lambda e, p: p["profiles"]["8b-shape"]["roles"].update({"organism": "8b-target"}),
     r"profile 8b-shape.roles: unknown role 'organism'; a shapes profile binds target, twin, small-vlm, text-draft"),
    (lambda e, p: p["profiles"]["8b-shape"].update(load_format="random"), r"8b-shape.load_format: must be one of"),
])
def test_bad_ladder_definitions_are_named(tmp_path, mutate, message):
    exps, profs = yaml.safe_load(EXPERIMENTS_FILE.read_text()), yaml.safe_load(PROFILES_FILE.read_text())
    mutate(exps, profs)
    (tmp_path / "e.yaml").write_text(yaml.safe_dump(exps))
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(profs))
    with pytest.raises(RegistryError, match=message):
        load_registry(tmp_path / "e.yaml", tmp_path / "p.yaml")


@pytest.mark.parametrize("argv, message", [
    (["run", "E16", "--profile", "8b-thinking"], "E16 runs under profile(s) 8b-shape, 32b-shape"),
    (["run", "E1", "--profile", "8b-shape"], "only the cost ladder and the serving experiment run under it, not E1"),
    (["run", "E16", "--profile", "tiny", "-p", "batches=0"], "batches must be a list of distinct integers >= 1"),
    (["run", "E16", "--profile", "tiny", "-p", "repeats=x"], "repeats takes integers"),
    (["run", "E16", "--profile", "tiny", "-p", "dataset=tiny"], "takes no dataset"),
    (["run", "E16", "--profile", "tiny", "-p", "eager=sometimes"], "eager takes true or false"),
    (["run", "E1", "--profile", "tiny", "-p", "batches=1"], "unknown parameter 'batches'"),
    (["run", "E16", "--profile", "8b-shape"], "runs on a CUDA GPU"),
    (["run", "E16", "--profile", "32b-shape", "-p", "gamma=4"], "runs on a CUDA GPU"),
])
def test_bad_options_fail_before_a_run_folder_exists(tmp_path, capsys, argv, message):
    if "CUDA" in message and _cuda():
        pytest.skip("this host has a GPU: the shape profiles run here")
    root = tmp_path / "results"
    assert main(argv + ["--results", str(root)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not root.exists(), "a refused run leaves nothing behind"


def test_benchmark_script_refuses_an_unknown_size(tmp_path):
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cost_ladder.py"), "--sizes", "8b,70b",
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "unknown size(s) ['70b']: use 8b, 32b or tiny" in res.stderr
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- the analysis on synthetic rows


def _rows() -> tuple[list[dict], list[dict]]:
    """Steps and walls as the ladder engine writes them, with known times (and rows the analysis must skip)."""
    steps, walls = [], []
    for b in BATCHES:
        for rep in range(3):
            tag = {"kind": "vanilla", "gamma": None, "draft_graphs": None, "size": "8b", "batch": b, "rep": rep}
            steps.append({**tag, "reqs": b, "tokens": b * 128, "spec_tokens": 0, "prefill": True,
                          "target_ms": 99.0, "draft_ms": None})  # prefill: not a decode step
            for i in range(5):
                steps.append({**tag, "reqs": b, "tokens": b, "spec_tokens": 0, "prefill": False,
                              "target_ms": DECODE_MS + (i - 2) * 0.1, "draft_ms": None})
            walls.append({**tag, "wall_s": 2.0, "out_tokens": 128 * b})
            for graphs in (True, False):
                tag = {"kind": "spec", "gamma": GAMMA, "draft_graphs": graphs, "size": "8b", "batch": b, "rep": rep}
                for i in range(5):
                    steps.append({**tag, "reqs": b, "tokens": b * (GAMMA + 1), "spec_tokens": b * GAMMA,
                                  "prefill": False, "target_ms": VERIFY_MS + (i - 2) * 0.1,
                                  "draft_ms": GAMMA * DRAFT_STEP_MS[graphs],
                                  "draft_loop_ms": (GAMMA - 1) * SINGLE_STEP_MS[graphs]})
                # a step with a request short of gamma drafts is no verification step of gamma + 1 tokens
                steps.append({**tag, "reqs": b, "tokens": b * GAMMA, "spec_tokens": b * (GAMMA - 1),
                              "prefill": False, "target_ms": 50.0, "draft_ms": 50.0})
                walls.append({**tag, "wall_s": 1.0 if graphs else 1.6, "out_tokens": 128 * b})
    walls.insert(0, {"size": "8b", "kind": "vanilla", "gamma": None, "engine_start_s": 3.0, "engine_report": {}})
    return steps, walls


def _walls_with_first(walls: list[dict]) -> list[dict]:
    """``walls`` as the engine writes them since it times the first token apart: ``first_wall_s`` and a wall of
    first token + decode. The first token's cost grows by repeat (x1.0, 1.1, 1.2: rep 1 is the median), the
    decode per token does not, so the decode-only ratio is TOKEN_S's by construction."""
    out = []
    for w in walls:
        if "wall_s" not in w:  # the engine's header row
            out.append(w)
            continue
        side = "vanilla" if w["kind"] == "vanilla" else w["draft_graphs"]
        first = FIRST_S[side] * (1 + 0.1 * w["rep"])
        out.append({**w, "first_wall_s": first, "wall_s": first + TOKEN_S[side] * (w["out_tokens"] - w["batch"])})
    return out


def _jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _ladder_run(root, first_token: bool = False):
    """A run folder as `workbench run E16` leaves it: run.json, two complete ladder legs with their rows
    (``first_token``: walls that time the first token apart, as the engine writes them now)."""
    steps, walls = _rows()
    if first_token:
        walls = _walls_with_first(walls)
    rdir = root / "E16" / "20260101T000000Z-1add"
    legs = [{"index": 0, "name": "vanilla", "kind": "vanilla", "tier": "vanilla", "model": "target", "knobs": {}},
            {"index": 1, "name": f"forced_g{GAMMA}", "kind": "spec", "tier": "relaxed", "model": "target",
             "draft": "twin", "knobs": {"gamma": GAMMA}}]
    for leg in legs:
        d = rdir / "legs" / leg["name"]
        d.mkdir(parents=True)
        mine = lambda r: r["kind"] == leg["kind"]  # noqa: E731
        _jsonl(d / "steps.jsonl", [dict(r, leg=leg["name"]) for r in steps if mine(r)])
        _jsonl(d / "walls.jsonl", [dict(r, leg=leg["name"]) for r in walls if mine(r)])
        (d / "summary.json").write_text(json.dumps({"status": "complete", "runner": "ladder", "mode": leg["kind"],
                                                    "tier": leg["tier"], "gamma": leg["knobs"].get("gamma")}))
    (rdir / "run.json").write_text(json.dumps({"experiment": "E16", "run_id": rdir.name, "profile": "8b-shape",
                                               "runner": "ladder", "legs": legs, "analyses": [
                                                   "step_cost_vs_batch", "c_by_graphs", "speedup_curves"]}))
    return rdir, steps, walls


def test_analysis_derives_c_and_speedup_from_the_rows(tmp_path):
    rdir, steps, walls = _ladder_run(tmp_path / "results")
    assert all(leg_status(rdir / "legs" / n) == "complete" for n in ("vanilla", f"forced_g{GAMMA}"))
    t = analyses.RunTables(load_run(rdir))
    costs, ratios, curve = t["step_costs"], t["cost_ratio"], t["speedup_curve"]

    med = costs.set_index(["batch", "role", "draft_graphs"])["median_ms"]
    for b in BATCHES:
        assert med[(b, "target decode", None)] == pytest.approx(DECODE_MS)
        for graphs in (True, False):
            assert med[(b, "target verify", graphs)] == pytest.approx(VERIFY_MS)
            assert med[(b, "draft propose", graphs)] == pytest.approx(GAMMA * DRAFT_STEP_MS[graphs])
    iqr = costs[costs["role"] == "target decode"].iloc[0]
    assert (iqr["q1_ms"], iqr["q3_ms"], iqr["n"]) == (pytest.approx(DECODE_MS - 0.1), pytest.approx(DECODE_MS + 0.1), 15)

    assert len(ratios) == len(BATCHES) * 2
    for r in ratios.itertuples():
        c = DRAFT_STEP_MS[r.draft_graphs] / VERIFY_MS                       # c = gamma * draft step / (gamma * verify)
        assert r.c == pytest.approx(c) and r.c == pytest.approx(GAMMA * r.propose_per_token_ms / (GAMMA * r.verify_ms))
        assert r.single_step_ms == pytest.approx(SINGLE_STEP_MS[r.draft_graphs])  # reported beside propose / gamma
        assert r.S_pred_alpha1 == pytest.approx((GAMMA + 1) / (GAMMA * c + 1))
        assert r.S_steps_alpha1 == pytest.approx((GAMMA + 1) * DECODE_MS / (VERIFY_MS + GAMMA * DRAFT_STEP_MS[r.draft_graphs]))
        assert r.S_measured_alpha1 == pytest.approx(2.0 / (1.0 if r.draft_graphs else 1.6))
    assert ratios[ratios["draft_graphs"]]["S_pred_alpha1"].iloc[0] == pytest.approx(2.5)  # c = 0.25
    # walls rows from before the engine timed the first token apart: no decode-only figure, no error
    assert ratios[["S_measured_decode_alpha1", "first_ms_vanilla", "first_ms_spec"]].isna().all().all()

    assert curve["alpha"].min() == pytest.approx(0.5) and curve["alpha"].max() == pytest.approx(0.98)
    on = curve[(curve["batch"] == 1) & curve["draft_graphs"]].set_index("alpha")["S"]
    a = 0.5
    assert on[a] == pytest.approx((1 - a ** (GAMMA + 1)) / (1 - a) / (GAMMA * 0.25 + 1))
    assert float(ladder.speedup(1.0, GAMMA, 0.25)) == pytest.approx(2.5)

    # the seed PR's acceptance length, placed at the alpha whose expected length at gamma is 1.49
    alpha = ladder.alpha_for_length(1.49, GAMMA)
    assert (1 - alpha ** (GAMMA + 1)) / (1 - alpha) == pytest.approx(1.49, abs=1e-9)
    figs = analyses.draw(t, ["step_cost_vs_batch", "c_by_graphs", "speedup_curves"])
    assert set(figs) == {"step_cost_vs_batch", "c_by_graphs", "speedup_curves"}, t.errors
    seed = [d for d in figs["speedup_curves"].data if (d.meta or {}).get("role") == "seed_point"]
    assert len(seed) == 1 and seed[0].x[0] == pytest.approx(alpha) and seed[0].y[0] == pytest.approx(1.28)
    assert "L = (1" in seed[0].hovertemplate and "γ = 4" in seed[0].hovertemplate
    quant = [d for d in figs["speedup_curves"].data if (d.meta or {}).get("role") == "quantspec_point"]
    assert quant[0].x[0] == pytest.approx(0.9) and quant[0].y[0] == pytest.approx(2.5)

    # the benchmark script's folder (rows at the top, no legs; a folder from before it wrote run.json gets
    # one) is an ordinary run folder: the same tables and figures, from the analysis registry
    bench = tmp_path / "bench"
    bench.mkdir()
    _jsonl(bench / "steps.jsonl", steps)
    _jsonl(bench / "walls.jsonl", walls)
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cost_ladder.py"), "--analyze", str(bench)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads((bench / "run.json").read_text())["runner"] == "ladder"
    assert {"step_costs.csv", "cost_ratio.csv", "speedup_curve.csv", "summary.json"} <= \
        {p.name for p in (bench / "tables").iterdir()}
    assert {"step_cost_vs_batch.html", "c_by_graphs.html", "speedup_curves.html"} <= \
        {p.name for p in (bench / "figures").iterdir()}
    bench_tables = analyses.RunTables(load_run(bench))
    pd.testing.assert_frame_equal(bench_tables["cost_ratio"].reset_index(drop=True), ratios.reset_index(drop=True),
                                  check_dtype=False)
    pd.testing.assert_frame_equal(ladder.tables(bench)["cost_ratio"].reset_index(drop=True),
                                  ratios.reset_index(drop=True), check_dtype=False)
    table = ladder.summary_markdown(bench)
    assert "| 8b | 1 | 4 | 10.00 | 12.00 | 3.00 / 6.00 | 2.00 / 5.00 | 0.25 / 0.50 | 2.50 | 2.00 / 1.25 |" in table
    assert "decode only" not in table  # an older folder's table keeps its columns
    assert not [d for d in figs["speedup_curves"].data if (d.meta or {}).get("role") == "measured_decode_alpha1"]


def test_decode_only_speedup_takes_the_first_token_off(tmp_path):
    """Walls with ``first_wall_s``: the decode-only ratio is TOKEN_S's by construction, the end-to-end one is
    lower (the spec side's first token costs more); both from the analysis registry, in the table and figure."""
    from workbench.widgets import _ladder_readout_html

    rdir, _, walls = _ladder_run(tmp_path / "results", first_token=True)
    t = analyses.RunTables(load_run(rdir))
    ratios = t["cost_ratio"]
    assert len(ratios) == len(BATCHES) * 2
    for r in ratios.itertuples():
        side, after = r.draft_graphs, 128 * r.batch - r.batch  # output tokens after each request's first
        decode = TOKEN_S["vanilla"] / TOKEN_S[side]
        end_to_end = ((1.1 * FIRST_S["vanilla"] + TOKEN_S["vanilla"] * after)
                      / (1.1 * FIRST_S[side] + TOKEN_S[side] * after))     # rep 1's walls are the medians
        assert r.S_measured_decode_alpha1 == pytest.approx(decode)
        assert r.S_measured_alpha1 == pytest.approx(end_to_end) and r.S_measured_alpha1 < decode
        assert r.first_ms_vanilla == pytest.approx(1.1 * FIRST_S["vanilla"] * 1e3)
        assert r.first_ms_spec == pytest.approx(1.1 * FIRST_S[side] * 1e3)

    table = ladder.summary_markdown(ratios=ratios)
    assert "| measured S at α=1 (graphs / eager) | measured S at α=1, decode only (graphs / eager) |" in table
    on = ratios[(ratios["batch"] == 1) & ratios["draft_graphs"]].iloc[0]
    assert f"| 2.50 | {on.S_measured_alpha1:.2f} / " in table and "| 1.50 / 1.20 |" in table
    assert all(line.count("|") == 12 for line in table.splitlines())

    figs = analyses.draw(t, ["speedup_curves"])
    marks = [d for d in figs["speedup_curves"].data if (d.meta or {}).get("role") == "measured_decode_alpha1"]
    assert sorted(round(m.y[0], 4) for m in marks) == sorted(round(x, 4) for x in ratios["S_measured_decode_alpha1"])
    assert "decode only 1.50" in _ladder_readout_html(ratios, GAMMA)

    # a side without first_wall_s (a vanilla leg from before it): no decode-only figure, the end-to-end one stays
    old_vanilla = [{k: v for k, v in w.items() if k != "first_wall_s"} if w.get("kind") == "vanilla" else w
                   for w in walls if "wall_s" in w]
    mixed = ladder.cost_ratio(t["step_costs"], pd.DataFrame(old_vanilla))
    assert mixed["S_measured_decode_alpha1"].isna().all() and mixed["first_ms_vanilla"].isna().all()
    assert mixed["first_ms_spec"].notna().all()
    pd.testing.assert_series_equal(mixed["S_measured_alpha1"], ratios["S_measured_alpha1"])


def test_export_and_explorer_handle_a_ladder_run(tmp_path):
    from workbench.export import export_run
    from workbench.widgets import Explorer

    root = tmp_path / "results"
    rdir, _, _ = _ladder_run(root)
    written = export_run(rdir, formats=("html",))
    assert {"step_cost_vs_batch", "c_by_graphs", "speedup_curves"} <= set(written)
    summary = json.loads((rdir / "tables" / "summary.json").read_text())
    assert summary["n_complete"] == 2 and summary["not_computed"] == {}
    assert all(math.isfinite(r["c"]) and r["c"] > 0 for r in summary["cost_ratio"])
    assert (rdir / "tables" / "speedup_curve.csv").is_file()

    ex = Explorer(root, "E16")
    assert ex.pre.is_ladder and ex.pre.gammas == [GAMMA]
    assert all(b.layout.display == "none" for b in ex._leg_boxes)
    assert all(b.layout.display is None for b in ex._ladder_boxes)
    assert "c = <b>0.25</b> graphs / 0.50 eager" in ex.readout.value
    curves = [t for t in ex.fig_ladder_curves.data if (t.meta or {}).get("role") == "curve"]
    assert curves and all(t.visible is not False for t in curves)
    ex.on_gamma(99)  # a gamma with no curves hides them all
    assert all(t.visible is False for t in ex.fig_ladder_curves.data if (t.meta or {}).get("role") == "curve")


def test_ladder_leg_status_follows_the_contract(tmp_path):
    d = tmp_path / "legs" / "vanilla"
    d.mkdir(parents=True)
    _jsonl(d / "steps.jsonl", [])
    _jsonl(d / "walls.jsonl", [])
    (d / "summary.json").write_text(json.dumps({"status": "complete"}))
    assert leg_status(d) == "incomplete", "rows without the ladder's summary are not a complete leg"
    (d / "summary.json").write_text(json.dumps({"status": "complete", "runner": "ladder"}))
    assert leg_status(d) == "complete"
    (d / "walls.jsonl").unlink()
    assert leg_status(d) == "incomplete"
    (d / "failure.json").write_text(json.dumps({"status": "failed"}))
    assert leg_status(d) == "failed"


# --------------------------------------------------------------------------- the CPU rehearsal, end to end


@pytest.mark.vllm
def test_workbench_run_e16_tiny_makes_a_complete_run_folder(tmp_path):
    root, tmp = tmp_path / "results", tmp_path / "tmp"
    tmp.mkdir()
    res = subprocess.run(workbench_cli("run", "E16", "--profile", "tiny", "--results", str(root), "--formats", "html"),
                         cwd=str(REPO), capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TMPDIR": str(tmp)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (rdir,) = list((root / "E16").iterdir())
    # each engine's report is kept in its leg's folder; the run leaves nothing in the temp dir
    for leg in ("vanilla", "forced_g2"):
        assert list((rdir / "legs" / leg).glob("engine-*/engine-*.json")), leg
    assert not [p.name for p in tmp.iterdir() if "engine" in p.name], list(tmp.iterdir())
    cfg = json.loads((rdir / "run.json").read_text())
    assert cfg["runner"] == "ladder" and cfg["ladder"]["size"] == "tiny" and cfg["prompts_file"] is None
    assert json.loads((rdir / "env.json").read_text())["git"]
    assert json.loads((rdir / "protocol.json").read_text())["state"] == "finished"
    assert (rdir / "run.lock").read_text() == "", "the lock is released"
    for leg in ("vanilla", "forced_g2"):
        assert leg_status(rdir / "legs" / leg) == "complete"
        assert json.loads((rdir / "legs" / leg / "leg.json").read_text())["runner"] == "ladder"
    # the raw rows, whole at the top, in the benchmark script's format
    steps = [json.loads(x) for x in (rdir / "steps.jsonl").read_text().splitlines()]
    assert {s["leg"] for s in steps} == {"vanilla", "forced_g2"} and {s["batch"] for s in steps} == {1, 4}
    assert {"target_ms", "draft_ms", "tokens", "reqs", "prefill", "draft_graphs", "rep"} <= set(steps[0])
    # every timed generate's wall carries the time to the first token of its batch, timed apart before it;
    # that generate's steps are not the cell's: one prefill per request, the timed prompts'
    walls = [w for w in map(json.loads, (rdir / "walls.jsonl").read_text().splitlines()) if "wall_s" in w]
    assert walls and all(w["first_wall_s"] > 0 and w["wall_s"] > 0 for w in walls)
    # the first token is timed in a call of its own: on a loaded CPU it can take longer than a whole tiny
    # generate; such a row gives no decode time (NaN), never a negative one
    per_token = ladder._decode_s_per_token(pd.DataFrame(walls))
    usable = [w["first_wall_s"] < w["wall_s"] for w in walls]
    assert list(per_token.notna()) == usable and (per_token.dropna() > 0).all()
    cell = ("leg", "batch", "rep", "draft_graphs", "draft_cudagraph_mode")
    for w in walls:
        mine = [s for s in steps if all(s.get(k) == w.get(k) for k in cell)]
        assert sum(s["reqs"] for s in mine if s["prefill"]) == w["batch"], (w, mine)
        assert sum(s["tokens"] for s in mine if s["prefill"]) == w["batch"] * cfg["ladder"]["prompt_len"], (w, mine)
    # the tables, from the analysis registry
    ratios = pd.read_csv(rdir / "tables" / "cost_ratio.csv")
    assert len(ratios) == 4  # 2 batches x drafter graphs on/off
    assert ratios["c"].map(math.isfinite).all() and (ratios["c"] > 0).all()
    assert (ratios["S_pred_alpha1"] > 0).all() and ratios["S_measured_alpha1"].notna().all()
    assert (ratios["first_ms_spec"] > 0).all()
    wdf = pd.DataFrame(walls).assign(ok=usable)
    for _, r in ratios.iterrows():  # decode-only wherever both sides of the cell have a usable row
        van = wdf[(wdf["leg"] == "vanilla") & (wdf["batch"] == r["batch"])]
        spec = wdf[(wdf["leg"] != "vanilla") & (wdf["batch"] == r["batch"]) & (wdf["draft_graphs"] == r["draft_graphs"])]
        assert (r["S_measured_decode_alpha1"] > 0) == (van["ok"].any() and spec["ok"].any()), (r, van, spec)
    costs = pd.read_csv(rdir / "tables" / "step_costs.csv")
    assert set(costs["role"]) == {"target decode", "target verify", "draft propose", "draft single-token step"}
    assert ratios["single_step_ms"].notna().all() and "propose_per_token_ms" in ratios
    assert (rdir / "tables" / "speedup_curve.csv").is_file()
    summary = json.loads((rdir / "tables" / "summary.json").read_text())
    assert summary["n_complete"] == 2 and set(summary["figures"]) == {"step_cost_vs_batch", "c_by_graphs",
                                                                    "speedup_curves"}
    for name in summary["figures"]:
        assert (rdir / "figures" / f"{name}.html").is_file()
    # the executed notebook, with the ladder's table
    nb = json.loads((rdir / "notebook.ipynb").read_text())
    shown = json.dumps([c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code"])
    assert "| tiny | 1 | 2 |" in shown and "Operating points" in shown


def test_step_cost_legend_names_every_series_once_across_sizes():
    """32B measured at gamma 4 only, 8B at gamma 2 and 4: the 8B-only series must still be in the legend."""
    from workbench import plots

    rows = [{"size": "32b", "batch": 1, "gamma": None, "draft_graphs": None, "role": "target decode",
             "median_ms": 18.0, "q1_ms": 17.9, "q3_ms": 18.1, "n": 10}]
    for size, gammas in (("32b", [4]), ("8b", [2, 4])):
        for g in gammas:
            for graphs in (True, False):
                for role, ms in (("target verify", 5.0), ("draft propose", 20.0)):
                    rows.append({"size": size, "batch": 1, "gamma": float(g), "draft_graphs": graphs, "role": role,
                                 "median_ms": ms, "q1_ms": ms - 1, "q3_ms": ms + 1, "n": 10})
    fig = plots.step_cost_vs_batch(pd.DataFrame(rows))
    in_legend = [t.name for t in fig.data if t.showlegend is not False]
    assert sorted(in_legend) == sorted(set(t.name for t in fig.data))  # every series named, none twice
    assert "draft step γ=2, drafter graphs" in in_legend


def test_a_before_and_an_after_in_one_folder_are_told_apart_by_their_drafter_setup():
    """Rows of two drafter setups of one size (their knob tags) make two cells, each against the same vanilla."""
    import pandas as pd

    from workbench import ladder

    steps, walls = [], []
    for b in (1, 4):
        steps.append({"kind": "vanilla", "gamma": None, "draft_graphs": None, "size": "32b", "batch": b, "rep": 0,
                      "reqs": b, "tokens": b, "prefill": False, "target_ms": 18.0, "draft_ms": None})
        walls.append({"kind": "vanilla", "gamma": None, "draft_graphs": None, "size": "32b", "batch": b,
                      "wall_s": 1.2})
        for kernel, sched, propose, wall in (("machete", False, 50.0, 1.05), ("marlin", True, 40.0, 0.95)):
            tags = {"draft_linear_kernel": kernel, "draft_cudagraph_mode": "piecewise", "async_scheduling": sched}
            steps.append({"kind": "spec", "gamma": 4, "draft_graphs": True, "size": "32b", "batch": b, "rep": 0,
                          "reqs": b, "tokens": 5 * b, "prefill": False, "target_ms": 18.5, "draft_ms": propose,
                          **tags})
            walls.append({"kind": "spec", "gamma": 4, "draft_graphs": True, "size": "32b", "batch": b,
                          "wall_s": wall, **tags})
    costs = ladder.step_costs(pd.DataFrame(steps))
    ratios = ladder.cost_ratio(costs, pd.DataFrame(walls)).set_index(["size", "batch"])
    before, after = "32b [machete piecewise]", "32b [marlin piecewise async]"
    assert set(ratios.index.get_level_values(0)) == {before, after}
    assert ratios.loc[(before, 1), "c"] == pytest.approx(50.0 / 4 / 18.5)
    assert ratios.loc[(after, 1), "c"] == pytest.approx(40.0 / 4 / 18.5)
    assert ratios.loc[(after, 4), "S_measured_alpha1"] == pytest.approx(1.2 / 0.95)
    assert ratios.loc[(before, 4), "decode_ms"] == ratios.loc[(after, 4), "decode_ms"] == 18.0
    # a folder of one setup keeps its plain size label
    one = ladder.step_costs(pd.DataFrame([r for r in steps if r.get("draft_linear_kernel") != "marlin"]))
    assert set(one["size"]) == {"32b"}


@pytest.mark.parametrize("built,eager,expected", [
    ("full", True, [("full", True, "built"), ("piecewise", True, "piecewise"), ("full", False, "none")]),
    ("full", False, [("full", True, "built"), ("piecewise", True, "piecewise")]),
    ("full_all", False, [("full_all", True, "built"), ("full", True, "full"), ("piecewise", True, "piecewise")]),
    ("piecewise", True, [("piecewise", True, "built"), ("piecewise", False, "none")]),
    ("none", True, [("none", True, "built"), ("none", False, "none")]),
])
def test_a_spec_engine_measures_every_dispatch_its_graphs_allow(built, eager, expected):
    """FULL graphs built: their single-token steps are also timed piecewise in the same engine."""
    from workbench.ladder_engine import spec_cells

    cells = spec_cells({"draft_cudagraph_mode": built}, eager=eager)
    assert [(c["draft_cudagraph_mode"], c["draft_graphs"], mode) for c, mode in cells] == expected


def test_full_and_piecewise_cells_of_one_engine_are_two_setups_against_one_vanilla():
    import pandas as pd

    from workbench import ladder

    steps, walls = [], []
    tags = {"draft_linear_kernel": "marlin", "async_scheduling": True}
    for b in (1, 4):
        steps.append({"kind": "vanilla", "gamma": None, "draft_graphs": None, "size": "32b", "batch": b, "rep": 0,
                      "reqs": b, "tokens": b, "prefill": False, "target_ms": 18.0, "draft_ms": None,
                      "draft_cudagraph_mode": "full", **tags})
        walls.append({"kind": "vanilla", "gamma": None, "draft_graphs": None, "size": "32b", "batch": b,
                      "wall_s": 1.2, "draft_cudagraph_mode": "full", **tags})
        for mode, graphs, propose, wall in (("full", True, 32.0, 0.8), ("piecewise", True, 40.0, 0.95),
                                            ("full", False, 90.0, 2.0)):
            cell = {"kind": "spec", "gamma": 4, "draft_graphs": graphs, "size": "32b", "batch": b, "rep": 0,
                    "draft_cudagraph_mode": mode, **tags}
            steps.append({**cell, "reqs": b, "tokens": 5 * b, "prefill": False, "target_ms": 18.5,
                          "draft_ms": propose})
            walls.append({**cell, "wall_s": wall})
    costs = ladder.step_costs(pd.DataFrame(steps))
    ratios = ladder.cost_ratio(costs, pd.DataFrame(walls)).set_index(["size", "batch", "draft_graphs"])
    full, pw = "32b [marlin full async]", "32b [marlin piecewise async]"
    assert ratios.loc[(full, 1, True), "c"] == pytest.approx(32.0 / 4 / 18.5)
    assert ratios.loc[(pw, 1, True), "c"] == pytest.approx(40.0 / 4 / 18.5)
    assert ratios.loc[(full, 4, False), "S_measured_alpha1"] == pytest.approx(1.2 / 2.0)  # eager: under full
    assert (pw, 1, False) not in ratios.index
    table = ladder.summary_markdown(ratios=ratios.reset_index())
    assert "| 32b [marlin full async] | 1 | 4 |" in table and "| 32b [marlin piecewise async] | 4 | 4 |" in table


def test_rows_are_tagged_with_the_kernel_and_scheduling_that_ran():
    from workbench.ladder_engine import ran_tags

    tags = {"leg": "forced_g4", "draft_linear_kernel": "auto", "draft_cudagraph_mode": "full",
            "async_scheduling": True}
    report = {"draft_linear_kernel": "MarlinLinearKernel", "async_scheduling": False}
    assert ran_tags(report, tags) == {"draft_linear_kernel": "marlin", "async_scheduling": False}
    assert ran_tags({"draft_linear_kernel": "mixed"}, tags) == {"draft_linear_kernel": "mixed"}
    assert ran_tags({}, tags) == {}  # a vanilla engine's report names no drafter: its tags stay
    # the decode attention asked, and what ran (mixed: some layers kept vLLM's)
    assert ran_tags({"draft_attention": "mixed"}, {**tags, "draft_attention": "twin"}) == {"draft_attention": "mixed"}


def test_a_drafter_on_the_twin_attention_is_its_own_setup_in_the_tables():
    base = {"draft_linear_kernel": "marlin", "draft_cudagraph_mode": "full", "async_scheduling": True}
    assert ladder._drafter(pd.Series({**base, "draft_attention": "twin"})) == "marlin full async twin-attn"
    assert ladder._drafter(pd.Series({**base, "draft_attention": "vllm"})) == "marlin full async"


def test_a_resume_rebuilds_shape_checkpoints_that_are_gone_and_names_any_other(tmp_path, monkeypatch):
    """A GPU host that lost the run's shape stand-ins (a fresh copy of the checkout) rebuilds them on
    resume; a missing checkpoint the project does not build is refused by name, before a leg starts."""
    from workbench import preparing, shapes
    from workbench.registry import load_registry

    gone = tmp_path / "shapes" / "32b-target"
    calls = []

    def fake_build(root=None):
        calls.append(root)
        gone.mkdir(parents=True, exist_ok=True)
        return {"32b-target": gone}

    monkeypatch.setattr(shapes, "build_shapes", fake_build)
    reg = load_registry()
    preparing._rebuild_missing_models(tmp_path, {"profile": "32b-shape", "models": {"target": str(gone)}}, reg)
    assert calls and gone.is_dir()
    other = tmp_path / "elsewhere" / "ckpt"
    with pytest.raises(preparing.ProtocolError, match=f"checkpoint {other}, which is not on this host"):
        preparing._rebuild_missing_models(tmp_path, {"profile": "32b-shape", "models": {"twin": str(other)}}, reg)
    with pytest.raises(preparing.ProtocolError, match="not built by the project"):
        preparing._rebuild_missing_models(tmp_path, {"profile": "32b", "models": {"twin": str(other)}}, reg)
    # hub ids and present folders are left alone
    preparing._rebuild_missing_models(tmp_path, {"profile": "32b", "models": {"target": "Qwen/Qwen3-VL-32B"}}, reg)


def test_setups_of_one_size_share_its_c_panels_one_colour_each():
    from workbench import plots

    rows = []
    for setup in ("marlin full async", "marlin piecewise async"):
        for g in (2, 4):
            for b in (1, 4):
                rows.append({"size": f"32b [{setup}]", "batch": b, "gamma": g, "draft_graphs": True, "c": 0.5,
                             "propose_per_token_ms": 9.0, "verify_ms": 18.0, "S_pred_alpha1": 1.5})
    fig = plots.cost_ratio_by_graphs(pd.DataFrame(rows))
    assert [a.text for a in fig.layout.annotations] == ["32b, γ=2", "32b, γ=4"]  # panels per size and γ
    named = [t.name for t in fig.data if t.showlegend]
    assert named == ["marlin full async, drafter graphs", "marlin piecewise async, drafter graphs"]
    assert len({t.marker.color for t in fig.data}) == 2


def test_decode_time_per_token_is_nan_where_the_first_token_outlasted_the_wall():
    walls = pd.DataFrame({"wall_s": [1.0, 0.03, 0.5, 0.4], "first_wall_s": [0.2, 0.09, 0.5, 0.1],
                          "out_tokens": [9, 32, 9, 1], "batch": [1, 4, 1, 1]})
    got = ladder._decode_s_per_token(walls)
    assert got.iloc[0] == pytest.approx(0.1)          # (1.0 - 0.2) / (9 - 1)
    assert got.iloc[1:].isna().all()                  # first > wall, first == wall, no token after the first


def test_first_token_costs_split_the_drafts_first_propose_into_prefill_and_single_steps(tmp_path):
    """The first-token table: the draft's prefill is its first propose less gamma-1 single-token steps
    (measured on the decode rows), set against the vanilla engine's prefill of the same prompt tokens."""
    gamma, single, draft_prefill, vanilla_prefill, spec_target = 4, 9.0, 45.0, 20.0, 22.0
    steps = []
    for rep in range(3):
        steps.append({"size": "32b", "kind": "vanilla", "gamma": None, "draft_graphs": None, "batch": 1, "rep": rep,
                      "reqs": 1, "tokens": 128, "prefill": True, "target_ms": vanilla_prefill + rep, "draft_ms": None})
        tag = {"size": "32b", "kind": "spec", "gamma": gamma, "draft_graphs": True, "batch": 1, "rep": rep}
        steps.append({**tag, "reqs": 1, "tokens": 128, "prefill": True, "target_ms": spec_target,
                      "draft_ms": draft_prefill + (gamma - 1) * single, "draft_loop_ms": None})
        steps.append({**tag, "reqs": 1, "tokens": gamma + 1, "prefill": False, "target_ms": 18.0,
                      "draft_ms": gamma * single, "draft_loop_ms": (gamma - 1) * single})
    t = ladder.first_token_costs(pd.DataFrame(steps))
    assert len(t) == 1
    r = t.iloc[0]
    assert r["prompt_tokens"] == 128 and r["gamma"] == gamma
    assert r["vanilla_prefill_ms"] == pytest.approx(vanilla_prefill + 1)  # the median of 20, 21, 22
    assert r["draft_single_step_ms"] == pytest.approx(single)
    assert r["draft_prefill_ms"] == pytest.approx(draft_prefill)
    assert r["draft_prefill_over_target"] == pytest.approx(draft_prefill / (vanilla_prefill + 1))
    assert r["first_step_ratio"] == pytest.approx((spec_target + draft_prefill + 3 * single) / (vanilla_prefill + 1))
    rdir, _, _ = _ladder_run(tmp_path / "results")
    md = ladder.first_token_markdown(rdir)
    assert md == "(no prefill rows of a spec leg)"  # the synthetic run times only the vanilla engine's prefill
