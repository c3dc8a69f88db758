"""The draft's decode attention: the project's one-launch kernel (``vllm_patch.twin_attention``) against
FlashAttention 3 as vLLM calls it, at the draft's shapes, per layer and per draft step.

One query token per request over a paged bf16 KV cache (vLLM 0.27.1's FlashAttention cache, blocks of 16 scattered
through the cache), the twin's head counts (8B: 32 query / 8 KV heads, 36 layers; 32B: 64 / 8, 64 layers), batch
1 / 4 / 16 / 32, every request at one context length (256 / 1024 / 3584 tokens). Each kernel is captured in a CUDA
graph of ``--calls`` launches over rotating caches (above the L2) and timed by CUDA events, interleaved, ``--repeats``
times after warm-up: µs per launch, median (IQR), the KV bytes' read rate, and the layer count's sum (what one
draft step spends in attention). Every configuration is checked against float32 attention first (``--check``).
FlashAttention 3 needs vLLM's ``vllm_flash_attn`` (a staged GPU host); without it the table has the own kernel
alone and says why. The run folder (``results/decode-attn/<stamp>-<gpu>/``): ``README.md``, ``rows.csv``,
``env.json``.

On a CPU, ``--dry-run`` checks the kernel's arithmetic (``twin_attention.emulate``) against float32 attention at
small shapes and prints the split counts the GPU run would use.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from vllm_patch import twin_attention as ta  # noqa: E402

SHAPES = {"8b": (32, 8, 36), "32b": (64, 8, 64)}  # query heads, KV heads, layers
BLOCK = 16
ROTATE_BYTES = 256 << 20  # the caches a graph rotates through: well above the L2


def _paged(batch, hq, hkv, length, device, seed=0):
    return ta.paged_cache(batch, hq, hkv, [length] * batch, block=BLOCK, seed=seed, device=device)


def kv_bytes(batch, hkv, length) -> int:
    return batch * length * hkv * ta.HEAD_DIM * 2 * 2


def dry_run() -> int:
    for hq, hkv in ((8, 2), (16, 2)):
        q, k, v, table, lens = _paged(2, hq, hkv, 40, "cpu")
        lens[0] = 7
        want = ta.reference(q, k, v, table, lens, ta.HEAD_DIM ** -0.5)
        for s in (1, 3):
            err = float((ta.emulate(q, k, v, table, lens, ta.HEAD_DIM ** -0.5, s) - want).abs().max())
            print(f"emulated kernel, {hq}/{hkv} heads, {s} splits: max abs error {err:.2e} against float32 attention")
            if err > 1e-4:
                return 1
    for size, (hq, hkv, _) in SHAPES.items():
        print(size, {b: {n: ta.splits_for(b, hkv, n, sms=132) for n in (256, 1024, 3584)} for b in (1, 4, 16, 32)},
              "(splits on 132 SMs, by batch and context)")
    return 0


def _fa3():
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001 - no vLLM on a kernel-only host
        return None, f"vllm_flash_attn not importable ({type(e).__name__}: {e})"
    return flash_attn_varlen_func, None


def _cases(batch, hq, hkv, length, device, sms, fa3, engine_len=0):
    """Per kernel, the launches of one CUDA graph over rotating caches; the first cache checked first. With
    ``engine_len`` also the kernel at the split count the drafter uses (``draft_attention``: fixed per batch, from
    the model's longest sequence ``engine_len``), where it differs from the one for this length."""
    one = kv_bytes(batch, hkv, length)
    copies = max(1, min(16, ROTATE_BYTES // max(1, one)))
    sets = [_paged(batch, hq, hkv, length, device, seed=i) for i in range(copies)]
    scale = ta.HEAD_DIM ** -0.5
    splits = ta.splits_for(batch, hkv, length, sms)
    ws = ta.make_workspace(batch, hq, hkv, splits, device)
    out = torch.empty_like(sets[0][0])
    fns = {"own": [lambda s=s: ta.decode_attention(*s, scale, splits, out=out, workspace=ws) for s in sets]}
    engine = ta.splits_for(batch, hkv, engine_len, sms) if engine_len else splits
    if engine != splits:
        ws_e = ta.make_workspace(batch, hq, hkv, engine, device)
        fns["own@engine"] = [lambda s=s: ta.decode_attention(*s, scale, engine, out=out, workspace=ws_e)
                             for s in sets]
    if fa3 is not None:
        cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
        fns["fa3"] = [lambda s=s: fa3(q=s[0], k=s[1], v=s[2], out=out, cu_seqlens_q=cu, max_seqlen_q=1, seqused_k=s[4],
                                      max_seqlen_k=length, softmax_scale=scale, causal=True, block_table=s[3],
                                      fa_version=3) for s in sets]
    want = ta.reference(*[t.cpu() for t in sets[0]], scale)
    errs = {}
    for name, f in fns.items():
        f[0]()
        errs[name] = float((out.float().cpu() - want).abs().max())
    return fns, errs, {"own": splits, "own@engine": engine}


def run(args) -> int:
    from int4_gemm import Timer, gpu_tag, interleaved, read_bandwidth

    dev = torch.cuda.get_device_properties(0)
    fa3, why = _fa3()
    read_tbps = read_bandwidth(5)
    rows, t0 = [], time.time()
    for size in args.sizes.split(","):
        hq, hkv, layers = SHAPES[size]
        for batch in map(int, args.batches.split(",")):
            for length in map(int, args.lengths.split(",")):
                fns, errs, splits = _cases(batch, hq, hkv, length, "cuda", dev.multi_processor_count, fa3,
                                           args.engine_max_len)
                timed = interleaved({n: Timer(f[: args.calls] * max(1, args.calls // len(f))) for n, f in fns.items()},
                                    args.repeats)
                for name, (med, q1, q3) in timed.items():
                    rows.append({"size": size, "batch": batch, "context": length, "kernel": name,
                                 "splits": splits.get(name, ""), "us_median": round(med, 2),
                                 "iqr_us": round(q3 - q1, 2), "tbps": round(kv_bytes(batch, hkv, length) / med / 1e6, 3),
                                 "floor_us": round(kv_bytes(batch, hkv, length) / read_tbps / 1e6, 2),
                                 "per_step_ms": round(med * layers / 1e3, 3), "max_abs_err": f"{errs[name]:.2e}"})
                print(rows[-len(timed):], flush=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = args.out or REPO / "results" / "decode-attn" / f"{stamp}-{gpu_tag(dev.name)}"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "rows.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    try:
        from workbench.envcapture import capture

        env = capture()
    except Exception as e:  # noqa: BLE001
        env = {"note": f"workbench.envcapture failed: {e}"}
    env["benchmark"] = {"argv": sys.argv[1:], "gpu": dev.name, "read_tbps": read_tbps, "fa3_skipped": why,
                        "seconds": round(time.time() - t0)}
    (out / "env.json").write_text(json.dumps(env, indent=2, default=str) + "\n")
    md = [f"# Decode attention for the draft — {dev.name}", "",
          f"One query token a request, paged bf16 KV cache (blocks of {BLOCK}), head dim 128; µs per launch, "
          f"median (IQR) of {args.repeats} interleaved CUDA-graph replays; floor = KV bytes / {read_tbps:.2f} TB/s; "
          "per step = µs × the shape's layers; own@engine: the split count the drafter uses (fixed per batch, from "
          f"a longest sequence of {args.engine_max_len})." + (f" FlashAttention 3 skipped: {why}." if why else ""), "",
          "| size | batch | context | kernel | splits | µs (IQR) | TB/s | floor µs | per draft step ms | max abs err |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['size']} | {r['batch']} | {r['context']} | {r['kernel']} | {r['splits']} | {r['us_median']} "
           f"({r['iqr_us']}) | {r['tbps']} | {r['floor_us']} | {r['per_step_ms']} | {r['max_abs_err']} |" for r in rows]
    (out / "README.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"wrote {out}")
    bad = [r for r in rows if float(r["max_abs_err"]) > 3e-2]
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8b,32b")
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--lengths", default="256,1024,3584")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=32, help="launches per CUDA graph")
    ap.add_argument("--engine-max-len", type=int, default=3584,
                    help="the model's longest sequence, for the split count draft_attention fixes per batch (0: off)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU: the kernel's arithmetic against float32 attention")
    args = ap.parse_args(argv)
    if args.dry_run:
        return dry_run()
    if not torch.cuda.is_available():
        raise SystemExit("decode_attention.py needs a CUDA GPU (or --dry-run on a CPU)")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
