"""MathVista testmini: hub parquet, local parquet, the JSON layout, or a fetched folder -> Prompts.

Prompt text is the data set's `query` field (the question with its answer-format
hint and choices); the prompt's one image is `decoded_image`. Where no image is
available the loader refuses unless `stand_in_images=True`; stand-ins are marked
with `meta["image_is_stand_in"] = True`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

from workbench.datasets import _common as C
from workbench.datasets._common import DatasetError
from workbench.datasets.stand_in import stand_in_size, write_stand_in
from workbench.prompts import Prompt, save_prompts, validate_prompt

NAME = "mathvista"
SPLIT = "testmini"
LICENCE = "CC BY-SA 4.0 (MathVista); source questions remain with their original authors"
DEFAULT_DIR_NAME = "mathvista"
PARQUET_NAME = f"{SPLIT}.parquet"
FIELDS = ("pid", "question", "image", "choices", "unit", "precision", "answer",
          "question_type", "answer_type", "metadata", "query")
HUB_REQUIRED = ("pid", "question", "choices", "unit", "precision", "answer",
                "question_type", "answer_type", "metadata", "query")


# --------------------------------------------------------------------------- rows

def _clean_precision(value: Any) -> int | None:
    # The hub stores precision as float64 (1.0, NaN); the JSON as int or null.
    if value is None:
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    if math.isnan(f):
        return None
    return int(round(f))


def _clean_row(raw: dict, where: str) -> dict:
    missing = [k for k in HUB_REQUIRED if k not in raw]
    if missing:
        raise DatasetError(f"{where}: missing field(s) {missing}")
    pid = str(raw["pid"])
    if not isinstance(raw["query"], str) or not raw["query"]:
        raise DatasetError(f"{where} (pid {pid!r}): empty or missing query")
    choices = raw.get("choices")
    metadata = raw.get("metadata") or {}
    if isinstance(metadata, str):
        metadata = json.loads(metadata)
    return {
        "pid": pid,
        "question": raw["question"],
        "image": raw.get("image"),
        "choices": list(choices) if choices is not None else None,
        "unit": raw.get("unit") or None,
        "precision": _clean_precision(raw.get("precision")),
        "answer": None if raw.get("answer") is None else str(raw["answer"]),
        "question_type": raw["question_type"],
        "answer_type": raw["answer_type"],
        "metadata": dict(metadata),
        "query": raw["query"],
        # Only files written by fetch carry this column; hub and JSON rows are real or absent.
        "image_is_stand_in": bool(raw.get("image_is_stand_in") or False),
    }


def rows_from_json_layout(folder: Path) -> tuple[list[dict], dict[str, Path]]:
    """Rows from testmini.json + query.json; also the image files that exist (images/ optional)."""
    folder = Path(folder)
    tm_path, q_path = folder / "testmini.json", folder / "query.json"
    for p in (tm_path, q_path):
        if not p.is_file():
            raise DatasetError(f"MathVista JSON layout: {p.name} not found in {folder}")
    try:
        testmini = json.loads(tm_path.read_text(encoding="utf-8"))
        queries = json.loads(q_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DatasetError(f"MathVista JSON layout in {folder}: invalid JSON ({exc})") from exc
    if not isinstance(testmini, dict) or not isinstance(queries, dict):
        raise DatasetError(f"{folder}: testmini.json and query.json must map pid -> record")
    rows, images = [], {}
    for key, rec in testmini.items():
        pid = str(rec.get("pid", key))
        if pid not in queries:
            raise DatasetError(f"{q_path}: no query for pid {pid!r}")
        row = _clean_row({**rec, "pid": pid, "query": queries[pid]}, where=f"{tm_path} pid {pid!r}")
        rows.append(row)
        if row["image"]:
            p = folder / row["image"]
            if p.is_file():
                images[pid] = p
    return rows, images


def rows_from_parquet(paths: Iterable[Path]) -> tuple[list[dict], dict[str, bytes], dict[str, Path]]:
    """Rows from hub-format parquet shard(s) or a fetched testmini.parquet.

    Image bytes come from `decoded_image`; a fetched file instead names an
    `image_file` next to it.
    """
    rows, blobs, files = [], {}, {}
    for path in paths:
        path = Path(path)
        table = C.read_parquet_table(path, where="MathVista")
        C.require_columns(table.column_names, HUB_REQUIRED, where=f"MathVista parquet {path}")
        for i, raw in enumerate(table.to_pylist()):
            row = _clean_row(raw, where=f"{path} row {i}")
            rows.append(row)
            data = C.image_bytes_of(raw.get("decoded_image"))
            if data is not None:
                blobs[row["pid"]] = data
            elif raw.get("image_file"):
                files[row["pid"]] = path.parent / raw["image_file"]
    return rows, blobs, files


def _check_unique(rows: list[dict], where: str) -> None:
    seen = set()
    for r in rows:
        if r["pid"] in seen:
            raise DatasetError(f"{where}: duplicate pid {r['pid']!r}")
        seen.add(r["pid"])


# --------------------------------------------------------------------------- rows -> prompts

def _meta(row: dict, stand_in: bool) -> dict:
    return {
        "question_type": row["question_type"],
        "answer_type": row["answer_type"],
        "choices": row["choices"],
        "unit": row["unit"],
        "precision": row["precision"],
        "answer": row["answer"],
        "metadata": row["metadata"],
        "split": SPLIT,
        "image_is_stand_in": stand_in,
    }


def build_prompts(rows: list[dict], *, blobs: dict[str, bytes] | None = None,
                  files: dict[str, Path] | None = None, image_dir: Path | None = None,
                  stand_in_images: bool = False, stand_in_dir: Path | None = None,
                  stand_in_max_side: int | None = None) -> list[Prompt]:
    """Turn rows into Prompts; bytes are written to `image_dir`, missing images refuse or get stand-ins."""
    blobs, files = blobs or {}, files or {}
    prompts, missing = [], []
    for row in rows:
        pid = row["pid"]
        stand_in = False
        if pid in blobs:
            if image_dir is None:
                raise DatasetError("image bytes need an image_dir to be written to")
            path = Path(image_dir) / f"{C.safe_name(pid)}{C.image_suffix(blobs[pid])}"
            C.write_bytes_if_changed(path, blobs[pid])
        elif pid in files and not row["image_is_stand_in"]:
            path = files[pid]
        elif pid in files and stand_in_images:
            path, stand_in = files[pid], True
        elif stand_in_images:
            md = row["metadata"]
            size = stand_in_size(md.get("img_width"), md.get("img_height"), stand_in_max_side)
            path = write_stand_in(pid, Path(stand_in_dir or image_dir), size, dataset=NAME)
            stand_in = True
        else:
            missing.append(pid)
            continue
        prompts.append(Prompt(pid=pid, text=row["query"], images=[str(path)], dataset=NAME,
                              meta=_meta(row, stand_in)))
    if missing:
        shown = ", ".join(repr(p) for p in missing[:5])
        raise DatasetError(
            f"MathVista: no real image for {len(missing)} problem(s) (pid {shown}"
            f"{', ...' if len(missing) > 5 else ''}). Fetch the hub copy (which has the images), or "
            f"pass stand_in_images=True (--stand-in-images) to use synthetic stand-ins, which are "
            f"marked in each prompt's meta and make accuracy meaningless")
    return prompts


# --------------------------------------------------------------------------- public loaders

def default_dir() -> Path:
    return C.data_root() / DEFAULT_DIR_NAME


def _source_kind(source: Path) -> str:
    if source.is_dir():
        if (source / C.MANIFEST_NAME).is_file():
            return "fetched"
        if (source / "testmini.json").is_file():
            return "json"
        shards = sorted(source.glob(f"**/{SPLIT}-*.parquet")) or sorted(source.glob("*.parquet"))
        if shards:
            return "parquet-dir"
        raise DatasetError(f"{source}: not a MathVista folder (no manifest.json, testmini.json or parquet)")
    if source.suffix == ".parquet":
        return "parquet"
    if not source.exists():
        raise DatasetError(f"MathVista source not found: {source}")
    raise DatasetError(f"{source}: not a MathVista source (expected a folder or a .parquet file)")


def _parquet_shards(source: Path) -> list[Path]:
    return sorted(source.glob(f"**/{SPLIT}-*.parquet")) or sorted(source.glob("*.parquet"))


def load_rows(source: Path) -> tuple[str, list[dict], dict[str, bytes], dict[str, Path]]:
    source = Path(source)
    kind = _source_kind(source)
    if kind == "fetched":
        C.verify_folder(source, row_counter=C.count_rows, expect_dataset=NAME)
        rows, blobs, files = rows_from_parquet([source / PARQUET_NAME])
    elif kind == "json":
        rows, files = rows_from_json_layout(source)
        blobs = {}
    else:
        shards = [source] if kind == "parquet" else _parquet_shards(source)
        rows, blobs, files = rows_from_parquet(shards)
    _check_unique(rows, str(source))
    return kind, rows, blobs, files


def load_mathvista(source: str | Path | None = None, *, pids=None, n: int | None = None,
                   stand_in_images: bool = False, image_dir: str | Path | None = None,
                   check_images: bool = True, stand_in_max_side: int | None = None) -> list[Prompt]:
    """MathVista testmini prompts.

    `source`: None for the fetched copy in data/mathvista/ (verified against its
    manifest), a fetched folder, a folder in the JSON layout (testmini.json +
    query.json [+ images/]), or hub-format parquet (file or folder of shards).
    Images held as bytes, and stand-ins, are written under `image_dir`
    (default: the workbench cache). `stand_in_max_side` shrinks stand-ins
    (aspect kept) for small-context models such as the tiny profile's.
    """
    src = Path(source) if source is not None else default_dir()
    if source is None and not src.exists():
        raise DatasetError(f"no fetched MathVista copy at {src}; run `python -m workbench.datasets fetch "
                           f"mathvista` (hub) or `... fetch mathvista --from LOCAL_PATH`, or pass source=")
    kind, rows, blobs, files = load_rows(src)
    rows = C.select_rows(rows, pids, n, source=f"MathVista ({src})")
    if image_dir is None:
        image_dir = C.default_image_dir(NAME, src)
    prompts = build_prompts(rows, blobs=blobs, files=files, image_dir=Path(image_dir),
                            stand_in_images=stand_in_images,
                            stand_in_dir=Path(image_dir) / "stand_ins", stand_in_max_side=stand_in_max_side)
    for p in prompts:
        validate_prompt(p, check_readable=check_images)
    return prompts


def fetch_mathvista(source: str | Path | None = None, out: str | Path | None = None, *,
                    revision: str | None = None, stand_in_images: bool = False,
                    force: bool = False, repo_id: str | None = None,
                    stand_in_max_side: int | None = None) -> Path:
    """Materialise testmini into `out` (default data/mathvista/): testmini.parquet, images/, prompts.jsonl, manifest.json.

    `source` None downloads from the hub (optional dependency, imported here only).
    """
    out = Path(out) if out is not None else default_dir()
    if source is None:
        from workbench.datasets.hub import download_split_parquet, pinned_revision

        pinned_repo, pinned_rev = pinned_revision(NAME)
        repo_id = repo_id or pinned_repo
        paths, sha = download_split_parquet(repo_id, SPLIT, revision or pinned_rev,
                                            cache_dir=C.cache_root() / "hub")
        rows, blobs, files = rows_from_parquet(paths)
        src_info = {"kind": "hub", "repo_id": repo_id, "files": [p.name for p in paths]}
        rev = sha
    else:
        src = Path(source)
        kind, rows, blobs, files = load_rows(src)
        src_info = {"kind": kind, "path": str(src)}
        rev = revision
        if kind == "fetched":
            rev = rev or C.read_manifest(src).get("revision")
    _check_unique(rows, str(source or repo_id))
    with C.StagedFolder(out, force=force) as tmp:
        img_dir = tmp / "images"
        prompts = build_prompts(rows, blobs=blobs, files=files, image_dir=img_dir,
                                stand_in_images=stand_in_images, stand_in_dir=img_dir,
                                stand_in_max_side=stand_in_max_side)
        # Images found as files elsewhere are copied in so the folder stands alone.
        for p in prompts:
            path = Path(p.images[0])
            if path.parent.resolve() != img_dir.resolve():
                data = path.read_bytes()
                dest = img_dir / f"{C.safe_name(p.pid)}{C.image_suffix(data, default=path.suffix or '.png')}"
                C.write_bytes_if_changed(dest, data)
                p.images = [str(dest)]
        _write_parquet(tmp / PARQUET_NAME, rows, prompts, tmp)
        save_prompts(prompts, tmp / "prompts.jsonl")
        stand_ins = sorted(p.pid for p in prompts if p.meta["image_is_stand_in"])
        C.write_manifest(tmp, dataset=NAME, split=SPLIT, source=src_info, revision=rev, licence=LICENCE,
                         rows={PARQUET_NAME: len(rows), "prompts.jsonl": len(prompts)},
                         images_are_stand_ins=bool(stand_ins), files=[PARQUET_NAME, "prompts.jsonl"],
                         extra={"stand_in_pids": stand_ins})
    return out


def _write_parquet(path: Path, rows: list[dict], prompts: list[Prompt], folder: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    by_pid = {p.pid: p for p in prompts}
    records = []
    for r in rows:
        p = by_pid[r["pid"]]
        rec = {k: r[k] for k in FIELDS}
        # metadata varies in keys between sources; JSON text keeps it lossless.
        rec["metadata"] = json.dumps(r["metadata"], ensure_ascii=False, sort_keys=True)
        rec["image_file"] = Path(p.images[0]).resolve().relative_to(folder.resolve()).as_posix()
        rec["image_is_stand_in"] = bool(p.meta["image_is_stand_in"])
        records.append(rec)
    schema = pa.schema([
        ("pid", pa.string()), ("question", pa.string()), ("image", pa.string()),
        ("choices", pa.list_(pa.string())), ("unit", pa.string()), ("precision", pa.float64()),
        ("answer", pa.string()), ("question_type", pa.string()), ("answer_type", pa.string()),
        ("metadata", pa.string()), ("query", pa.string()), ("image_file", pa.string()),
        ("image_is_stand_in", pa.bool_()),
    ])
    pq.write_table(pa.Table.from_pylist(records, schema=schema), path)
