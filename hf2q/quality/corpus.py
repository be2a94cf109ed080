"""Calibration and evaluation text: a file the user names, or a corpus shipped in the package.

``--corpus`` (``hf2q imatrix``, ``hf2q quality``, ``convert --imatrix-corpus``) takes either a path
or one of the names in :data:`SHIPPED`; a path wins when both could match. The shipped corpora are
our own text (prose, code, dialogue, a little non-English) so that importance matrices and scores
are reproducible without a download.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import attrs

from hf2q.errors import InputError, did_you_mean

SHIPPED = {"calibration": "calibration.txt"}
DEFAULT = "calibration"


@attrs.frozen
class Corpus:
    name: str  # what llama.cpp records as the dataset: the path as typed, or the shipped name
    text: str


def load_corpus(spec: str | None) -> Corpus:
    """The corpus ``spec`` names (None → the default shipped one); InputError when unreadable or empty."""
    spec = DEFAULT if spec is None else spec
    path = Path(spec).expanduser()
    if path.is_file():
        try:
            text = path.read_bytes().decode("utf-8")
        except OSError as e:
            raise InputError(f"cannot read corpus {spec}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise InputError(f"corpus {spec} is not UTF-8 text (byte {e.start})") from None
    elif spec in SHIPPED:
        text = resources.files("hf2q.quality").joinpath("data", SHIPPED[spec]).read_text("utf-8")
    elif path.exists():
        raise InputError(f"corpus {spec} is not a regular file")
    else:
        raise InputError(f"no corpus file or shipped corpus named {spec!r}"
                         + (did_you_mean(spec, SHIPPED) or f" (shipped: {', '.join(SHIPPED)})"))
    if not text.strip():
        raise InputError(f"corpus {spec} is empty")
    return Corpus(spec, text)
