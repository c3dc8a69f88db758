"""ipywidgets around ``workbench.plots``: the run explorer (``explorer``) and the divergence viewer (``divergence``).

``Explorer`` and ``explorer`` are the notebook's entry points; the in-place edits a slider move makes are in
``edits``, the readout beside the sliders in ``readout``, the run picker's labels in ``picker``.
"""

from .divergence import MAX_PROMPT_OPTIONS, _has_divergence_pairs, _text_split, divergence_html, divergence_viewer
from .edits import _apply_patches, _edit_to_match, _patch_props, _same, replace_figure
from .explorer import FIG_HEIGHT, X_MAX, X_STEP, Explorer, _empty, _Precomputed, explorer
from .picker import experiment_options, picker_options, run_label
from .readout import _ladder_readout_html, legs_readout_html, legs_readout_table

__all__ = ["Explorer", "explorer", "divergence_viewer", "divergence_html", "replace_figure", "run_label",
           "picker_options", "legs_readout_html", "legs_readout_table"]
