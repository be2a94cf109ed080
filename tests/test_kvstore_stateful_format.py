"""Blocks of caches that are not plain per-position K/V (format version 3): the payload codec round
trip, the header's cache kind and end state, the version rule, the restore plan that stops only where
an end state is saved, and the budget counting the state's bytes."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf2q.kvstore import BLOCK_TOKENS, BlockStore, KVBlock, plan_restore
from hf2q.kvstore.blockfile import (CACHE_KINDS, FORMAT_VERSION, HEAD_FORMAT_VERSION, PAYLOAD_KINDS,
                                    STATE_FORMAT_VERSION, BlockFileError, encode_block_bytes, read_block, read_meta)
from hf2q.kvstore.fingerprint import ROOT_PARENT, chain_hash
from hf2q.kvstore.payload import block_kind, decode_payload, encode_payload

FP = "stateful-fingerprint-v1"


def _floats(rng, shape, narrow: bool) -> np.ndarray:
    """float32 values; ``narrow``: exactly representable in float16 (the engine's f16 cache exported)."""
    x = rng.standard_normal(shape).astype(np.float32)
    return x.astype(np.float16).astype(np.float32) if narrow else x


def _arrays(rng, n_tokens: int, narrow: bool, with_state: bool) -> dict[str, np.ndarray]:
    out = {"k.0": _floats(rng, (2, n_tokens, 4), narrow), "v.0": _floats(rng, (2, n_tokens, 4), narrow)}
    if with_state:  # a recurrent state is never narrow: float32 accumulations
        out["state.conv.0"] = _floats(rng, (3, 6), False)
        out["state.ssm.0"] = _floats(rng, (2, 4, 4), False) * 1e5
    return out


def _round_trip(tmp_path, arrays, kind: str, cache_kind: str):
    """Encode ``arrays`` as a store of ``kind`` would, write the block file, read it back."""
    stored_kind = block_kind(arrays, kind)
    stored, tags, dtypes = encode_payload(arrays, stored_kind)
    tokens = [1, 2]
    path = tmp_path / "b.safetensors"
    path.write_bytes(encode_block_bytes(block_hash=chain_hash(ROOT_PARENT, FP, tokens), parent_hash=ROOT_PARENT,
                                        fingerprint=FP, token_ids=tokens, arrays=stored, payload_kind=stored_kind,
                                        payload_dtypes=dtypes, dtype_tags=tags, cache_kind=cache_kind))
    meta, got = read_block(path)
    return meta, decode_payload(got, meta)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), n_tokens=st.integers(1, 9), narrow=st.booleans(), with_state=st.booleans(),
       kind=st.sampled_from(PAYLOAD_KINDS), cache_kind=st.sampled_from(CACHE_KINDS))
def test_payload_round_trip_keeps_the_end_state_bit_for_bit(tmp_path, seed, n_tokens, narrow, with_state, kind,
                                                            cache_kind):
    rng = np.random.default_rng(seed)
    arrays = _arrays(rng, n_tokens, narrow, with_state)
    meta, got = _round_trip(tmp_path, arrays, kind, cache_kind)
    assert meta.cache_kind == cache_kind and meta.has_end_state == with_state
    version = HEAD_FORMAT_VERSION if cache_kind.endswith("-mtp") else STATE_FORMAT_VERSION
    assert _header(meta.path)["__metadata__"]["format_version"] == str(version)
    assert got.keys() == arrays.keys()
    for name, want in arrays.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape
        if name.startswith("state.") or kind == "kv" or (narrow and kind == "kv-f16"):
            assert np.array_equal(got[name], want), name  # lossless: the state whatever the payload kind
        else:  # the opt-in approximations of K/V rows
            np.testing.assert_allclose(got[name], want, atol=float(np.abs(want).max()) / 60, rtol=0)


def _header(path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])


def _store_block(store, tokens, i, arrays, cache_kind):
    span = store.spans(tokens)[i]
    return store.write(KVBlock.from_span(span, tokens, arrays, cache_kind))


def _tokens(n_blocks: int, extra: int = 5) -> list[int]:
    return [(i * 31) % 997 + 2 for i in range(n_blocks * BLOCK_TOKENS + extra)]


def test_header_says_the_cache_kind_and_the_version_rule_holds(tmp_path):
    rng = np.random.default_rng(1)
    tokens = _tokens(2)
    with BlockStore.open(tmp_path / "kv", FP) as store:
        stateful = _store_block(store, tokens, 0, _arrays(rng, BLOCK_TOKENS, True, True), "recurrent")
        stateless = _store_block(store, tokens, 1, _arrays(rng, BLOCK_TOKENS, True, False), "recurrent")
    assert (stateful.cache_kind, stateful.has_end_state) == ("recurrent", True)
    assert (stateless.cache_kind, stateless.has_end_state) == ("recurrent", False)
    meta, arrays = read_block(stateful.path)
    assert meta == stateful and sorted(arrays) == ["k.0", "state.conv.0", "state.ssm.0", "v.0"]
    # a plain model's block is unchanged: version 1, no cache kind, always a place to stop
    with BlockStore.open(tmp_path / "plain", FP) as store:
        plain = _store_block(store, tokens, 0, _arrays(rng, BLOCK_TOKENS, True, False), "")
    assert (plain.cache_kind, plain.has_end_state) == ("", True)
    assert _header(plain.path)["__metadata__"]["format_version"] == str(FORMAT_VERSION)

    def rewritten(path, **changes):
        raw = bytearray(path.read_bytes())
        (hlen,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + hlen])
        header["__metadata__"].update(changes)
        for k in [k for k, v in changes.items() if v is None]:
            del header["__metadata__"][k]
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * ((-(8 + len(text))) % 8)
        out = tmp_path / f"edited-{len(changes)}-{sorted(changes)[0]}.safetensors"
        out.write_bytes(struct.pack("<Q", len(text)) + text + bytes(raw[8 + hlen:]))
        return out

    with pytest.raises(BlockFileError) as e:
        read_meta(rewritten(stateful.path, format_version="5"))  # a later format: refused, not misread
    assert e.value.reason == "wrong-version"
    with pytest.raises(BlockFileError) as e:
        read_meta(rewritten(stateful.path, cache_kind=None))  # version 3 without its cache kind
    assert e.value.reason == "unknown-payload"
    with pytest.raises(BlockFileError) as e:
        read_meta(rewritten(plain.path, cache_kind="recurrent"))  # a state claimed by a version-1 block
    assert e.value.reason == "unknown-payload"
    for version, kind in (("3", "recurrent-mtp"), ("4", "recurrent"), ("4", None)):  # each version its own kinds
        with pytest.raises(BlockFileError) as e:
            read_meta(rewritten(stateful.path, format_version=version, cache_kind=kind))
        assert e.value.reason == "unknown-payload", (version, kind)


def test_restore_plan_stops_at_the_deepest_block_with_an_end_state(tmp_path):
    rng = np.random.default_rng(2)
    tokens = _tokens(4)
    with BlockStore.open(tmp_path / "kv", FP) as store:
        for i, with_state in enumerate((True, True, False, False)):
            _store_block(store, tokens, i, _arrays(rng, BLOCK_TOKENS, True, with_state), "recurrent")
        plan = plan_restore(store, tokens, 0, (0,), "recurrent")
        assert [imp.meta.has_end_state for imp in plan.imports] == [True, True]
        assert plan.keep_tokens == 0 and plan.cached_tokens == 2 * BLOCK_TOKENS
        # a slot holding 300 tokens (points 0, 256, 300) keeps its block-aligned point and imports after it
        plan = plan_restore(store, tokens, 300, (0, BLOCK_TOKENS, 300), "recurrent")
        assert plan.keep_tokens == BLOCK_TOKENS and len(plan.imports) == 1
        assert plan.imports[0].meta.block_hash == store.spans(tokens)[1].block_hash
        # a slot already past the deepest stored end state: nothing to do
        assert plan_restore(store, tokens, 2 * BLOCK_TOKENS + 10, (0, 2 * BLOCK_TOKENS + 10), "recurrent") is None
        # another cache's sequence (plain K/V, DeepSeek-V4) never takes these blocks
        assert plan_restore(store, tokens, 0) is None
        assert plan_restore(store, tokens, 0, (0,), "deepseek4") is None


def test_budget_counts_the_end_state_bytes(tmp_path):
    rng = np.random.default_rng(3)
    tokens = _tokens(3)
    with BlockStore.open(tmp_path / "probe", FP) as probe:
        with_state = _store_block(probe, tokens, 0, _arrays(rng, BLOCK_TOKENS, True, True), "recurrent").file_bytes
        without = _store_block(probe, tokens, 1, _arrays(rng, BLOCK_TOKENS, True, False), "recurrent").file_bytes
    assert with_state > without + (3 * 6 + 2 * 4 * 4) * 4 - 1  # the state's float32 bytes are on disk
    with BlockStore.open(tmp_path / "kv", FP, budget_bytes=2 * with_state + 16) as store:
        for i in range(3):
            _store_block(store, tokens, i, _arrays(rng, BLOCK_TOKENS, True, True), "recurrent")
        stats = store.stats()
        files = list((tmp_path / "kv" / "blocks").glob("*.safetensors"))
        assert stats.evicted == 1 and stats.blocks == 2 == len(files)
        assert stats.bytes_on_disk == sum(f.stat().st_size for f in files) <= 2 * with_state + 16
