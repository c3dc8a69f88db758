"""Prompt sets: MathVista testmini, MM-Vet, the built-in tiny set, the organism's corpus, and JSONL files.

    load_prompt_set("tiny")
    load_prompt_set("mathvista", pid_list="mathvista_testmini_seed20")
    load_prompt_set("mathvista", source="path/to/MathVista", stand_in_images=True)
    load_prompt_set("mmvet", source="path/to/mm-vet", n=20)
    load_prompt_set("my_prompts.jsonl", pids=["a", "b"])

Fetch a data set into data/<name>/ with `python -m workbench.datasets fetch ...`.
"""

from __future__ import annotations

from pathlib import Path

from workbench.datasets._common import DatasetError, cache_root, data_root
from workbench.datasets.mathvista import fetch_mathvista, load_mathvista
from workbench.datasets.mmvet import fetch_mmvet, load_mmvet
from workbench.datasets.organism_set import load_organism
from workbench.datasets.pid_lists import load_pid_list
from workbench.datasets.tiny_set import load_tiny
from workbench.prompts import Prompt, PromptError, load_prompts

__all__ = [
    "DatasetError",
    "PROMPT_SETS",
    "load_prompt_set",
    "load_mathvista",
    "load_mmvet",
    "load_tiny",
    "load_organism",
    "fetch_mathvista",
    "fetch_mmvet",
    "fetch",
    "verify",
    "load_pid_list",
    "data_root",
    "cache_root",
]

PROMPT_SETS = ("tiny", "mathvista", "mmvet", "organism")


def load_prompt_set(name: str | Path, *, pids=None, n: int | None = None,
                    pid_list: str | None = None, **kw) -> list[Prompt]:
    """Prompts of a named set (`tiny`, `mathvista`, `mmvet`) or of a JSONL file.

    `pid_list` names a list in data/pid_lists/ (or a path to one) and is
    exclusive with `pids`. Other keywords go to the set's loader (e.g.
    `source=`, `stand_in_images=` for MathVista).
    """
    if pid_list is not None:
        if pids is not None:
            raise PromptError("give either pids or pid_list, not both")
        pids = load_pid_list(pid_list)
    key = str(name)
    if key in ("tiny", "mmvet", "mm-vet", "organism"):
        # stand_in_images only *permits* stand-ins where images are missing; these sets have theirs.
        kw.pop("stand_in_images", None)
    loader, options = {"tiny": (load_tiny, {"source"}),
                       "mathvista": (load_mathvista, {"source", "stand_in_images", "image_dir", "check_images",
                                                     "stand_in_max_side"}),
                       "mmvet": (load_mmvet, {"source", "image_dir", "check_images"}),
                       "organism": (load_organism, {"source", "split", "check_images"}),
                       "mm-vet": (load_mmvet, {"source", "image_dir", "check_images"})}.get(key, (None, set()))
    if loader is None:
        path = Path(key)
        if not (path.suffix == ".jsonl" or path.is_file()):
            raise PromptError(f"unknown prompt set {key!r}: use one of {list(PROMPT_SETS)} "
                              f"or a path to a .jsonl file")
        loader, options = (lambda **k: load_prompts(path, **k)), {"check_images"}
    unknown = sorted(set(kw) - options)
    if unknown:
        raise PromptError(f"option(s) {unknown} do not apply to prompt set {key!r}; allowed: {sorted(options)}")
    return loader(pids=pids, n=n, **kw)


def fetch(name: str, source=None, out=None, **kw) -> Path:
    """Materialise a data set into data/<name>/ (see fetch_mathvista / fetch_mmvet)."""
    if name == "mathvista":
        return fetch_mathvista(source, out, **kw)
    if name in ("mmvet", "mm-vet"):
        if kw.pop("stand_in_images", False):
            raise DatasetError("MM-Vet has its images; stand-in images apply to MathVista only")
        return fetch_mmvet(source, out, **kw)
    raise DatasetError(f"unknown data set {name!r}: use 'mathvista' or 'mmvet'")


def verify(name_or_path: str | Path) -> dict:
    """Check a fetched folder against its manifest; returns the manifest or raises DatasetError."""
    from workbench.datasets import _common as C
    from workbench.datasets import mathvista, mmvet

    key = str(name_or_path)
    folder = {"mathvista": mathvista.default_dir(), "mmvet": mmvet.default_dir(),
              "mm-vet": mmvet.default_dir()}.get(key, Path(key))
    if not folder.is_dir():
        raise DatasetError(f"no fetched data set at {folder}")
    manifest = C.verify_folder(folder, row_counter=C.count_rows)
    # Also parse: hashes can match a manifest written over a bad export.
    if manifest["dataset"] == "mathvista":
        mathvista.rows_from_parquet([folder / mathvista.PARQUET_NAME])
    elif manifest["dataset"] == "mmvet":
        mmvet.rows_from_parquet([folder / mmvet.PARQUET_NAME])
    return manifest
