"""The persistent KV store (``serve --kv-persist DIR``) under an 8-bit cache: a block holds the cache's own
codes and scales (payload ``kv-codes``, block format version 2), so a restart restores the very codes —
the restored slot continues bit for bit like the live one — at a fraction of the float rows' disk; an
older block format or a version that does not go with its payload is refused cleanly, and a version-1
block of float rows (what a q8 server wrote before) still imports.
"""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import numpy as np
import pytest

from hf2q.engine.kv_layout import SCALES_SUFFIX
from hf2q.kvstore import BLOCK_TOKENS, BlockStore, KVBlock, model_fingerprint, plan_restore
from hf2q.kvstore.blockfile import (CODES_FORMAT_VERSION, FORMAT_VERSION, PAYLOAD_KV_CODES, BlockFileError,
                                    read_block, read_meta)
from tests.engine_support import random_tokens, tiny_runner

PROMPT = random_tokens(BLOCK_TOKENS + 6, seed=31)


@pytest.fixture(scope="module")
def q8(tiny_checkpoint, tmp_path_factory):
    """The tiny qwen3 (2 KV heads × 32) on a q8-rotated cache, and a live slot holding ``PROMPT``'s first
    block then the rest (two transactions) with the rest's logits."""
    from hf2q.engine.runner import MlxModelRunner

    f16 = tiny_runner(tiny_checkpoint, tmp_path_factory, "qwen3")
    runner = MlxModelRunner(f16.gguf, f16.model, f16.dtype, None, "q8-rotated")
    live = runner.new_sequence()
    runner.prefill(live, PROMPT[:BLOCK_TOKENS])
    return runner, live, runner.prefill(live, PROMPT[BLOCK_TOKENS:])


def _greedy(runner, seq, logits, n=6) -> list[int]:
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = runner.decode([seq], [out[-1]])[0]
    return out


def _persist(runner, live, root, fp, payload_kind="kv"):
    with BlockStore.open(root, fp, payload_kind=payload_kind) as store:
        (span,) = store.missing_spans(PROMPT)
        meta = store.write(KVBlock.from_span(span, PROMPT, runner.export_kv(live, span.start, span.end)))
    return meta


def _restore(runner, root, fp):
    with BlockStore.open(root, fp) as store:
        assert store.recovery.own_blocks == 1 and store.recovery.quarantined == ()
        plan = plan_restore(store, PROMPT, 0)
        assert plan.cached_tokens == BLOCK_TOKENS
        seq = runner.new_sequence()
        for imp in plan.imports:
            runner.import_kv(seq, store.read(imp.meta), imp.n_tokens)
    return seq


@pytest.mark.parametrize("payload_kind", ["kv", "kv-f16"])
def test_restored_codes_continue_bit_for_bit_like_the_live_slot(q8, tmp_path, payload_kind):
    """Persisted, reopened (recovery), read, imported: every layer's codes and scales are the live slot's,
    and prefilling the rest then decoding gives the live slot's logits exactly — also in a store whose
    chosen payload (``kv-f16``) would round float rows: an 8-bit block keeps its own kind."""
    runner, live, live_logits = q8
    fp = model_fingerprint(runner.gguf.path, None, None, FORMAT_VERSION, runner.kv_identity)
    meta = _persist(runner, live, tmp_path / "kv", fp, payload_kind)
    assert meta.payload_kind == PAYLOAD_KV_CODES
    restored = _restore(runner, tmp_path / "kv", fp)
    for i in range(live.n_layers):
        for a, b in zip((*live.keys[i], *live.values[i]), (*restored.keys[i], *restored.values[i])):
            np.testing.assert_array_equal(np.array(a[:, :BLOCK_TOKENS]), np.array(b[:, :BLOCK_TOKENS]))
    logits = runner.prefill(restored, PROMPT[BLOCK_TOKENS:])
    assert np.array_equal(logits, live_logits)
    fork = runner.new_sequence()  # the live slot itself goes on decoding in the other tests: a copy of it
    runner.import_kv(fork, runner.export_kv(live, 0, live.length), live.length)
    assert _greedy(runner, restored, logits) == _greedy(runner, fork, live_logits)


def test_a_codes_block_is_a_fraction_of_the_float_rows_block(q8, tmp_path):
    """Against the block of the same rows as float32 (what a q8 server stored before: the CPU engine's rows
    do not narrow to 16 bits losslessly): one byte a value plus one float32 scale per 32-value head row,
    under a third of the bytes; the header says version 2, payload ``kv-codes``."""
    runner, live, _ = q8
    fp = model_fingerprint(runner.gguf.path, None, None, FORMAT_VERSION, runner.kv_identity)
    codes = _persist(runner, live, tmp_path / "codes", fp)
    codec = runner.kv_codec
    exported = runner.export_kv(live, 0, BLOCK_TOKENS)
    floats = {name: np.array(codec.decode(*codec.from_host(exported, name, live.head_dim)))
              for name in exported if not name.endswith(SCALES_SUFFIX)}
    with BlockStore.open(tmp_path / "floats", fp) as store:
        (span,) = store.missing_spans(PROMPT)
        rows = store.write(KVBlock.from_span(span, PROMPT, floats))
    assert rows.payload_kind == "kv" and codes.file_bytes * 3 < rows.file_bytes
    meta, arrays = read_block(codes.path)
    assert arrays["k.0"].dtype == np.uint8 and arrays["k.0.scales"].dtype == np.float32
    assert read_meta(codes.path).payload_kind == PAYLOAD_KV_CODES
    header = codes.path.read_bytes()
    assert f'"format_version":"{CODES_FORMAT_VERSION}"'.encode() in header

    # a version-1 block of float rows (an older q8 store) imports: the rows encode to the same codes
    seq = runner.new_sequence()
    with BlockStore.open(tmp_path / "floats", fp) as store:
        runner.import_kv(seq, store.read(rows), BLOCK_TOKENS)
    got = np.array(seq.keys[0][0][:, :BLOCK_TOKENS]).view(np.uint8).astype(int)
    want = np.array(live.keys[0][0][:, :BLOCK_TOKENS]).view(np.uint8).astype(int)
    assert np.abs(got - want).max() <= 1 and (got != want).mean() < 1e-3


@pytest.mark.parametrize("version,reason", [("1", "unknown-payload"), ("9", "wrong-version")])
def test_a_version_that_does_not_hold_its_payload_is_refused(q8, tmp_path, version, reason):
    """A ``kv-codes`` block claiming version 1 (codes a version-1 reader would take for K/V values), or a
    version this reader does not know: the header is refused with its reason, recovery quarantines the
    file, and the store opens without it."""
    runner, live, _ = q8
    fp = model_fingerprint(runner.gguf.path, None, None, FORMAT_VERSION, runner.kv_identity)
    meta = _persist(runner, live, tmp_path / "kv", fp)
    data = meta.path.read_bytes()
    was = f'"format_version":"{CODES_FORMAT_VERSION}"'.encode()
    meta.path.write_bytes(data.replace(was, f'"format_version":"{version}"'.encode()))
    with pytest.raises(BlockFileError) as e:
        read_meta(meta.path)
    assert e.value.reason == reason
    with BlockStore.open(tmp_path / "kv", fp) as store:
        assert store.recovery.own_blocks == 0
        assert [r for _, r in store.recovery.quarantined] == [reason]
        assert plan_restore(store, PROMPT, 0) is None
