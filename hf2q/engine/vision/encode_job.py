"""The engine-thread side of serving images: what one GPU job of an image encode does.

``plan_images`` runs once per request (one short job): it puts the M-RoPE shifts of the images
in the slot's cached prefix back on the sequence — the persistent KV store restores K/V, not
the shifts, and a restore may bring in images its sequence never prefilled — and returns one
``ImageEncodeJob`` per image the rest of the prompt names. Each ``job.step(runner)`` is then one
GPU job of ``hf2q.actors.encoder``: the first looks the image up in the feature cache and
begins the encode, every one runs a bounded number of vision blocks (``JOB_PATCH_BLOCKS``
patch rows × blocks), the last one the merger, caching the features the prefill will splice in.

A step never raises: an image the encoder cannot take fails its request (400), any other
error of the vision pass too (503) — the encoder holds no slot's state, so the engine stays
healthy and other requests go on.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import numpy as np

from hf2q.engine.vision.prompt_images import IMAGE_ID_BASE, chunk_positions, split_image_token
from hf2q.errors import InputError

#: patch rows × vision blocks one job runs at most (always at least one block)
JOB_PATCH_BLOCKS = 8192


@attrs.frozen
class EncodeStep:
    """What one job did: ``cached`` (features were there), ``running`` (more blocks to go),
    ``encoded`` (features cached now) or ``failed`` with an HTTP ``status`` and ``message``."""

    outcome: str
    status: int = 0
    message: str = ""


def shifts_through(tokens: Sequence[int], store) -> list[tuple[int, int]]:
    """The ``(length, shift)`` pairs the images in ``tokens`` leave when prefilled from position 0
    (only the stretch from the first image token to the last is walked: text outside adds no pair)."""
    where = np.flatnonzero(np.asarray(tokens, dtype=np.int64) >= IMAGE_ID_BASE)  # ids past 32 bits
    if not where.size:
        return []
    a, b = int(where[0]), int(where[-1]) + 1
    return chunk_positions(tokens[a:b], a, 0, store)[1]


def plan_images(runner, seq, prompt: Sequence[int], cached: int,
                restored: bool = True) -> "list[ImageEncodeJob] | EncodeStep | None":
    """Before a request's prefill: a job per image still to prefill (in prompt order, each image once),
    and, when part of the cached prefix was ``restored`` from elsewhere (the persistent store), that
    prefix's shifts on ``seq`` (a slot's own prefix keeps its own: ``shift_at`` drops those past the
    length). None when the runner serves no images; a failed ``EncodeStep`` when the prompt names an
    image the store no longer holds."""
    store = getattr(runner, "images", None)
    if store is None:
        return None
    if restored:
        try:
            seq.mrope_shifts = shifts_through(prompt[:cached], store)
        except InputError as e:
            return EncodeStep("failed", 400, str(e))
    rest = np.asarray(prompt[cached:], dtype=np.int64)
    keys = dict.fromkeys(split_image_token(int(t))[0] for t in rest[rest >= IMAGE_ID_BASE])
    return [ImageEncodeJob(key) for key in keys]


@attrs.define(eq=False)
class ImageEncodeJob:
    """One image's encode, advanced one bounded piece per ``step``; its partial state lives here
    (touched only by the engine thread) and is dropped with the job when its client leaves."""

    key: int
    state: Any = None
    blocks: int = 1

    def step(self, runner) -> EncodeStep:
        try:
            return self._step(runner)
        except InputError as e:
            self.state = None
            return EncodeStep("failed", 400, f"the image cannot be encoded: {e}")
        except Exception as e:  # noqa: BLE001 — the vision pass failed: this request only
            self.state = None
            return EncodeStep("failed", 503, f"image encoding failed: {type(e).__name__}: {e}")

    def _step(self, runner) -> EncodeStep:
        store, encoder = runner.images, runner.vision
        if self.state is None:
            if store.cached_features(self.key, hit=True) is not None:
                return EncodeStep("cached")
            image = store.get(self.key)
            self.state = encoder.begin(image.patches, image.grid)
            self.blocks = max(1, JOB_PATCH_BLOCKS // max(len(image.patches), 1))
        if not encoder.advance(self.state, self.blocks):
            return EncodeStep("running")
        store.put_features(self.key, encoder.finish(self.state))
        self.state = None
        return EncodeStep("encoded")
