"""Progress reporting: a rich bar when stderr is an interactive terminal, silence otherwise.

With ``--log-format json`` progress milestones go to the log as JSON records instead.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterator

from hf2q.logs import log_format

log = logging.getLogger("hf2q.progress")


def interactive() -> bool:
    return sys.stderr.isatty() and log_format() == "text"


class _Quiet:
    def __init__(self, total: float | None, description: str):
        self.total, self.description, self.done = total, description, 0.0

    def advance(self, n: float = 1.0, note: str | None = None) -> None:
        self.done += n

    def set_description(self, text: str) -> None:
        self.description = text


class _Rich(_Quiet):
    def __init__(self, progress, task, total, description):
        super().__init__(total, description)
        self._p, self._t = progress, task

    def advance(self, n: float = 1.0, note: str | None = None) -> None:
        super().advance(n)
        self._p.update(self._t, advance=n, **({"description": note} if note else {}))

    def set_description(self, text: str) -> None:
        self._p.update(self._t, description=text)


@contextlib.contextmanager
def progress_bar(description: str, total: float | None) -> Iterator[_Quiet]:
    """Yield an object with ``advance(n)``; draws a bar only on a TTY."""
    if not interactive():
        bar = _Quiet(total, description)
        yield bar
        log.info("%s: done", description, extra={"progress": bar.done, "total": total})
        return
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    from rich.console import Console

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                  transient=False) as p:
        task = p.add_task(description, total=total)
        yield _Rich(p, task, total, description)
