"""The analysis registry: every table a run folder holds and every figure drawn from them, named once.

A **table** is computed from a run's raw records by a ``workbench.metrics``
function and written as ``<run>/tables/<name>.csv``. An **analysis** is a
figure: the ``workbench.plots`` function that draws it and the tables it reads;
``experiments.yaml`` names analyses, and the registry refuses an unknown name
when it loads. The executed notebook, ``workbench export`` and the explorer
all read tables and figures from here, so a number has one name and one
recipe wherever it appears.

    tables = RunTables(load_run(run_dir))       # computed on demand, each once
    tables.get("speedup")                       # DataFrame, or None where the run lacks what it needs
    draw(tables, ["speedup_distribution"])      # {analysis name: figure}
    analyze_run(run_dir)                        # every table -> tables/*.csv + tables/summary.json

An analysis with a ``view`` (``View``) is also a figure of the run explorer
(``workbench.widgets.Explorer``), which loops over this table: the view says
which runs show it, which sliders drive it and how a slider move updates it.
Adding a figure to the explorer is one ``Analysis(...)`` entry in
``analyses.figures`` (and its ``workbench.plots`` function).

The package: ``base`` (Table, Analysis, View, constants), ``tables`` (the
table registry and its recipes), ``runtables`` (``RunTables``), ``explorer``
(what an explorer slider move computes), ``figures`` (the figure registry,
drawing), ``output`` (``tables/*.csv``, ``summary.json``, ``analyze_run``).
"""

from .base import (OVER_POSITION_BINS, RELAX_GRID, SLIDERS, SUMMARY_JSON, VIEW_GROUPS, Analysis, NotApplicable,
                   Table, View)
from .figures import ANALYSES, check_names, draw, draw_one, view_figure, views
from .output import _json_rows, analyze_run, summary, write_summary, write_tables
from .runtables import RunTables
from .tables import (GROUNDED_AUTO_BYTES, TABLES, _model_dir, _per_target, _prompts, _targets_in_order,
                     alpha_from_length)
