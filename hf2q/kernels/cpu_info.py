"""What this CPU is, as ``/proc/cpuinfo`` says: the one reader of that file.

The C kernels' compiler flags (``cpu_build``), the OpenBLAS wheel's core check (``cpu_blas``) and the
test oracle's build choice all ask the same question of the same file; off Linux it is absent and the
answers are "unknown".
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path


@functools.cache
def _fields() -> dict[str, str]:
    """The first processor's ``name: value`` lines."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block is enough: every core reports the same
        name, _, value = line.partition(":")
        out.setdefault(name.strip(), value.strip())
    return out


def cpu_flags() -> set[str] | None:
    """The x86 instruction-set flags (``avx2``, ``avx512f``, …), or None where the file does not say."""
    flags = _fields().get("flags")
    return set(flags.split()) if flags is not None else None


def cpu_model() -> str:
    """The CPU's model name (``AMD EPYC``), else the machine type (``aarch64``)."""
    return _fields().get("model name") or platform.machine()
