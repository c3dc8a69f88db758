"""benchmarks/int4_ncu.py: Nsight Compute's raw CSV read back into one row per GEMM and M (the GPU run needs
`ncu` and a CUDA GPU; here its parsing, the launch-to-GEMM assignment and the report, on a CSV as ncu writes it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import int4_ncu  # noqa: E402

PLAN = [("default", "32b", "qkv", 10240, 5120, 1), ("pipe", "32b", "o", 5120, 8192, 1)]


def _raw_csv(durations_ns: list[float]) -> str:
    """`ncu --csv --page raw --print-units base`: ==PROF== lines, a header, a units row, a row per launch
    (other kernels too: the benchmark's own copies and fills)."""
    metrics = list(int4_ncu.METRICS)
    head = ["ID", "Process ID", "Kernel Name"] + metrics
    units = ["", "", ""] + ["nsecond" if m.startswith("gpu__time") else "" for m in metrics]
    rows = ['==PROF== Connected to process 7 (python3)', ",".join(f'"{h}"' for h in head),
            ",".join(f'"{u}"' for u in units)]
    launch = 0
    for i, d in enumerate(durations_ns):
        if i == 2:
            rows.append(",".join(f'"{v}"' for v in [str(launch), "7", "void at::native::fill_kernel()"]
                                 + ["1"] * len(metrics)))
            launch += 1
        vals = {m: "0.5" for m in metrics}
        vals["gpu__time_duration.sum"] = f"{d:,.0f}"  # a thousands separator, as ncu may print it
        vals["dram__bytes_read.sum"] = "26,214,400"
        vals["smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"] = "7.5"
        vals["smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"] = "1.25"
        rows.append(",".join(f'"{v}"' for v in [str(launch), "7", "void twin_w4::w4a16_decode<2, 1, 4, true>(Params)"]
                             + [vals[m] for m in metrics]))
        launch += 1
    rows.append("==PROF== Disconnected from process 7")
    return "\n".join(rows) + "\n"


def test_the_read_call_of_each_gemm_is_its_third_launch_and_the_report_names_its_stalls():
    durations = [30000, 20000, 17700, 31000, 21000, 15200]  # two warm-ups, then the read call, per GEMM
    launches = int4_ncu.parse(_raw_csv(durations))
    assert len(launches) == 6 and all("w4a16_decode" in r["kernel"] for r in launches)  # the fill kernel dropped
    rows = int4_ncu.assign(PLAN, launches)
    assert [(r["variant"], r["gemm"], r["duration_ns"]) for r in rows] == [("default", "qkv", 17700.0),
                                                                           ("pipe", "o", 15200.0)]
    assert rows[0]["dram_read_bytes"] == 26214400.0 and rows[0]["stall_long_scoreboard"] == 7.5
    text = int4_ncu.report(rows, "t")
    qkv = next(line for line in text.splitlines() if "| qkv |" in line)
    assert qkv.startswith("| default | 32b | qkv | 1 | 17.7 |") and "| 26.2 | 1.48 |" in qkv  # µs, MB, TB/s
    assert qkv.split("| ")[-1].startswith("long_scoreboard 7.50, barrier 1.25, ")  # the largest first


def test_a_launch_count_that_does_not_match_the_plan_is_refused():
    with pytest.raises(SystemExit, match="profiled 5 launches of w4a16_decode, expected 6"):
        int4_ncu.assign(PLAN, int4_ncu.parse(_raw_csv([1.0] * 5)))


def test_without_ncu_the_benchmark_says_so_before_anything_runs(monkeypatch, capsys):
    monkeypatch.setattr(int4_ncu, "ncu_path", lambda: None)
    assert int4_ncu.main(["--ms", "1"]) == 2
    assert "no `ncu`" in capsys.readouterr().err


def test_an_unknown_variant_is_refused_before_anything_runs(monkeypatch, capsys):
    monkeypatch.setattr(int4_ncu, "ncu_path", lambda: "/usr/bin/true")
    assert int4_ncu.main(["--ms", "1", "--variants", "default,fast"]) == 2
    assert "--variants 'default,fast': each one of default, deep, pipe" in capsys.readouterr().err
