"""The image features rank 0 sends its tensor-parallel followers (``hf2q.engine.vision.tp_images``), as a
command stream between rank 0's store and a follower's, without processes: each image's features travel once
however many chunks read them, every chunk's reads find on the follower what rank 0 holds, and the first command
after the last request holding an image ends leaves the follower without it (grid entry and features).
The end-to-end run on two real ranks is ``tests/test_vision_tp.py``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from hf2q.engine.vision.prompt_images import ImageStore, PreparedImage, image_token, is_image_token, split_image_token
from hf2q.engine.vision.qwen3vl import VisionFeatures
from hf2q.engine.vision.tp_images import SentImages, drop_images, take_images

D = 8


def encode(patches, grid):
    """A stand-in encoder: features derived from the patch rows (so two images differ)."""
    t, h, w = grid
    n = t * (h // 2) * (w // 2)
    base = np.resize(patches.sum(axis=1), (n, 1)) + np.arange(D, dtype=np.float32)
    return VisionFeatures(mx.array(base), (mx.array(base * 2), mx.array(base * 3)), grid)


class Follower:
    """The follower's side of the runner that ``take_images`` / ``drop_images`` touch."""

    dtype = mx.float32

    def __init__(self):
        self.images = None
        self.vision = None

    def attach_vision(self, encoder, store):
        self.vision, self.images = encoder, store


class Group:
    """Rank 0's store and account, one follower, and the bytes of features that went over."""

    def __init__(self):
        self.store, self.sent, self.follower = ImageStore(), SentImages(), Follower()
        self.bytes_sent = 0

    def command(self, tokens=()):
        """One command (a prefill chunk of ``tokens``, or with none a decode step) through both sides; the
        follower's prefill reads each image the chunk names."""
        header, arrays = {"op": "prefill" if tokens else "decode"}, {}
        if tokens:
            entries, arrays = self.sent.chunk(self.store, encode, tokens)
            if entries:
                header["images"] = entries
        header = self.sent.with_drops(header, self.store)
        self.bytes_sent += sum(a.nbytes for a in arrays.values())
        if "images" in header:
            take_images(self.follower, header["images"], arrays)
        for key in {split_image_token(t)[0] for t in tokens if is_image_token(t)}:
            theirs = self.follower.images.cached_features(key)
            mine = self.store.features(key, encode)
            assert theirs is not None, key
            assert np.array_equal(np.array(theirs.merged), np.array(mine.merged))
            assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(theirs.deepstack, mine.deepstack))
        if "drop_images" in header:
            drop_images(self.follower, header["drop_images"])

    def holds(self, key) -> bool:
        f = self.follower.images
        return f is not None and key in f and f.cached_features(key) is not None


def _image(seed: int) -> PreparedImage:
    return PreparedImage(np.random.default_rng(seed).standard_normal((4 * 8, 3)).astype(np.float32), (1, 4, 8), 2)


def _tokens(key: int, image: PreparedImage) -> list[int]:
    return [1, 2] + [image_token(key, i) for i in range(image.n_tokens)] + [3]


def _chunks(tokens, size=3):
    return [tokens[a:a + size] for a in range(0, len(tokens), size)]


def test_each_image_goes_once_and_leaves_with_its_last_request():
    g = Group()
    a, b = _image(1), _image(2)
    one_set = encode(a.patches, a.grid).nbytes
    g.store.add(10, a)  # request 1: image 10
    g.store.add(10, a)  # request 2: image 10 again, then image 20
    g.store.add(20, b)
    for chunk in _chunks(_tokens(10, a)):  # request 1's prompt cut into chunks that cut the image
        g.command(chunk)
    for chunk in _chunks(_tokens(10, a) + _tokens(20, b)):
        g.command(chunk)
    assert g.sent.sends == 2 and g.bytes_sent == 2 * one_set  # two images, each once
    g.store.release([10])  # request 1 ends: request 2 still holds both
    g.command()
    assert g.holds(10) and g.holds(20)
    g.store.release([10, 20])  # request 2 ends
    g.command()  # the next command (any) drops them on the follower
    assert not g.holds(10) and not g.holds(20) and 10 not in g.follower.images and 20 not in g.follower.images
    assert g.follower.images.feature_bytes == 0
    g.store.add(10, a)  # asked for again later: sent again
    g.command(_tokens(10, a))
    assert g.sent.sends == 3 and g.holds(10)


def test_a_command_that_reads_an_image_whose_last_hold_just_ended_still_finds_it():
    """The drop rides on a command that may itself read the image: the follower forgets it after that command."""
    g = Group()
    a = _image(3)
    g.store.add(5, a)
    tokens = _tokens(5, a)
    g.command(tokens[:4])
    g.store.release([5])  # released while its prompt's last chunk is still to run (a cancelled request)
    g.command(tokens[4:])  # reads image 5 on the follower, then drops it there
    assert not g.holds(5) and g.sent.sends == 1

