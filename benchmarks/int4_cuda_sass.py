"""What the own CUDA W4A16 kernel (``own-cuda``) compiles to, without a GPU: its main loop per 64-k chunk.

    python benchmarks/int4_cuda_sass.py [--rev REV ...] [--sizes 32b] [--ms 1,4,8,16] [--group 128]
                                        [--symmetric] [--against results/int4-ncu-source/RUN] [--out-root DIR]

Each kernel instance that ``twin_cuda.plan`` launches for the layer set's GEMMs at the given token counts is
compiled for ``sm_90a`` (NVRTC from the environment's CUDA wheels, or ``nvcc`` where it is on PATH; the kernel's
source of each ``--rev``: a git revision, or ``worktree``, the default) and disassembled with the ``nvdisasm``
of Triton's wheel. The main loop (the longest loop that holds the tensor-core MMAs) is counted by opcode and
divided into 64-k chunks by its MMAs (4 k16 steps a chunk, each one MMA per row tile and token tile, two with
one token tile: ``step`` of twin_w4a16.cuh). Per GEMM, the loop's instructions times the warp-chunks of its
launch give the instructions the main loop issues, and over 132 SMs x 4 schedulers at 1.98 GHz the least time
that issue takes (a floor, beside the byte floor of ``int4_gemm.py``; the kernel reaches neither).

Why: four forms of x in shared memory at 16 tokens were each timed on a GPU lease before their cost in issue
slots was known (docs/benchmarks.md); two revisions side by side here show it first.

``--against`` an ``int4-ncu-source`` run folder: its SASS pages (what ran, as Nsight Compute saw it) against the
static compile of the revision its ``env.json`` names, opcode by opcode, and the main loop's instructions
executed against static count x trips: whether this static view is the kernel that ran.

Writes ``results/int4-cuda-sass/<UTC id>-sm90a/``: ``instances.csv`` (revision, instance, registers, spills,
shared memory, the loop's instructions per chunk and by opcode), ``gemms.csv`` (per revision, size, M and
GEMM: instance, warp-chunks, main-loop instructions, issue floor), ``against.csv`` (with ``--against``),
``README.md`` and ``env.json``.
"""

from __future__ import annotations

import argparse
import collections
import csv
import difflib
import gzip
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _p in (str(REPO), str(HERE)):
    if _p not in sys.path:
        sys.path.append(_p)

import int4_sass  # noqa: E402  (Triton's nvdisasm, nvdisasm's listing parsed)
from int4_ncu_source import opcode  # noqa: E402  (``@!P0 LDG.E.128 ...`` -> ``LDG``, as the profiles count)

from vllm_patch import twin_cuda_compile as tcc  # noqa: E402

ARCH = "sm_90a"
ISSUE_PER_S = 132 * 4 * 1.98e9  # warp-instructions a second: H100 / H200 SXM, one per scheduler per clock
_FUNC = re.compile(r"^\s*\.text\.(\S+):")
_BRANCH = re.compile(r"BRA\s+(?:`\()?(\.L_x_\d+|0x[0-9a-f]+)")
_MANGLED = re.compile(r"w4a16_decodeILi(\d)ELi(\d)ELi(\d)ELb(\d)ELb(\d)E")
_DEMANGLED = re.compile(r"w4a16_decode<\(int\)(\d), \(int\)(\d), \(int\)(\d), \(bool\)(\d), \(bool\)(\d)>")
# what an opcode is counted as: the MMAs, the weights' decode, loads by kind, address and loop integer work
CLASSES = (("mma", ("HMMA",)), ("decode", ("LOP3", "SHF", "HADD2", "PRMT")), ("global load", ("LDG",)),
           ("shared", ("LDS", "STS", "LDSM", "LDGSTS", "LDGDEPBAR", "DEPBAR")), ("barrier", ("BAR", "SYNCS")),
           ("scale fold", ("FFMA", "FMUL", "FADD")),
           ("integer", ("IMAD", "IADD3", "LEA", "VIADD", "VIADDMNMX", "ISETP", "SEL", "IABS", "MOV", "IMNMX",
                        "VIMNMX", "I2F", "MUFU", "F2I", "ULDC", "UMOV", "S2UR", "S2R", "UIADD3", "ULEA")))


class SassError(RuntimeError):
    """A revision, instance or run folder this tool cannot read."""


def op_class(op: str) -> str:
    return next((name for name, ops in CLASSES if op in ops), "other")


def instance_of(name: str) -> tuple[int, int, int, bool, bool] | None:
    """(R, NT, group / 32, zero points, deep) of a mangled or demangled ``w4a16_decode`` name."""
    m = _MANGLED.search(name) or _DEMANGLED.search(name)
    if not m:
        return None
    r, nt, gs, z, d = (int(v) for v in m.groups())
    return r, nt, gs, bool(z), bool(d)


def source_tree(rev: str, tmp: Path) -> Path:
    """The kernel's source folder at ``rev`` (``worktree``: this checkout's files)."""
    if rev == "worktree":
        return tcc.CSRC
    out = tmp / re.sub(r"[^A-Za-z0-9_.-]", "_", rev)
    if (out / "vllm_patch" / "csrc").is_dir():  # extracted before in this temporary folder
        return out / "vllm_patch" / "csrc"
    res = subprocess.run(["git", "-C", str(REPO), "archive", rev, "vllm_patch/csrc"], capture_output=True)
    if res.returncode:
        raise SassError(f"--rev {rev}: not a revision of this checkout ({res.stderr.decode().strip()[:200]})")
    out.mkdir(parents=True)
    with tempfile.TemporaryFile() as fh:
        fh.write(res.stdout)
        fh.seek(0)
        tarfile.open(fileobj=fh).extractall(out, filter="data")
    return out / "vllm_patch" / "csrc"


def nvdisasm() -> Path:
    """Triton's ``nvdisasm`` (``int4_sass.tools``)."""
    try:
        return int4_sass.tools()[0]
    except FileNotFoundError as exc:
        raise SassError(str(exc)) from None


def compile_sass(csrc: Path, instances: list[tuple], tmp: Path) -> tuple[dict[tuple, list[tuple[int, str]]], dict]:
    """``{instance: [(address, instruction)]}`` of the kernel instances compiled from ``csrc``; ptxas facts."""
    out = Path(tempfile.mkdtemp(dir=tmp))
    if tcc.compiler() == "nvcc":
        cubin, facts = tcc.compile_cubin(out, ARCH, instances=instances, pipe_instances=[], bulk_instances=[],
                                         csrc=csrc)
    else:
        cubin, facts = tcc.compile_cubin_nvrtc(out, ARCH, instances=instances, pipe_instances=[],
                                               bulk_instances=[], csrc=csrc)
    sass = subprocess.run([str(nvdisasm()), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    return {inst: ins for name, ins in functions(sass).items() if (inst := instance_of(name))}, facts


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """nvdisasm's listing split by function (each parsed by ``int4_sass.instructions``); branch targets as
    addresses."""
    out = {}
    for block in re.split(r"(?m)^(?=\s*\.text\.)", sass):
        f = _FUNC.match(block)
        if not f:
            continue
        ins, labels = int4_sass.instructions(block)

        def resolve(b: re.Match, labels=labels) -> str:  # a label branched to, as its address (unknown: kept)
            target = labels.get(b.group(1))
            return "BRA " + hex(target) if target is not None else b.group(0)

        out[f.group(1)] = [(a, _BRANCH.sub(resolve, t)) for a, t in ins]
    return out


def loops(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) instruction indices of each backward branch's loop."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    found = []
    for i, (a, t) in enumerate(ins):
        b = _BRANCH.search(t)
        if b and b.group(1).startswith("0x"):
            target = int(b.group(1), 16)
            if target < a and target in index:
                found.append((index[target], i))
    return found


def main_loop(ins: list[tuple[int, str]]) -> tuple[int, int]:
    """The longest loop that holds MMAs."""
    cands = [(j - i, i, j) for i, j in loops(ins) if any(opcode(t) == "HMMA" for _, t in ins[i:j + 1])]
    if not cands:
        raise SassError("no loop with tensor-core MMAs in the kernel")
    _, i, j = max(cands)
    return i, j


def mma_per_chunk(inst: tuple) -> int:
    r, nt = inst[0], inst[1]
    return 4 * r * nt * (2 if nt == 1 else 1)


def loop_profile(inst: tuple, ins: list[tuple[int, str]]) -> dict:
    """The main loop of one instance: instructions, chunks an iteration, per chunk, by opcode and class."""
    i, j = main_loop(ins)
    body = [t for _, t in ins[i:j + 1]]
    ops = collections.Counter(opcode(t) for t in body)
    chunks = ops["HMMA"] / mma_per_chunk(inst)
    per = {k: v / chunks for k, v in ops.items()}
    classes = collections.Counter()
    for k, v in per.items():
        classes[op_class(k)] += v
    return {"loop_instructions": len(body), "chunks_per_iteration": chunks,
            "per_chunk": round(len(body) / chunks, 2), "classes": {k: round(v, 2) for k, v in classes.items()},
            "ops": {k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1])},
            "sass_total": len(ins)}


def plan_rows(sizes: list[str], ms: list[int], group: int, symmetric: bool) -> list[dict]:
    """Per size, M and GEMM: the launch plan's instance and warp-chunks (row tiles / R x chunks x token blocks)."""
    from int4_gemm_kernels import gemm_shapes

    from vllm_patch import twin_cuda, twin_cuda_layout as layout

    rows = []
    for size in sizes:
        for m in ms:
            for gemm, (n, k) in gemm_shapes(size).items():
                p = twin_cuda.plan(n, k, m, group)
                tiles = -(-n // layout.TILE)
                inst = (p.r, p.nt, group // 32, not symmetric, p.deep)
                warp_chunks = -(-tiles // p.r) * (k // layout.CHUNK) * p.grid[2]
                rows.append({"size": size, "m": m, "gemm": gemm, "n": n, "k": k, "plan": p.tag,
                             "instance": tcc.instance_name(*inst), "inst": inst, "warp_chunks": warp_chunks})
    return rows


def issue_rows(plans: list[dict], profiles: dict[tuple[str, tuple], dict], revs: list[str]) -> list[dict]:
    out = []
    for rev in revs:
        for p in plans:
            prof = profiles[(rev, p["inst"])]
            loop = p["warp_chunks"] * prof["per_chunk"]
            out.append({"rev": rev, **{k: v for k, v in p.items() if k != "inst"},
                        "loop_per_chunk": prof["per_chunk"], "loop_instructions": round(loop),
                        "issue_floor_us": round(loop / ISSUE_PER_S * 1e6, 2)})
    return out


def ncu_page(path: Path) -> tuple[str, list[tuple[str, int]]]:
    """(kernel name, [(instruction, executed)]) of an int4-ncu-source SASS page."""
    rows = list(csv.reader(gzip.open(path, "rt")))
    start = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if start is None:
        raise SassError(f"{path}: not an ncu SASS source page")
    kernel = next((r[1] for r in rows[:start] if r and r[0] == "Kernel Name"), "")
    head = rows[start]
    si, ei = head.index("Source"), head.index("Instructions Executed")
    return kernel, [(r[si].strip(), int(r[ei] or 0)) for r in rows[start + 1:] if len(r) == len(head)]


def against(run: Path, tmp: Path) -> list[dict]:
    """Each SASS page of an int4-ncu-source run beside the static compile of the revision that ran."""
    env = json.loads((run / "env.json").read_text()) if (run / "env.json").is_file() else {}
    rev = ((env.get("git") or {}).get("commit") or "")[:12]
    if not rev:
        raise SassError(f"{run}/env.json names no commit: nothing to compile against")
    pages = sorted(run.glob("*_sass.csv.gz"))
    if not pages:
        raise SassError(f"{run}: no <gemm>_sass.csv.gz pages")
    csrc = source_tree(rev, tmp)
    out, compiled = [], {}
    for page in pages:
        kernel, ran = ncu_page(page)
        inst = instance_of(kernel)
        if inst is None:
            raise SassError(f"{page}: kernel {kernel!r} is not a w4a16_decode instance")
        if inst not in compiled:
            compiled[inst] = compile_sass(csrc, [inst], tmp)[0][inst]
        static = compiled[inst]
        a, b = [opcode(t) for _, t in static], [opcode(t) for t, _ in ran]
        i, j = main_loop(static)
        trips = _trips(ran, i, j, len(static) == len(ran))
        executed = sum(e for _, e in ran[i:j + 1]) if trips is not None else None
        out.append({"run": str(run.relative_to(REPO)) if run.is_relative_to(REPO) else str(run),
                    "gemm": page.name.split("_sass")[0], "rev": rev, "instance": tcc.instance_name(*inst),
                    "static_instructions": len(a), "ran_instructions": len(b),
                    "same_opcodes": round(difflib.SequenceMatcher(None, a, b, autojunk=False).ratio(), 4),
                    "loop_static": j - i + 1, "loop_trips": trips, "loop_executed": executed,
                    "loop_static_x_trips": (j - i + 1) * trips if trips is not None else None,
                    "loop_share_of_executed": round(executed / sum(e for _, e in ran), 3) if executed else None})
    return out


def _trips(ran: list[tuple[str, int]], i: int, j: int, aligned: bool) -> int | None:
    """Warp-iterations of the main loop: its backward branch's executions (only where the listings align)."""
    if not aligned or opcode(ran[j][0]) != "BRA":
        return None
    return ran[j][1]


def report(inst_rows: list[dict], gemm_rows: list[dict], against_rows: list[dict], argv: list[str]) -> str:
    classes = [name for name, _ in CLASSES] + ["other"]
    lines = [f"# own-cuda's main loop compiled for {ARCH} (static: no GPU ran)", "",
             f"`python benchmarks/int4_cuda_sass.py {' '.join(argv)}`. Per 64-k chunk a warp handles (its main "
             "loop's instructions over the chunks an iteration covers, from its MMAs), by class of opcode.", "",
             "| revision | instance | regs | spills | loop instr / chunk | " + " | ".join(classes) + " |",
             "|---|---|---|---|---|" + "---|" * len(classes)]
    for r in inst_rows:
        lines.append(f"| {r['rev']} | {r['instance']} | {r['regs']} | {r['spill_bytes']} | {r['per_chunk']:.1f} | "
                     + " | ".join(f"{r['classes'].get(c, 0):.1f}" for c in classes) + " |")
    lines += ["", "Per layer set (the plan's instance per GEMM): main-loop warp-instructions and the least time "
              f"their issue takes at {ISSUE_PER_S / 1e12:.3f}e12 warp-instructions a second.", "",
              "| revision | size | M | GEMMs (instance) | loop instructions (M) | issue floor µs |",
              "|---|---|---|---|---|---|"]
    sets = collections.defaultdict(list)
    for g in gemm_rows:
        sets[(g["rev"], g["size"], g["m"])].append(g)
    for (rev, size, m), gs in sets.items():
        names = ", ".join(f"{g['gemm']} ({g['instance']})" for g in gs)
        lines.append(f"| {rev} | {size} | {m} | {names} | {sum(g['loop_instructions'] for g in gs) / 1e6:.2f} | "
                     f"{sum(g['issue_floor_us'] for g in gs):.1f} |")
    if against_rows:
        lines += ["", "Against the SASS that ran (Nsight Compute's source pages): opcode sequences compared "
                  "(1.0: identical), the main loop's instructions executed against its static count x trips.", "",
                  "| run | GEMM | revision | instance | instructions static / ran | same opcodes | loop static x trips "
                  "| loop executed | loop share of executed |", "|---|---|---|---|---|---|---|---|---|"]
        for a in against_rows:
            lines.append(f"| {a['run']} | {a['gemm']} | {a['rev']} | {a['instance']} | {a['static_instructions']} / "
                         f"{a['ran_instructions']} | {a['same_opcodes']} | {a['loop_static_x_trips']} | "
                         f"{a['loop_executed']} | {a['loop_share_of_executed']} |")
    return "\n".join(lines) + "\n"


def _write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        for r in rows:
            w.writerow({k: json.dumps(v) if isinstance(v, dict) else v for k, v in r.items()})


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", action="append", help="a git revision whose kernel source to compile, or worktree "
                    "(the default); repeat to compare")
    ap.add_argument("--sizes", default="32b", help="comma-separated shape sizes of int4_gemm (8b, 32b)")
    ap.add_argument("--ms", default="1,4,8,16", help="comma-separated token counts (1-64)")
    ap.add_argument("--group", type=int, default=128, choices=(32, 64, 128))
    ap.add_argument("--symmetric", action="store_true", help="no zero points (uint4b8)")
    ap.add_argument("--against", type=Path, action="append", default=[],
                    help="an int4-ncu-source run folder: its SASS pages beside the static compile")
    ap.add_argument("--out-root", type=Path, default=REPO / "results" / "int4-cuda-sass")
    args = ap.parse_args(argv)
    args.rev = args.rev or ["worktree"]
    try:
        args.ms = [int(v) for v in args.ms.split(",")]
    except ValueError:
        ap.error(f"--ms {args.ms!r}: comma-separated integers")
    if any(not 1 <= m <= 64 for m in args.ms):
        ap.error(f"--ms {args.ms}: the decode kernel takes 1-64 tokens")
    from int4_gemm_kernels import SHAPES

    args.sizes = args.sizes.split(",")
    if unknown := [s for s in args.sizes if s not in SHAPES]:
        ap.error(f"--sizes: unknown {unknown}; known {sorted(SHAPES)}")
    for run in args.against:
        if not run.is_dir():
            ap.error(f"--against {run}: no such run folder")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if tcc.compiler() is None:
        print("int4_cuda_sass: neither nvcc nor NVRTC (nvidia-cuda-nvrtc) is here", file=sys.stderr)
        return 2
    plans = plan_rows(args.sizes, args.ms, args.group, args.symmetric)
    instances = list(dict.fromkeys(p["inst"] for p in plans))
    inst_rows, profiles = [], {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rev in args.rev:
                sass, facts = compile_sass(source_tree(rev, Path(tmp)), instances, Path(tmp))
                for inst in instances:
                    prof = loop_profile(inst, sass[inst])
                    profiles[(rev, inst)] = prof
                    name = tcc.instance_name(*inst)
                    inst_rows.append({"rev": rev, "instance": name, **facts.get(name, {}), **prof})
                    print(f"{rev:12} {name:22} {prof['per_chunk']:7.1f} instr/chunk  {prof['classes']}", flush=True)
            against_rows = [a for run in args.against for a in against(run.resolve(), Path(tmp))]
    except SassError as e:
        print(f"int4_cuda_sass: {e}", file=sys.stderr)
        return 2
    gemm_rows = issue_rows(plans, profiles, args.rev)
    out = args.out_root / f"{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}-{ARCH.replace('_', '')}"
    out.mkdir(parents=True, exist_ok=False)
    _write_csv(out / "instances.csv", inst_rows)
    _write_csv(out / "gemms.csv", gemm_rows)
    _write_csv(out / "against.csv", against_rows)
    text = report(inst_rows, gemm_rows, against_rows, argv)
    (out / "README.md").write_text(text)
    from workbench.envcapture import capture

    env = capture()
    env["benchmark"] = {"argv": argv, "compiler": tcc.compiler(), "arch": ARCH}
    (out / "env.json").write_text(json.dumps(env, indent=2, default=str) + "\n")
    print(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
