"""``python -m workbench.leg``: the leg's command line (``workbench.leg.command``)."""

import sys

from .command import main

sys.exit(main())
