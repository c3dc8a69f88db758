"""Optional Hugging Face hub access. Nothing here is imported unless a hub fetch is asked for."""

from __future__ import annotations

import json
from pathlib import Path

from workbench.datasets._common import DatasetError, data_root

REVISIONS_FILE = "hub_revisions.json"


def pinned_revision(key: str) -> tuple[str, str | None]:
    """(repo_id, revision) for a data set from data/hub_revisions.json; revision None = not pinned yet."""
    path = data_root() / REVISIONS_FILE
    if not path.is_file():
        raise DatasetError(f"{path} not found: it names the hub repository of each data set")
    table = json.loads(path.read_text(encoding="utf-8"))
    if key not in table:
        raise DatasetError(f"{path}: no entry for {key!r}")
    entry = table[key]
    return entry["repo_id"], entry.get("revision")


def download_split_parquet(repo_id: str, split: str, revision: str | None,
                           cache_dir: Path | None = None) -> tuple[list[Path], str]:
    """Download the parquet shards of one split; returns (local paths, resolved commit sha).

    Uses huggingface_hub when importable, else the `datasets` library; both are
    optional, so the error says what to install rather than failing on import.
    """
    try:
        from huggingface_hub import HfApi, hf_hub_download
    except ImportError:
        return _download_with_datasets(repo_id, split, revision, cache_dir)
    api = HfApi()
    try:
        info = api.dataset_info(repo_id, revision=revision or "main")
    except Exception as exc:  # noqa: BLE001 - network and auth errors come in many types
        raise DatasetError(f"cannot reach hub data set {repo_id!r} at revision {revision or 'main'!r}: "
                           f"{type(exc).__name__}: {exc}") from exc
    sha = info.sha
    names = sorted(s.rfilename for s in (info.siblings or [])
                   if s.rfilename.endswith(".parquet")
                   and Path(s.rfilename).name.startswith(f"{split}-"))
    if not names:
        raise DatasetError(f"hub data set {repo_id!r}@{sha}: no parquet file for split {split!r}")
    paths = []
    for name in names:
        local = hf_hub_download(repo_id, name, repo_type="dataset", revision=sha,
                                cache_dir=str(cache_dir) if cache_dir else None)
        paths.append(Path(local))
    return paths, sha


def _download_with_datasets(repo_id: str, split: str, revision: str | None,
                            cache_dir: Path | None) -> tuple[list[Path], str]:
    try:
        import datasets  # noqa: F401
    except ImportError as exc:
        raise DatasetError("fetching from the hub needs `huggingface_hub` or `datasets`; neither is "
                           "installed. Install one, or fetch from a local copy with --from") from exc
    from datasets import load_dataset

    ds = load_dataset(repo_id, split=split, revision=revision or "main")
    out = Path(cache_dir or ".") / f"{repo_id.replace('/', '__')}-{split}.parquet"
    out.parent.mkdir(parents=True, exist_ok=True)
    ds.to_parquet(str(out))
    sha = getattr(getattr(ds, "info", None), "version", None)
    return [out], str(revision or sha or "unknown")
