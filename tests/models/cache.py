"""Build-once cache for generated test models (``<hf2q cache>/test-models/…``).

A model is built into a temporary sibling folder and renamed into place only when
complete, so an interrupted build never leaves a half-written model behind. An flock
serialises builders: several pytest processes (and several engineers sharing one cache)
asking for the same model build it once and then all reuse it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from hf2q.paths import cache_root


def test_models_root() -> Path:
    return cache_root() / "test-models"


def build_once(name: str, builder: Callable[[Path], None]) -> Path:
    """Return ``test-models/<name>``, calling ``builder(tmp_dir)`` first if it does not exist yet."""
    out = test_models_root() / name
    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_dir():  # someone else built it while we waited
            return out
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            builder(tmp)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
