"""What a serving leg sends before its first cell: the prime pass (each distinct request once) and the shape pass.

The shape pass: input shapes a server meets for the first time, met before the first cell.

A server pays the first step of each new input shape class once: Triton compiles a kernel per
specialization (a constexpr, and each integer argument's class: 1, divisible by 16, other), and vLLM's
drafting kernels take a constexpr block size from the step's longest query (the next power of two, at most
256). The prime pass sends each prompt of the leg once, but a cell's fresh prompts are a token or two longer
or shorter than the prime's and can fall in a class the prime did not meet; at a cell's concurrency the
first decode step at a batch that divides by 16 is a class of its own. On an H100 at 8B the first
speculative server of a run had steps with 100-395 ms of draft work at such first meetings, inside its
cells (`results/E18/20261207T235605Z-869510a1`, twin_a1's steps), and the servers after it none (Triton's
on-disk cache).

The shape pass sends, before the first cell: one prompt of each length class (``PREFILL_LENGTHS``: lengths
1 to 257 with one of each next power of two, divisible by 16 and not), one at a time, then bursts of 2, 4,
... up to the leg's ``max_num_seqs`` requests at once, so decode steps run at each batch class. Prompts are
token ids sent to ``/v1/completions`` (exact lengths, no chat template), each distinct (no prefix cache
hit for a cell), a few tokens each. Every leg of a run sends the same pass; its requests stay out of every
cell's counters and records (they precede the first cell's warm-up and counters).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from workbench import leg as legmod
from workbench.serve_args import client_args
from workbench.serve_client import BenchClient, ClientError
from workbench.serve_requests import FRESH, write_requests
from workbench.serve_server import ServeError, _http

__all__ = ["PREFILL_LENGTHS", "PRIME_TOKENS", "burst_sizes", "distinct_requests", "prefill_lengths", "prime_dataset",
           "prime_pass", "shape_pass", "token_prompt", "vocab_size"]


# --------------------------------------------------------------------------- the prime pass
PRIME_LOG = "prime.log"
PRIME_REQUESTS = "prime-requests.jsonl"
PRIME_TOKENS = 4  # a prefill, the draft's prefill and first draft, a verify step: what a new input shape costs


def distinct_requests(dataset: Path) -> dict[str, int]:
    """The distinct requests of ``dataset`` (by their content, what the server receives), in order: each
    line and the index of its first occurrence."""
    first: dict[str, int] = {}
    for i, line in enumerate(dataset.read_text().splitlines()):
        if line.strip():
            first.setdefault(line, i)
    return first


def prime_dataset(dataset: Path, path: Path) -> int:
    """The distinct requests of ``dataset`` into ``path``, in order; returns how many."""
    lines = list(distinct_requests(dataset))
    path.write_text("".join(x + "\n" for x in lines))
    return len(lines)


def prime_pass(cfg: legmod.LegConfig, client: BenchClient, base_url: str, prompts: list, dataset: Path,
           out: Path) -> None:
    """Every distinct prompt (by content) once, one at a time, a few tokens, before the first cell: what a
    server pays the first time it sees an input shape is paid here, not by whichever cell meets that shape
    first (fresh requests: the prompts' shapes, each request its own, so no cell finds them cached). Without
    it the first cell (concurrency 1, warmed by one request) carried it, and more so in the legs that ran early
    in a run (8B H100, E18 20261206T091621Z-553b266a: the longest prompts' TTFT 350-430 ms in the first vanilla
    and spec legs, 90-130 ms in the later ones; vanilla_1's median 77 ms against vanilla_2's 52). Which part
    of the server pays it is not separated."""
    if cfg.serve_requests == FRESH:
        # request i of the dataset is prompts[i] as it is: the first of each, by content, made fresh
        first = list(distinct_requests(dataset).values())
        n_prompts = len(first)
        write_requests([prompts[i] for i in first], out / PRIME_REQUESTS, n_prompts, FRESH, "prime-")
    else:
        n_prompts = prime_dataset(dataset, out / PRIME_REQUESTS)
    try:
        client.run(client_args(cfg, base_url, out / PRIME_REQUESTS, out, n_prompts, f"{cfg.leg or 'leg'}-prime-", 1,
                               save=False, output_len=PRIME_TOKENS), out / PRIME_LOG, None,
                   max(600.0, 30.0 * n_prompts))
    except ClientError as exc:
        raise ServeError(f"vllm bench serve failed priming the server with the {n_prompts} prompts: {exc}") from None
    finally:
        (out / PRIME_REQUESTS).unlink(missing_ok=True)  # derived from the leg's requests.jsonl


# --------------------------------------------------------------------------- the shape pass

# one length per (next power of two of length + 1, capped at 256; divisible by 16 or not) class
PREFILL_LENGTHS = (1, 3, 5, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257)
SHAPE_TOKENS = 4      # a prefill, the draft's first pass, a verify step: a new prompt shape's first costs
BURST_TOKENS = 8      # enough decode steps at the burst's batch
BURST_PROMPT = 17


def prefill_lengths(max_model_len: int, output_len: int = SHAPE_TOKENS) -> list[int]:
    """``PREFILL_LENGTHS`` that fit the server's ``max_model_len`` with ``output_len`` tokens after them."""
    return [n for n in PREFILL_LENGTHS if n + output_len <= max_model_len]


def burst_sizes(max_num_seqs: int) -> list[int]:
    """2, 4, 8, ... below ``max_num_seqs``, and ``max_num_seqs`` itself (none for 1)."""
    sizes, k = [], 2
    while k < max_num_seqs:
        sizes.append(k)
        k *= 2
    return sizes + ([max_num_seqs] if max_num_seqs > 1 else [])


def vocab_size(model_dir: str | Path) -> int:
    """The text vocabulary of a checkpoint folder (``text_config.vocab_size`` of a VLM, else ``vocab_size``)."""
    path = Path(model_dir) / "config.json"
    try:
        conf = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ServeError(f"the shape pass reads the vocabulary from {path}: {exc}") from None
    size = (conf.get("text_config") or {}).get("vocab_size") or conf.get("vocab_size")
    if not isinstance(size, int) or size < 8:
        raise ServeError(f"{path} names no vocab_size the shape pass can draw token ids from")
    return size


def token_prompt(length: int, vocab: int, salt: int) -> list[int]:
    """``length`` token ids in [4, vocab), distinct per ``salt`` from the first id on (so no two prompts of
    the pass share a prefix-cache block), deterministic."""
    span = vocab - 4
    return [4 + (salt * 7919 + i * 104729 + (i * i) % 31) % span for i in range(length)]


def _complete(base_url: str, model: str, prompt: list[int], max_tokens: int, timeout: float) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    try:
        _http(f"{base_url}/v1/completions", json.dumps(body).encode(), timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - a refused or failed request: the leg cannot be measured as planned
        raise ServeError(f"the shape pass's request of {len(prompt)} prompt tokens failed: {exc}") from None


def shape_pass(base_url: str, model: str, vocab: int, max_model_len: int, max_num_seqs: int,
               timeout: float = 120.0) -> dict[str, Any]:
    """Send the pass (see the module's doc); what it sent and how long it took, for the leg's summary."""
    t0 = time.perf_counter()
    lengths = prefill_lengths(max_model_len)
    for salt, n in enumerate(lengths):
        _complete(base_url, model, token_prompt(n, vocab, salt), SHAPE_TOKENS, timeout)
    bursts = burst_sizes(max_num_seqs) if BURST_PROMPT + BURST_TOKENS <= max_model_len else []
    salt = len(lengths)
    for k in bursts:
        prompts = [token_prompt(BURST_PROMPT, vocab, salt + i) for i in range(k)]
        salt += k
        with ThreadPoolExecutor(max_workers=k) as pool:
            list(pool.map(lambda p: _complete(base_url, model, p, BURST_TOKENS, timeout), prompts))
    return {"prefill_lengths": lengths, "bursts": bursts, "requests": salt,
            "seconds": round(time.perf_counter() - t0, 3)}
