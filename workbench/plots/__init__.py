"""DataFrame -> plotly Figure. The same functions feed the notebook widgets and the exported figures.

Every trace carries ``meta = {"leg": ..., "tier": ..., "gamma": ..., "role": ...}``
so that widgets can find a trace and update it in place instead of
rebuilding the figure. 
"""

from ._base import (ACCEPTANCE_METRICS, BLIND_DASH, BOX_MAX_POINTS, CURVE_DASH, GAMMA_SYMBOLS, RELAXED_SHADES,
                    TEMPLATE, TIER_COLORS, _gamma, _layout, _meta, _num, _one_of, _relaxed_xs, series_color,
                    series_key, series_label)
from .costladder import (BATCH_COLORS, LADDER_ROLE_COLORS, SETUP_COLORS, cost_ratio_by_graphs, speedup_curves,
                         step_cost_vs_batch)
from .legs import (acceptance_over_position, acceptance_vs_tau, agreement_vs_acceptance, exactness_table,
                   per_position_acceptance, speedup_distribution, speedup_vs_gamma, token_class_bars)
from .serving import serving_acceptance, serving_latency, serving_summary, serving_throughput
from .legstyle import PREDICTED_DASH, LegStyle, LegStyles, drafter_label, run_leg_frame, styles_for
