"""The shape pass's plan (workbench.serve_prime): which lengths and bursts it sends, and its token ids. The
pass against a real server is tests/test_serving.py's (every E17 leg)."""

from __future__ import annotations

import json

import pytest

from workbench.serve_server import ServeError
from workbench.serve_prime import (PREFILL_LENGTHS, SHAPE_TOKENS, burst_sizes, prefill_lengths, token_prompt,
                                    vocab_size)


def _block(n: int) -> int:
    """vLLM 0.27.1's drafting block size for a query of n tokens plus the new slot (next power of two, ≤ 256)."""
    return min(256, 1 << n.bit_length())


def test_the_lengths_meet_every_block_class_divisible_by_16_and_not():
    classes = {(_block(n), n % 16 == 0, n == 1) for n in PREFILL_LENGTHS}
    blocks = {b for b, _, _ in classes}
    assert blocks == {2, 4, 8, 16, 32, 64, 128, 256}
    for b in (32, 64, 128, 256):          # both integer classes where a block holds a multiple of 16
        assert (b, True, False) in classes and (b, False, False) in classes, b
    assert prefill_lengths(64) == [n for n in PREFILL_LENGTHS if n + SHAPE_TOKENS <= 64]
    assert max(prefill_lengths(4096)) == 257 and prefill_lengths(4) == []


def test_bursts_double_up_to_the_servers_batch():
    assert burst_sizes(32) == [2, 4, 8, 16, 32]
    assert burst_sizes(13) == [2, 4, 8, 13]
    assert burst_sizes(2) == [2] and burst_sizes(1) == []


def test_token_prompts_are_exact_in_range_and_share_no_first_token():
    vocab = 512
    prompts = [token_prompt(17, vocab, salt) for salt in range(80)]
    assert all(len(p) == 17 and all(4 <= t < vocab for t in p) for p in prompts)
    assert len({p[0] for p in prompts}) == len(prompts)        # no two share a prefix-cache block
    assert token_prompt(17, vocab, 3) == token_prompt(17, vocab, 3)


def test_the_vocabulary_comes_from_the_checkpoint_and_a_missing_one_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 151936}}))
    assert vocab_size(tmp_path) == 151936
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 512}))
    assert vocab_size(tmp_path) == 512
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ServeError, match="vocab_size"):
        vocab_size(tmp_path)
    with pytest.raises(ServeError, match="config.json"):
        vocab_size(tmp_path / "nowhere")
