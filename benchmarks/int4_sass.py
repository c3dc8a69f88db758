"""What the twin's W4A16 kernels compile to for Hopper, without a GPU: instructions per weight of the main loop.

    python benchmarks/int4_sass.py [--arch 90] [--configs default|sweep] [--out-root DIR]

Triton compiles ``vllm_patch.twin_gemv_kernel``'s kernels for ``sm_<arch>`` on any host (its wheel
ships ``ptxas`` and ``nvdisasm``); this benchmark disassembles each configuration's cubin, finds the
main loop (the longest backward branch) and counts its SASS instructions per int4 weight a thread
handles there, by opcode, with the registers per thread and the shared memory per CTA.

Why it matters: at M = 1 a CUDA-core GEMV issues every instruction of that loop once per 8 weights
per packed int, so ``instr/weight x weights / (32 x issue rate)`` bounds the kernel from below.
At the H200's ~1.05e12 warp-instructions per second (132 SMs x 4 schedulers x ~1.98 GHz), the
32B layer set's 488 M weights need ``488e6 x instr/weight / 32 / 1.05e12`` s of issue alone
(6 instructions a weight: 87 µs; 3: 44 µs) against a 61-92 µs byte floor. The GPU run of
``benchmarks/int4_gemm.py`` measures the time; this shows why a configuration is where it is.

Writes ``results/int4-sass/<UTC id>-sm<arch>/``: ``configs.csv`` (one row per configuration),
``README.md`` (the table) and ``env.json``.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_patch import twin_gemv_kernel as tk  # noqa: E402

# Integer arguments Triton's launcher marks divisible by 16 for the 32B / 8B shapes (and pointers):
# the static compile must see the same, or it would not vectorize the loads a real launch vectorizes.
_DIVISIBLE = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "out_ptr", "fin_ptr", "cnt_ptr", "N", "K8", "stride_xm",
              "stride_om", "stride_split", "stride_sn")
_POINTERS = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "out_ptr": "*fp32",
             "fin_ptr": "*bf16", "cnt_ptr": "*i32"}


def tools() -> tuple[Path, Path]:
    """``nvdisasm`` and ``cuobjdump`` of Triton's NVIDIA backend."""
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    nvdisasm, cuobjdump = bin_dir / "nvdisasm", bin_dir / "cuobjdump"
    for t in (nvdisasm, cuobjdump):
        if not t.is_file():
            raise FileNotFoundError(f"{t} is missing: this triton wheel has no NVIDIA tools")
    return nvdisasm, cuobjdump


def compile_config(cfg: tk.Config, group_ints: int = 16, has_z: bool = True, arch: int = 90):
    """Triton's compiled kernel (cubin in ``.asm['cubin']``) of one configuration, for ``sm_<arch>``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if cfg.kind == "gemv":
        fn = tk._w4_gemv_kernel
        consts = {"GROUP_INTS": group_ints, "HAS_Z": has_z, "BM": cfg.bm, "BN": cfg.bn, "BKP": cfg.bkp,
                  "FUSED": cfg.fused, "ASM": cfg.asm}
    else:
        fn = tk._w4_mma_kernel
        consts = {"GROUP_INTS": group_ints, "HAS_Z": has_z, "BM": cfg.bm, "BN": cfg.bn, "BKP": cfg.bkp,
                  "LOWP": cfg.lowp, "PREC": "tf32", "EMULATE": False}
    names = fn.arg_names
    sig = {a: ("constexpr" if a in consts else _POINTERS.get(a, "i32")) for a in names}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in _DIVISIBLE if a in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.warps, "num_stages": cfg.stages})


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA\s+`\((\.L_x_\d+)\)")
_OPCODE = re.compile(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)")


def instructions(sass: str) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """``[(address, instruction)]`` and ``{label: address}`` of nvdisasm's listing."""
    ins, labels, pending = [], {}, []
    for line in sass.splitlines():
        lm = _LABEL.match(line)
        if lm:
            pending.append(lm.group(1))
            continue
        m = _INSTR.search(line)
        if m:
            addr = int(m.group(1), 16)
            for p in pending:
                labels[p] = addr
            pending = []
            ins.append((addr, m.group(2).strip()))
    return ins, labels


def main_loop(sass: str) -> list[str]:
    """The instructions of the longest loop (a branch back to a lower address and what lies between)."""
    ins, labels = instructions(sass)
    best: list[str] = []
    for addr, text in ins:
        b = _BRANCH.search(text)
        if b and labels.get(b.group(1), 1 << 62) < addr:
            body = [t for a, t in ins if labels[b.group(1)] <= a <= addr]
            if len(body) > len(best):
                best = body
    return best


def opcode(text: str) -> str:
    """``LDG.E.128`` keeps its width, ``FFMA`` its base name: what the issue count is made of."""
    m = _OPCODE.match(text)
    if not m:
        return "?"
    base, mods = m.group(1), m.group(2)
    if base in ("LDG", "LDS", "STS", "LDSM"):
        width = [w for w in mods.split(".") if w in ("64", "128", "U16", "U8", "16", "8")]
        return base + ("." + width[0] if width else ".32")
    return base


def profile(cfg: tk.Config, group_ints: int = 16, has_z: bool = True, arch: int = 90) -> dict:
    """One configuration's main loop: instructions, per weight, by opcode; registers; shared memory."""
    kernel = compile_config(cfg, group_ints, has_z, arch)
    nvdisasm, cuobjdump = tools()
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    body = main_loop(sass)
    ops = collections.Counter(opcode(t) for t in body)
    threads = 32 * cfg.warps
    weights = 8 * cfg.bn * cfg.bkp / threads  # int4 weights a thread handles in one iteration
    return {"config": cfg.tag, "kind": cfg.kind, "asm": cfg.asm, "bn": cfg.bn, "bkp": cfg.bkp, "warps": cfg.warps,
            "stages": cfg.stages, "group_ints": group_ints, "zero_points": has_z,
            "registers": int(regs.group(1)) if regs else None, "shared_bytes": kernel.metadata.shared,
            "loop_instructions": len(body), "weights_per_thread": weights,
            "instr_per_weight": round(len(body) / weights, 3) if weights and body else None,
            "ops_per_weight": {k: round(v / weights, 3) for k, v in ops.most_common()} if weights else {},
            "sass_total": len(instructions(sass)[0])}


def configs(which: str) -> list[tk.Config]:
    """The heuristic's choices at M = 1 for the 32B shapes (K/8 = 640, 1024, 3200), or the M = 1 sweep."""
    if which == "default":
        base = [tk.choose_config(n, k8, 1) for n, k8 in ((10240, 640), (5120, 1024), (51200, 640), (5120, 3200))]
        return list(dict.fromkeys(base + [tk.replace(c, asm=True) for c in base if c.kind == "gemv"]))
    return [c for c in tk.sweep_configs(1, 640) if c.kind == "gemv"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="SM version to compile for (90: H100 / H200)")
    ap.add_argument("--configs", choices=("default", "sweep"), default="sweep")
    ap.add_argument("--group-ints", type=int, default=16, help="packed ints per quantization group (16: group 128)")
    ap.add_argument("--symmetric", action="store_true", help="no zero points (uint4b8)")
    ap.add_argument("--out-root", type=Path, default=REPO / "results" / "int4-sass")
    args = ap.parse_args(argv)
    try:
        tools()
        import triton
    except (ImportError, FileNotFoundError) as e:
        print(f"int4_sass: {e}", file=sys.stderr)
        return 2
    rows = []
    for cfg in configs(args.configs):
        try:
            rows.append(profile(cfg, args.group_ints, not args.symmetric, args.arch))
        except Exception as e:  # noqa: BLE001 - a configuration that does not compile is a finding
            rows.append({"config": cfg.tag, "kind": cfg.kind, "asm": cfg.asm, "error": f"{type(e).__name__}: {e}"})
        r = rows[-1]
        print(f"{r['config']:48} " + (f"{r['instr_per_weight']:6} instr/weight  {r['registers']} regs"
                                       if "error" not in r else r["error"][:100]), flush=True)
    run_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = args.out_root / f"{run_id}-sm{args.arch}"
    out.mkdir(parents=True, exist_ok=False)
    keys = ["config", "kind", "asm", "bn", "bkp", "warps", "stages", "group_ints", "zero_points", "registers",
            "shared_bytes", "loop_instructions", "weights_per_thread", "instr_per_weight", "sass_total", "error"]
    with open(out / "configs.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys + ["ops_per_weight"], extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**r, "ops_per_weight": json.dumps(r.get("ops_per_weight", {}))})
    top = ("LOP3", "FADD", "FFMA", "FMUL", "SHF", "PRMT", "IMAD", "LDG.128", "LDG.32")
    lines = [f"# twin-gemv main loop compiled for sm_{args.arch} (static: no GPU ran)", "",
             f"`python benchmarks/int4_sass.py --arch {args.arch} --configs {args.configs}"
             f"{' --symmetric' if args.symmetric else ''}`; triton {triton.__version__}; "
             f"group {8 * args.group_ints}, {'no zero points' if args.symmetric else 'zero points'}. "
             "Instructions of the main loop per int4 weight a thread handles there, and by opcode.", "",
             "| config | instr/weight | regs | " + " | ".join(top) + " |",
             "|---|---|---|" + "---|" * len(top)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['error'][:60]} |")
            continue
        o = r["ops_per_weight"]
        lines.append(f"| {r['config']} | {r['instr_per_weight']} | {r['registers']} | "
                     + " | ".join(f"{o.get(k, 0):.2f}" for k in top) + " |")
    (out / "README.md").write_text("\n".join(lines) + "\n")
    from workbench.envcapture import capture

    env = capture()
    env["benchmark"] = {"argv": sys.argv[1:], "triton": triton.__version__, "arch": args.arch,
                        "configs": [asdict(c) for c in configs(args.configs)]}
    (out / "env.json").write_text(json.dumps(env, indent=2, default=str) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
