"""Speedup, exactness and acceptance from raw per-prompt records.

Pure pandas/numpy: every function takes ``Run.records`` (or ``Run.legs``) and
returns a DataFrame (or a small named tuple of DataFrames). Vocabulary, as in
vLLM's spec-decode metrics:

- acceptance rate = accepted / draft tokens                        (``acceptance_rate``)
- acceptance length = 1 + accepted / drafts, tokens per target step (``acceptance_length``)
- per-position acceptance = accepted at draft position i / drafts   (``position_acceptance``)

These three functions are the only place the formulas are written; the leg's
summaries and every table here use them.

Speedup of a spec leg is *bracketed*: for each prompt, its tok/s divided by
the mean of that prompt's tok/s in the nearest vanilla leg before and after
the spec leg in run order (one side if only one exists), so slow drift of
the machine over a run divides out; the leg's speedup is the median over
prompts, with its quartiles.

The package: ``common`` (leg keys, tiers, the formulas), ``speedup``, ``divergence`` (exactness),
``counters`` (acceptance from counters), ``trace`` (acceptance from the trace, ``TraceIndex``), ``tokens``
(token classes). Every name is importable from ``workbench.metrics``.
"""

from .common import (LEG_KEYS, SPEC_TIERS, _is_spec, _is_vanilla, _leg_meta, _leg_order, _per, _require,
                     acceptance_length, acceptance_rate, position_acceptance)
from .speedup import (PlacementError, bracketed_speedup, bracketing_vanilla, check_placements, median_iqr,
                      median_ratio_ci, median_ratio_draws, prompt_ratios, prompt_speedups, ratio_summary)
from .divergence import exactness, exactness_summary, first_divergence
from .counters import _spec_rows, acceptance, leg_summary_acceptance, per_position_acceptance, prompt_acceptance
from .trace import Prediction, TraceIndex, ZERO_PLUS, acceptance_over_position, predict_acceptance
from .tokens import IMAGE_WORDS, image_word_token_ids, token_class_acceptance
