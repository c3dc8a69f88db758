"""Host time of one call into the draft's GEMM op, by how the op is registered (no GPU needed).

    python benchmarks/op_dispatch.py [--calls 20000] [--repeats 5] [--out-root results/op-dispatch]

The draft's linear layers reach their kernels through custom ops (``twin_spec::w4a16_cuda_mm``,
``twin_spec::w4a16_by_m``). Inside CUDA graphs a call costs nothing on the host; outside them (a prefill above
the captured sizes, an eager step) every call pays the dispatcher. This times one call of two ops with the same
schema and the same trivial body (it returns a preallocated tensor): one made by ``torch.library.custom_op``,
one registered directly (``vllm_patch.custom_ops``, as vLLM registers its own), alternating, ``--repeats``
times ``--calls`` calls each after a warm-up. Prints µs per call (median and IQR over the repeats) and their
ratio, and writes ``<out-root>/<UTC id>-cpu/README.md``, ``numbers.json`` and ``env.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SCHEMA = "(Tensor x, str key, int n) -> Tensor"


_OPS: tuple | None = None  # (ops, library): registered once per process


def _ops():
    global _OPS
    if _OPS is None:
        _OPS = _register()
    return _OPS


def _register():
    import torch

    from vllm_patch import custom_ops

    out = torch.empty(8, 32)

    def body(x, key, n):
        return out

    def fake(x, key, n):
        return x.new_empty((x.shape[0], n))

    wrapped = torch.library.custom_op("twin_bench::by_custom_op", mutates_args=(), schema=SCHEMA)(body)
    wrapped.register_fake(fake)
    lib = custom_ops.library()  # the plugin's own registration, as its GEMM ops use it
    direct = custom_ops.register(lib, "bench_direct", SCHEMA, body, fake)
    return {"torch.library.custom_op": wrapped, "direct (custom_ops.register)": direct}, lib


def measure(calls: int, repeats: int) -> dict[str, list[float]]:
    """µs per call of each op, one value per repeat, the ops alternating within each repeat."""
    import torch

    ops, _lib = _ops()
    x = torch.randn(8, 64)
    times: dict[str, list[float]] = {name: [] for name in ops}
    for name, op in ops.items():  # warm-up
        for _ in range(min(calls, 1000)):
            op(x, "k", 32)
    for _ in range(repeats):
        for name, op in ops.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                op(x, "k", 32)
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
    return times


def _quartiles(v: list[float]) -> tuple[float, float, float]:
    if len(v) < 2:
        return v[0], v[0], v[0]
    q = statistics.quantiles(v, n=4, method="inclusive")
    return q[0], statistics.median(v), q[2]


def report(times: dict[str, list[float]], calls: int) -> tuple[str, dict]:
    rows, numbers = [], {}
    for name, v in times.items():
        q1, med, q3 = _quartiles(v)
        numbers[name] = {"median_us": med, "q1_us": q1, "q3_us": q3, "repeats": len(v), "calls": calls}
        rows.append(f"| {name} | {med:.2f} | {q1:.2f}–{q3:.2f} |")
    names = list(times)
    ratio = numbers[names[0]]["median_us"] / numbers[names[1]]["median_us"]
    numbers["ratio_custom_op_over_direct"] = ratio
    text = "\n".join([
        f"# Host time of one custom-op call — {platform.processor() or platform.machine()}", "",
        f"Same schema and body, {calls} calls a repeat, {len(times[names[0]])} repeats alternating; µs per call.", "",
        "| registration | median µs | IQR |", "|---|---|---|", *rows, "",
        f"`torch.library.custom_op` costs {ratio:.1f}× the direct registration a call.", ""])
    return text, numbers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out-root", default=str(REPO / "results" / "op-dispatch"))
    a = ap.parse_args(argv)
    if a.calls < 1 or a.repeats < 1:
        ap.error("--calls and --repeats must be at least 1")
    times = measure(a.calls, a.repeats)
    text, numbers = report(times, a.calls)
    print(text)
    out = Path(a.out_root) / (datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-cpu")
    out.mkdir(parents=True, exist_ok=True)
    (out / "README.md").write_text(text)
    (out / "numbers.json").write_text(json.dumps(numbers, indent=1) + "\n")
    from workbench.envcapture import write_env

    write_env(out / "env.json", {"command": "python benchmarks/op_dispatch.py " + " ".join(argv or sys.argv[1:])})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
