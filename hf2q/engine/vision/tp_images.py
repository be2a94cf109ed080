"""Images at tensor parallelism: rank 0 encodes, every rank takes the features as the prompt's input.

The vision encoder is small beside the language model and its output is the same for every rank
(each rank's hidden rows are the full width; only attention heads and FFN columns are split), so it
runs unsplit on rank 0 (``DistributedRunner.attach_vision``) and its features travel with the
prefill command of every chunk holding the image's tokens, as plain arrays on the control socket:
per image its grid (for the chunk's M-RoPE ids) and the merged and deepstack rows. A follower puts
them in an ``ImageStore`` of its own, from which its shard's prefill splices them in exactly as
rank 0's does; a follower never encodes (``NoEncoder``). The M-RoPE shifts a sequence keeps after
an image are computed by every rank's own prefill; a shift set from outside (a restored prefix,
``encode_job.plan_images``) is sent as its own small command.
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


def chunk_images(store: ImageStore, encoder, tokens: Sequence[int]) -> tuple[list[dict], dict[str, np.ndarray]]:
    """On rank 0: the header entries and arrays of the images ``tokens`` names (encoded here on a miss)."""
    ids = np.asarray(tokens, dtype=np.int64)
    keys = dict.fromkeys(split_image_token(int(t))[0] for t in ids[ids >= IMAGE_ID_BASE])
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


def ensure_store(runner) -> ImageStore:
    """A follower's image store, attached on first use (its shard then reads image ids and shifts)."""
    if runner.images is None:
        runner.attach_vision(NoEncoder(), ImageStore())
    return runner.images


def take_images(runner, entries: list[dict], arrays: dict[str, np.ndarray]) -> None:
    """On a follower: the images rank 0 sent with a prefill, into this shard's store (made on first use)."""
    import mlx.core as mx

    from hf2q.engine.vision.qwen3vl import VisionFeatures

    store = ensure_store(runner)
    for n, e in enumerate(entries):
        key, grid = e["key"], tuple(e["grid"])
        if key not in store:
            store.add(key, PreparedImage(np.zeros((0, 1), np.float32), grid, e["merge"]))
            store.release([key])  # a follower's store keeps images as the LRU allows, never held
        merged = mx.array(arrays[f"image{n}.merged"]).astype(runner.dtype)
        deep = tuple(mx.array(arrays[f"image{n}.deepstack{k}"]).astype(runner.dtype) for k in range(e["deepstack"]))
        store.put_features(key, VisionFeatures(merged, deep, grid), counted=False)
