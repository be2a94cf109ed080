"""How every benchmark here ends: the report as indented JSON on stdout, and in a file when asked."""

from __future__ import annotations

import json
from pathlib import Path


def emit(report: dict, out: str | None) -> int:
    """Print ``report``; also write it to ``out`` when given. Returns the exit code (0)."""
    text = json.dumps(report, indent=2)
    if out:
        Path(out).write_text(text + "\n")
    print(text)
    return 0
