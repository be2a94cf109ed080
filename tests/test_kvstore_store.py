"""BlockStore behaviour: prefix lookup, read-back, recovery quarantine, LRU eviction under a budget."""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from hf2q.kvstore import BLOCK_TOKENS, BlockStore, BlockUnavailable, KVBlock
from hf2q.kvstore.blockfile import verify_file

FP = hashlib.sha256(b"model-a").hexdigest()


def kv_for(span, tokens, width=4):
    """Deterministic fake KV whose values encode the block's tokens (so mix-ups are visible)."""
    t = np.asarray(tokens[span.start:span.end], dtype=np.float32)
    k = np.broadcast_to(t[None, :, None], (2, BLOCK_TOKENS, width)).astype(np.float16)
    return {"layers.0.k": k, "layers.0.v": -k}


def fill(store, tokens):
    metas = []
    for span in store.missing_spans(tokens):
        metas.append(store.write(KVBlock.from_span(span, tokens, kv_for(span, tokens))))
    return metas


def prompt(seed, n_blocks, extra=10):
    return np.random.default_rng(seed).integers(0, 50000, n_blocks * BLOCK_TOKENS + extra).tolist()


def test_longest_prefix_reads_back_exact_payloads(tmp_path):
    toks = prompt(0, 3)
    with BlockStore.open(tmp_path, FP) as store:
        assert store.longest_prefix(toks) == []
        fill(store, toks)
        assert store.missing_spans(toks) == []
        # a prompt that diverges inside block 2 reuses blocks 0 and 1 only
        other = list(toks)
        other[2 * BLOCK_TOKENS + 3] += 1
        found = store.longest_prefix(other)
        assert [m.token_count for m in found] == [BLOCK_TOKENS, BLOCK_TOKENS]
        for i, meta in enumerate(found):
            arrays = store.read(meta)
            expect = kv_for(store.spans(toks)[i], toks)
            assert all(np.array_equal(arrays[k], v) for k, v in expect.items())
            assert list(meta.token_ids) == toks[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS]
        s = store.stats()
        assert (s.blocks, s.written, s.hits, s.misses) == (3, 3, 2, 2)  # the empty lookup missed too
        assert s.bytes_on_disk == sum(p.stat().st_size for p in (tmp_path / "blocks").iterdir())
    # a restarted store finds them again, for this fingerprint only
    with BlockStore.open(tmp_path, FP) as store:
        assert store.recovery.blocks == 3 and store.recovery.own_blocks == 3
        assert len(store.longest_prefix(toks)) == 3
    with BlockStore.open(tmp_path, hashlib.sha256(b"model-b").hexdigest()) as store:
        assert store.longest_prefix(toks) == [] and store.recovery.own_blocks == 0


def test_written_blocks_are_plain_safetensors(tmp_path):
    toks = prompt(1, 1)
    with BlockStore.open(tmp_path, FP) as store:
        (meta,) = fill(store, toks)
        ref = load_file(str(meta.path))
        ours = store.read(meta)
        assert ref.keys() == ours.keys() and all(np.array_equal(ref[k], ours[k]) for k in ref)


def test_wrong_block_hash_is_refused(tmp_path):
    toks = prompt(2, 1)
    with BlockStore.open(tmp_path, FP) as store:
        span = store.spans(toks)[0]
        bad = KVBlock(span.block_hash, span.parent_hash, [t + 1 for t in toks[:BLOCK_TOKENS]], kv_for(span, toks))
        with pytest.raises(ValueError, match="block hash"):
            store.write(bad)
        assert not list((tmp_path / "blocks").iterdir())


def _damage(path, how):
    raw = bytearray(path.read_bytes())
    if how == "corrupt":
        raw[len(raw) // 2] ^= 0xFF
    elif how == "truncated":
        raw = raw[: len(raw) - 100]
    elif how == "foreign-version":
        raw = bytearray(bytes(raw).replace(b'"format_version":"1"', b'"format_version":"7"'))
    path.write_bytes(bytes(raw))


def test_recovery_quarantines_bad_blocks_and_removes_dead_temps(tmp_path):
    toks = prompt(3, 5)
    with BlockStore.open(tmp_path, FP) as store:
        metas = fill(store, toks)
    _damage(metas[1].path, "corrupt")
    _damage(metas[2].path, "truncated")
    _damage(metas[3].path, "foreign-version")
    stale = tmp_path / "blocks" / f".{metas[4].block_hash}.999999.deadbeef.tmp"
    stale.write_bytes(b"partial")
    with BlockStore.open(tmp_path, FP) as store:
        rep = store.recovery
        assert sorted(r for _, r in rep.quarantined) == ["bad-checksum", "truncated", "wrong-version"]
        assert rep.temps_removed == 1 and not stale.exists()
        assert rep.blocks == 2 and store.stats().quarantined == 3
        # only block 0 is still reachable: the chain stops at the first missing block
        assert [m.block_hash for m in store.longest_prefix(toks)] == [metas[0].block_hash]
        q = sorted(p.name for p in (tmp_path / "quarantine").iterdir())
        assert q == sorted(f"{m.path.name}.{r}" for m, r in zip(metas[1:4], ["bad-checksum", "truncated",
                                                                              "wrong-version"]))
        for p in (tmp_path / "blocks").iterdir():
            verify_file(p)


def test_recovery_starting_while_a_temp_is_created_leaves_it_to_its_writer(tmp_path, monkeypatch):
    """Another process's start-up recovery that runs between a writer creating its temp and locking it must
    not take the temp for a dead writer's (two servers sharing a directory, one starting up)."""
    import threading

    from hf2q.kvstore import store as store_module
    from hf2q.kvstore.recovery import recover

    toks = prompt(4, 1)
    real_open, real_replace, other = os.open, os.replace, []

    def open_then_recover(path, flags, *mode):
        fd = real_open(path, flags, *mode)
        if str(path).endswith(".tmp") and not other:  # the temp exists; its writer has not locked it yet
            other.append(threading.Thread(target=lambda: other.append(recover(tmp_path, FP)[1])))
            other[0].start()
            other[0].join(0.5)  # a recovery free to run is done well within this
        return fd

    def replace_after_recovery(src, dst):  # the temp still exists while recovery scans, however slow it runs
        if other and threading.current_thread() is not other[0]:
            other[0].join(10)
        return real_replace(src, dst)

    with BlockStore.open(tmp_path, FP) as store:
        monkeypatch.setattr(store_module.os, "open", open_then_recover)
        monkeypatch.setattr(store_module.os, "replace", replace_after_recovery)
        metas = fill(store, toks)  # FileNotFoundError at the rename when recovery removed the temp
        monkeypatch.undo()
        other[0].join(10)
        assert not other[0].is_alive() and other[1].temps_in_use == 1 and other[1].temps_removed == 0
        assert [m.block_hash for m in store.longest_prefix(toks)] == [metas[0].block_hash]
        verify_file(metas[0].path)


def test_corruption_after_start_is_caught_on_read(tmp_path):
    toks = prompt(4, 2)
    with BlockStore.open(tmp_path, FP) as store:
        metas = fill(store, toks)
        _damage(metas[1].path, "corrupt")
        found = store.longest_prefix(toks)
        store.read(found[0])
        with pytest.raises(BlockUnavailable, match="bad-checksum"):
            store.read(found[1])
        s = store.stats()
        assert s.errors == 1 and s.quarantined == 1 and s.blocks == 1
        assert len(store.longest_prefix(toks)) == 1
        metas[0].path.unlink()  # evicted by someone else: a miss, not a crash
        with pytest.raises(BlockUnavailable, match="evicted"):
            store.read(found[0])


def test_header_only_startup_defers_checksum_to_read(tmp_path):
    toks = prompt(5, 1)
    with BlockStore.open(tmp_path, FP) as store:
        (meta,) = fill(store, toks)
    _damage(meta.path, "corrupt")
    with BlockStore.open(tmp_path, FP, verify_bodies=False) as store:
        assert store.recovery.blocks == 1
        (found,) = store.longest_prefix(toks)
        with pytest.raises(BlockUnavailable):
            store.read(found)
        assert store.stats().quarantined == 1


def test_budget_eviction_is_lru_and_keeps_store_under_budget(tmp_path):
    prompts = [prompt(10 + i, 1) for i in range(6)]
    with BlockStore.open(tmp_path, FP) as probe:
        (m,) = fill(probe, prompts[0])
        block_bytes = m.file_bytes
    for p in (tmp_path / "blocks").iterdir():
        p.unlink()
    budget = 3 * block_bytes + block_bytes // 2  # room for three blocks
    with BlockStore.open(tmp_path, FP, budget) as store:
        for p in prompts[:3]:
            fill(store, p)
        assert store.longest_prefix(prompts[0])  # touch: prompt 0 becomes most recently used
        fill(store, prompts[3])  # evicts prompt 1 (the LRU), not prompt 0
        assert store.longest_prefix(prompts[1]) == []
        assert store.longest_prefix(prompts[0]) and store.longest_prefix(prompts[2])
        for p in prompts[4:]:
            fill(store, p)
            on_disk = sum(f.stat().st_size for f in (tmp_path / "blocks").iterdir())
            assert on_disk <= budget and store.stats().bytes_on_disk == on_disk
        assert store.stats().evicted == 3
        # uses since: 3 written, 0 and 2 looked up, 4 and 5 written → 3 then 0 were the LRU victims
        survivors = [store.spans(p)[0].block_hash for p in (prompts[2], prompts[4], prompts[5])]
        assert store.lru_order() == survivors


def test_lru_order_survives_restart_and_smaller_budget_evicts_at_open(tmp_path):
    prompts = [prompt(20 + i, 1) for i in range(3)]
    with BlockStore.open(tmp_path, FP) as store:
        metas = [fill(store, p)[0] for p in prompts]
    now = time.time()
    for age, m in zip((30, 10, 20), metas):  # prompt 0 oldest use, then 2, then 1
        os.utime(m.path, (now - age, now - age))
    with BlockStore.open(tmp_path, FP, budget_bytes=metas[0].file_bytes) as store:
        assert store.lru_order() == [metas[1].block_hash]
        assert store.stats().evicted == 2


def test_prometheus_collector_exposes_store_stats(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from hf2q.kvstore.metrics import KVStoreCollector

    toks = prompt(30, 2)
    with BlockStore.open(tmp_path, FP, budget_bytes=1 << 30) as store:
        fill(store, toks)
        store.longest_prefix(toks)
        store.note_skipped(3)
        store.note_pending(5)
        store.note_pending(-2)
        store.note_not_written(4)
        reg = CollectorRegistry()
        reg.register(KVStoreCollector(store))
        text = generate_latest(reg).decode()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(text) for s in fam.samples}
        st = store.stats()
        assert samples[("hf2q_kv_persist_bytes_on_disk", ())] == st.bytes_on_disk > 0
        assert samples[("hf2q_kv_persist_blocks", ())] == 2
        assert samples[("hf2q_kv_persist_block_hits_total", ())] == 2
        assert samples[("hf2q_kv_persist_blocks_skipped_total", ())] == 3
        assert samples[("hf2q_kv_persist_blocks_pending", ())] == st.pending == 3
        assert samples[("hf2q_kv_persist_blocks_not_written_total", ())] == st.not_written == 4
        assert samples[("hf2q_kv_persist_blocks_written_total", ())] == 2
        assert samples[("hf2q_kv_persist_budget_bytes", ())] == 1 << 30
        assert samples[("hf2q_kv_persist_recovery", (("field", "quarantined"),))] == 0


def test_auto_verification_switches_to_headers_only_for_big_stores(tmp_path, monkeypatch):
    from hf2q.kvstore import recovery

    toks = prompt(31, 2)
    with BlockStore.open(tmp_path, FP) as store:
        assert store.recovery.verified_bodies  # empty store: full verification
        fill(store, toks)
    with BlockStore.open(tmp_path, FP) as store:
        assert store.recovery.verified_bodies
    monkeypatch.setattr(recovery, "AUTO_VERIFY_MAX_BYTES", 1000)
    with BlockStore.open(tmp_path, FP) as store:
        assert not store.recovery.verified_bodies and store.recovery.blocks == 2


def test_eviction_trims_prompts_from_the_tail_keeping_shared_heads(tmp_path):
    a, b, c = prompt(40, 4), prompt(41, 2), prompt(42, 1)
    with BlockStore.open(tmp_path, FP) as probe:
        block_bytes = fill(probe, c)[0].file_bytes
    for p in (tmp_path / "blocks").iterdir():
        p.unlink()
    with BlockStore.open(tmp_path, FP, budget_bytes=int(5.5 * block_bytes)) as store:
        fill(store, a)
        fill(store, b)  # 6 blocks > budget: a's last block goes, not its first
        assert len(store.longest_prefix(b)) == 2 and len(store.longest_prefix(a)) == 3
        fill(store, c)  # the LRU prompt is now b (a was looked up after it): b loses its tail
        assert len(store.longest_prefix(a)) == 3
        assert len(store.longest_prefix(b)) == 1 and len(store.longest_prefix(c)) == 1
        assert store.stats().evicted == 2
    # after a restart the file times alone give the same tail-first order
    now = time.time()
    for i, span in enumerate(store.spans(a)[:3]):  # a: oldest, written head first
        os.utime(tmp_path / "blocks" / f"{span.block_hash}.safetensors", (now - 100 + i, now - 100 + i))
    with BlockStore.open(tmp_path, FP, budget_bytes=int(4.5 * block_bytes)) as store:
        assert store.stats().evicted == 1 and store.stats().blocks == 4
        assert len(store.longest_prefix(a)) == 2  # a's third block went, its head stayed


def test_unusable_directory_and_bad_options_are_input_errors(tmp_path):
    from hf2q.errors import InputError

    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(InputError, match="cannot use KV store directory"):
        BlockStore.open(f, FP)
    with pytest.raises(InputError, match="negative"):
        BlockStore.open(tmp_path / "kv", FP, budget_bytes=-1)
    with pytest.raises(InputError, match="payload kind"):
        BlockStore.open(tmp_path / "kv", FP, payload_kind="kv-q4")
