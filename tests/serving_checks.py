"""What the serving test modules read back: whether a server process is still there, a leg's records."""

from __future__ import annotations

import json
import os
from pathlib import Path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.is_file() and stat.read_text().split()[2] == "Z")


def records(leg: Path) -> list[dict]:
    return [json.loads(line) for line in (leg / "records.jsonl").read_text().splitlines()]
