"""Serving legs (E17): tables, bracketed speedups and figures from a synthetic serving run folder (no vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from workbench import analyses, metrics, serving
from workbench.registry import analysis_names
from workbench.results import load_run

GAMMA = 4
# run order: vanilla legs before, between and after the spec legs, at each concurrency
LEGS = [
    {"name": "vanilla_c1", "tier": "vanilla", "concurrency": 1},
    {"name": "strict_c1", "tier": "strict", "concurrency": 1},
    {"name": "relaxed_c1", "tier": "relaxed", "concurrency": 1},
    {"name": "vanilla_c1b", "tier": "vanilla", "concurrency": 1},
    {"name": "vanilla_c4", "tier": "vanilla", "concurrency": 4},
    {"name": "strict_c4", "tier": "strict", "concurrency": 4},
    {"name": "vanilla_c4b", "tier": "vanilla", "concurrency": 4},
    {"name": "relaxed_c4", "tier": "relaxed", "concurrency": 4},
    {"name": "vanilla_c4c", "tier": "vanilla", "concurrency": 4},
]
NAMES = ("serving_summary", "serving_speedup", "serving_latency", "serving_throughput", "serving_acceptance")


def _leg(leg: dict, n: int, seed: int, drift: float = 1.0) -> tuple[list[dict], dict]:
    rng = np.random.default_rng(seed)
    tier, conc = leg["tier"], leg["concurrency"]
    spec_mode = tier != "vanilla"
    rate = {"vanilla": 0.0, "strict": 0.6, "relaxed": 0.8}[tier]
    recs, tot = [], {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": [0] * GAMMA}
    for i in range(n):
        out_tokens = int(rng.integers(2, 40)) if i != 0 else 1        # request 0: one token, no TPOT
        base = 0.02 * drift * (1 + 0.15 * (conc - 1)) * (0.5 if spec_mode else 1.0)
        itl = (base * (1 + 0.2 * rng.random(max(out_tokens - 1, 0)))).round(6).tolist()
        ttft = float(0.05 + 0.02 * rng.random())
        e2el = ttft + sum(itl)
        spec = None
        if spec_mode:
            drafts = max(out_tokens // 2, 1)
            per_pos = [int(drafts * rate ** (k + 1)) for k in range(GAMMA)]
            acc = sum(per_pos)
            spec = {"drafts": drafts, "draft_tokens": drafts * GAMMA, "accepted": acc, "accepted_per_pos": per_pos,
                    "acceptance_rate": acc / (drafts * GAMMA), "acceptance_length": 1 + acc / drafts}
            tot["num_drafts"] += drafts
            tot["num_draft_tokens"] += drafts * GAMMA
            tot["num_accepted_tokens"] += acc
            tot["accepted_per_pos"] = [a + b for a, b in zip(tot["accepted_per_pos"], per_pos)]
        error = "HTTP 500: synthetic" if i == n - 1 else ""   # the last request failed
        recs.append({"kind": "serve", "pid": f"p{i % 5:06d}", "request_index": i, "experiment": "E17",
                     "leg": leg["name"], "run_id": "20260101T000000Z-5e7e", "mode": "spec" if spec_mode else "vanilla",
                     "tier": tier, "concurrency": conc, "gamma": GAMMA if spec_mode else None,
                     "ttft_s": ttft, "tpot_s": (e2el - ttft) / (out_tokens - 1) if out_tokens > 1 else None,
                     "itl_s": itl, "e2el_s": e2el, "output_tokens": out_tokens, "generated_text": "w " * out_tokens,
                     "error": error, "spec": spec, "knobs": {"relax_logtau": 0.7 if tier == "relaxed" else 0.0}})
    ok = [r for r in recs if not r["error"]]
    duration = sum(r["e2el_s"] for r in ok) / conc
    summary = {"status": "complete", "runner": "serve", "leg": leg["name"], "mode": recs[0]["mode"], "tier": tier,
               "gamma": recs[0]["gamma"], "concurrency": conc, "n_requests": n, "completed": len(ok),
               "duration_s": duration,
               "output_throughput": sum(r["output_tokens"] for r in ok) / duration,
               "request_throughput": len(ok) / duration, "percentiles": {},
               "spec": ({"num_drafts": tot["num_drafts"], "num_draft_tokens": tot["num_draft_tokens"],
                         # the server counts a little more than the requests' traces (warm-up requests)
                         "num_accepted_tokens": tot["num_accepted_tokens"] + 3,
                         "accepted_per_pos": tot["accepted_per_pos"],
                         "acceptance_rate": (tot["num_accepted_tokens"] + 3) / tot["num_draft_tokens"]}
                        if spec_mode else None),
               "client": {}, "engine_report": {}}
    return recs, summary


def write_serving_run(root: Path, n: int = 12, drift: dict | None = None) -> Path:
    rdir = root / "E17" / "20260101T000000Z-5e7e"
    (rdir / "legs").mkdir(parents=True)
    (rdir / "run.json").write_text(json.dumps({"experiment": "E17", "run_id": rdir.name, "profile": "tiny",
                                               "smoke": True, "runner": "serve", "analyses": list(NAMES),
                                               "legs": [dict(leg) for leg in LEGS]}))
    for k, leg in enumerate(LEGS):
        ldir = rdir / "legs" / leg["name"]
        ldir.mkdir()
        recs, summary = _leg(leg, n, seed=k, drift=(drift or {}).get(leg["name"], 1.0))
        (ldir / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        (ldir / "summary.json").write_text(json.dumps(summary))
        (ldir / "leg.json").write_text(json.dumps({"name": leg["name"], "runner": "serve"}))
    return rdir


@pytest.fixture
def run(tmp_path):
    return write_serving_run(tmp_path, drift={"vanilla_c1b": 1.3, "vanilla_c4b": 0.9, "vanilla_c4c": 1.2})


def _records(rdir: Path, leg: str) -> list[dict]:
    return [json.loads(line) for line in (rdir / "legs" / leg / "records.jsonl").read_text().splitlines()]


def test_leg_table_percentiles_are_numpys_of_the_records(run):
    table, _, requests = serving.load(run)
    assert list(table["leg"]) == [leg["name"] for leg in LEGS]
    for leg in LEGS:
        row = table[table["leg"] == leg["name"]].iloc[0]
        recs = _records(run, leg["name"])
        ok = [r for r in recs if not r["error"]]
        assert (row["n"], row["completed"], row["concurrency"]) == (len(recs), len(ok), leg["concurrency"])
        values = {"ttft": [r["ttft_s"] for r in ok], "tpot": [r["tpot_s"] for r in ok if r["tpot_s"] is not None],
                  "itl": [x for r in ok for x in r["itl_s"]], "e2el": [r["e2el_s"] for r in ok]}
        assert len(values["tpot"]) == len(ok) - 1        # the one-token request has no TPOT
        for m, v in values.items():
            ms = np.asarray(v) * 1000
            assert row[f"{m}_ms_mean"] == pytest.approx(ms.mean())
            assert row[f"{m}_ms_median"] == pytest.approx(np.percentile(ms, 50))
            assert row[f"{m}_ms_p90"] == pytest.approx(np.percentile(ms, 90))
            assert row[f"{m}_ms_p99"] == pytest.approx(np.percentile(ms, 99))
        summary = json.loads((run / "legs" / leg["name"] / "summary.json").read_text())
        assert row["output_throughput"] == pytest.approx(summary["output_throughput"])
        assert row["request_throughput"] == pytest.approx(summary["request_throughput"])
        if leg["tier"] == "vanilla":
            assert np.isnan(row["acceptance_rate"]) and np.isnan(row["trace_acceptance_rate"])
        else:
            s = summary["spec"]
            assert row["acceptance_rate"] == pytest.approx(s["num_accepted_tokens"] / s["num_draft_tokens"])
            assert row["acceptance_length"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_drafts"])
            sums = [sum(r["spec"][k] for r in ok) for k in ("accepted", "draft_tokens", "drafts")]
            assert row["trace_acceptance_rate"] == pytest.approx(sums[0] / sums[1])
            assert row["trace_acceptance_length"] == pytest.approx(1 + sums[0] / sums[2])
            assert row["trace_acceptance_rate"] < row["acceptance_rate"]
    # the long form: one row per request, failures kept and marked
    assert len(requests) == sum(len(_records(run, leg["name"])) for leg in LEGS)
    assert (~requests["ok"]).sum() == len(LEGS)
    r0 = requests[(requests["leg"] == "strict_c4") & (requests["request_index"] == 3)].iloc[0]
    rec = _records(run, "strict_c4")[3]
    assert r0["tpot_ms"] == pytest.approx(rec["tpot_s"] * 1000) and r0["ttft_ms"] == pytest.approx(rec["ttft_s"] * 1000)


def test_paired_speedups_are_medians_over_the_bracketing_vanilla_legs_of_the_same_concurrency(run):
    table, speed, _ = serving.load(run)
    t = table.set_index("leg")
    med = lambda vals: float(np.median(vals))   # noqa: E731
    expect = {  # spec leg -> its neighbouring vanilla legs at its concurrency
        "strict_c1": ["vanilla_c1", "vanilla_c1b"], "relaxed_c1": ["vanilla_c1", "vanilla_c1b"],
        "strict_c4": ["vanilla_c4", "vanilla_c4b"], "relaxed_c4": ["vanilla_c4b", "vanilla_c4c"],
    }
    assert list(speed["leg"]) == list(expect)
    for leg, vans in expect.items():
        row = speed[speed["leg"] == leg].iloc[0]
        assert [row["vanilla_before"], row["vanilla_after"]] == vans and row["n_pairs"] == 2
        tpot = [t.loc[v, "tpot_ms_median"] / t.loc[leg, "tpot_ms_median"] for v in vans]
        thr = [t.loc[leg, "output_throughput"] / t.loc[v, "output_throughput"] for v in vans]
        assert row["tpot_speedup"] == pytest.approx(med(tpot))
        assert row["throughput_ratio"] == pytest.approx(med(thr))
        ttft = [t.loc[leg, "ttft_ms_median"] / t.loc[v, "ttft_ms_median"] for v in vans]
        assert row["ttft_ratio"] == pytest.approx(med(ttft))
        # quartiles as the offline speedup forms them (pandas' linear quantiles)
        q25, q75 = np.percentile(tpot, [25, 75])
        assert (row["tpot_speedup_q25"], row["tpot_speedup_q75"]) == (pytest.approx(q25), pytest.approx(q75))
        assert row["tpot_speedup_iqr"] == pytest.approx(q75 - q25)
        assert row["throughput_ratio_iqr"] == pytest.approx(np.subtract(*np.percentile(thr, [75, 25])))
        assert row["tpot_speedup"] > 1.4   # spec legs' ITL is half the vanilla legs'
        # the bracket's own drift, after / before - 1, beside the ratios it bounds
        before, after = t.loc[vans[0]], t.loc[vans[1]]
        assert row["bracket_drift_tpot"] == pytest.approx(after["tpot_ms_median"] / before["tpot_ms_median"] - 1)
        assert row["bracket_drift_ttft"] == pytest.approx(after["ttft_ms_median"] / before["ttft_ms_median"] - 1)
        assert row["bracket_drift_throughput"] == pytest.approx(
            after["output_throughput"] / before["output_throughput"] - 1)


def test_the_request_interval_holds_the_ratio_and_widens_with_the_requests_spread(run):
    """The 95 % bootstrap interval over requests: it holds the point ratio, it is what ``median_ratio_ci`` gives
    for the cell's own requests, and requests that vary more give a wider interval (the bracket's IQR over
    two vanilla legs could not show that)."""
    _, speed, requests = serving.load(run)
    ok = requests[requests["ok"]]
    for _, row in speed.iterrows():
        assert row["tpot_speedup_ci_lo"] <= row["tpot_speedup"] <= row["tpot_speedup_ci_hi"]
        assert row["ttft_ratio_ci_lo"] <= row["ttft_ratio"] <= row["ttft_ratio_ci_hi"]
        cell = ok[ok["concurrency"] == row["concurrency"]]
        tp = lambda leg: cell.loc[cell["leg"] == leg, "tpot_ms"].to_numpy()   # noqa: E731
        sides = [tp(row["vanilla_before"]), tp(row["vanilla_after"])]
        assert (row["tpot_speedup_ci_lo"], row["tpot_speedup_ci_hi"]) == pytest.approx(
            metrics.median_ratio_ci(tp(row["leg"]), sides))
    rng = np.random.default_rng(1)
    spec, vanilla = 10 + rng.normal(0, 0.1, 13), 15 + rng.normal(0, 0.1, 13)
    lo, hi = metrics.median_ratio_ci(spec, [vanilla, vanilla])
    lo2, hi2 = metrics.median_ratio_ci(10 + rng.normal(0, 1.0, 13), [vanilla, vanilla])
    assert lo <= np.median(vanilla) / np.median(spec) <= hi and hi - lo < 0.1 and hi2 - lo2 > 3 * (hi - lo)
    assert metrics.median_ratio_ci(spec, [vanilla]) == metrics.median_ratio_ci(spec, [vanilla])   # seeded
    assert all(np.isnan(metrics.median_ratio_ci(spec[:1], [vanilla])))    # one request: no interval
    # spec / vanilla (the TTFT ratio's direction) is the reciprocal's interval
    lo3, hi3 = metrics.median_ratio_ci(spec, [vanilla], spec_over_side=True)
    assert lo3 == pytest.approx(1 / metrics.median_ratio_ci(spec, [vanilla])[1], rel=0.02)


def test_the_realised_prediction_reads_the_acceptance_the_cell_drew():
    """``S_realised``: the cost model's S at the acceptance length the cell's requests drew (the server's
    counters), so a synthetic cell whose draws fell short is not read as a slower step. On the committed H100
    run: α 1 draws nothing (realised = predicted); α 0.9 at concurrency 1 drew 3.995 tokens a step against the
    profile's 4.0951; γ-0 cells (speculation off) keep S 1."""
    run = Path(__file__).resolve().parents[1] / "results" / "E18" / "20261207T235605Z-869510a1"
    table, speed, _ = serving.load(run)
    legs = table.set_index(["leg", "concurrency"])
    for _, row in speed.iterrows():
        if pd.isna(row["S_predicted"]):
            assert pd.isna(row["S_realised"])
            continue
        drawn = legs.loc[(row["leg"], row["concurrency"]), "acceptance_length"]
        if row["leg"] in ("twin_a1", "twin_a1_hybrid"):
            assert drawn == 5.0 and row["S_realised"] == pytest.approx(row["S_predicted"])
        elif row["S_predicted"] == 1.0:
            assert row["S_realised"] == 1.0
        else:
            assert row["S_realised"] == pytest.approx(row["S_predicted"] * drawn / 4.0951)
    auto1 = speed[(speed["leg"] == "twin_a0.9_auto_lean") & (speed["concurrency"] == 1)].iloc[0]
    assert auto1["S_realised"] < auto1["S_predicted"]


def test_a_failed_vanilla_leg_is_skipped_over_and_one_side_suffices(run):
    (run / "legs" / "vanilla_c1b" / "summary.json").unlink()
    (run / "legs" / "vanilla_c1b" / "failure.json").write_text(json.dumps({"status": "failed", "error": "x"}))
    table, speed, _ = serving.load(run)
    assert "vanilla_c1b" not in set(table["leg"])
    row = speed[speed["leg"] == "strict_c1"].iloc[0]
    assert (row["vanilla_before"], row["n_pairs"]) == ("vanilla_c1", 1) and pd.isna(row["vanilla_after"])
    t = table.set_index("leg")
    assert row["tpot_speedup"] == pytest.approx(t.loc["vanilla_c1", "tpot_ms_median"] / t.loc["strict_c1", "tpot_ms_median"])
    assert row["tpot_speedup_iqr"] == 0
    assert pd.isna(row["bracket_drift_tpot"]) and pd.isna(row["bracket_drift_ttft"])  # one side: no drift known


def test_registry_tables_and_figures(run):
    assert set(NAMES) <= set(analyses.ANALYSES) and set(NAMES) <= set(analysis_names())
    assert analyses.check_names(NAMES, "E17") == list(NAMES)
    r = load_run(run)                           # serving records stay out of the prompt records
    assert r.records.empty and set(r.legs["status"]) == {"complete"}
    tables = analyses.RunTables(r)
    avail = tables.available()
    assert {"serving_legs", "serving_speedup", "serving_requests"} <= set(avail)
    assert "speedup" not in avail and not tables.errors     # offline tables: not applicable, not errors
    figs = analyses.draw(tables, NAMES)
    assert set(figs) == set(NAMES) and not tables.errors
    assert all(isinstance(f, go.Figure) for f in figs.values())
    table = figs["serving_summary"].data[0]
    assert isinstance(table, go.Table) and list(table.cells.values[0]) == [leg["name"] for leg in LEGS]
    lat = figs["serving_latency"].data
    assert all(isinstance(tr, go.Box) for tr in lat)
    assert sorted((tr.meta["role"], tr.name) for tr in lat) == sorted(
        (m, s) for m in ("tpot_ms", "ttft_ms") for s in ("vanilla", "strict", "relaxed"))
    box = next(tr for tr in lat if tr.meta["role"] == "tpot_ms" and tr.name == "strict")
    assert sorted(set(box.x)) == ["1", "4"]
    thr = figs["serving_throughput"].data
    assert [tr.name for tr in thr] == ["vanilla", "strict", "relaxed"]
    legs = avail["serving_legs"]
    van = thr[0]
    assert list(van.x) == [1, 4]
    assert van.y[1] == pytest.approx(legs.loc[legs["tier"].eq("vanilla") & legs["concurrency"].eq(4),
                                              "output_throughput"].median())
    acc = figs["serving_acceptance"].data
    assert sorted((tr.meta["role"], tr.meta["tier"]) for tr in acc) == [
        ("server", "relaxed"), ("server", "strict"), ("trace", "relaxed"), ("trace", "strict")]
    srv = next(tr for tr in acc if tr.meta["role"] == "server" and tr.meta["tier"] == "strict")
    assert list(srv.y) == pytest.approx(list(legs[legs["tier"] == "strict"].sort_values("concurrency")["acceptance_rate"]))
    assert plots_violin_builds(avail["serving_requests"])
    # the headline: per spec leg its TPOT speedup against concurrency, bars to the request interval; TTFT beside
    speed = avail["serving_speedup"].set_index("leg")
    tpot = [tr for tr in figs["serving_speedup"].data if tr.meta["role"] == "tpot_speedup"]
    assert [tr.meta["leg"] for tr in tpot] == list(speed.index)
    for tr in tpot:
        row = speed.loc[tr.meta["leg"]]
        assert list(tr.x) == [row["concurrency"]] and tr.y[0] == pytest.approx(row["tpot_speedup"])
        assert tr.y[0] + tr.error_y.array[0] == pytest.approx(row["tpot_speedup_ci_hi"])
        assert tr.y[0] - tr.error_y.arrayminus[0] == pytest.approx(row["tpot_speedup_ci_lo"])
    ttft = [tr for tr in figs["serving_speedup"].data if tr.meta["role"] == "ttft_ratio"]
    assert [tr.y[0] for tr in ttft] == pytest.approx(list(speed["ttft_ratio"]))


def plots_violin_builds(requests) -> bool:
    from workbench import plots
    fig = plots.serving_latency(requests, kind="violin")
    return len(fig.data) == 6 and all(isinstance(t, go.Violin) for t in fig.data)


def test_analyze_run_writes_the_serving_tables(run):
    out = analyses.analyze_run(run, figures=True)
    assert set(out["_figures"]) == set(NAMES)
    assert (run / "tables" / "serving_legs.csv").is_file() and (run / "tables" / "serving_speedup.csv").is_file()
    assert [r["leg"] for r in out["serving_speedup"]] == ["strict_c1", "relaxed_c1", "strict_c4", "relaxed_c4"]
    assert "serving_requests" not in out and out["not_computed"] == {}


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.pop("tpot_s"), r"lacks field\(s\) \['tpot_s'\]"),
    (lambda r: r.pop("concurrency"), r"lacks field\(s\) \['concurrency'\]"),
    (lambda r: r["spec"].pop("draft_tokens"), r"'spec' lacks field\(s\) \['draft_tokens'\]"),
])
def test_a_bad_record_raises_naming_the_file(run, mutate, message):
    path = run / "legs" / "strict_c4" / "records.jsonl"
    recs = _records(run, "strict_c4")
    mutate(recs[2])
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(ValueError, match=message) as exc:
        serving.load(run)
    assert f"{path}:3:" in str(exc.value)
    # through the registry the reason is kept, not swallowed
    tables = analyses.RunTables(load_run(run))
    assert tables.get("serving_legs") is None and str(path) in tables.errors["serving_legs"]


def test_a_spec_leg_without_the_trace_has_server_acceptance_only(run):
    path = run / "legs" / "strict_c1" / "records.jsonl"
    recs = _records(run, "strict_c1")
    for r in recs:
        r["spec"] = None
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    row = serving.load(run)[0].set_index("leg").loc["strict_c1"]
    assert row["acceptance_rate"] > 0 and np.isnan(row["trace_acceptance_rate"])


def test_the_explorer_shows_a_serving_run_with_the_serving_views(run):
    from workbench.widgets import Explorer

    ex = Explorer(run=load_run(run))
    assert ex.pre.group == "serving"
    for name, view in analyses.views().items():
        shown = view.group == "serving"
        assert ex.boxes[name].layout.display == (None if shown else "none"), name
        assert (name in ex._drawn) == shown, name
    assert ex._divergence_box.layout.display == "none"


def test_the_target_graph_mode_comes_from_the_engine_report_else_from_the_servers_config_line(run):
    """A spec leg under vLLM's batch-size γ schedule runs its target on PIECEWISE graphs (vLLM 0.27.1's V1
    runner), vanilla on FULL_AND_PIECEWISE: the table says which, so a TPOT ratio is read with it."""
    def summary(leg):
        return json.loads((run / "legs" / leg / "summary.json").read_text())

    s = summary("strict_c1")
    s["engine_report"] = {"target_cudagraph_mode": "PIECEWISE", "gamma_schedule_dynamic": True}
    (run / "legs" / "strict_c1" / "summary.json").write_text(json.dumps(s))
    # a leg run before the report had the field: vLLM's own config line in server.log
    (run / "legs" / "vanilla_c1" / "server.log").write_text(
        "INFO [core.py:121] Initializing a V1 LLM engine (v0.27.1) with config: model='t', compilation_config="
        "{'level': None, 'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>, 'splitting_ops': []}\n")
    # the report wins over the log
    (run / "legs" / "strict_c1" / "server.log").write_text("'cudagraph_mode': <CUDAGraphMode.FULL: 2>\n")
    table, _, _ = serving.load(run)
    graphs = table.set_index("leg")["target_graphs"]
    assert graphs["strict_c1"] == "PIECEWISE"
    assert graphs["vanilla_c1"] == "FULL_AND_PIECEWISE"
    assert graphs["relaxed_c1"] is None or pd.isna(graphs["relaxed_c1"])  # neither recorded


def test_the_drafts_kernel_is_a_column_of_the_leg_table(run):
    """Two spec legs that differ only in the draft's W4A16 kernel (E18's twin_a1 and twin_a1_hybrid) are told
    apart in the table by the engine report's kernel class; a vanilla leg, and a leg without it, show none."""
    path = run / "legs" / "strict_c1" / "summary.json"
    s = json.loads(path.read_text())
    s["engine_report"] = {"draft_linear_kernel": "TwinHybridLinearKernel",
                          "draft_linear_kernel_requested": "own-cuda+marlin", "draft_attention": "twin"}
    path.write_text(json.dumps(s))
    table, _, _ = serving.load(run)
    kernels = table.set_index("leg")["draft_kernel"]
    assert kernels["strict_c1"] == "TwinHybridLinearKernel"
    assert kernels["vanilla_c1"] is None or pd.isna(kernels["vanilla_c1"])
    assert "draft_kernel" in serving.LEG_COLUMNS
    # and the draft's decode attention (E18's twin_a1_attn)
    attn = table.set_index("leg")["draft_attention"]
    assert attn["strict_c1"] == "twin" and (attn["vanilla_c1"] is None or pd.isna(attn["vanilla_c1"]))


def test_the_step_timers_medians_are_columns_of_the_leg_table(run):
    """The engine's time per step (the plugin's step timer, per cell in summary.json): the prefill step's target
    forward and drafter work, the decode step's verification and propose; NaN where a leg has none."""
    path = run / "legs" / "strict_c1" / "summary.json"
    s = json.loads(path.read_text())
    s["step_costs"] = {"steps": 40, "decode_steps": 36, "decode_ms": None,
                       "verify_ms": {"median": 18.2, "q1": 18.0, "q3": 18.4, "n": 30},
                       "propose_ms": {"median": 36.5, "q1": 36.0, "q3": 37.0, "n": 30},
                       "prefill_ms": {"median": 97.0, "q1": 95.0, "q3": 99.0, "n": 4},
                       "prefill_propose_ms": {"median": 110.0, "q1": 108.0, "q3": 111.0, "n": 4}}
    path.write_text(json.dumps(s))
    vpath = run / "legs" / "vanilla_c1" / "summary.json"
    v = json.loads(vpath.read_text())
    v["step_costs"] = {"decode_ms": {"median": 18.3, "q1": 18.1, "q3": 18.5, "n": 40},
                       "prefill_ms": {"median": 96.0, "q1": 95.0, "q3": 98.0, "n": 4}, "prefill_propose_ms": None}
    vpath.write_text(json.dumps(v))
    table = serving.load(run)[0].set_index("leg")
    assert table.loc["strict_c1", ["prefill_target_ms", "prefill_draft_ms", "step_target_ms", "step_draft_ms"]
                     ].tolist() == [97.0, 110.0, 18.2, 36.5]
    assert table.loc["vanilla_c1", "step_target_ms"] == 18.3 and table.loc["vanilla_c1", "prefill_target_ms"] == 96.0
    assert pd.isna(table.loc["vanilla_c1", "prefill_draft_ms"]) and pd.isna(table.loc["relaxed_c1", "step_target_ms"])


def test_the_summary_table_pairs_each_cell_with_its_own_speedup():
    """A server swept over concurrencies is one leg with a row per cell: the summary table keeps one row per leg
    and concurrency, each with the speedup of that concurrency (it once crossed every cell with every speedup)."""
    from workbench.plots.serving import serving_summary

    run = Path(__file__).resolve().parents[1] / "results" / "E18" / "20261206T193821Z-18b8309d"
    legs, speedups, _ = serving.load(run)
    table = serving_summary(legs, speedups).data[0]
    header = list(table.header.values)
    cols = {h: list(table.cells.values[i]) for i, h in enumerate(header) if h not in ("IQR",)}
    rows = list(zip(cols["leg"], cols["conc."], cols["TPOT ×"]))
    assert len(rows) == len(legs) == len(set((leg, c) for leg, c, _ in rows)) == 16
    want = {(r.leg, str(r.concurrency)): f"{r.tpot_speedup:.3g}" for r in speedups.itertuples()}
    assert [(leg, c, s) for leg, c, s in rows if s != "—"] == [(leg, c, want[(leg, c)]) for leg, c, _ in rows
                                                             if (leg, c) in want]
    assert len(want) == 8
    # run before fresh requests: every cell repeated the prompt set, and the table says so
    assert set(cols["sent"]) == {"repeat"} and set(cols["cached: prefix / image"]) == {"— / —"}
