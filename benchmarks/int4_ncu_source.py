"""Which instructions of the own CUDA W4A16 kernel wait, and on what: Nsight Compute's source counters.

    python benchmarks/int4_ncu_source.py [--sizes 32b] [--m 16] [--gemms qkv,down] [--symmetric] [--out-root DIR]
    python benchmarks/int4_ncu_source.py --from-csv qkv=qkv_sass.csv,down=down_sass.csv --device NAME

``benchmarks/int4_ncu.py`` gives a launch's stall reasons as a whole; this splits them by instruction. It runs
``int4_ncu.py``'s child (each GEMM of the layer set three times on fresh weights, the third call read, caches
flushed, clocks unlocked) under ``ncu --section SourceCounters`` for one GEMM and M at a time, exports the SASS
page (``--page source --print-source sass``: one row per instruction with its warp-stall samples by reason) and
sums the samples by opcode. Which operand an instruction waits on follows from the kernel's data flow: an
``HMMA`` stalled on ``long_sb`` (the long scoreboard: a register still being loaded from global memory) waits
for x, its B operand, loaded straight into registers, because its A operand (the weights) comes from the
``LOP3`` / ``HADD2`` that dequantize them, fixed-latency instructions whose waits are ``wait`` / ``short_sb``;
a ``LOP3`` on ``long_sb`` waits for the weights' load, an ``HADD2`` for the zero points', the ``FADD`` / ``SEL``
of the split-K epilogue for the other splits' partial sums.

Writes ``results/int4-ncu-source/<UTC id>-<gpu>/``: ``README.md`` (per GEMM: samples by opcode, the share of
all samples, the instructions executed, the largest stall reasons), ``summary.csv`` (opcode × reason samples),
``<gemm>_sass.csv.gz`` (the SASS page as ncu wrote it) and ``env.json``. ``--from-csv`` summarises SASS pages
written before (the run's device named by ``--device``). Needs a CUDA GPU, ``nvcc`` and ``ncu`` otherwise.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import json
import re
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _p in (str(REPO), str(HERE)):
    if _p not in sys.path:
        sys.path.append(_p)

import int4_ncu  # noqa: E402  (the child that calls the GEMMs, ncu's path, the launch order)

ALL = "Warp Stall Sampling (All Samples)"


def opcode(source: str) -> str:
    """``@!P0 HMMA.16816.F32.BF16 R4, ...`` -> ``HMMA`` (predicate and modifiers dropped)."""
    s = re.sub(r"^@!?U?P[T\d]+\s+", "", source.strip())
    return s.split(" ", 1)[0].split(".", 1)[0]


def summarise(text: str) -> dict:
    """A SASS source page (ncu's CSV: the kernel's name line, the header, one row per instruction) ->
    {"kernel", "samples", "ops": {opcode: {"samples", "instructions", "reasons": {reason: samples}}}}."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"Address"')), None)
    if start is None:
        raise ValueError("not an ncu SASS source page: no header row starting with \"Address\"")
    names = [ln.split(",", 1)[1] for ln in lines[:start] if ln.startswith('"Kernel Name"')]
    kernel = names[0].strip().strip('",') if names else ""
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    head, ix = rows[0], {h: i for i, h in enumerate(rows[0])}
    for need in ("Source", ALL, "Instructions Executed"):
        if need not in ix:
            raise ValueError(f"ncu SASS source page without the column {need!r}")
    reasons = [h for h in head if h.startswith("stall_") and not h.endswith("(Not Issued)")]
    ops: dict = collections.defaultdict(lambda: {"samples": 0, "instructions": 0, "reasons": collections.Counter()})
    total = 0
    for r in rows[1:]:
        if len(r) != len(head) or not r[ix[ALL]].strip().isdigit():
            continue
        op = ops[opcode(r[ix["Source"]])]
        n = int(r[ix[ALL]])
        total += n
        op["samples"] += n
        op["instructions"] += int(r[ix["Instructions Executed"]] or 0)
        for h in reasons:
            v = r[ix[h]].strip()
            if v.isdigit() and int(v):
                op["reasons"][h.removeprefix("stall_")] += int(v)
    if not total:
        raise ValueError("the SASS source page holds no warp-stall samples (was --section SourceCounters collected?)")
    return {"kernel": kernel, "samples": total, "ops": dict(ops)}


def report(per_gemm: dict[str, dict], title: str, top: int = 8) -> str:
    out = [f"# {title}", "",
           "Nsight Compute's warp-stall samples per SASS instruction, summed by opcode (one launch per GEMM: the "
           "third call on fresh weights, caches flushed). `long_sb` on an `HMMA` is a wait for x (its B operand, "
           "loaded into registers); on a `LOP3` for the weights; on `FADD` / `SEL` for the split-K partials.", ""]
    for gemm, s in per_gemm.items():
        out += [f"## {gemm}: {s['samples']} samples", "", f"`{s['kernel']}`", "",
                "| opcode | samples | share | instructions executed | largest reasons (samples) |",
                "|---|---|---|---|---|"]
        for op, d in sorted(s["ops"].items(), key=lambda kv: -kv[1]["samples"])[:top]:
            rs = ", ".join(f"{k} {v}" for k, v in d["reasons"].most_common(3))
            share = 100 * d["samples"] / s["samples"]
            out.append(f"| {op} | {d['samples']} | {share:.1f} % | {d['instructions']} | {rs} |")
        hmma = s["ops"].get("HMMA", {"reasons": {}})["reasons"].get("long_sb", 0)
        lop3 = s["ops"].get("LOP3", {"reasons": {}})["reasons"].get("long_sb", 0)
        out += ["", f"Waits on global memory (`long_sb`): HMMA (x) {100 * hmma / s['samples']:.1f} % of all samples, "
                    f"LOP3 (weights) {100 * lop3 / s['samples']:.1f} %.", ""]
    return "\n".join(out)


def write(out: Path, per_gemm: dict[str, dict], pages: dict[str, str], title: str, env: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "summary.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["gemm", "opcode", "samples", "instructions", "reason", "reason_samples"])
        for gemm, s in per_gemm.items():
            for op, d in s["ops"].items():
                for reason, n in sorted(d["reasons"].items()) or [("", 0)]:
                    w.writerow([gemm, op, d["samples"], d["instructions"], reason, n])
    for gemm, text in pages.items():
        with gzip.open(out / f"{gemm}_sass.csv.gz", "wt") as f:
            f.write(text)
    (out / "README.md").write_text(report(per_gemm, title))
    (out / "env.json").write_text(json.dumps(env, indent=1))


def launch_skip(size: str, m: int, gemm: str) -> int:
    """Launches of the kernel before ``gemm``'s last call in int4_ncu.py's child (its order: ``_plan``)."""
    order = [g for _, _, g, _, _, _ in int4_ncu._plan([size], [m], ["default"])]
    return order.index(gemm) * int4_ncu.CALLS + int4_ncu.CALLS - 1


def _profile(ncu: str, gemm: str, size: str, m: int, group: int, symmetric: bool, tmp: Path) -> str:
    skip = launch_skip(size, m, gemm)
    rep = tmp / f"{gemm}.ncu-rep"
    cmd = [ncu, "--section", "SourceCounters", "--section", "WarpStateStats", "--kernel-name",
           f"regex:{int4_ncu.KERNEL}", "--launch-skip", str(skip), "--launch-count", "1", "--cache-control", "all",
           "--clock-control", "none", "-f", "-o", str(rep.with_suffix("")), sys.executable,
           str(HERE / "int4_ncu.py"), "--child", "--sizes", size, "--ms", str(m), "--group", str(group),
           "--variants", "default"] + (["--symmetric"] if symmetric else [])
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
    page = subprocess.run([ncu, "-i", str(rep), "--page", "source", "--csv", "--print-source", "sass"],
                          check=True, capture_output=True, text=True)
    return page.stdout


def _argv_names(argv: list[str]) -> list[str]:
    """argv with --from-csv's paths cut to their file names (the pages are in the run folder)."""
    out = list(argv)
    for i, v in enumerate(out[:-1]):
        if v == "--from-csv":
            pairs = (q.split("=", 1) for q in out[i + 1].split(",") if "=" in q)
            out[i + 1] = ",".join(f"{g}={Path(p).name}" for g, p in pairs)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="32b", help="one size of the layer set (int4_gemm.py's)")
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--gemms", default="qkv,down")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--symmetric", action="store_true")
    ap.add_argument("--from-csv", default="", help="GEMM=PATH,...: summarise SASS pages exported before")
    ap.add_argument("--device", default="", help="with --from-csv: the GPU those pages were measured on")
    ap.add_argument("--measured-at", default="", help="with --from-csv: when (UTC, 20261207T151500Z), the folder's id")
    ap.add_argument("--out-root", default=str(REPO / "results" / "int4-ncu-source"))
    a = ap.parse_args(argv)
    gemms = [g for g in a.gemms.split(",") if g]
    if a.from_csv:
        pairs = [p.split("=", 1) for p in a.from_csv.split(",") if p]
        if any(len(p) != 2 for p in pairs) or not a.device:
            print("int4_ncu_source: --from-csv takes GEMM=PATH pairs and needs --device", file=sys.stderr)
            return 2
        pages = {g: Path(p).read_text() for g, p in pairs}
        dev = a.device
    else:
        if "," in a.sizes or not a.sizes:  # the launch to profile is counted within one size's layer set
            print(f"int4_ncu_source: --sizes {a.sizes!r}: one size a run (8b or 32b)", file=sys.stderr)
            return 2
        from int4_gemm_kernels import gemm_shapes  # the layer set's GEMMs, in the child's order

        known = list(gemm_shapes(a.sizes))
        bad = [g for g in gemms if g not in known]
        if bad or not gemms:
            print(f"int4_ncu_source: --gemms {a.gemms!r}: each one of {', '.join(known)}", file=sys.stderr)
            return 2
        ncu = int4_ncu.ncu_path()
        import torch

        if ncu is None or not torch.cuda.is_available():
            print("int4_ncu_source: needs a CUDA GPU and Nsight Compute (`ncu`)", file=sys.stderr)
            return 2
        dev = torch.cuda.get_device_name(0)
        with tempfile.TemporaryDirectory() as tmp:
            pages = {g: _profile(ncu, g, a.sizes, a.m, a.group, a.symmetric, Path(tmp)) for g in gemms}
    per_gemm = {g: summarise(text) for g, text in pages.items()}
    from int4_gemm import gpu_tag
    from workbench.envcapture import git_state

    when = a.measured_at if a.from_csv and a.measured_at else f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"
    out = Path(a.out_root) / f"{when}-{gpu_tag(dev)}"
    flavour = "symmetric uint4b8" if a.symmetric else "zero points"
    title = f"own-cuda's stalls by instruction — {dev}, {a.sizes}, M = {a.m}, {flavour}, group {a.group}"
    git = git_state()
    write(out, per_gemm, pages, title, {"device": dev, "commit": git.get("commit"), "git": git,
                                         "argv": _argv_names(list(argv if argv is not None else sys.argv[1:])),
                                         "from_csv": bool(a.from_csv),
                                         "written": f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"})
    print(report(per_gemm, title))
    print(f"wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
