"""Advisory file locks that let several processes share one KV store directory.

Three locks, all ``flock`` (released by the kernel when a process dies, even by
``kill -9``, so a crash never leaves a stale lock behind):

* ``DIR/.lock`` — every open store holds it *shared* for its lifetime; ``hf2q cache
  clear`` needs it *exclusive*, so it refuses to wipe a directory a server is using.
* ``DIR/.recovery.lock`` — held *exclusive* while a store runs start-up recovery, so two
  servers starting together do not quarantine or delete under each other; a writer holds it
  *shared* while it creates and locks a temp, so recovery never sees a live writer's temp unlocked.
* each temp file — its writer holds it *exclusive* until the rename; recovery removes a
  temp only if it can take that lock, i.e. its writer is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

USE_LOCK = ".lock"
RECOVERY_LOCK = ".recovery.lock"


class LockBusy(Exception):
    """A non-blocking lock request found the lock held by another process."""


class FileLock:
    """One ``flock`` on one file; ``acquire`` / ``release`` or use as a context manager."""

    def __init__(self, path: str | os.PathLike, *, exclusive: bool, blocking: bool = True):
        self.path = Path(path)
        self.exclusive = exclusive
        self.blocking = blocking
        self._fd: int | None = None

    def acquire(self) -> "FileLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        flags = (fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH) | (0 if self.blocking else fcntl.LOCK_NB)
        try:
            fcntl.flock(fd, flags)
        except BlockingIOError:
            os.close(fd)
            raise LockBusy(str(self.path)) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing drops the flock

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "FileLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def lock_fd_exclusive_nowait(fd: int) -> bool:
    """Try to take an exclusive lock on an open fd; False if another process holds one."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def exclusive_use(root: str | os.PathLike) -> Iterator[None]:
    """Hold ``DIR/.lock`` exclusively or raise ``LockBusy`` (a server has the store open)."""
    root = Path(root)
    with FileLock(root / USE_LOCK, exclusive=True, blocking=False):
        yield


def temp_owner_alive(path: str | os.PathLike) -> bool:
    """True while some live process holds the temp file's writer lock."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        return not lock_fd_exclusive_nowait(fd)
    finally:
        os.close(fd)
