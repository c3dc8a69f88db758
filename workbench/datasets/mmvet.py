"""MM-Vet: the original layout (mm-vet.json + images/), hub parquet, or a fetched folder -> Prompts.

Prompt text is the question; the one image is the question's image. The
reference answer (with MM-Vet's `<AND>` / `<OR>` notation) and the capability
list are kept in meta for grading and per-capability tables.
"""

from __future__ import annotations

import json
from pathlib import Path

from workbench.datasets import _common as C
from workbench.datasets._common import DatasetError
from workbench.prompts import Prompt, save_prompts, validate_prompt

NAME = "mmvet"
SPLIT = "test"
LICENCE = "CC BY-NC 4.0 (MM-Vet data); attribution to the MM-Vet authors"
DEFAULT_DIR_NAME = "mm-vet"
PARQUET_NAME = "mm-vet.parquet"
CAPABILITIES = {"rec": "recognition", "ocr": "OCR", "know": "knowledge",
                "gen": "language generation", "spat": "spatial awareness", "math": "math"}
# Long names as some copies spell them -> the short codes of mm-vet.json.
_CAPABILITY_CODES = {v.lower(): k for k, v in CAPABILITIES.items()}
_CAPABILITY_CODES.update({"spatial": "spat", "knowledge": "know", "generation": "gen",
                          "recognition": "rec", "ocr": "ocr", "math": "math"})


def _capabilities(value, where: str) -> list[str]:
    if isinstance(value, str):
        value = [v for v in value.replace(";", ",").split(",")]
    if not isinstance(value, (list, tuple)) or not value:
        raise DatasetError(f"{where}: capability must be a non-empty list, got {value!r}")
    out = []
    for v in value:
        key = str(v).strip()
        code = key if key in CAPABILITIES else _CAPABILITY_CODES.get(key.lower())
        if code is None:
            raise DatasetError(f"{where}: unknown capability {key!r}; known: {sorted(CAPABILITIES)}")
        if code not in out:
            out.append(code)
    return out


def _row(pid: str, question, answer, capability, imagesource, imagename, where: str) -> dict:
    if not isinstance(question, str) or not question.strip():
        raise DatasetError(f"{where} (pid {pid!r}): empty or missing question")
    if answer is None:
        raise DatasetError(f"{where} (pid {pid!r}): missing answer")
    return {"pid": pid, "question": question, "answer": str(answer),
            "capability": _capabilities(capability, f"{where} (pid {pid!r})"),
            "imagesource": imagesource, "imagename": imagename}


def rows_from_original(folder: Path) -> tuple[list[dict], dict[str, Path]]:
    folder = Path(folder)
    jpath = folder / "mm-vet.json"
    if not jpath.is_file():
        raise DatasetError(f"MM-Vet layout: mm-vet.json not found in {folder}")
    try:
        table = json.loads(jpath.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{jpath}: invalid JSON ({exc})") from exc
    if not isinstance(table, dict):
        raise DatasetError(f"{jpath}: expected an object mapping pid -> record")
    rows, files = [], {}
    for pid, rec in table.items():
        where = str(jpath)
        for key in ("imagename", "question", "answer", "capability"):
            if key not in rec:
                raise DatasetError(f"{where} (pid {pid!r}): missing field {key!r}")
        rows.append(_row(str(pid), rec["question"], rec["answer"], rec["capability"],
                         rec.get("imagesource"), rec["imagename"], where))
        # A missing image file is reported by build_prompts, naming pid and path.
        files[str(pid)] = folder / "images" / rec["imagename"]
    return rows, files


def rows_from_parquet(paths) -> tuple[list[dict], dict[str, bytes], dict[str, Path]]:
    """Hub parquet (question_id, image, question, answer, capability, image_source) or a fetched file."""
    rows, blobs, files = [], {}, {}
    for path in paths:
        path = Path(path)
        table = C.read_parquet_table(path, where="MM-Vet")
        cols = set(table.column_names)
        id_col = "pid" if "pid" in cols else "question_id"
        C.require_columns(cols, (id_col, "question", "answer", "capability"), where=f"MM-Vet parquet {path}")
        for i, raw in enumerate(table.to_pylist()):
            pid = str(raw[id_col])
            rows.append(_row(pid, raw["question"], raw["answer"], raw["capability"],
                             raw.get("imagesource", raw.get("image_source")), raw.get("imagename"),
                             f"{path} row {i}"))
            data = C.image_bytes_of(raw.get("image"))
            if data is not None:
                blobs[pid] = data
            elif raw.get("image_file"):
                files[pid] = path.parent / raw["image_file"]
    return rows, blobs, files


def build_prompts(rows, *, blobs=None, files=None, image_dir: Path | None = None) -> list[Prompt]:
    blobs, files = blobs or {}, files or {}
    prompts = []
    for r in rows:
        pid = r["pid"]
        if pid in blobs:
            if image_dir is None:
                raise DatasetError("image bytes need an image_dir to be written to")
            name = r["imagename"] or f"{C.safe_name(pid)}{C.image_suffix(blobs[pid])}"
            path = Path(image_dir) / C.safe_name(name)
            C.write_bytes_if_changed(path, blobs[pid])
        elif pid in files:
            path = files[pid]
        else:
            raise DatasetError(f"MM-Vet: no image for pid {pid!r}")
        meta = {"answer": r["answer"], "capability": list(r["capability"]),
                "imagesource": r["imagesource"], "imagename": r["imagename"] or Path(path).name}
        prompts.append(Prompt(pid=pid, text=r["question"], images=[str(path)], dataset=NAME, meta=meta))
    return prompts


def default_dir() -> Path:
    return C.data_root() / DEFAULT_DIR_NAME


def load_rows(source: Path):
    source = Path(source)
    if source.is_dir() and (source / C.MANIFEST_NAME).is_file():
        C.verify_folder(source, row_counter=C.count_rows, expect_dataset=NAME)
        kind = "fetched"
        rows, blobs, files = rows_from_parquet([source / PARQUET_NAME])
    elif source.is_dir() and (source / "mm-vet.json").is_file():
        kind = "original"
        rows, files = rows_from_original(source)
        blobs = {}
    elif source.is_dir() and sorted(source.glob("**/*.parquet")):
        kind = "parquet-dir"
        rows, blobs, files = rows_from_parquet(sorted(source.glob("**/*.parquet")))
    elif source.suffix == ".parquet":
        kind = "parquet"
        rows, blobs, files = rows_from_parquet([source])
    elif not source.exists():
        raise DatasetError(f"MM-Vet source not found: {source}")
    else:
        raise DatasetError(f"{source}: not an MM-Vet source (expected mm-vet.json + images/, "
                           f"a fetched folder, or parquet)")
    seen = set()
    for r in rows:
        if r["pid"] in seen:
            raise DatasetError(f"{source}: duplicate pid {r['pid']!r}")
        seen.add(r["pid"])
    return kind, rows, blobs, files


def load_mmvet(source: str | Path | None = None, *, pids=None, n: int | None = None,
               image_dir: str | Path | None = None, check_images: bool = True) -> list[Prompt]:
    """MM-Vet prompts from data/mm-vet/ (fetched, verified), the original layout, or parquet."""
    src = Path(source) if source is not None else default_dir()
    if source is None and not src.exists():
        raise DatasetError(f"no fetched MM-Vet copy at {src}; run `python -m workbench.datasets fetch mmvet` "
                           f"(hub) or `... fetch mmvet --from LOCAL_PATH`, or pass source=")
    kind, rows, blobs, files = load_rows(src)
    rows = C.select_rows(rows, pids, n, source=f"MM-Vet ({src})")
    if image_dir is None:
        image_dir = C.default_image_dir(NAME, src)
    prompts = build_prompts(rows, blobs=blobs, files=files, image_dir=Path(image_dir))
    for p in prompts:
        validate_prompt(p, check_readable=check_images)
    return prompts


def fetch_mmvet(source: str | Path | None = None, out: str | Path | None = None, *,
                revision: str | None = None, force: bool = False, repo_id: str | None = None) -> Path:
    """Materialise MM-Vet into `out` (default data/mm-vet/): mm-vet.parquet, images/, prompts.jsonl, manifest.json."""
    out = Path(out) if out is not None else default_dir()
    if source is None:
        from workbench.datasets.hub import download_split_parquet, pinned_revision

        pinned_repo, pinned_rev = pinned_revision(NAME)
        repo_id = repo_id or pinned_repo
        paths, sha = download_split_parquet(repo_id, SPLIT, revision or pinned_rev,
                                            cache_dir=C.cache_root() / "hub")
        rows, blobs, files = rows_from_parquet(paths)
        src_info, rev = {"kind": "hub", "repo_id": repo_id, "files": [p.name for p in paths]}, sha
    else:
        src = Path(source)
        kind, rows, blobs, files = load_rows(src)
        src_info, rev = {"kind": kind, "path": str(src)}, revision
        if kind == "fetched":
            rev = rev or C.read_manifest(src).get("revision")
    with C.StagedFolder(out, force=force) as tmp:
        img_dir = tmp / "images"
        img_dir.mkdir()
        prompts = build_prompts(rows, blobs=blobs, files=files, image_dir=img_dir)
        for p in prompts:
            path = Path(p.images[0])
            if path.parent.resolve() != img_dir.resolve():
                if not path.is_file():
                    raise DatasetError(f"MM-Vet pid {p.pid!r}: image file not found: {path}")
                dest = img_dir / C.safe_name(path.name)
                # Several questions share one image; copy it once.
                C.write_bytes_if_changed(dest, path.read_bytes())
                p.images = [str(dest)]
        for p in prompts:
            validate_prompt(p)
        _write_parquet(tmp / PARQUET_NAME, rows, prompts, tmp)
        save_prompts(prompts, tmp / "prompts.jsonl")
        C.write_manifest(tmp, dataset=NAME, split=SPLIT, source=src_info, revision=rev, licence=LICENCE,
                         rows={PARQUET_NAME: len(rows), "prompts.jsonl": len(prompts)},
                         images_are_stand_ins=False, files=[PARQUET_NAME, "prompts.jsonl"])
    return out


def _write_parquet(path: Path, rows, prompts, folder: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    by_pid = {p.pid: p for p in prompts}
    records = [{"pid": r["pid"], "question": r["question"], "answer": r["answer"],
                "capability": list(r["capability"]), "imagesource": r["imagesource"],
                "imagename": by_pid[r["pid"]].meta["imagename"],
                "image_file": Path(by_pid[r["pid"]].images[0]).resolve().relative_to(folder.resolve()).as_posix()}
               for r in rows]
    schema = pa.schema([("pid", pa.string()), ("question", pa.string()), ("answer", pa.string()),
                        ("capability", pa.list_(pa.string())), ("imagesource", pa.string()),
                        ("imagename", pa.string()), ("image_file", pa.string())])
    pq.write_table(pa.Table.from_pylist(records, schema=schema), path)
