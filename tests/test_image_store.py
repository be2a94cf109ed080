"""``ImageStore``'s feature cache: a byte-bounded LRU whose account is kept as sets come and go.

The reference is a plain LRU written here that sums its sets' bytes on every change."""

from __future__ import annotations

import collections

from hypothesis import given, settings
from hypothesis import strategies as st

from hf2q.engine.vision.prompt_images import ImageStore


class Features:
    """A stand-in feature set of ``size`` bytes that counts how often its size is read."""

    reads = 0

    def __init__(self, size: int):
        self.size = size

    @property
    def nbytes(self) -> int:
        Features.reads += 1
        return self.size


def _reference_lru(ops, bound: int) -> collections.OrderedDict:
    kept: collections.OrderedDict[int, int] = collections.OrderedDict()
    for op, key, size in ops:
        if op == "forget":
            kept.pop(key, None)
            continue
        if op == "get":
            if key in kept:
                kept.move_to_end(key)
            continue
        kept.pop(key, None)
        kept[key] = size
        while sum(kept.values()) > bound and len(kept) > 1:
            kept.popitem(last=False)
    return kept


OPS = st.lists(st.tuples(st.sampled_from(["put", "put", "get", "forget"]), st.integers(0, 6), st.integers(0, 50)),
               max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, bound=st.integers(0, 120))
def test_the_feature_cache_keeps_what_a_summing_lru_keeps(ops, bound):
    store = ImageStore(feature_bytes=bound)
    for op, key, size in ops:
        if op == "put":
            store.put_features(key, Features(size), counted=False)
        elif op == "get":
            store.cached_features(key)
        else:
            store.forget(key)
    want = _reference_lru(ops, bound)
    assert {k: store.cached_features(k).size for k in want} == dict(want)
    assert all(store.cached_features(k) is None for k in range(7) if k not in want)
    assert store.feature_bytes == sum(want.values())


def test_a_put_reads_no_size_but_its_own_and_those_it_evicts():
    """Each set's size is read once going in and once going out, however many the cache holds."""
    store = ImageStore(feature_bytes=10_000)
    Features.reads = 0
    puts = 300
    for key in range(puts):
        store.put_features(key, Features(64), counted=False)
    assert Features.reads <= 2 * puts
    assert store.feature_bytes == (10_000 // 64) * 64
