"""#36: what a serving leg's cells send: fresh requests (none repeats another, none is cached) or the prompt set
repeated; and the cache counters that show which a cell measured (``workbench.serve_requests``)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from workbench.prompts import Prompt
from workbench.serve_leg import cache_delta
from workbench.serve_requests import FRESH, REPEAT, STAMP_VALUES, nonce, write_requests
from workbench.serve_server import parse_metrics


def _pixels(url: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))


@pytest.fixture()
def prompts(tmp_path):
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    Image.fromarray(np.arange(8 * 6 * 3, dtype=np.uint8).reshape(8, 6, 3)).save(a)
    Image.new("L", (5, 7), 200).save(b)
    return [Prompt("p1", "What is it?", images=[str(a)]), Prompt("p2", "Two?", images=[str(a), str(b)]),
            Prompt("p3", "Text only.")]


def _rows(path):
    return [json.loads(line)["content"] for line in path.read_text().splitlines()]


def test_fresh_requests_are_each_their_own_with_the_prompts_shapes(prompts, tmp_path):
    write_requests(prompts, tmp_path / "fresh.jsonl", 7, FRESH, "c4-")
    write_requests(prompts, tmp_path / "repeat.jsonl", 7, REPEAT)
    fresh, repeat = _rows(tmp_path / "fresh.jsonl"), _rows(tmp_path / "repeat.jsonl")
    assert len({json.dumps(r) for r in fresh}) == 7  # no request repeats another
    assert len({json.dumps(r) for r in repeat}) == 3  # the prompt set cycled
    images_seen = []
    for i, (f, r) in enumerate(zip(fresh, repeat)):
        assert f[0] == {"type": "text", "text": nonce("c4-", i)}  # the nonce first, then the prompt
        assert (f[1:] != r) == any(c["type"] == "image_url" for c in r)  # its images salted, its text as it is
        assert [c["type"] for c in f[1:]] == [c["type"] for c in r]
        assert [c.get("text") for c in f[1:]] == [c.get("text") for c in r]
        for fi, ri in zip((c for c in f if c["type"] == "image_url"), (c for c in r if c["type"] == "image_url")):
            new, old = _pixels(fi["image_url"]["url"]), _pixels(ri["image_url"]["url"])
            assert new.shape == old.shape and new.dtype == old.dtype  # same size: same image tokens
            moved = (new != old).reshape(-1)
            assert moved[0] and not moved[STAMP_VALUES:].any()  # the first value always, none past the stamp
            images_seen.append(fi["image_url"]["url"])
    assert len(set(images_seen)) == len(images_seen)  # every image sent is another content hash
    assert all(len(f[0]["text"]) == len(nonce("c4-", 0)) for f in fresh)  # fixed width: same token counts


def test_fresh_requests_depend_on_the_cell_not_the_leg(prompts, tmp_path):
    write_requests(prompts, tmp_path / "a.jsonl", 5, FRESH, "c16-")
    write_requests(prompts, tmp_path / "b.jsonl", 5, FRESH, "c16-")
    write_requests(prompts, tmp_path / "warm.jsonl", 5, FRESH, "c16-warm-")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()  # every leg sends these
    assert not set((tmp_path / "a.jsonl").read_text().splitlines()) & set(
        (tmp_path / "warm.jsonl").read_text().splitlines())  # the warm-up primes none of them


def test_no_two_images_of_a_run_match(prompts, tmp_path):
    """Every image a run's server receives is its own: the prime pass, each cell's warm-up and requests
    (E18's cells: 13, 13, 32 and 64 requests; one value moved by 1-255 matched twice in 112 images on a GPU)."""
    files = [("prime-", 3), ("c1-warm-", 1), ("c1-", 13), ("c4-warm-", 4), ("c4-", 13), ("c16-warm-", 16),
             ("c16-", 32), ("c32-warm-", 32), ("c32-", 64)]
    seen = {}
    for tag, n in files:
        write_requests(prompts, tmp_path / f"{tag}.jsonl", n, FRESH, tag)
        for i, row in enumerate(_rows(tmp_path / f"{tag}.jsonl")):
            for j, part in enumerate(c for c in row if c["type"] == "image_url"):
                pixels = _pixels(part["image_url"]["url"])
                key = (pixels.shape, pixels.tobytes())
                assert key not in seen, f"{tag}{i} image {j} repeats {seen[key]}"
                seen[key] = f"{tag}{i} image {j}"
    assert len(seen) > 150  # the prompts' two images, each sent about 90 times


def test_bad_mode_and_empty_prompts_are_refused(prompts, tmp_path):
    with pytest.raises(ValueError, match="serve_requests must be one of fresh, repeat"):
        write_requests(prompts, tmp_path / "x.jsonl", 2, "again")
    with pytest.raises(ValueError, match="no prompts"):
        write_requests([], tmp_path / "x.jsonl", 2, FRESH)


def test_the_cache_counters_are_read_and_differenced():
    page = "\n".join([
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries",
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1200.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 300.0',
        'vllm:mm_cache_queries_total{engine="0",model_name="m"} 10.0',
        'vllm:mm_cache_hits_total{engine="0",model_name="m"} 4.0',
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 7.0',
    ])
    after = parse_metrics(page)
    assert (after["prefix_cache_queries"], after["prefix_cache_hits"]) == (1200, 300)
    assert (after["mm_cache_queries"], after["mm_cache_hits"], after["num_drafts"]) == (10, 4, 7)
    before = parse_metrics(page.replace("1200.0", "200.0").replace(" 300.0", " 100.0").replace(" 10.0", " 10.0"))
    d = cache_delta(after, before)
    assert d["prefix_cache_queries"] == 1000 and d["prefix_cache_hit_rate"] == pytest.approx(0.2)
    assert d["mm_cache_queries"] == 0 and d["mm_cache_hit_rate"] is None  # nothing queried: no rate


def test_no_kv_block_of_a_fresh_request_is_anothers(prompts, tmp_path, tiny_models):
    """Rendered by the target's chat template (as the server renders the turn), two fresh requests of one
    prompt part within the first 16 tokens (vLLM's KV block on a GPU: no full block shared, so the prefix cache
    holds nothing of one for the other; on CPU a block is 128 tokens) and have the same number of tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_models["target"]))

    def ids(content):
        parts = [{"type": "image"} if c["type"] == "image_url" else c for c in content]
        return tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                       return_dict=False)

    write_requests(prompts * 2, tmp_path / "fresh.jsonl", 6, FRESH, "c32-")
    write_requests(prompts, tmp_path / "repeat.jsonl", 3, REPEAT)
    fresh, repeat = _rows(tmp_path / "fresh.jsonl"), _rows(tmp_path / "repeat.jsonl")
    for i in range(3):  # request i and i + 3: the same prompt, each fresh
        a, b = ids(fresh[i]), ids(fresh[i + 3])
        assert len(a) == len(b) > len(ids(repeat[i]))
        first = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        assert first < 16, (first, tok.decode(a[:first + 1]))
        # and they part inside the nonce, the turn's first text: nothing of the prompt comes before it
        assert ("<|im_start|>user\n" + nonce("c32-", i)).startswith(tok.decode(a[:first])), tok.decode(a[:first])


def test_the_by_hand_dataset_writes_fresh_requests_on_demand(tmp_path, capsys):
    from conftest import TINY_PROMPTS
    from workbench.serve_leg import _dataset_main

    assert _dataset_main([str(TINY_PROMPTS), str(tmp_path / "plain.jsonl")]) == 0
    assert _dataset_main([str(TINY_PROMPTS), str(tmp_path / "a.jsonl"), "--fresh", "run2-", "--requests", "20"]) == 0
    assert "20 fresh requests" in capsys.readouterr().out
    plain, fresh = _rows(tmp_path / "plain.jsonl"), _rows(tmp_path / "a.jsonl")
    assert len(fresh) == 20 == len({json.dumps(r) for r in fresh}) and fresh[0][0]["text"] == nonce("run2-", 0)
    assert fresh[len(plain)][1:] != plain[0] or not any(c["type"] == "image_url" for c in plain[0])
    with pytest.raises(SystemExit):
        _dataset_main([str(TINY_PROMPTS), str(tmp_path / "b.jsonl"), "--requests", "3"])  # --requests needs --fresh
    assert not (tmp_path / "b.jsonl").exists()
