"""Logging set-up: human text or one JSON object per line (``--log-format json``).

Prompt text never goes to logs: log records carry ids, counts and timings only.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING, "error": logging.ERROR}
_STD_ATTRS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record; ``extra={...}`` fields are merged in."""

    def format(self, record: logging.LogRecord) -> str:
        obj = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in _STD_ATTRS and not k.startswith("_"):
                obj[k] = v
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        t = time.strftime("%H:%M:%S", time.localtime(record.created))
        extras = " ".join(f"{k}={v}" for k, v in vars(record).items()
                          if k not in _STD_ATTRS and not k.startswith("_"))
        line = f"{t} {record.levelname.lower():5} {record.name}: {record.getMessage()}"
        if extras:
            line += f" [{extras}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(fmt: str = "text", level: str | None = None, verbose: int = 0) -> None:
    if level is not None:
        lvl = _LEVELS[level]
    else:
        lvl = logging.DEBUG if verbose >= 2 else logging.INFO if verbose == 1 else logging.WARNING
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("hf2q")
    root.handlers[:] = [handler]
    root.setLevel(lvl)
    root.propagate = False
    # the log format is also consulted by progress reporting and the operator UI
    root.hf2q_log_format = fmt  # type: ignore[attr-defined]


def log_format() -> str:
    return getattr(logging.getLogger("hf2q"), "hf2q_log_format", "text")
