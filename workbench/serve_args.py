"""What a serving leg starts: the ``vllm serve`` command, its environment, and the arguments of vLLM's benchmark
client for a cell (``workbench.serve_leg`` runs them)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from workbench import engine as engines
from workbench import leg as legmod

__all__ = ["BENCH_JSON", "PERCENTILES", "client_args", "server_command", "server_env"]

BENCH_JSON = "bench.json"
PERCENTILES = (50, 90, 99)


def _flag(name: str, value: Any) -> list[str]:
    opt = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [opt] if value else ["--no-" + name.replace("_", "-")]
    return [opt, str(value)]


def server_command(cfg: legmod.LegConfig, port: int, on_cuda: bool, mem_plan=None) -> list[str]:
    """``vllm serve`` of the leg's engine (the module the console script runs), on 127.0.0.1:``port``.

    ``mem_plan`` (``workbench.memory_plan.MemoryPlan``, on CUDA): the KV cache it sized and the memory
    share that covers weights, KV and overhead, instead of vLLM's discovery at start."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.target,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", cfg.dtype,
           "--max-model-len", str(cfg.max_model_len), "--max-num-seqs", str(cfg.max_num_seqs),
           "--seed", str(cfg.seed), "--limit-mm-per-prompt", json.dumps({"image": cfg.limit_images, "video": 0}),
           *_flag("enable_prefix_caching", cfg.enable_prefix_caching),
           *_flag("enable_chunked_prefill", cfg.enable_chunked_prefill)]
    if cfg.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(cfg.max_num_batched_tokens)]
    if cfg.load_format != "auto":
        cmd += ["--load-format", cfg.load_format]
    if cfg.attention_backend:
        cmd += ["--attention-backend", cfg.attention_backend]
    kv_bytes = cfg.kv_cache_memory_bytes if cfg.kv_cache_memory_bytes is not None else (
        mem_plan.kv_cache_memory_bytes if mem_plan is not None else None)
    if kv_bytes is not None and on_cuda:
        cmd += ["--kv-cache-memory-bytes", str(kv_bytes)]
    gpu_mem = cfg.gpu_memory_utilization if cfg.gpu_memory_utilization is not None else (None if on_cuda else 0.05)
    if mem_plan is not None:
        gpu_mem = mem_plan.gpu_memory_utilization
    if gpu_mem is not None:
        cmd += ["--gpu-memory-utilization", str(gpu_mem)]
    if (not on_cuda) if cfg.enforce_eager is None else cfg.enforce_eager:
        cmd.append("--enforce-eager")
    if cfg.draft is not None:
        cmd += ["--speculative-config", json.dumps(engines.spec_config(
            cfg.draft, cfg.knobs.gamma, cfg.knobs.spec_config_extra(cfg.max_num_seqs, cfg.target)[0]))]
        for name, value in cfg.knobs.engine_args(on_cuda).items():
            cmd += _flag(name, value)
    return cmd


def client_args(cfg: legmod.LegConfig, base_url: str, dataset: Path, out: Path, n: int, prefix: str,
                concurrency: int | None = None, save: bool = True, output_len: int | None = None) -> list[str]:
    """The arguments of ``vllm bench serve`` for one cell of this leg (vLLM's benchmark client);
    ``save=False``: a warm-up (no result file, no endpoint check: the server is up); ``output_len``: other
    than the leg's max_tokens (the prime pass)."""
    args = ["--backend", "openai-chat", "--base-url", base_url, "--endpoint", "/v1/chat/completions",
            "--model", cfg.target, "--dataset-name", "custom_image", "--dataset-path", str(dataset),
            "--disable-shuffle", "--num-prompts", str(n),
            "--max-concurrency", str(concurrency or cfg.max_num_seqs),
            "--custom-output-len", str(output_len or cfg.max_tokens), "--temperature", "0", "--seed", str(cfg.seed),
            "--request-id-prefix", prefix, "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", ",".join(str(p) for p in PERCENTILES)]
    args += (["--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", BENCH_JSON]
             if save else ["--ready-check-timeout-sec", "0", "--disable-tqdm"])
    if cfg.ignore_eos:
        args.append("--ignore-eos")
    return args


def server_env(cfg: legmod.LegConfig, report_dir: Path, on_cuda: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.update(cfg.knobs.to_env(report_dir=str(report_dir)))
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # the plugin's trace is flushed through the dev RPC route; the server listens on loopback only
    env["VLLM_SERVER_DEV_MODE"] = "1"
    # the plugin's step timer on every server, vanilla's too: the target's forward and the drafter's work per
    # engine step, prefill steps apart (where a first token's time goes), a few events a step
    env["VLLM_SPEC_STEP_TIMING"] = "1"
    if not on_cuda:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("OMP_NUM_THREADS", str(cfg.cpu_threads))
        if cfg.tensor_parallel_size == 1:
            # The engine core runs its worker in its own process (vLLM's uni executor), as on CUDA and as an
            # offline CPU leg does; vLLM's CPU platform otherwise starts a worker process of its own, one more
            # `import vllm` (about 10 s of CPU). The API server's engine core is a process of its own either way.
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return env
