"""Crash-safe file output: write ``NAME.tmp``, fsync, rename over ``NAME``, fsync the directory.

A killed process leaves either the old file, the complete new one, or a ``.tmp`` that the
next run removes — never a half-written ``NAME``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import BinaryIO, Iterator

TMP_SUFFIX = ".tmp"


def fsync_dir(path: str | os.PathLike) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def tmp_path_for(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p.with_name(p.name + TMP_SUFFIX)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, mode: str = "wb") -> Iterator[BinaryIO]:
    """Open ``path + '.tmp'`` for writing; on clean exit fsync + rename, on error unlink the temp."""
    final = Path(path)
    tmp = tmp_path_for(final)
    f = open(tmp, mode)
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, final)
        fsync_dir(final.parent if str(final.parent) else ".")
    except BaseException:
        f.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_output(path) as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def replace_dir(tmp: Path, dest: Path) -> None:
    """Put the finished directory ``tmp`` at ``dest`` (replacing an old one), then fsync the parent.

    The old directory is first renamed aside, so ``dest`` is always either the old or the new
    complete tree; the set-aside copy is removed last.
    """
    old = None
    if dest.exists():
        old = dest.with_name(f"{dest.name}.old-{os.getpid()}")
        os.replace(dest, old)
    os.replace(tmp, dest)
    fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
