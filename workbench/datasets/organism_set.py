"""The `organism` prompt set: the held-out test split of the organism's synthetic visual-QA corpus.

The corpus is the one the organism was trained on (`workbench.organism.corpus`, written from the
training recipe's seed and sizes into ``models/organism/corpus`` on first use; its splits are disjoint
by construction), so the test split's questions were never seen in training. Answers are scored with
the project's MathVista scorer (`workbench.organism.corpus.score_output`).

    load_organism(n=20)                       # the test split
    load_organism(split="validation")
    load_organism(source="path/to/corpus")    # a corpus written by python -m workbench.organism.corpus
"""

from __future__ import annotations

from pathlib import Path

from workbench.prompts import Prompt, PromptError, load_prompts

NAME = "organism"
SPLITS = ("train", "validation", "test")


def default_corpus() -> Path:
    """The training corpus folder, written deterministically first if it is missing or stale."""
    from workbench import tiny
    from workbench.organism import train as T

    root = Path(T.DEFAULT_ROOT).resolve()
    root.mkdir(parents=True, exist_ok=True)
    corpus = root / T.CORPUS_DIRNAME
    with tiny._exclusive_lock(root / ".corpus.lock"):
        T._ensure_corpus(corpus, T.Recipe().resolved())
    return corpus


def load_organism(pids=None, n: int | None = None, *, split: str = "test", source=None,
                  check_images: bool = True) -> list[Prompt]:
    if split not in SPLITS:
        raise PromptError(f"organism: unknown split {split!r}; splits: {', '.join(SPLITS)}")
    corpus = Path(source) if source else default_corpus()
    path = corpus / split / "prompts.jsonl"
    if not path.is_file():
        raise PromptError(f"organism: {path} not found (write a corpus with python -m workbench.organism.corpus)")
    return load_prompts(path, pids=pids, n=n, check_images=check_images)
