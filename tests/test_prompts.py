"""The prompt schema: JSONL round trip, path resolution, selection, validation, the tiny set."""

import json
from pathlib import Path

import pytest
from PIL import Image

from workbench.datasets import load_prompt_set
from workbench.datasets.tiny_set import build as build_tiny
from workbench.prompts import Prompt, PromptError, load_prompts, prompts_to_frame, save_prompts

REPO = Path(__file__).resolve().parents[1]


def _png(path: Path, size=(32, 32), colour=(10, 20, 30)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


@pytest.fixture
def prompt_dir(tmp_path):
    folder = tmp_path / "set"
    a = _png(folder / "img" / "a.png")
    b = _png(folder / "img" / "b.png", (48, 16))
    outside = _png(tmp_path / "elsewhere" / "c.png")
    prompts = [
        Prompt("p1", "one image", [str(a)], "unit", {"answer": "1"}),
        Prompt("p2", "two images", [str(a), str(b)], "unit", {"answer": "2", "nested": {"x": [1, 2]}}),
        Prompt("p3", "no image", [], "unit", {}),
        Prompt("p4", "image outside the folder", [str(outside)], "unit", {}),
    ]
    path = save_prompts(prompts, folder / "prompts.jsonl")
    return folder, path, prompts


def test_round_trip_keeps_every_field(prompt_dir):
    _, path, prompts = prompt_dir
    loaded = load_prompts(path)
    assert [p.pid for p in loaded] == ["p1", "p2", "p3", "p4"]
    for got, want in zip(loaded, prompts):
        assert got.text == want.text and got.dataset == want.dataset and got.meta == want.meta
        assert [Path(p).resolve() for p in got.images] == [Path(p).resolve() for p in want.images]


def test_images_inside_the_folder_are_stored_relative(prompt_dir):
    folder, path, _ = prompt_dir
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    assert raw[0]["images"] == ["img/a.png"]
    assert raw[1]["images"] == ["img/a.png", "img/b.png"]
    assert Path(raw[3]["images"][0]).is_absolute()


def test_relative_paths_resolve_against_the_file_not_the_cwd(prompt_dir, tmp_path, monkeypatch):
    folder, path, _ = prompt_dir
    moved = tmp_path / "moved"
    folder.rename(moved)
    monkeypatch.chdir(tmp_path)
    loaded = load_prompts(moved / "prompts.jsonl", pids=["p2"])
    assert [Path(p) for p in loaded[0].images] == [moved / "img" / "a.png", moved / "img" / "b.png"]


def test_selection_by_pid_keeps_requested_order_and_n(prompt_dir):
    _, path, _ = prompt_dir
    assert [p.pid for p in load_prompts(path, pids=["p3", "p1"])] == ["p3", "p1"]
    assert [p.pid for p in load_prompts(path, pids="p2,p1")] == ["p2", "p1"]
    assert [p.pid for p in load_prompts(path, n=2)] == ["p1", "p2"]
    assert [p.pid for p in load_prompts(path, pids=["p4", "p3", "p2"], n=1)] == ["p4"]


def test_unknown_pid_is_named(prompt_dir):
    _, path, _ = prompt_dir
    with pytest.raises(PromptError, match=r"unknown pid.*'nope'"):
        load_prompts(path, pids=["p1", "nope"])


def test_n_beyond_the_set_is_an_error(prompt_dir):
    _, path, _ = prompt_dir
    with pytest.raises(PromptError, match="n=9 requested but .* only 4"):
        load_prompts(path, n=9)


def test_missing_image_names_pid_and_path(prompt_dir):
    folder, path, _ = prompt_dir
    (folder / "img" / "b.png").unlink()
    with pytest.raises(PromptError, match=r"'p2'.*not found.*b\.png"):
        load_prompts(path)
    # prompts that do not use the missing file still load
    assert [p.pid for p in load_prompts(path, pids=["p1"])] == ["p1"]


def test_unreadable_image_is_named(prompt_dir):
    folder, path, _ = prompt_dir
    (folder / "img" / "a.png").write_bytes(b"this is not a picture")
    with pytest.raises(PromptError, match=r"'p1'.*not a readable image.*a\.png"):
        load_prompts(path, pids=["p1"])


@pytest.mark.parametrize("line, message", [
    ("{not json", r"prompts\.jsonl:2: not valid JSON"),
    ('{"pid": "x"}', r"missing required field 'text'"),
    ('{"pid": "x", "text": "t", "colour": 1}', r"unknown field\(s\) \['colour'\]"),
    ('{"pid": "", "text": "t"}', r"'pid' must be a non-empty string"),
    ('{"pid": "x", "text": "t", "images": "a.png"}', r"'images' must be a list"),
    ('{"pid": "p1", "text": "again"}', r"duplicate pid 'p1' \(first on line 1\)"),
])
def test_malformed_lines_are_reported_with_their_line(tmp_path, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"pid": "p1", "text": "fine"}\n' + line + "\n")
    with pytest.raises(PromptError, match=message):
        load_prompts(path)


def test_save_refuses_duplicate_pids_and_leaves_no_file(tmp_path):
    path = tmp_path / "out.jsonl"
    with pytest.raises(PromptError, match="duplicate pid 'a'"):
        save_prompts([Prompt("a", "x"), Prompt("a", "y")], path)
    assert not path.exists()


def test_prompts_to_frame(prompt_dir):
    _, path, _ = prompt_dir
    df = prompts_to_frame(load_prompts(path))
    assert list(df["n_images"]) == [1, 2, 0, 1]
    assert list(df["meta.answer"][:2]) == ["1", "2"]


# --------------------------------------------------------------------------- the built-in tiny set

def test_tiny_set_covers_the_cases_the_tiny_profile_needs():
    prompts = load_prompt_set("tiny")
    assert len(prompts) >= 10
    counts = [len(p.images) for p in prompts]
    assert 0 in counts and 2 in counts and 1 in counts
    sizes = set()
    for p in prompts:
        assert p.dataset == "tiny" and p.text.strip() and p.meta["answer"]
        for img in p.images:
            assert Path(img).stat().st_size < 4096
            with Image.open(img) as im:
                sizes.add(im.size)
                assert list(im.size) in p.meta["image_sizes"]
    assert (64, 64) in sizes and (320, 240) in sizes
    assert any(w % 32 or h % 32 for w, h in sizes), "needs at least one size that is not a multiple of 32"
    assert any(w % 2 or h % 2 for w, h in sizes), "needs at least one odd size"


def test_tiny_build_reproduces_the_committed_files(tmp_path):
    build_tiny(tmp_path)
    committed = REPO / "data" / "tiny"
    assert (tmp_path / "prompts.jsonl").read_text() == (committed / "prompts.jsonl").read_text()
    names = sorted(p.name for p in (committed / "images").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "images").iterdir())
    for name in names:
        with Image.open(committed / "images" / name) as a, Image.open(tmp_path / "images" / name) as b:
            assert a.size == b.size
            assert a.convert("RGB").tobytes() == b.convert("RGB").tobytes(), name


def test_load_prompt_set_accepts_a_jsonl_path_and_rejects_unknown_names(prompt_dir):
    _, path, _ = prompt_dir
    assert [p.pid for p in load_prompt_set(str(path), pids=["p3"])] == ["p3"]
    with pytest.raises(PromptError, match="unknown prompt set 'nonesuch'"):
        load_prompt_set("nonesuch")
    with pytest.raises(PromptError, match=r"option\(s\) \['colour'\] do not apply to prompt set 'tiny'"):
        load_prompt_set("tiny", colour="red")
    # the protocol may pass stand_in_images to any set; sets with real images ignore it
    assert len(load_prompt_set("tiny", n=2, stand_in_images=True)) == 2
    with pytest.raises(PromptError, match="either pids or pid_list"):
        load_prompt_set("tiny", pids=["tiny-001"], pid_list="mathvista_testmini_seed20")


def test_image_position_puts_the_pictures_before_or_after_the_text(tmp_path):
    from workbench.chat import chat_messages, image_position
    from workbench.serve_leg import bench_dataset

    png = tmp_path / "a.png"

    Image.new("RGB", (8, 8)).save(png)
    first = Prompt("p1", "What is it?", images=[str(png)])
    after = Prompt("p2", "What is it?", images=[str(png)], meta={"image_position": "after_text"})
    assert [c["type"] for c in chat_messages(first)[0]["content"]] == ["image", "text"]
    assert [c["type"] for c in chat_messages(after)[0]["content"]] == ["text", "image"]
    assert chat_messages(after, with_images=False) == [{"role": "user", "content": "What is it?"}]
    # the serving legs' benchmark file keeps the offline order
    bench_dataset([first, after], tmp_path / "bench.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert [[c["type"] for c in r["content"]] for r in rows] == [["image_url", "text"], ["text", "image_url"]]
    # a multiple choice's pictures between its question and its choices; without a Choices block, after the text
    mc = Prompt("p4", "Question: Where?\nChoices:\n(A) top\n(B) left", images=[str(png)],
                meta={"image_position": "before_choices"})
    assert chat_messages(mc)[0]["content"] == [{"type": "text", "text": "Question: Where?"}, {"type": "image"},
                                               {"type": "text", "text": "Choices:\n(A) top\n(B) left"}]
    plain = Prompt("p5", "What is it?", images=[str(png)], meta={"image_position": "before_choices"})
    assert [c["type"] for c in chat_messages(plain)[0]["content"]] == ["text", "image"]
    bench_dataset([mc], tmp_path / "mc.jsonl")
    row = json.loads((tmp_path / "mc.jsonl").read_text())
    assert [c["type"] for c in row["content"]] == ["text", "image_url", "text"]
    bad = Prompt("p3", "x", images=[str(png)], meta={"image_position": "middle"})
    with pytest.raises(PromptError, match="p3.*image_position.*middle"):
        image_position(bad)
