"""Error types that map to the documented exit codes (README, "Using it").

Raising one of these anywhere below the CLI yields a single ``hf2q: error: …`` line
on stderr and the matching exit code; anything else is an internal error (exit 1).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INPUT = 3
EXIT_INTERRUPTED = 130


class Hf2qError(Exception):
    """A failure we anticipated and can explain in one line."""

    exit_code = EXIT_FAILURE


class UsageError(Hf2qError):
    """The command line itself is wrong (bad flag combination)."""

    exit_code = EXIT_USAGE


class InputError(Hf2qError):
    """An input file, model, name or value is invalid (bad file, unknown quant, unsupported arch)."""

    exit_code = EXIT_INPUT


class ConversionError(Hf2qError):
    """Conversion or generation failed at run time (disk full, unwritable output, …)."""

    exit_code = EXIT_FAILURE


def did_you_mean(word: str, choices, n: int = 3) -> str:
    """A short suggestion suffix for an unknown name, e.g. ``; did you mean q4_k_m, q4_k_s?``."""
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=n, cutoff=0.5)
    return f"; did you mean {', '.join(close)}?" if close else ""
