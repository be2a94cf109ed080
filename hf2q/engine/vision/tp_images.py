"""Images at tensor parallelism: rank 0 encodes, every rank takes the features as the prompt's input.

The vision encoder is small beside the language model and its output is the same for every rank
(each rank's hidden rows are the full width; only attention heads and FFN columns are split), so it
runs unsplit on rank 0 (``DistributedRunner.attach_vision``) and its features travel once, with
the prefill command of the first chunk holding the image's tokens, as plain arrays on the control
socket: per image its grid (for the chunk's M-RoPE ids) and the merged and deepstack rows. A
follower puts them in an ``ImageStore`` of its own, from which its shard's prefill splices them in
exactly as rank 0's does; a follower never encodes (``NoEncoder``).

Rank 0 keeps the account (:class:`SentImages`): an image stays on the followers while a request on
rank 0 holds it, so the follower's store needs no bound of its own; the first command after the last
hold is released names it in ``drop_images``, and each follower forgets it once that command has run
(the command may still read it). An image asked for again later is sent again. The M-RoPE shifts a
sequence keeps after an image are computed by every rank's own prefill; a shift set from outside (a
restored prefix, ``encode_job.plan_images``) is sent as its own small command.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from hf2q.engine.vision.prompt_images import IMAGE_ID_BASE, ImageStore, PreparedImage, split_image_token
from hf2q.errors import InputError


class NoEncoder:
    """A follower's stand-in: its features come from rank 0, so an encode here is a bug."""

    def __call__(self, patches, grid):
        raise InputError("a tensor-parallel follower was asked to encode an image rank 0 did not send")


class SentImages:
    """Rank 0's account of the images the followers hold (see the module docstring)."""

    def __init__(self):
        self._sent: set[int] = set()
        #: images whose features went to the followers (an image sent again after a drop counts again)
        self.sends = 0

    def chunk(self, store: ImageStore, encoder, tokens: Sequence[int]) -> tuple[list[dict], dict[str, np.ndarray]]:
        """The header entries and arrays of the images ``tokens`` names that the followers do not hold yet."""
        entries, arrays = chunk_images(store, encoder, tokens, skip=self._sent)
        self._sent.update(e["key"] for e in entries)
        self.sends += len(entries)
        return entries, arrays

    def with_drops(self, header: dict, store: ImageStore) -> dict:
        """``header`` naming, in ``drop_images``, the sent images no request holds any more (forgotten here)."""
        gone = sorted(k for k in self._sent if not store.held(k))
        if not gone:
            return header
        self._sent.difference_update(gone)
        return {**header, "drop_images": gone}


def chunk_images(store: ImageStore, encoder, tokens: Sequence[int],
                 skip=frozenset()) -> tuple[list[dict], dict[str, np.ndarray]]:
    """On rank 0: the header entries and arrays of the images ``tokens`` names, but those in ``skip`` (encoded
    here on a miss)."""
    ids = np.asarray(tokens, dtype=np.int64)
    keys = [k for k in dict.fromkeys(split_image_token(int(t))[0] for t in ids[ids >= IMAGE_ID_BASE]) if k not in skip]
    entries, arrays = [], {}
    for n, key in enumerate(keys):
        image = store.get(key)
        feats = store.features(key, encoder)
        arrays[f"image{n}.merged"] = _host(feats.merged)
        for k, d in enumerate(feats.deepstack):
            arrays[f"image{n}.deepstack{k}"] = _host(d)
        entries.append({"key": int(key), "grid": [int(v) for v in image.grid], "merge": int(image.merge),
                        "deepstack": len(feats.deepstack)})
    return entries, arrays


def _host(a) -> np.ndarray:
    import mlx.core as mx

    return np.array(a.astype(mx.float32))


#: a follower's feature cache is never evicted by size: rank 0's holds bound it (``drop_images``)
FOLLOWER_FEATURE_BYTES = 1 << 62


def ensure_store(runner) -> ImageStore:
    """A follower's image store, attached on first use (its shard then reads image ids and shifts)."""
    if runner.images is None:
        runner.attach_vision(NoEncoder(), ImageStore(feature_bytes=FOLLOWER_FEATURE_BYTES))
    return runner.images


def drop_images(runner, keys) -> None:
    """On a follower: forget the images rank 0 no longer holds (their grid entries and features)."""
    if runner.images is not None:
        for key in keys:
            runner.images.forget(int(key))


def take_images(runner, entries: list[dict], arrays: dict[str, np.ndarray]) -> None:
    """On a follower: the images rank 0 sent with a prefill, into this shard's store (made on first use)."""
    import mlx.core as mx

    from hf2q.engine.vision.qwen3vl import VisionFeatures

    store = ensure_store(runner)
    for n, e in enumerate(entries):
        key, grid = e["key"], tuple(e["grid"])
        if key not in store:
            store.add(key, PreparedImage(np.zeros((0, 1), np.float32), grid, e["merge"]))
            store.release([key])  # never held here: the entry (no patch rows) lives until rank 0 drops it
        merged = mx.array(arrays[f"image{n}.merged"]).astype(runner.dtype)
        deep = tuple(mx.array(arrays[f"image{n}.deepstack{k}"]).astype(runner.dtype) for k in range(e["deepstack"]))
        store.put_features(key, VisionFeatures(merged, deep, grid), counted=False)
