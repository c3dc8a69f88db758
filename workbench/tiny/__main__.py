"""``python -m workbench.tiny``: build the tiny models (``workbench.tiny.main``)."""

from . import main

raise SystemExit(main())
