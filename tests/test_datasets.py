"""MathVista / MM-Vet loaders, fetch + manifest, verify, pid lists — on the real shared copies."""

import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from workbench.datasets import (DatasetError, fetch, load_mathvista, load_mmvet, load_pid_list,
                                load_prompt_set, verify)
from workbench.datasets import cli as data_cli
from workbench.datasets.mathvista import rows_from_json_layout
from workbench.datasets.mmvet import CAPABILITIES
from workbench.datasets.pid_lists import mathvista_seed20, mathvista_stratum
from workbench.datasets.stand_in import stand_in_size
from workbench.prompts import PromptError, load_prompts

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("WORKBENCH_SHARED_DATA", REPO.parent / "shared" / "data"))


def _need(sub: str) -> Path:
    p = SHARED / sub
    if not p.exists():
        pytest.skip(f"shared data copy {sub} not found at {p}")
    return p


def _sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def mmvet_dir():
    return _need("mm-vet")


@pytest.fixture(scope="session")
def mathvista_dir():
    return _need("mathvista")


@pytest.fixture(scope="session")
def mathvista_prompts(mathvista_dir, tmp_path_factory):
    return load_mathvista(mathvista_dir, stand_in_images=True, image_dir=tmp_path_factory.mktemp("mv_cache"))


@pytest.fixture(scope="session")
def mmvet_fetched(mmvet_dir, tmp_path_factory):
    return fetch("mmvet", source=mmvet_dir, out=tmp_path_factory.mktemp("fetched") / "mm-vet")


@pytest.fixture(scope="session")
def mathvista_fetched(mathvista_dir, tmp_path_factory):
    return fetch("mathvista", source=mathvista_dir, out=tmp_path_factory.mktemp("fetched") / "mathvista",
                 stand_in_images=True)


def _copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --------------------------------------------------------------------------- MM-Vet

def test_every_mmvet_prompt_builds(mmvet_dir):
    table = json.loads((mmvet_dir / "mm-vet.json").read_text())
    prompts = load_mmvet(mmvet_dir)
    assert [p.pid for p in prompts] == list(table)
    assert len(prompts) == 218
    for p in prompts:
        rec = table[p.pid]
        assert p.dataset == "mmvet" and p.text == rec["question"]
        assert p.meta["answer"] == rec["answer"]
        assert p.meta["capability"] == rec["capability"] and isinstance(p.meta["capability"], list)
        assert set(p.meta["capability"]) <= set(CAPABILITIES)
        assert len(p.images) == 1 and Path(p.images[0]).name == rec["imagename"]


def test_mmvet_missing_image_names_pid_and_path(mmvet_dir, tmp_path):
    table = json.loads((mmvet_dir / "mm-vet.json").read_text())
    keep, names = {}, set()
    for pid, rec in table.items():  # questions can share an image; take three that do not
        if rec["imagename"] not in names and len(keep) < 3:
            keep[pid] = rec
            names.add(rec["imagename"])
    (tmp_path / "images").mkdir()
    (tmp_path / "mm-vet.json").write_text(json.dumps(keep))
    for pid, rec in list(keep.items())[:2]:
        shutil.copy(mmvet_dir / "images" / rec["imagename"], tmp_path / "images")
    lost_pid, lost = list(keep.items())[2]
    with pytest.raises(PromptError, match=rf"'{lost_pid}'.*not found.*{lost['imagename']}"):
        load_mmvet(tmp_path)


def test_mmvet_unknown_pid_is_named(mmvet_dir):
    with pytest.raises(PromptError, match=r"unknown pid.*'v9_999'"):
        load_mmvet(mmvet_dir, pids=["v1_0", "v9_999"])
    assert [p.pid for p in load_mmvet(mmvet_dir, pids=["v1_1", "v1_0"])] == ["v1_1", "v1_0"]


def test_mmvet_hub_format_parquet(mmvet_dir, tmp_path):
    """lmms-lab/MMVet style: question_id, image struct with bytes, capability joined by commas or listed."""
    table = json.loads((mmvet_dir / "mm-vet.json").read_text())
    items = list(table.items())[:4]
    # pyarrow needs one type per column, so the two spellings of capability go to two shards
    for shard, part, joined in (("test-00000-of-00002", items[:2], True), ("test-00001-of-00002", items[2:], False)):
        rows = [{"question_id": pid, "image": {"bytes": (mmvet_dir / "images" / rec["imagename"]).read_bytes(),
                                               "path": None},
                 "question": rec["question"], "answer": rec["answer"], "image_source": rec["imagesource"],
                 "capability": ",".join(rec["capability"]) if joined else rec["capability"]}
                for pid, rec in part]
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{shard}.parquet")
    prompts = load_mmvet(tmp_path, image_dir=tmp_path / "imgs")
    assert [p.pid for p in prompts] == [pid for pid, _ in items]
    for p in prompts:
        rec = table[p.pid]
        assert p.meta["capability"] == rec["capability"] and p.meta["answer"] == rec["answer"]
        assert _sha(p.images[0]) == _sha(mmvet_dir / "images" / rec["imagename"])


# --------------------------------------------------------------------------- MathVista

def test_mathvista_without_images_refuses_unless_stand_ins_are_asked_for(mathvista_dir, tmp_path):
    with pytest.raises(DatasetError, match="stand_in_images=True"):
        load_mathvista(mathvista_dir, image_dir=tmp_path, n=3)
    assert not list(tmp_path.rglob("*.png")), "a refused load must not leave images behind"


def test_every_mathvista_prompt_builds_with_marked_stand_ins(mathvista_dir, mathvista_prompts):
    testmini = json.loads((mathvista_dir / "testmini.json").read_text())
    queries = json.loads((mathvista_dir / "query.json").read_text())
    assert len(mathvista_prompts) == 1000
    assert [p.pid for p in mathvista_prompts] == [str(r["pid"]) for r in testmini.values()]
    for p in mathvista_prompts:
        rec = testmini[p.pid]
        assert p.text == queries[p.pid] and p.dataset == "mathvista"
        assert p.meta["image_is_stand_in"] is True
        for key in ("question_type", "answer_type", "choices", "unit", "precision", "answer", "metadata"):
            assert p.meta[key] == rec[key], (p.pid, key)
        assert len(p.images) == 1
    # stand-ins have the real image's size (that sets the image token count)
    for p in mathvista_prompts[::97]:
        md = testmini[p.pid]["metadata"]
        with Image.open(p.images[0]) as im:
            assert im.size == stand_in_size(md["img_width"], md["img_height"])


def test_stand_ins_can_be_shrunk_for_small_context_models(mathvista_dir, tmp_path):
    (p,) = load_mathvista(mathvista_dir, pids=["1"], stand_in_images=True, image_dir=tmp_path,
                          stand_in_max_side=320)
    with Image.open(p.images[0]) as im:
        assert max(im.size) == 320 and im.size == stand_in_size(1514, 720, 320)
    assert p.meta["image_is_stand_in"] is True


def test_stand_ins_are_deterministic(mathvista_dir, mathvista_prompts, tmp_path):
    again = load_mathvista(mathvista_dir, stand_in_images=True, image_dir=tmp_path, pids=["1", "500", "1000"])
    first = {p.pid: p for p in mathvista_prompts}
    for p in again:
        assert _sha(p.images[0]) == _sha(first[p.pid].images[0])
    assert _sha(again[0].images[0]) != _sha(again[1].images[0])


def _hub_rows(mathvista_dir, pids, with_image=True):
    testmini = json.loads((mathvista_dir / "testmini.json").read_text())
    queries = json.loads((mathvista_dir / "query.json").read_text())
    rows = []
    for pid in pids:
        rec = dict(testmini[pid])
        im = Image.new("RGB", (40 + int(pid), 30), (int(pid) % 255, 0, 0))
        b = io.BytesIO()
        im.save(b, format="PNG")
        rows.append({**rec, "precision": float("nan") if rec["precision"] is None else float(rec["precision"]),
                     "decoded_image": {"bytes": b.getvalue(), "path": None} if with_image else None,
                     "query": queries[pid]})
    return rows


def test_mathvista_hub_format_parquet_gives_real_images(mathvista_dir, tmp_path):
    pids = ["1", "2", "3", "97", "5"]
    shard = tmp_path / "data" / "testmini-00000-of-00001.parquet"
    shard.parent.mkdir()
    pq.write_table(pa.Table.from_pylist(_hub_rows(mathvista_dir, pids)), shard)
    prompts = load_mathvista(tmp_path, image_dir=tmp_path / "imgs")
    assert [p.pid for p in prompts] == pids
    for p in prompts:
        assert p.meta["image_is_stand_in"] is False
        assert p.meta["precision"] in (None, 1, 2) and not isinstance(p.meta["precision"], float)
        with Image.open(p.images[0]) as im:
            assert im.size == (40 + int(p.pid), 30)


def test_mathvista_parquet_rows_without_images_refuse(mathvista_dir, tmp_path):
    shard = tmp_path / "testmini-00000-of-00001.parquet"
    rows = _hub_rows(mathvista_dir, ["1", "2"]) + _hub_rows(mathvista_dir, ["3"], with_image=False)
    pq.write_table(pa.Table.from_pylist(rows), shard)
    with pytest.raises(DatasetError, match=r"no real image for 1 problem.*'3'"):
        load_mathvista(shard, image_dir=tmp_path / "imgs")


def test_unreadable_parquet_is_named(tmp_path):
    bad = tmp_path / "testmini-00000-of-00001.parquet"
    bad.write_bytes(b"PAR1 but not really a parquet file")
    with pytest.raises(DatasetError, match=r"cannot read parquet file .*testmini-00000-of-00001\.parquet"):
        load_mathvista(bad, stand_in_images=True, image_dir=tmp_path)
    with pytest.raises(DatasetError, match=r"cannot read parquet file"):
        load_mmvet(bad)


def test_parquet_missing_columns_are_named(tmp_path):
    path = tmp_path / "x.parquet"
    pq.write_table(pa.Table.from_pylist([{"pid": "1", "question": "q"}]), path)
    with pytest.raises(DatasetError, match=r"missing column\(s\) \['choices'"):
        load_mathvista(path, stand_in_images=True, image_dir=tmp_path)


def test_mathvista_unknown_pid_is_named(mathvista_dir, tmp_path):
    with pytest.raises(PromptError, match=r"unknown pid.*'1001'"):
        load_mathvista(mathvista_dir, pids=["1", "1001"], stand_in_images=True, image_dir=tmp_path)


def test_default_location_without_a_fetch_explains_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_DATA", str(tmp_path))
    with pytest.raises(DatasetError, match=r"fetch mathvista"):
        load_prompt_set("mathvista", stand_in_images=True)
    with pytest.raises(DatasetError, match=r"fetch mmvet"):
        load_prompt_set("mmvet")


# --------------------------------------------------------------------------- pid list

def test_seed20_list_follows_its_documented_rule(mathvista_dir):
    rows, _ = rows_from_json_layout(mathvista_dir)
    stored = load_pid_list("mathvista_testmini_seed20")
    assert stored == mathvista_seed20(rows)
    assert len(stored) == 20 == len(set(stored))
    by = {r["pid"]: r for r in rows}
    assert {mathvista_stratum(by[p]) for p in stored} == {mathvista_stratum(r) for r in rows}
    obj = json.loads((REPO / "data" / "pid_lists" / "mathvista_testmini_seed20.json").read_text())
    assert "sha256" in obj["rule"]


def test_load_prompt_set_with_the_seed20_list(mathvista_dir, tmp_path):
    prompts = load_prompt_set("mathvista", pid_list="mathvista_testmini_seed20", source=mathvista_dir,
                              stand_in_images=True, image_dir=tmp_path)
    assert [p.pid for p in prompts] == load_pid_list("mathvista_testmini_seed20")


# --------------------------------------------------------------------------- fetch, manifest, verify

def test_mmvet_fetch_round_trips_through_parquet_and_manifest(mmvet_dir, mmvet_fetched, tmp_path):
    manifest = verify(mmvet_fetched)
    assert manifest["dataset"] == "mmvet" and manifest["rows"]["mm-vet.parquet"] == 218
    assert manifest["licence"].startswith("CC BY-NC 4.0")
    assert len(manifest["images"]) == len(list((mmvet_dir / "images").iterdir()))
    direct = load_mmvet(mmvet_dir)
    fetched = load_mmvet(mmvet_fetched)
    from_jsonl = load_prompts(mmvet_fetched / "prompts.jsonl")
    for a, b, c in zip(direct, fetched, from_jsonl):
        assert (a.pid, a.text, a.meta) == (b.pid, b.text, b.meta) == (c.pid, c.text, c.meta)
        assert _sha(a.images[0]) == _sha(b.images[0]) == manifest["images"][f"images/{Path(b.images[0]).name}"]
        assert Path(c.images[0]) == Path(b.images[0])
    # a second fetch from the fetched folder reads its parquet and gives the same content
    again = fetch("mmvet", source=mmvet_fetched, out=tmp_path / "again")
    assert verify(again)["images"] == manifest["images"]


def test_mathvista_fetch_round_trip_keeps_stand_in_marks(mathvista_dir, mathvista_fetched, mathvista_prompts):
    manifest = verify(mathvista_fetched)
    assert manifest["images_are_stand_ins"] is True and len(manifest["stand_in_pids"]) == 1000
    assert manifest["licence"].startswith("CC BY-SA 4.0") and manifest["rows"]["testmini.parquet"] == 1000
    with pytest.raises(DatasetError, match="stand_in_images=True"):
        load_mathvista(mathvista_fetched, n=2)
    fetched = load_mathvista(mathvista_fetched, stand_in_images=True)
    assert [(p.pid, p.text, p.meta) for p in fetched] == [(p.pid, p.text, p.meta) for p in mathvista_prompts]
    assert all(Path(p.images[0]).parent == mathvista_fetched / "images" for p in fetched)
    jsonl = load_prompts(mathvista_fetched / "prompts.jsonl", n=5)
    assert all(p.meta["image_is_stand_in"] for p in jsonl)


def _corrupt_copy(src: Path, dst: Path) -> Path:
    return _copy_tree(src, dst)


def test_verify_names_a_changed_image(mmvet_fetched, tmp_path):
    copy = _corrupt_copy(mmvet_fetched, tmp_path / "c")
    victim = sorted((copy / "images").iterdir())[5]
    victim.write_bytes(victim.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(DatasetError, match=rf"images/{victim.name} does not match the manifest"):
        verify(copy)
    with pytest.raises(DatasetError, match=rf"images/{victim.name}"):
        load_mmvet(copy)


def test_verify_names_a_missing_or_extra_file(mmvet_fetched, tmp_path):
    copy = _corrupt_copy(mmvet_fetched, tmp_path / "c")
    (copy / "mm-vet.parquet").unlink()
    with pytest.raises(DatasetError, match=r"mm-vet\.parquet is listed in the manifest but missing"):
        verify(copy)
    copy2 = _corrupt_copy(mmvet_fetched, tmp_path / "d")
    shutil.copy(REPO / "data" / "tiny" / "images" / "circle_red_64x64.png", copy2 / "images" / "intruder.png")
    with pytest.raises(DatasetError, match=r"images/intruder\.png is not listed in the manifest"):
        verify(copy2)


def test_verify_names_a_row_count_mismatch(mmvet_fetched, tmp_path):
    copy = _corrupt_copy(mmvet_fetched, tmp_path / "c")
    m = json.loads((copy / "manifest.json").read_text())
    m["rows"]["mm-vet.parquet"] = 219
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DatasetError, match=r"mm-vet\.parquet has 218 rows, manifest says 219"):
        verify(copy)


def test_verify_refuses_a_folder_without_manifest(tmp_path):
    with pytest.raises(DatasetError, match="no manifest.json"):
        verify(tmp_path)


def test_fetch_never_leaves_a_partial_folder(mathvista_dir, mmvet_fetched, tmp_path):
    out = tmp_path / "mathvista"
    with pytest.raises(DatasetError, match="stand_in_images=True"):
        fetch("mathvista", source=mathvista_dir, out=out)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(DatasetError, match="already exists"):
        fetch("mmvet", source=mmvet_fetched, out=mmvet_fetched)


def test_cli_fetch_and_verify(mmvet_dir, tmp_path, capsys):
    out = tmp_path / "mm"
    assert data_cli.main(["fetch", "mmvet", "--from", str(mmvet_dir), "--out", str(out)]) == 0
    assert "fetched mmvet" in capsys.readouterr().out
    assert data_cli.main(["verify", str(out)]) == 0
    (out / "prompts.jsonl").write_text("")
    assert data_cli.main(["verify", str(out)]) == 2
    assert "prompts.jsonl does not match the manifest" in capsys.readouterr().err


def test_add_cli_mounts_on_another_parser(tmp_path):
    import argparse

    parser = argparse.ArgumentParser(prog="workbench")
    top = parser.add_subparsers(dest="cmd", required=True)
    data = top.add_parser("data")
    data_cli.add_cli(data.add_subparsers(dest="data_cmd", required=True))
    args = parser.parse_args(["data", "fetch", "mathvista", "--from", "x", "--stand-in-images", "--force"])
    assert args.func is data_cli._fetch and args.source == "x" and args.stand_in_images and args.force
    args = parser.parse_args(["data", "verify", str(tmp_path)])
    with pytest.raises(DatasetError, match="no manifest.json"):
        args.func(args)


def test_hub_fetch_records_the_resolved_revision(mathvista_dir, tmp_path, monkeypatch):
    """The hub path without a network: huggingface_hub is replaced by a stand-in serving a local shard."""
    import huggingface_hub
    from types import SimpleNamespace

    shard = tmp_path / "hub" / "data" / "testmini-00000-of-00001-abc.parquet"
    shard.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(_hub_rows(mathvista_dir, ["1", "2"])), shard)
    asked = {}

    class FakeApi:
        def dataset_info(self, repo_id, revision=None, **kw):
            asked["info"] = (repo_id, revision)
            names = ["README.md", "data/test-00000-of-00002.parquet", "data/testmini-00000-of-00001-abc.parquet"]
            return SimpleNamespace(sha="f" * 40, siblings=[SimpleNamespace(rfilename=n) for n in names])

    def fake_download(repo_id, filename, repo_type=None, revision=None, cache_dir=None, **kw):
        asked.setdefault("files", []).append((filename, revision, repo_type))
        return str(tmp_path / "hub" / filename)

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    out = fetch("mathvista", out=tmp_path / "mv", revision="v1")
    assert asked["info"] == ("AI4Math/MathVista", "v1")
    assert asked["files"] == [("data/testmini-00000-of-00001-abc.parquet", "f" * 40, "dataset")]
    manifest = verify(out)
    assert manifest["revision"] == "f" * 40 and manifest["source"]["kind"] == "hub"
    assert manifest["images_are_stand_ins"] is False
    prompts = load_mathvista(out)
    assert [p.pid for p in prompts] == ["1", "2"] and not any(p.meta["image_is_stand_in"] for p in prompts)
