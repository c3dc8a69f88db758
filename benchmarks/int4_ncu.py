"""Where the own CUDA W4A16 kernel's time goes: Nsight Compute's counters per GEMM of a layer set.

    python benchmarks/int4_ncu.py [--sizes 32b] [--ms 1,4,16] [--variants default,deep,pipe] [--symmetric]
                                  [--out-root DIR]

``benchmarks/int4_gemm.py`` times ``own-cuda`` (``vllm_patch.twin_cuda``) against the byte floor; this
says why a GEMM is where it is. It runs itself under ``ncu`` (Nsight Compute, on the GPU host's PATH or
``/usr/local/cuda/bin``): the child process calls each GEMM of the layer set at each M three times on
fresh random weights (two warm-up calls, then the call that is read), ``ncu`` collects a fixed list of
counters for every launch of the kernel (``w4a16_decode``), with the caches flushed before each (the 64
layers' weights of a real draft step never sit in L2) and the clocks as the driver sets them (no locking,
so durations are comparable with the timed benchmark).

Per GEMM and M it writes: duration, DRAM bytes read and their rate (TB/s and % of peak), the SM and
issue-slot utilization, achieved occupancy, registers per thread, grid, the tensor pipe's busy share, and
the warp stall reasons (cycles a warp waits per issued instruction, by reason: ``long_scoreboard`` is a
wait on global memory, ``math_pipe_throttle`` / ``mio_throttle`` a full pipe or queue, ``barrier`` the
split-K epilogue's ``__syncthreads``, ``membar`` its ``__threadfence``...).

Writes ``results/int4-ncu/<UTC id>-<gpu>/``: ``metrics.csv`` (one row per GEMM and M, raw counters),
``README.md`` (the table and the stall breakdown) and ``env.json``. Needs a CUDA GPU, ``nvcc`` and ``ncu``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _p in (str(REPO), str(HERE)):  # the repository and the sibling benchmark modules
    if _p not in sys.path:
        sys.path.append(_p)

KERNEL = "w4a16_decode"
CALLS = 3  # per GEMM and M: two warm-up calls, the third is read
# the kernel's launch-plan variants (twin_cuda.plan): its default, the deep scale ring, the staged kernel
VARIANTS = {"default": {}, "deep": {"deep": True}, "pipe": {"pipe": True}}
METRICS = {
    "gpu__time_duration.sum": "duration_ns",
    "dram__bytes_read.sum": "dram_read_bytes",
    "dram__bytes_read.sum.per_second": "dram_read_per_s",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct_peak",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct_peak",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_active_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy_pct",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor_pipe_pct",
    "launch__registers_per_thread": "registers",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
    "smsp__average_warp_latency_per_inst_issued.ratio": "cycles_per_issue",
    # what grows with the token tiles: instructions issued, L1 traffic, global load requests (x and weights)
    "smsp__inst_executed.sum": "instructions",
    "l1tex__throughput.avg.pct_of_peak_sustained_active": "l1_pct_peak",
    "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum": "global_load_requests",
    "lts__t_sectors_srcunit_tex_op_read.sum": "l2_read_sectors",
}
STALLS = ("long_scoreboard", "short_scoreboard", "barrier", "membar", "math_pipe_throttle", "mio_throttle",
          "lg_throttle", "wait", "not_selected", "selected", "no_instruction", "dispatch_stall", "drain",
          "imc_miss", "branch_resolving", "sleeping", "tex_throttle")
for _s in STALLS:
    METRICS[f"smsp__average_warps_issue_stalled_{_s}_per_issue_active.ratio"] = f"stall_{_s}"
# where a counter of the list is not known to this ncu, the run is repeated with these alone
CORE = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "sm__throughput.avg.pct_of_peak_sustained_elapsed", "launch__registers_per_thread", "launch__grid_size")


def _child(sizes: list[str], ms: list[int], symmetric: bool, group: int, variants: list[str]) -> int:
    """Run every GEMM of the layer sets ``CALLS`` times per M, in the order ``_plan`` lists them."""
    import torch

    from int4_gemm_kernels import OwnCuda, random_layer

    gen = torch.Generator(device="cuda").manual_seed(0)
    for variant, size, gemm, n, k, m in _plan(sizes, ms, variants):
        kernel = OwnCuda(**VARIANTS[variant])
        packed, scales, zeros = random_layer(n, k, group, symmetric, "cuda", gen)
        state = kernel.prepare(packed, scales, zeros, group, None)
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        for _ in range(CALLS):
            kernel.run(state, x)
        torch.cuda.synchronize()
        del packed, scales, zeros, state
    return 0


def _plan(sizes: list[str], ms: list[int], variants: list[str]) -> list[tuple[str, str, str, int, int, int]]:
    from int4_gemm_kernels import gemm_shapes

    return [(v, size, g, n, k, m) for v in variants for size in sizes for m in ms
            for g, (n, k) in gemm_shapes(size).items()]


def ncu_path() -> str | None:
    return shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu",) if os.path.exists(p)), None)


def parse(raw_csv: str) -> list[dict[str, float | str]]:
    """``ncu --csv --page raw``: one row per profiled launch (after the header and units rows)."""
    lines = [ln for ln in raw_csv.splitlines() if ln.startswith('"')]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    out = []
    for r in rows:
        if KERNEL not in (r.get("Kernel Name") or "") or r.get("ID") in (None, "", "ID"):
            continue
        if not (r.get("ID") or "").strip().isdigit():
            continue  # the units row
        rec: dict[str, float | str] = {"kernel": r.get("Kernel Name", "")}
        for metric, name in METRICS.items():
            v = (r.get(metric) or "").replace(",", "")  # a thousands separator
            try:
                rec[name] = float(v)
            except ValueError:
                rec[name] = ""
        out.append(rec)
    return out


def assign(plan: list[tuple], launches: list[dict]) -> list[dict]:
    """The read call (the last of ``CALLS``) of each planned GEMM and M."""
    if len(launches) != CALLS * len(plan):
        raise SystemExit(f"ncu profiled {len(launches)} launches of {KERNEL}, expected {CALLS * len(plan)}")
    rows = []
    for i, (variant, size, gemm, n, k, m) in enumerate(plan):
        rec = dict(launches[CALLS * i + CALLS - 1])
        rec.update(variant=variant, size=size, gemm=gemm, n=n, k=k, m=m)
        rows.append(rec)
    return rows


def _scaled(v, by: float):
    return v / by if isinstance(v, float) else None


def _fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, float) else "—"


def report(rows: list[dict], title: str) -> str:
    lines = [f"# {title}", "",
             "Nsight Compute counters of `own-cuda` (`w4a16_decode`), one launch per GEMM and M (the third call on "
             "fresh weights, caches flushed, clocks unlocked). TB/s: DRAM bytes read / duration. Stalls: cycles a "
             "warp waits per issued instruction, the three largest reasons.", "",
             "| variant | size | GEMM | M | µs | DRAM read MB | TB/s | DRAM % peak | SM % | issue % | occupancy % "
             "| tensor % | L1 % | instructions M | global loads k | regs | grid | top stalls |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        us = r["duration_ns"] / 1e3 if isinstance(r["duration_ns"], float) else None
        tbps = (r["dram_read_bytes"] / r["duration_ns"] / 1e3) if us and isinstance(r["dram_read_bytes"], float) else None
        stalls = sorted(((r[f"stall_{s}"], s) for s in STALLS if isinstance(r.get(f"stall_{s}"), float)),
                        reverse=True)[:3]
        top = ", ".join(f"{s} {v:.2f}" for v, s in stalls)
        lines.append(f"| {r.get('variant', 'default')} | {r['size']} | {r['gemm']} | {r['m']} | {_fmt(us, '.1f')} | "
                     f"{_fmt(r['dram_read_bytes'] / 1e6 if isinstance(r['dram_read_bytes'], float) else None, '.1f')} | "
                     f"{_fmt(tbps, '.2f')} | {_fmt(r['dram_pct_peak'], '.0f')} | {_fmt(r['sm_pct_peak'], '.0f')} | "
                     f"{_fmt(r['issue_active_pct'], '.0f')} | {_fmt(r['occupancy_pct'], '.0f')} | "
                     f"{_fmt(r['tensor_pipe_pct'], '.0f')} | {_fmt(r.get('l1_pct_peak'), '.0f')} | "
                     f"{_fmt(_scaled(r.get('instructions'), 1e6), '.2f')} | "
                     f"{_fmt(_scaled(r.get('global_load_requests'), 1e3), '.1f')} | {_fmt(r['registers'], '.0f')} | {_fmt(r['grid'], '.0f')} | "
                     f"{top} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="32b")
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--variants", default="default",
                    help="comma-separated launch-plan variants: default, deep (scale ring), pipe (staged kernel)")
    ap.add_argument("--symmetric", action="store_true", help="uint4b8 (zero point 8) instead of zero points")
    ap.add_argument("--out-root", default=str(REPO / "results" / "int4-ncu"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sizes, ms = a.sizes.split(","), [int(v) for v in a.ms.split(",")]
    variants = [v for v in a.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        print(f"int4_ncu: --variants {a.variants!r}: each one of {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    if a.child:
        return _child(sizes, ms, a.symmetric, a.group, variants)
    ncu = ncu_path()
    if ncu is None:
        print("int4_ncu: no `ncu` on PATH or in /usr/local/cuda/bin (Nsight Compute is needed)", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print("int4_ncu: needs a CUDA GPU", file=sys.stderr)
        return 2
    plan = _plan(sizes, ms, variants)
    child = [sys.executable, str(Path(__file__).resolve()), "--child", "--sizes", a.sizes, "--ms", a.ms,
             "--group", str(a.group), "--variants", ",".join(variants)] + (["--symmetric"] if a.symmetric else [])
    for metrics in (list(METRICS), list(CORE)):
        cmd = [ncu, "--csv", "--page", "raw", "--print-units", "base", "--clock-control", "none",
               "--cache-control", "all", "--kernel-name", f"regex:{KERNEL}", "--metrics", ",".join(metrics)] + child
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode == 0:
            break
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
    if proc.returncode != 0:
        return proc.returncode
    rows = assign(plan, parse(proc.stdout))
    dev = torch.cuda.get_device_name(0)
    from int4_gemm import gpu_tag  # the int4 GEMM benchmark's folder tag for this GPU

    tag = gpu_tag(dev)
    out = Path(a.out_root) / f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{tag}"
    out.mkdir(parents=True, exist_ok=True)
    keys = ["variant", "size", "gemm", "n", "k", "m"] + list(METRICS.values())
    with (out / "metrics.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    flavour = "symmetric uint4b8" if a.symmetric else "zero points"
    (out / "README.md").write_text(report(rows, f"own-cuda under Nsight Compute — {dev}, {flavour}, group {a.group}"))
    ver = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1:]
    from workbench.envcapture import git_state  # WORKBENCH_GIT_COMMIT over a GPU host's older .git

    git = git_state()
    (out / "env.json").write_text(json.dumps({"device": dev, "torch": torch.__version__, "ncu": ver,
                                              "commit": git.get("commit"), "git": git,
                                              "argv": list(argv if argv is not None else sys.argv[1:]),
                                              "metrics": list(METRICS)}, indent=1))
    print(report(rows, f"own-cuda under Nsight Compute — {dev}, {flavour}"))
    print(f"wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
