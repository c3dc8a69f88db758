"""W4A16 GEMM kernels at decode batch sizes against bf16 cuBLAS and the HBM byte floor, in one run.

    python benchmarks/int4_gemm.py [--check] [--sizes 32b,8b] [--ms 1,2,4,8,16] [--no-sweep]
    python benchmarks/int4_gemm.py --dry-run      # CPU: shapes and the reference path only

For the Qwen3-VL 32B and 8B decoder shapes (``workbench/shapes.py``), per GEMM
(qkv, o, gate_up, down), per decoder-layer set (the four in sequence), per MLP
(gate_up, SiluAndMul, down; ``own-cuda[fused-mlp]``: the activation in the gate_up
GEMM's epilogue, ``int4_gemm_mlp.py``) and per decoder (layers x layer set + the
bf16 ``lm_head``), at M = 1, 2, 4, 8, 16:
median and IQR of the time per call (CUDA events around a CUDA graph of many
calls, warmed, ``--repeats`` repeats, the kernels interleaved repeat by repeat
in rotating order) and the effective bandwidth, for

- ``cublas-bf16``: ``torch.nn.functional.linear`` on the dequantized bf16 weight;
- ``machete``, ``marlin``: vLLM's ``MacheteLinearKernel`` / ``MarlinLinearKernel``
  on a layer laid out as vLLM's compressed-tensors scheme loads it (skipped,
  with the reason printed, where vLLM's CUDA build is not importable);
- ``tinygemm``: ``torch._weight_int4pack_mm`` (bf16, group-wise only);
- ``twin-gemv``: ``vllm_patch.twin_gemv_kernel`` (heuristic config); with the
  sweep (default) also its alternative configs, in ``sweep.csv``;
- ``own-cuda``: ``vllm_patch.twin_cuda`` (CUDA C++, tensor cores; built with the host's ``nvcc`` at
  first use), its default launch plan; ``--cuda-sweep`` adds its other row tiles per warp and CTA
  targets as ``own-cuda[r<R>-w<waves>]`` rows, and the deep scale ring (``own-cuda[deep]``,
  ``own-cuda[r2-deep]``: scales and zero points loaded two weight rings ahead) and the staged kernel
  (``own-cuda[pipe]``, ``own-cuda[r1-pipe]``: loads by cp.async into shared memory), and
  ``own-cuda[plain]``: the default plan launched plainly (the default launches each call as a programmatic
  dependent of the one before, SM 9.0+: its weights stream in while the call before ends; in the layer set,
  the GEMM before; up to commit aede0ff the default was the plain launch and ``own-cuda[pdl]`` the variant);
- ``gemlite``: GemLite's Triton W4A16 kernels (``pip install gemlite``; its GEMV
  / RevSplit-K / split-K choice and autotuning), on the same weights in its
  ``(W_q - zeros) * scales`` form (skipped, with the reason, where it is not installed).

Weights are random ``pack-quantized`` int4 (asymmetric ``uint4`` with zero
points by default, ``--symmetric`` for ``uint4b8``), group 128. Each GEMM
cycles through enough copies of its weights that they do not fit in L2 (so
every call reads HBM). The byte floor is the int4 bytes (weights, scales, zero
points, x, y) over the read bandwidth measured in the same run (a reduction
over 1 GiB: what a kernel that only streams its operands in can reach). The
device copy (``dst.copy_(src)`` of 1 GiB in a CUDA graph, read + write bytes)
is measured beside it; up to commit e736766 the floor divided by that copy
rate, which on the H200 (2.75 TB/s) is well below the read rate, so those
folders' floors are too high. ``--check`` compares every
kernel's output with ``x @ W^T`` on the float32 dequantized weight.

Writes ``results/int4-gemm/<UTC id>-<gpu tag>/``: ``env.json``,
``kernels.csv`` (one row per kernel x shape x M, scopes gemm / layer /
decoder), ``sweep.csv``, ``README.md`` (the tables printed at the end).
Runs with torch + triton alone (vLLM's kernels skipped) and with vLLM 0.27.1.

The kernels, the weights and the reference are ``int4_gemm_kernels.py``'s, the tables and the files
``int4_gemm_report.py``'s (both beside this script); this one times them.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if str(HERE) not in sys.path:  # the sibling modules below, also where this file is loaded by its path
    sys.path.append(str(HERE))

import torch  # noqa: E402

from int4_gemm_kernels import (CHECK_TOLERANCE, GEMMS, KERNEL_ORDER, Cublas, Gemlite, Kernel,  # noqa: E402,F401
                               Ours, OwnCuda, Tinygemm, VllmKernel, bf16_bytes, dequant_reference, gemlite_kernel,
                               gemm_shapes, int4_bytes, random_layer, vllm_kernels)
from int4_gemm_report import markdown, write_results  # noqa: E402
from vllm_patch import twin_gemv as tl4  # noqa: E402 (the repacking; importable without vLLM)
from vllm_patch import twin_gemv_kernel as tk  # noqa: E402
from workbench.shapes import SHAPES  # noqa: E402

WORKING_SET = 256 << 20  # bytes per GEMM's rotating copies: well above the 50-60 MB L2


# ---------------------------------------------------------------- timing

class Timer:
    """A CUDA graph of ``calls`` launches, replayed between CUDA events; eager launches if capture fails."""

    def __init__(self, fn_list):
        self.fns = fn_list
        self.mode = "graph"
        for f in self.fns[:2]:
            f()  # compile / autotune / workspace outside the capture
        torch.cuda.synchronize()
        try:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                for f in self.fns:
                    f()
            self.graph.replay()
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            self.graph, self.mode = None, "eager"
            torch.cuda.synchronize()

    def once(self) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if self.graph is not None:
            self.graph.replay()
        else:
            for f in self.fns:
                f()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / len(self.fns)  # µs per call


def stats(samples):
    q = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [samples[0]] * 3
    return statistics.median(samples), q[0], q[2]


def interleaved(timers: dict[str, Timer], repeats: int, warm: int = 3) -> dict[str, tuple[float, float, float]]:
    names = list(timers)
    for _ in range(warm):
        for n in names:
            timers[n].once()
    samples = {n: [] for n in names}
    for r in range(repeats):
        for i in range(len(names)):
            n = names[(r + i) % len(names)]
            samples[n].append(timers[n].once())
    return {n: stats(v) for n, v in samples.items()}


def copy_bandwidth(repeats: int) -> tuple[float, float]:
    """(TB/s, GiB) of ``dst.copy_(src)`` on 1 GiB, read + write bytes."""
    size = 1 << 30
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = Timer([lambda: dst.copy_(src)] * 5)
    med = stats([t.once() for _ in range(max(repeats, 5))])[0]
    del src, dst
    return 2 * size / (med * 1e-6) / 1e12, 1.0


def read_bandwidth(repeats: int) -> float:
    """TB/s of a reduction over 1 GiB (read bytes): the rate a kernel that only streams its operands in reaches."""
    size = 1 << 30
    src = torch.zeros(size // 4, dtype=torch.float32, device="cuda")
    acc = torch.zeros((), dtype=torch.float32, device="cuda")
    t = Timer([lambda: torch.sum(src, dim=0, out=acc)] * 5)
    med = stats([t.once() for _ in range(max(repeats, 5))])[0]
    del src
    return size / (med * 1e-6) / 1e12


# ---------------------------------------------------------------- the run

def gpu_tag(name: str) -> str:
    low = name.lower()
    for tag in ("h200", "h100", "h20", "gh200", "a100", "l40s", "b200", "a10g", "l4"):
        if tag in low.replace(" ", "").replace("-", ""):
            return tag
    return "".join(ch for ch in low.split()[-1] if ch.isalnum())[:12] or "gpu"


def _prepare_states(size, shapes, active, sweep, group, symmetric, check, gen, log):
    """gemm -> kernel -> its prepared copies of enough random weights to overflow L2 (False: the kernel
    cannot run that GEMM), and gemm -> the float32 reference of the first copy (``--check``)."""
    zp = not symmetric
    states: dict[str, dict[str, list]] = {g: {} for g in GEMMS}  # gemm -> kernel -> copies
    refs = {}
    for g, (n, k) in shapes.items():
        copies = max(2, min(16, math.ceil(WORKING_SET / int4_bytes(n, k, 1, group, zp))))
        copies_bf16 = max(2, min(16, math.ceil(WORKING_SET / bf16_bytes(n, k, 1))))
        for c in range(copies):
            packed, scales, zeros = random_layer(n, k, group, symmetric, "cuda", gen)
            dense = None
            if c < copies_bf16 and "cublas-bf16" in active:
                dense = dequant_reference(packed, scales, zeros, group)
                if c == 0 and check:
                    refs[g] = dense.clone()
                dense = dense.to(torch.bfloat16)
            elif c == 0 and check:
                refs[g] = dequant_reference(packed, scales, zeros, group)
            for name, kn in active.items():
                if name == "cublas-bf16" and c >= copies_bf16:
                    continue
                if states[g].get(name) is False:
                    continue
                try:
                    st = kn.prepare(packed, scales, zeros, group, dense)
                except Exception as e:  # noqa: BLE001
                    log(f"  {size} {g}: {name} skipped ({type(e).__name__}: {str(e)[:160]})")
                    states[g][name] = False
                    continue
                states[g].setdefault(name, []).append(st)
            del packed, scales, zeros, dense
        for sw in sweep:  # the swept configs run on twin-gemv's repacked copies
            base = states[g].get("twin-gemv")
            states[g][sw.name] = base if not base or sw.layout is None else [Ours.relayout(b, sw.layout) for b in base]
        torch.cuda.empty_cache()
    return states, refs


def _time_gemms(size, m, shapes, xs, all_kernels, states, refs, check, repeats, results, log):
    """Each GEMM at batch ``m``, every kernel that runs it, interleaved (``--check``: its error first)."""
    for g, (n, k) in shapes.items():
        x = xs[m][g]
        timers, errs = {}, {}
        for kn in all_kernels:
            copies = states[g].get(kn.name)
            if not copies or (isinstance(kn, Ours) and kn.cfg and not _cfg_applies(kn.name, m)):
                continue
            try:
                if check:
                    y = kn.run(copies[0], x).float()
                    if "ref" not in errs:
                        errs["ref"] = x.float() @ refs[g].T
                    ref = errs["ref"]
                    errs[kn.name] = float((y - ref).abs().max() / ref.abs().max())
                calls = max(20, 2 * len(copies))
                timers[kn.name] = Timer([(lambda st=copies[i % len(copies)], kn=kn: kn.run(st, x))
                                         for i in range(calls)])
            except Exception as e:  # noqa: BLE001
                log(f"  {size} {g} M={m}: {kn.name} failed ({type(e).__name__}: {str(e)[:160]})")
        for name, (med, q1, q3) in interleaved(timers, repeats).items():
            results[(g, m, name)] = (med, q1, q3, timers[name].mode, errs.get(name))
        del timers, errs


def _time_layer_sets(size, m, xs, active, states, repeats, results, log):
    """The layer set at batch ``m``: the four GEMMs in sequence over the layer copies, per kernel (heuristic
    configs only); the time of the four."""
    timers = {}
    for kn in active.values():
        if not all(states[g].get(kn.name) for g in GEMMS):
            continue
        ncop = min(len(states[g][kn.name]) for g in GEMMS)
        fns = []
        for i in range(max(8, ncop)):
            for g in GEMMS:
                fns.append(lambda st=states[g][kn.name][i % ncop], kn=kn, x=xs[m][g]: kn.run(st, x))
        try:
            timers[kn.name] = Timer(fns)
        except Exception as e:  # noqa: BLE001
            log(f"  {size} layer M={m}: {kn.name} failed ({type(e).__name__}: {str(e)[:160]})")
    for name, (med, q1, q3) in interleaved(timers, repeats).items():
        results[("layer", m, name)] = (med * len(GEMMS), q1 * len(GEMMS), q3 * len(GEMMS),
                                       timers[name].mode, None)
    del timers
    from int4_gemm_mlp import mlp_timers  # the MLP: gate_up, SiluAndMul, down; own-cuda's fused gate_up beside

    timers = mlp_timers(m, xs, active, states, Timer, log)
    for name, (med, q1, q3) in interleaved(timers, repeats).items():
        results[("mlp", m, name)] = (med, q1, q3, timers[name].mode, None)  # a call: the whole MLP
    del timers


def _time_lm_head(size, ms, repeats, gen) -> dict[int, tuple[float, float, float]]:
    """The bf16 ``lm_head`` (cuBLAS; the twin keeps it in bf16) at each batch: median, q1, q3 µs."""
    s = SHAPES[size]
    head = torch.randn(s.vocab, s.hidden, device="cuda", generator=gen).to(torch.bfloat16)
    lm = {}
    for m in ms:
        x = torch.randn(m, s.hidden, device="cuda", generator=gen).to(torch.bfloat16)
        t = Timer([lambda x=x: torch.nn.functional.linear(x, head)] * 10)
        lm[m] = stats([t.once() for _ in range(repeats)])
    del head
    torch.cuda.empty_cache()
    return lm


def _row(size, scope, g, n, k, m, name, med, q1, q3, nbytes, floor_bytes, mode, err, floor_tbps, config="",
         config_repr="") -> dict:
    """One row of kernels.csv / sweep.csv: the time, its bandwidth and the byte floor's time beside it."""
    floor_us = floor_bytes / (floor_tbps * 1e12) * 1e6
    return {"model": size, "scope": scope, "gemm": g, "n": n, "k": k, "m": m, "kernel": name,
            "us_median": round(med, 3), "us_q1": round(q1, 3), "us_q3": round(q3, 3),
            "iqr_us": round(q3 - q1, 3), "bytes": nbytes, "tbps": round(nbytes / (med * 1e-6) / 1e12, 3),
            "floor_us": round(floor_us, 3), "floor_over_time": round(floor_us / med, 3),
            "timing": mode, "check_rel_err": "" if err is None else f"{err:.2e}", "config": config,
            "config_repr": config_repr}


def _add_rows(size, results, lm, all_kernels, shapes, ms, group, zp, floor_tbps, rows, sweep_rows):
    """The timings as rows: per GEMM, per layer set, per decoder (layers x layer set + lm_head) and the
    lm_head alone; the swept twin-gemv configs go to ``sweep_rows``."""
    s = SHAPES[size]

    def add(scope, g, n, k, m, name, med, q1, q3, nbytes, floor_bytes, mode, err, config="", config_repr=""):
        row = _row(size, scope, g, n, k, m, name, med, q1, q3, nbytes, floor_bytes, mode, err, floor_tbps, config,
                   config_repr)
        (rows if not name.startswith("twin-gemv[") else sweep_rows).append(row)

    for (g, m, name), (med, q1, q3, mode, err) in results.items():
        kn = next((x for x in all_kernels if x.name == name.replace("[fused-mlp]", "")), None)
        if g == "mlp":  # gate_up, the activation, down (own-cuda[fused-mlp]: two launches)
            nb = sum(kn.bytes(*shapes[h], m, group, zp) for h in ("gate_up", "down"))
            fb = sum(int4_bytes(*shapes[h], m, group, zp) for h in ("gate_up", "down"))
            add("mlp", "gate_up+silu_mul+down", "", "", m, name, med, q1, q3, nb, fb, mode, None)
        elif g == "layer":
            nb = sum(kn.bytes(*shapes[h], m, group, zp) for h in GEMMS)
            fb = sum(int4_bytes(*shapes[h], m, group, zp) for h in GEMMS)
            add("layer", "qkv+o+gate_up+down", "", "", m, name, med, q1, q3, nb, fb, mode, None)
            hb = bf16_bytes(s.vocab, s.hidden, m)
            lmed, lq1, lq3 = lm[m]
            add("decoder", f"{s.layers}x layer + lm_head", "", "", m, name, s.layers * med + lmed,
                s.layers * q1 + lq1, s.layers * q3 + lq3, s.layers * nb + hb, s.layers * fb + hb, mode, None)
        else:
            n, k = shapes[g]
            cfg = (kn.cfg or tk.choose_config(n, k // 8, m)) if isinstance(kn, Ours) else None
            add("gemm", g, n, k, m, name, med, q1, q3, kn.bytes(n, k, m, group, zp),
                int4_bytes(n, k, m, group, zp), mode, err, cfg.tag if cfg else "",
                repr(cfg) if cfg else "")
    for m in ms:
        med, q1, q3 = lm[m]
        nb = bf16_bytes(s.vocab, s.hidden, m)
        add("gemm", "lm_head", s.vocab, s.hidden, m, "cublas-bf16", med, q1, q3, nb, nb, "graph", None)


def run_size(size, kernels, sweep, ms, group, symmetric, repeats, check, gen, rows, sweep_rows, floor_tbps, log):
    shapes = gemm_shapes(size)
    active = {kn.name: kn for kn in kernels}
    states, refs = _prepare_states(size, shapes, active, sweep, group, symmetric, check, gen, log)
    all_kernels = list(active.values()) + list(sweep)
    xs = {}
    for m in ms:
        xs[m] = {g: torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16) * 0.5
                 for g, (n, k) in shapes.items()}
    results = {}  # (g, m, name) -> (med, q1, q3, mode, err)
    for m in ms:
        _time_gemms(size, m, shapes, xs, all_kernels, states, refs, check, repeats, results, log)
        _time_layer_sets(size, m, xs, active, states, repeats, results, log)
    del states
    torch.cuda.empty_cache()
    lm = _time_lm_head(size, ms, repeats, gen)
    _add_rows(size, results, lm, all_kernels, shapes, ms, group, not symmetric, floor_tbps, rows, sweep_rows)


def dry_run(sizes, group, symmetric) -> int:
    """CPU: the shapes, byte counts, and the reference / repack path on a slice of every GEMM."""
    gen = torch.Generator().manual_seed(0)
    try:
        from vllm.scalar_type import scalar_types

        from vllm_patch.cpu_int4 import dequantize_packed
    except Exception:  # noqa: BLE001
        dequantize_packed = None
    print(f"{'model':5} {'gemm':8} {'N':>7} {'K':>6} {'int4 MB':>8} {'floor µs @4.27':>15}  reference")
    for size in sizes:
        for g, (n, k) in gemm_shapes(size).items():
            nb = int4_bytes(n, k, 1, group, not symmetric)
            packed, scales, zeros = random_layer(64, k, group, symmetric, "cpu", gen)
            w = dequant_reference(packed, scales, zeros, group)
            qw, s, z, gi = tl4.repack(packed, scales, zeros, group)
            assert torch.equal(tl4.dequant_repacked(qw, s, z, gi), w), (size, g)
            note = "repack == reference"
            # the values GemLite is given, (W_q - zeros) * scales, are the checkpoint's dequantization
            q = tl4.unpack_int4_cols(packed).to(torch.float32)
            zz = 8.0 if zeros is None else tl4.unpack_int4_rows(zeros, 64).to(torch.float32)
            zz = zz if isinstance(zz, float) else zz.repeat_interleave(group, dim=1)
            assert torch.equal((q - zz) * scales.to(torch.float32).repeat_interleave(group, dim=1), w), (size, g)
            note += " == gemlite's (W_q - zeros) * scales"
            from vllm_patch import twin_cuda_layout

            assert torch.equal(twin_cuda_layout.kernel_weight(twin_cuda_layout.repack(packed, scales, zeros, group)),
                               w), (size, g)
            note += " == own-cuda's reads"
            if dequantize_packed is not None:
                wt = scalar_types.uint4b8 if symmetric else scalar_types.uint4
                assert torch.equal(dequantize_packed(packed, scales, zeros, None, wt, group, torch.float32), w)
                note += " == cpu_int4.dequantize_packed"
            print(f"{size:5} {g:8} {n:7} {k:6} {nb / 1e6:8.1f} {nb / 4.27e12 * 1e6:15.1f}  {note}")
    print("dry run: shapes and the reference path check out (timing needs CUDA)")
    return 0



def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="32b,8b")
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--symmetric", action="store_true", help="uint4b8 weights (no zero points)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--check", action="store_true", help="verify every kernel against the dequantized reference")
    ap.add_argument("--no-sweep", action="store_true", help="time only the heuristic config of twin-gemv")
    ap.add_argument("--kernels", default=",".join(KERNEL_ORDER))
    ap.add_argument("--cuda-sweep", action="store_true",
                    help="own-cuda: also time R = 1, 2, 4 row tiles per warp at 1, 2, 3, 6 CTAs per SM, and the "
                         "deep scale ring (own-cuda[deep], own-cuda[r2-deep]), the staged kernel (own-cuda[pipe], "
                         "own-cuda[r1-pipe]) and the plain launch (own-cuda[plain]; the default is a programmatic "
                         "dependent launch), and the TMA-fed kernel's plans (own-cuda[bulk], own-cuda[rR-wW-bulk])")
    ap.add_argument("--bulk-sweep", action="store_true",
                    help="own-cuda: of the sweep, only the TMA-fed kernel's plans (own-cuda[bulk], own-cuda[rR-wW-bulk])")
    ap.add_argument("--dequant-mm", action="store_true",
                    help="own-cuda: also time its large-M path at every M (own-cuda[dequant-mm]: the weight dequantized "
                         "to bf16 in slices, then cuBLAS; the default takes it above twin_cuda.LARGE_M tokens)")
    ap.add_argument("--out-root", type=Path, default=REPO / "results" / "int4-gemm")
    ap.add_argument("--dry-run", action="store_true", help="CPU: shapes and the reference path only")
    return ap


def _kernels(wanted: set[str], cuda_sweep: bool, bulk_sweep: bool = False,
             dequant_mm: bool = False) -> tuple[list[Kernel], dict[str, str]]:
    """The kernels asked for that can run here, in ``KERNEL_ORDER``, and why each other one was skipped."""
    kernels: list[Kernel] = [k for k in (Cublas(), Tinygemm(), Ours(), OwnCuda()) if k.name in wanted]
    if cuda_sweep and "own-cuda" in wanted:
        kernels += [OwnCuda(r, w) for r in (1, 2, 4) for w in (1.0, 2.0, 3.0, 6.0)]
        kernels += [OwnCuda(deep=True), OwnCuda(r=2, deep=True)]  # the scales' ring as deep as two weight rings
        kernels += [OwnCuda(pipe=True), OwnCuda(r=1, pipe=True)]  # the staged kernel (cp.async, shared memory)
        kernels += [OwnCuda(pdl=False)]  # launched plainly (the default: a programmatic dependent of the call before)
    if (cuda_sweep or bulk_sweep) and "own-cuda" in wanted:  # the TMA-fed kernel (bulk copies, shared-memory ring)
        kernels += [OwnCuda(bulk=True)] + [OwnCuda(r, w, bulk=True) for r in (1, 2, 4) for w in (1.5, 3.0, 6.0)]
    if dequant_mm and "own-cuda" in wanted:  # its large-M path at every M (where it overtakes the decode kernel)
        kernels += [OwnCuda(large=True)]
    vk, skipped = vllm_kernels() if {"machete", "marlin", "humming"} & wanted else ([], {})
    kernels += [k for k in vk if k.name in wanted]
    if "gemlite" in wanted:
        gk, why = gemlite_kernel()
        kernels += gk
        skipped.update(why)
    kernels.sort(key=lambda k: KERNEL_ORDER.index(k.name.split("[")[0]))
    return kernels, skipped


def _sweep(size: str, ms: list[int], symmetric: bool) -> list[Ours]:
    """twin-gemv's alternative configs for a size's GEMMs, and its default configs with the other scale /
    zero-point memory order than repack's default."""
    k8s = {k // 8 for _, k in gemm_shapes(size).values()}
    cfgs = {c for m in ms for k8 in k8s for c in tk.sweep_configs(m, k8)}
    sweep = [Ours(c) for c in sorted(cfgs, key=lambda c: c.tag)]
    other = "ng" if tl4.default_scale_layout(not symmetric) == "gn" else "gn"
    sweep += [Ours(c, other) for c in sorted({tk.choose_config(1 << 14, 1 << 10, m) for m in ms},
                                              key=lambda c: c.tag)]
    return sweep


def _env(argv, triton, dev, copy_tbps, read_tbps, skipped, kernels, t0: float) -> dict:
    """env.json: the host's environment (``workbench.envcapture``) and this benchmark's settings and rates."""
    try:
        from workbench.envcapture import capture

        env = capture()
    except Exception as e:  # noqa: BLE001
        env = {"note": f"workbench.envcapture failed: {e}"}
    env["benchmark"] = {"argv": argv, "triton": triton.__version__, "torch": torch.__version__,
                        "gpu": dev.name, "sms": dev.multi_processor_count, "copy_tbps": copy_tbps,
                        "read_tbps": read_tbps,
                        "skipped": skipped, "kernels": [k.name for k in kernels], "seconds": round(time.time() - t0)}
    return env


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    ms = [int(v) for v in args.ms.split(",")]
    for s in sizes:
        if s not in SHAPES:
            ap.error(f"unknown size {s!r} (known: {', '.join(SHAPES)})")
    if args.dry_run:
        return dry_run(sizes, args.group, args.symmetric)
    if not torch.cuda.is_available():
        print("int4_gemm: needs CUDA (no CUDA device here); --dry-run checks shapes and the reference path",
              file=sys.stderr)
        return 2
    import triton

    wanted = set(args.kernels.split(","))
    kernels, skipped = _kernels(wanted, args.cuda_sweep, args.bulk_sweep, args.dequant_mm)
    for name, why in skipped.items():
        print(f"{name}: skipped ({why})")

    dev = torch.cuda.get_device_properties(0)
    run_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out_root / f"{run_id}-{gpu_tag(dev.name)}"
    out.mkdir(parents=True, exist_ok=False)
    log_lines = []

    def log(msg):
        print(msg, flush=True)
        log_lines.append(msg)

    t0 = time.time()
    copy_tbps, _ = copy_bandwidth(args.repeats)
    read_tbps = read_bandwidth(args.repeats)
    log(f"{dev.name}: read {read_tbps:.2f} TB/s, device copy {copy_tbps:.2f} TB/s; "
        f"kernels: {', '.join(k.name for k in kernels)}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, sweep_rows = [], []
    for size in sizes:
        sweep = _sweep(size, ms, args.symmetric) if not args.no_sweep and "twin-gemv" in wanted else []
        log(f"{size}: {len(sweep)} swept twin-gemv configs")
        run_size(size, kernels, sweep, ms, args.group, args.symmetric, args.repeats, args.check, gen, rows,
                 sweep_rows, read_tbps, log)
        log(f"{size}: done at {time.time() - t0:.0f} s")
    env = _env(sys.argv[1:], triton, dev, copy_tbps, read_tbps, skipped, kernels, t0)
    facts = {"gpu": dev.name, "copy_tbps": copy_tbps, "read_tbps": read_tbps, "repeats": args.repeats, "group": args.group,
             "flavour": "uint4b8 (symmetric)" if args.symmetric else "uint4 with zero points", "skipped": skipped}
    md = markdown(rows, sweep_rows, ms, facts)
    if log_lines:
        md += "\n## log\n\n" + "\n".join(f"- {line}" for line in log_lines) + "\n"
    write_results(out, env, rows, sweep_rows, md)
    print(md)
    print(f"wrote {out}")
    bad = [r for r in rows + sweep_rows if r["check_rel_err"] and float(r["check_rel_err"]) > CHECK_TOLERANCE]
    for r in bad:
        print(f"CHECK FAILED: {r['model']} {r['gemm']} M={r['m']} {r['kernel']}: max rel. error "
              f"{r['check_rel_err']} > {CHECK_TOLERANCE}", file=sys.stderr)
    return 1 if bad else 0


def _cfg_applies(kernel_name: str, m: int) -> bool:
    tag = kernel_name[len("twin-gemv["):-1].split(",")[0]
    kind, bm = tag.split("-")[0], int(tag.split("-")[1][1:])
    return (kind == "gemv" and bm == tk._pow2_at_least(m)) or (kind == "mma" and m <= bm)


if __name__ == "__main__":
    sys.exit(main())
