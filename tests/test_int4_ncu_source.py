"""The source-counter summary of benchmarks/int4_ncu_source.py: opcodes, samples by reason, and the committed
run folder's tables recomputed from its own SASS pages."""

import csv
import gzip
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import int4_ncu_source as src  # noqa: E402

HEAD = ['"Address"', '"Source"', f'"{src.ALL}"', '"Instructions Executed"', '"stall_long_sb"', '"stall_wait"',
        '"stall_long_sb (Not Issued)"']


def page(rows):
    lines = ['"Kernel Name","void twin_w4::w4a16_decode<1, 2, 4, true, false>(twin_w4::Params)",', ",".join(HEAD)]
    lines += [",".join(f'"{v}"' for v in r) for r in rows]
    return "\n".join(lines) + "\n"


def test_opcodes_drop_predicates_and_modifiers():
    assert src.opcode("      HMMA.16816.F32.BF16 R4, R8, R12, R4 ;") == "HMMA"
    assert src.opcode("@!P0 LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;") == "LDG"
    assert src.opcode("@P1 BRA 0x7f0") == "BRA"
    assert src.opcode("@UPT LOP3.LUT R1, R2, 0xf000f, RZ, 0xc0, !PT ;") == "LOP3"


def test_samples_are_summed_by_opcode_and_reason_and_not_issued_columns_are_left_out():
    s = src.summarise(page([
        ("0x10", "HMMA.16816.F32.BF16 R4, R8, R12, R4", 30, 100, 28, 2, 99),
        ("0x20", "@P0 HMMA.16816.F32.BF16 R6, R8, R14, R6", 10, 100, 10, 0, 99),
        ("0x30", "LOP3.LUT R8, R2, 0xf000f, RZ, 0xc0, !PT", 5, 400, 1, 4, 99),
        ("0x40", "EXIT", 0, 4, 0, 0, 0),
    ]))
    assert s["samples"] == 45 and "w4a16_decode" in s["kernel"]
    assert s["ops"]["HMMA"]["samples"] == 40 and s["ops"]["HMMA"]["instructions"] == 200
    assert dict(s["ops"]["HMMA"]["reasons"]) == {"long_sb": 38, "wait": 2}
    assert dict(s["ops"]["LOP3"]["reasons"]) == {"long_sb": 1, "wait": 4}
    text = src.report({"qkv": s}, "t")
    assert "| HMMA | 40 | 88.9 % | 200 | long_sb 38, wait 2 |" in text
    assert "HMMA (x) 84.4 % of all samples, LOP3 (weights) 2.2 %" in text


def test_a_page_without_samples_or_header_is_refused():
    with pytest.raises(ValueError, match="no warp-stall samples"):
        src.summarise(page([("0x10", "EXIT", 0, 4, 0, 0, 0)]))
    with pytest.raises(ValueError, match="not an ncu SASS source page"):
        src.summarise("==PROF== Disconnected\n")


def test_from_csv_needs_the_device_before_reading_anything(tmp_path, capsys):
    assert src.main(["--from-csv", f"qkv={tmp_path / 'missing.csv'}", "--out-root", str(tmp_path)]) == 2
    assert "needs --device" in capsys.readouterr().err and not list(tmp_path.iterdir())


@pytest.mark.parametrize("run", sorted((REPO / "results" / "int4-ncu-source").glob("*/summary.csv")),
                         ids=lambda p: p.parent.name)
def test_committed_run_folders_agree_with_their_own_sass_pages(run):
    """summary.csv and the README's tables are what the folder's gzipped SASS pages add up to."""
    rows = list(csv.DictReader(run.open()))
    readme = (run.parent / "README.md").read_text()
    for gemm in sorted({r["gemm"] for r in rows}):
        with gzip.open(run.parent / f"{gemm}_sass.csv.gz", "rt") as f:
            s = src.summarise(f.read())
        assert f"## {gemm}: {s['samples']} samples" in readme
        for r in (r for r in rows if r["gemm"] == gemm):
            op = s["ops"][r["opcode"]]
            assert int(r["samples"]) == op["samples"] and int(r["instructions"]) == op["instructions"]
            if r["reason"]:
                assert op["reasons"][r["reason"]] == int(r["reason_samples"])


def test_profiling_refuses_unknown_gemms_and_several_sizes_before_looking_for_a_gpu(capsys):
    assert src.main(["--gemms", "qkv,lm_head"]) == 2
    assert "each one of qkv, o, gate_up, down" in capsys.readouterr().err
    assert src.main(["--sizes", "8b,32b"]) == 2
    assert "one size a run" in capsys.readouterr().err


def test_the_profile_reads_each_gemms_third_call_and_exports_its_sass_page(tmp_path, monkeypatch):
    """The ncu command line as the tool builds it, run against a stand-in `ncu` that records its arguments."""
    log = tmp_path / "calls.txt"
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\necho \"$@\" >> " + str(log) + "\n"
                    "case \"$1\" in -i) printf '%s\\n' '\"Address\",\"Source\"';; esac\n")
    fake.chmod(0o755)
    for gemm, skip in (("qkv", 2), ("o", 5), ("gate_up", 8), ("down", 11)):
        assert src.launch_skip("32b", 16, gemm) == skip
        page = src._profile(str(fake), gemm, "32b", 16, 128, False, tmp_path)
        assert page.startswith('"Address"')
    calls = log.read_text().splitlines()
    assert len(calls) == 8
    run, export = calls[6].split(), calls[7].split()  # down: the profile, then the page
    assert run[run.index("--launch-skip") + 1] == "11" and run[run.index("--launch-count") + 1] == "1"
    assert "SourceCounters" in run and run[run.index("-o") + 1] == str(tmp_path / "down")
    assert run[-10:] == [str(REPO / "benchmarks" / "int4_ncu.py"), "--child", "--sizes", "32b", "--ms", "16",
                         "--group", "128", "--variants", "default"]
    assert export == ["-i", str(tmp_path / "down.ncu-rep"), "--page", "source", "--csv", "--print-source", "sass"]
