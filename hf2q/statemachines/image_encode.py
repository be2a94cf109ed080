"""Lifecycle of one image encode: the vision tower's pass over one image, as its own GPU work.

A slot whose prompt holds an image not yet encoded runs it before the prompt's prefill
(``queued``); the encode is cut into jobs of a few vision blocks each (``encoding``,
``chunk_done`` after every job but the last), so decode steps of other slots run between
them. It ends ``encoded`` (the features are in the cache), ``cached`` (an earlier request's
features were still there: no vision work), ``aborted`` (the client left between jobs:
the partial state is dropped) or ``failed`` — the image could not be encoded, which fails
its request only (``encode_failed``), or the engine itself failed (``engine_failed``).
"""

from __future__ import annotations

import enum

from hf2q.statemachines.base import MachineSpec


class ImageEncodeState(enum.Enum):
    queued = "queued"
    encoding = "encoding"
    encoded = "encoded"
    cached = "cached"
    aborted = "aborted"
    failed = "failed"


E = ImageEncodeState

IMAGE_ENCODE = MachineSpec.declare(
    "image_encode", ImageEncodeState, E.queued,
    [
        ("cache_hit", E.queued, E.cached),
        ("started", E.queued, E.encoding),
        ("chunk_done", E.encoding, E.encoding),
        ("finished", (E.queued, E.encoding), E.encoded),
        ("client_gone", (E.queued, E.encoding), E.aborted),
        ("encode_failed", (E.queued, E.encoding), E.failed),
        ("engine_failed", (E.queued, E.encoding), E.failed),
    ],
    description="one image through the vision encoder, a few blocks per GPU job, before its prompt's prefill",
)
