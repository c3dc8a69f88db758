"""Stable bytes on disk: JSON written with sorted keys."""

from __future__ import annotations

import json
from pathlib import Path


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _normalise_config(path: Path) -> None:
    """Rewrite a saved config.json with sorted keys (stable bytes across runs)."""
    cfg = json.loads(path.read_text())
    _write_json(path, cfg)
