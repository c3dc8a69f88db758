"""Shared pieces of the data-set loaders: locations, hashing, manifests, atomic folders."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable

from workbench.prompts import PromptError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "workbench-dataset/1"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff")


class DatasetError(PromptError):
    """A data-set source is missing, incomplete or does not match its manifest."""


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def data_root() -> Path:
    """Where prompt sets live: `$WORKBENCH_DATA`, else `<repo>/data`."""
    env = os.environ.get("WORKBENCH_DATA")
    return Path(env) if env else repo_root() / "data"


def cache_root() -> Path:
    """Scratch space for images extracted from parquet files and for stand-ins."""
    env = os.environ.get("WORKBENCH_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "workbench"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_bytes_if_changed(path: Path, data: bytes) -> None:
    """Write unless an identical file is already there (cache reuse without trusting stale bytes)."""
    if path.is_file() and path.stat().st_size == len(data) and sha256_file(path) == sha256_bytes(data):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def image_suffix(data: bytes, default: str = ".png") -> str:
    """File suffix from the image's magic bytes, so extracted files open with the right decoder."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return ".png"
    if data.startswith(b"\xff\xd8"):
        return ".jpg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return ".gif"
    if data.startswith(b"BM"):
        return ".bmp"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return ".webp"
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return ".tif"
    return default


def safe_name(pid: str) -> str:
    """A file-name-safe form of a pid (pids are short ids, but never trust them as paths)."""
    out = "".join(c if (c.isalnum() or c in "-_.") else "_" for c in str(pid))
    return out.lstrip(".") or "_"


# --------------------------------------------------------------------------- manifests

def write_manifest(folder: Path, *, dataset: str, split: str, source: dict[str, Any],
                   revision: str | None, licence: str, rows: dict[str, int],
                   images_are_stand_ins: bool, files: Iterable[str], extra: dict | None = None) -> dict:
    """Hash every data file and image of `folder` and write manifest.json (last, so its presence means done)."""
    folder = Path(folder)
    images = {}
    img_dir = folder / "images"
    if img_dir.is_dir():
        for p in sorted(img_dir.rglob("*")):
            if p.is_file():
                images[p.relative_to(folder).as_posix()] = sha256_file(p)
    manifest = {
        "format": MANIFEST_FORMAT,
        "dataset": dataset,
        "split": split,
        "source": source,
        "revision": revision,
        "licence": licence,
        "rows": dict(rows),
        "images_are_stand_ins": bool(images_are_stand_ins),
        "files": {name: sha256_file(folder / name) for name in files},
        "images": images,
    }
    if extra:
        manifest.update(extra)
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n",
                                        encoding="utf-8")
    return manifest


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        raise DatasetError(f"no {MANIFEST_NAME} in {folder}: not a fetched data-set folder "
                           f"(run `python -m workbench.datasets fetch ...` first)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: manifest is not valid JSON ({exc.msg})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise DatasetError(f"{path}: not a {MANIFEST_FORMAT} manifest")
    for key in ("dataset", "rows", "files", "images"):
        if key not in manifest:
            raise DatasetError(f"{path}: manifest lacks {key!r}")
    return manifest


def verify_folder(folder: Path, row_counter: Callable[[Path], int] | None = None,
                  expect_dataset: str | None = None) -> dict:
    """Check a fetched folder against its manifest; raise DatasetError naming the first bad item.

    Every listed file must exist with the listed sha256, no unlisted image may
    sit in images/, and each listed row count must match the file.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    if expect_dataset is not None and manifest["dataset"] != expect_dataset:
        raise DatasetError(f"{folder}: manifest is for data set {manifest['dataset']!r}, "
                           f"expected {expect_dataset!r}")
    listed = {**manifest["files"], **manifest["images"]}
    for rel, digest in listed.items():
        p = folder / rel
        if not p.is_file():
            raise DatasetError(f"{folder}: {rel} is listed in the manifest but missing")
        actual = sha256_file(p)
        if actual != digest:
            raise DatasetError(f"{folder}: {rel} does not match the manifest "
                               f"(sha256 {actual[:12]}..., manifest {str(digest)[:12]}...)")
    img_dir = folder / "images"
    if img_dir.is_dir():
        for p in sorted(img_dir.rglob("*")):
            rel = p.relative_to(folder).as_posix()
            if p.is_file() and rel not in manifest["images"]:
                raise DatasetError(f"{folder}: {rel} is not listed in the manifest")
    if row_counter is not None:
        for rel, expected in manifest["rows"].items():
            p = folder / rel
            try:
                actual = row_counter(p)
            except DatasetError:
                raise
            except Exception as exc:  # noqa: BLE001 - any reader failure is a verification failure
                raise DatasetError(f"{folder}: cannot read {rel} ({type(exc).__name__}: {exc})") from exc
            if actual != expected:
                raise DatasetError(f"{folder}: {rel} has {actual} rows, manifest says {expected}")
    return manifest


def count_rows(path: Path) -> int:
    """Rows of a parquet file or lines of a JSONL file."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    with open(path, "r", encoding="utf-8") as fh:
        return sum(1 for line in fh if line.strip())


# --------------------------------------------------------------------------- atomic output folders

class StagedFolder:
    """Build a folder under a temporary name and move it into place only when complete.

    Used as a context manager: on error the staging folder is removed and the
    old folder (if any) is untouched, so a failed fetch never looks complete.
    """

    def __init__(self, out: Path, force: bool = False):
        self.out = Path(out)
        self.force = force
        self.tmp = self.out.parent / f".{self.out.name}.staging-{uuid.uuid4().hex[:8]}"

    def __enter__(self) -> Path:
        if self.out.exists() and not self.force:
            raise DatasetError(f"{self.out} already exists; pass force=True (--force) to replace it")
        self.tmp.mkdir(parents=True)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        old = None
        if self.out.exists():
            old = self.out.parent / f".{self.out.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(self.out, old)
        os.replace(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return False


def read_parquet_table(path: Path, where: str):
    """Read a parquet file into a pyarrow Table with an error that names the file."""
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"parquet file not found: {path}")
    try:
        return pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for corrupt files
        raise DatasetError(f"{where}: cannot read parquet file {path} ({type(exc).__name__}: {exc})") from exc


def require_columns(columns: Iterable[str], needed: Iterable[str], where: str) -> None:
    missing = [c for c in needed if c not in set(columns)]
    if missing:
        raise DatasetError(f"{where}: missing column(s) {missing}")


def image_bytes_of(cell: Any) -> bytes | None:
    """Bytes of an image cell as the hub stores it ({'bytes': ..., 'path': ...}) or raw bytes."""
    if cell is None:
        return None
    if isinstance(cell, (bytes, bytearray)):
        return bytes(cell) or None
    if isinstance(cell, dict):
        data = cell.get("bytes")
        return bytes(data) if data else None
    return None


def select_rows(rows: list[dict[str, Any]], pids, n: int | None, source: str) -> list[dict[str, Any]]:
    """The rows of the requested pids (in the order asked) or the first n, with the prompt schema's checks."""
    from workbench.prompts import Prompt, select_prompts

    by_pid = {r["pid"]: r for r in rows}
    chosen = select_prompts([Prompt(pid=r["pid"], text="") for r in rows], pids=pids, n=n, source=source)
    return [by_pid[p.pid] for p in chosen]


def default_image_dir(dataset: str, src: Path) -> Path:
    """Where images held as bytes are written: the cache, one folder per source copy."""
    return cache_root() / dataset / sha256_bytes(str(src.resolve()).encode())[:12]
