"""DataFrame -> plotly Figure. The same functions feed the notebook widgets and the exported figures.

Every trace carries ``meta = {"leg": ..., "tier": ..., "gamma": ..., "role": ...}``
so that widgets can find a trace and update it in place instead of
rebuilding the figure. Each leg has one label, colour and dash in every figure
(``legstyle``: ``LegStyles``, which ``analyses.RunTables.leg_styles`` makes once per run).
"""

from ._base import (ACCEPTANCE_METRICS, BOX_MAX_POINTS, GAMMA_SYMBOLS, TEMPLATE, TIER_COLORS, _gamma, _layout, _meta,
                    _num, _one_of)
from .costladder import (BATCH_COLORS, LADDER_ROLE_COLORS, SETUP_COLORS, cost_ratio_by_graphs, speedup_curves,
                         step_cost_vs_batch)
from .legs import (acceptance_over_position, acceptance_vs_tau, agreement_vs_acceptance, exactness_table,
                   per_position_acceptance, speedup_distribution, speedup_vs_gamma, token_class_bars)
from .legstyle import PREDICTED_DASH, LegStyle, LegStyles, drafter_label, run_leg_frame, styles_for
from .serving import serving_acceptance, serving_latency, serving_speedup, serving_summary, serving_throughput
