"""Token classes: acceptance of image-word tokens (the vocabulary proxy) vs the others."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from .trace import TraceIndex


# Visual vocabulary used by the token-class proxy: words whose value has to be
# read off the image (colours, shapes, counts, positions, common objects).
IMAGE_WORDS = (
    "red orange yellow green blue purple pink brown black white gray grey color colour "
    "circle square triangle rectangle line bar dot shape left right top bottom above below "
    "behind front middle center corner image picture photo figure chart graph plot table "
    "axis label person man woman people dog cat car tree building sign text number "
    "one two three four five six seven eight nine ten 0 1 2 3 4 5 6 7 8 9"
).split()


def image_word_token_ids(tokenizer: Any, words: Iterable[str] = IMAGE_WORDS) -> set[int]:
    """Token ids that spell visual vocabulary, for ``token_class_acceptance``.

    ``tokenizer`` is anything with ``encode(text, add_special_tokens=False)``
    (a transformers tokenizer). Each word is encoded bare, with a leading
    space and capitalised, and every piece counts.
    """
    ids: set[int] = set()
    for w in words:
        for variant in {w, " " + w, w.capitalize(), " " + w.capitalize()}:
            ids.update(int(i) for i in tokenizer.encode(variant, add_special_tokens=False))
    return ids


def token_class_acceptance(
    records: pd.DataFrame,
    token_class: Mapping[int, str] | Callable[[np.ndarray], Sequence[str]] | set[int] | frozenset[int],
    *,
    in_class: str = "image-word",
    other: str = "other",
    position_labels: Sequence[Sequence[str]] | None = None,
) -> pd.DataFrame:
    """Acceptance by class of the output token at each evaluated draft position.

    Without labels for "image-grounded" tokens this uses a proxy: each draft
    position the target evaluated (every accepted position and the first
    rejected one) is attributed to the token that ended up in the output at
    that position (the accepted draft, or the target's own correction), and
    that token's class decides the bucket. ``token_class`` is a set of ids
    (e.g. ``image_word_token_ids(tokenizer)``: ``in_class`` vs ``other``), a
    mapping id -> label (unmapped ids are ``other``), or a function from an
    id array to labels. Rate = accepted / evaluated positions of the class,
    i.e. the acceptance of a drafted token given the draft got that far.

    ``position_labels`` (one sequence per traced record, in the records' order, one label per output
    position) labels positions instead of token ids, e.g. the grounded definition
    (``workbench.grounding``: the target's greedy choice there changes with a blank picture);
    ``token_class`` is then ignored.
    """
    index = TraceIndex(records)
    if index.empty:
        raise ValueError("token_class_acceptance: no record carries a trace (run the leg with --trace)")
    ids_by_prompt = records.loc[records["trace"].map(lambda t: isinstance(t, dict) and bool(t.get("steps"))), "gen_ids"]
    ids_by_prompt = [np.asarray(x, dtype=np.int64) for x in ids_by_prompt]
    # Evaluated positions: j = 0..min(accepted, drafted - 1) of every step.
    n_eval = np.minimum(index.accepted + 1, index.drafted)
    step_of = np.repeat(np.arange(n_eval.size), n_eval)
    j = np.arange(step_of.size) - np.repeat(np.cumsum(n_eval) - n_eval, n_eval)
    out_pos = index.position[step_of] + j
    prompt_of = index.step_prompt[step_of]
    lens = np.array([len(x) for x in ids_by_prompt], dtype=np.int64)
    keep = out_pos < lens[prompt_of]  # the last step may run past max_tokens/EOS
    offsets = np.cumsum(lens) - lens
    all_ids = np.concatenate(ids_by_prompt) if ids_by_prompt else np.zeros(0, np.int64)
    tok = all_ids[(offsets[prompt_of] + out_pos)[keep]]
    if position_labels is not None:
        if len(position_labels) != len(ids_by_prompt) or any(
                len(lab) != n for lab, n in zip(position_labels, lens)):
            raise ValueError("position_labels: one label per output token of every traced record")
        flat_labels = np.array([x for lab in position_labels for x in lab], dtype=object)
        labels = flat_labels[(offsets[prompt_of] + out_pos)[keep]] if flat_labels.size else flat_labels
    elif isinstance(token_class, (set, frozenset)):
        labels = np.where(np.isin(tok, np.fromiter(token_class, dtype=np.int64)), in_class, other)
    elif isinstance(token_class, Mapping):
        labels = np.array([token_class.get(int(t), other) for t in tok], dtype=object)
    elif callable(token_class):
        labels = np.asarray(token_class(tok), dtype=object)
        if labels.shape != tok.shape:
            raise ValueError("token_class function must return one label per token id")
    else:
        raise TypeError("token_class must be a set of ids, a mapping id -> label, or a function")
    df = pd.DataFrame({
        "leg": np.asarray(index.legs, dtype=object)[index.step_leg[step_of][keep]] if index.legs else [],
        "token_class": labels,
        "accepted": (j < index.accepted[step_of])[keep],
    })
    g = df.groupby(["leg", "token_class"], sort=False)["accepted"]
    out = pd.DataFrame({"evaluated": g.size(), "accepted": g.sum()}).reset_index()
    out["rate"] = out["accepted"] / out["evaluated"]
    return out
