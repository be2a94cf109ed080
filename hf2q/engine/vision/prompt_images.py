"""Images inside a token prompt: how an image's tokens name it, and where its M-RoPE ids put the text after it.

The serving runtime moves prompts as tuples of ints and reuses a cached prefix by comparing them, so an
image's placeholder tokens carry the image itself: token ``index`` of the image whose content key is
``key`` is ``IMAGE_ID_BASE + key · MAX_IMAGE_TOKENS + index``, an id no vocabulary reaches. Two prompts
with the same image bytes at the same place therefore share the prefix through it, and a different image
diverges at its first token — prefix reuse keyed on image bytes without the scheduler knowing images.
Each id also says which merged token of the image it is, so a prefill chunk may start or end inside one.

After an image the text's M-RoPE ids run behind the cache length (the image's ``h × w`` tokens advance
the ids only by ``max(h, w)``): each sequence keeps, as ``seq.mrope_shifts``, the ``(length, shift)``
pairs recorded where an image ended; text appended at length ``n`` sits at id ``n + shift`` of the last
pair at or before ``n``. Pairs past the length are dropped before every append, so a trim needs no hook.
"""

from __future__ import annotations

import collections
import hashlib
import threading

import attrs
import numpy as np

from hf2q.errors import InputError

#: the first image token id (above every vocabulary)
IMAGE_ID_BASE = 1 << 40
#: merged tokens one image may have at most (the id's index field)
MAX_IMAGE_TOKENS = 1 << 20
#: content keys are this many bits of the image bytes' SHA-256
KEY_BITS = 40
#: bytes of prepared patch rows a store keeps of images no request holds (the least recently added go first)
STORE_BYTES = 1 << 29
#: bytes of encoded features kept by image (each ``tokens × d_text × (1 + deepstack layers)``), least
#: recently used first out: a second request with the same image skips the encoder
FEATURE_BYTES = 1 << 28


def is_image_token(token: int) -> bool:
    return token >= IMAGE_ID_BASE


def image_token(key: int, index: int) -> int:
    return IMAGE_ID_BASE + key * MAX_IMAGE_TOKENS + index


def split_image_token(token: int) -> tuple[int, int]:
    """``(key, index)`` of an image token id."""
    return divmod(token - IMAGE_ID_BASE, MAX_IMAGE_TOKENS)


def image_keys(tokens) -> list[int]:
    """The key of every image that starts in ``tokens`` (one per occurrence)."""
    return [split_image_token(t)[0] for t in tokens if is_image_token(t) and split_image_token(t)[1] == 0]


def content_key(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:KEY_BITS // 8], "big")


@attrs.frozen
class PreparedImage:
    """An image cut into the encoder's patch rows (``grid``: frame pairs, patch rows, patch columns)."""

    patches: np.ndarray
    grid: tuple[int, int, int]
    merge: int

    @property
    def merged_grid(self) -> tuple[int, int, int]:
        t, h, w = self.grid
        return t, h // self.merge, w // self.merge

    @property
    def n_tokens(self) -> int:
        t, h, w = self.merged_grid
        return t * h * w


class ImageStore:
    """Prepared images by content key, shared by the request side (which adds them) and the engine
    thread (which encodes them, ``encode_job``); their encoded features in an LRU bounded in bytes.

    Each ``add`` holds its image until the matching ``release`` (the request ended): an image a queued
    request still needs is never evicted, since a missing one would fault the engine mid-step.
    ``encodes`` counts the images the encoder ran on, ``feature_hits`` the encodes a cached set saved."""

    def __init__(self, capacity: int = STORE_BYTES, feature_bytes: int = FEATURE_BYTES):
        self._images: collections.OrderedDict[int, PreparedImage] = collections.OrderedDict()
        self._holds: collections.Counter[int] = collections.Counter()
        self._features: collections.OrderedDict[int, object] = collections.OrderedDict()
        self._capacity, self._feature_bytes = capacity, feature_bytes
        self._features_held = 0  # bytes of ``_features``, kept as sets come and go (a put costs no sum)
        self._lock = threading.Lock()
        self.encodes = self.feature_hits = 0

    def add(self, key: int, image: PreparedImage) -> None:
        if image.n_tokens > MAX_IMAGE_TOKENS:
            raise InputError(f"an image of {image.n_tokens} tokens is above the {MAX_IMAGE_TOKENS} an id can index")
        with self._lock:
            self._images[key] = image
            self._images.move_to_end(key)
            self._holds[key] += 1
            self._evict()

    @property
    def holds(self) -> int:
        """Holds not yet released (requests that may still prefill their images)."""
        with self._lock:
            return sum(self._holds.values())

    def held(self, key: int) -> bool:
        """Whether some request still holds image ``key`` (added and not yet released)."""
        with self._lock:
            return key in self._holds

    def release(self, keys) -> None:
        """End one hold of each of ``keys`` (one per ``add``)."""
        with self._lock:
            for key in keys:
                self._holds[key] -= 1
                if self._holds[key] <= 0:
                    del self._holds[key]
            self._evict()

    def _evict(self) -> None:
        free = [k for k in self._images if k not in self._holds]
        held = sum(self._images[k].patches.nbytes for k in free)
        for key in free:
            if held <= self._capacity:
                break
            held -= self._images.pop(key).patches.nbytes

    def get(self, key: int) -> PreparedImage:
        with self._lock:
            image = self._images.get(key)
        if image is None:
            raise InputError("the prompt names an image this server does not hold (released before its prefill)")
        return image

    def forget(self, key: int) -> None:
        with self._lock:
            self._images.pop(key, None)
            self._holds.pop(key, None)
            self._drop_features(key)

    def _drop_features(self, key: int) -> None:
        feats = self._features.pop(key, None)
        if feats is not None:
            self._features_held -= _nbytes(feats)

    def cached_features(self, key: int, hit: bool = False):
        """The features of image ``key`` if the cache has them, else None; ``hit``: an encode they
        save (the encoder's check, not a prefill chunk reading them) is counted."""
        with self._lock:
            feats = self._features.get(key)
            if feats is not None:
                self._features.move_to_end(key)
                self.feature_hits += int(hit)
            return feats

    def __contains__(self, key: int) -> bool:
        with self._lock:
            return key in self._images

    def put_features(self, key: int, feats, counted: bool = True) -> None:
        """Cache one image's encoded features (``counted`` an encode); the least recently used go while
        the cache is over its bytes (the newest set stays even alone above them: its prefill reads it)."""
        with self._lock:
            self.encodes += int(counted)
            self._drop_features(key)
            self._features[key] = feats
            self._features_held += _nbytes(feats)
            while self._features_held > self._feature_bytes and len(self._features) > 1:
                self._features_held -= _nbytes(self._features.popitem(last=False)[1])

    @property
    def feature_bytes(self) -> int:
        """Bytes of the encoded features the cache holds now."""
        with self._lock:
            return self._features_held

    def features(self, key: int, encode):
        """The encoder's features of image ``key`` (``encode(patches, grid)`` on a miss); engine thread only.

        A server encodes every image before the prefill reaching it (``hf2q.actors.encoder``); a miss
        here is a set evicted in between, or a caller without that step (tests, ``generate``)."""
        feats = self.cached_features(key)
        if feats is None:
            image = self.get(key)
            feats = encode(image.patches, image.grid)
            self.put_features(key, feats)
        return feats


def _nbytes(feats) -> int:
    return int(getattr(feats, "nbytes", 0))


# ---- per-sequence M-RoPE shift -----------------------------------------------------------------------


def shift_at(seq) -> int:
    """The shift of text appended to ``seq`` now (pairs beyond its length, left by a trim, dropped)."""
    shifts = getattr(seq, "mrope_shifts", None)
    if not shifts:
        return 0
    while shifts and shifts[-1][0] > seq.length:
        shifts.pop()
    return shifts[-1][1] if shifts else 0


def record_shift(seq, length: int, shift: int) -> None:
    shifts = getattr(seq, "mrope_shifts", None)
    if shifts is None:
        shifts = seq.mrope_shifts = []
    shifts.append((length, shift))


def chunk_positions(tokens, start: int, shift: int, store: ImageStore):
    """M-RoPE ids ``[3, n]`` of ``tokens`` appended at cache length ``start`` with ``shift``; the
    ``(length, shift)`` pairs of images that end in the chunk; and per image run ``(key, indices, rows)``
    (the image's merged-token indices and where they sit in the chunk)."""
    n = len(tokens)
    pos = np.zeros((3, n), dtype=np.int64)
    ends: list[tuple[int, int]] = []
    runs: list[tuple[int, np.ndarray, np.ndarray]] = []
    j = 0
    while j < n:
        t = int(tokens[j])
        if not is_image_token(t):
            pos[:, j] = start + j + shift
            j += 1
            continue
        key, index = split_image_token(t)
        image = store.get(key)
        frames, gh, gw = image.merged_grid
        count = image.n_tokens
        k = j
        while k < n and k - j + index < count and int(tokens[k]) == image_token(key, index + k - j):
            k += 1
        if k == j:  # an index past the image (never in a prompt we built): a placeholder row at a text id
            pos[:, j] = start + j + shift
            j += 1
            continue
        indices = np.arange(index, index + k - j)
        first = start + j - index + shift  # the id of the image's first token (its text position)
        f, rem = np.divmod(indices, gh * gw)
        r, c = np.divmod(rem, gw)
        pos[:, j:k] = np.stack([f, r, c]) + first
        runs.append((key, indices, np.arange(j, k)))
        if indices[-1] == count - 1:
            shift = first + max(gh, gw) - (start + k)
            ends.append((start + k, shift))
        # a run cut short inside the chunk (only a speculative draft copying prompt tokens makes one: its
        # rows are rejected, the model never samples an image id) keeps the ids those tokens have in the image
        j = k
    return pos, ends, runs


#: the content key of the warm-up image (no SHA-256 prefix is all ones in practice; it is forgotten at once)
_WARM_UP_KEY = (1 << KEY_BITS) - 1


def warm_up_images(runner, side: int = 16) -> None:
    """Encode one blank image of ``side × side`` patches (the processor's smallest, 256×256 pixels) and
    prefill its tokens, so a GPU compiles the encoder's and M-RoPE's kernels before the server says ready."""
    enc = runner.vision
    stats = dict(runner.stats)
    counts = runner.images.encodes, runner.images.feature_hits
    rows = np.zeros((side * side, enc.patch_w.shape[1]), np.float32)
    runner.images.add(_WARM_UP_KEY, PreparedImage(rows, (1, side, side), enc.merge))
    try:
        n = (side // enc.merge) ** 2
        runner.prefill(runner.new_sequence(), [1, *(image_token(_WARM_UP_KEY, i) for i in range(n)), 1])
    finally:
        runner.images.forget(_WARM_UP_KEY)
        runner.images.encodes, runner.images.feature_hits = counts
        runner.stats.clear()
        runner.stats.update(stats)
