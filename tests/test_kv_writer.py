"""The KV writer actor and its declared state machine."""

from __future__ import annotations

import errno
import hashlib
import logging
import shutil

import numpy as np
import pytest
import trio

from hf2q.actors.kv_writer import open_kv_writer
from hf2q.kvstore import BLOCK_TOKENS, BlockStore, KVBlock
from hf2q.kvstore import store as store_module
from hf2q.kvstore.blockfile import verify_file
from hf2q.statemachines.base import IllegalTransition, fire
from hf2q.statemachines.kv_writer import SPEC, WriterState

FP = hashlib.sha256(b"writer-model").hexdigest()


def blocks_for(store, seed, n_blocks=1, width=8):
    toks = np.random.default_rng(seed).integers(0, 50000, n_blocks * BLOCK_TOKENS).tolist()
    return [KVBlock.from_span(s, toks, {"k": np.full((2, BLOCK_TOKENS, width), s.index, np.float16)})
            for s in store.spans(toks)]


class Model:
    pass


def test_machine_legal_path_and_illegal_transitions():
    m = Model()
    SPEC.attach(m)
    assert m.state == "idle"
    for trig, state in [("block_dequeued", "writing"), ("block_written", "syncing"), ("block_synced", "idle"),
                        ("block_dequeued", "writing"), ("io_failed", "failed"), ("recovered", "idle"),
                        ("block_dequeued", "writing"), ("block_already_stored", "idle"),
                        ("block_dequeued", "writing"), ("block_written", "syncing"), ("io_failed", "failed"),
                        ("input_closed", "closed")]:
        fire(m, trig)
        assert m.state == state
    for trig in SPEC.legal("idle") | SPEC.legal("failed") | {"block_written"}:
        with pytest.raises(IllegalTransition):
            fire(m, trig)  # closed is terminal
    m2 = Model()
    SPEC.attach(m2)
    for trig in ("block_written", "block_synced", "io_failed", "recovered", "block_already_stored", "nonsense"):
        with pytest.raises(IllegalTransition):
            fire(m2, trig)
        assert m2.state == "idle"
    fire(m2, "block_dequeued")
    with pytest.raises(IllegalTransition):
        fire(m2, "input_closed")  # never close mid-write
    assert {s.name for s in WriterState} == set(SPEC.state_names)
    mermaid = SPEC.to_mermaid()
    assert "writing --> syncing: block_written" in mermaid and "syncing --> idle: block_synced" in mermaid


async def test_writer_persists_in_order_and_drains_on_exit(tmp_path):
    with BlockStore.open(tmp_path, FP) as store:
        blocks = blocks_for(store, 1, n_blocks=3)
        async with open_kv_writer(store, capacity=4) as writer:
            assert all(writer.submit_nowait(b) for b in blocks)
        st = writer.statistics()
        assert (st.state, st.written, st.skipped, st.errors, st.queued) == ("closed", 3, 0, 0, 0)
        assert list(writer.history).count("syncing") == 3 and writer.history[-1] == "closed"
        for b in blocks:
            meta = verify_file(tmp_path / "blocks" / f"{b.block_hash}.safetensors")
            assert meta.parent_hash == b.parent_hash
        assert not writer.submit_nowait(blocks[0])  # closed: refused, counted
        assert store.stats().skipped == 1


async def test_full_channel_skips_and_counts_without_waiting(tmp_path):
    with BlockStore.open(tmp_path, FP) as store:
        blocks = blocks_for(store, 2, n_blocks=6)
        async with open_kv_writer(store, capacity=2) as writer:
            # submit_nowait is synchronous (it cannot wait); with no checkpoint between submits the
            # actor cannot drain, so the channel fills and the rest are skipped
            accepted = [writer.submit_nowait(b) for b in blocks]
            assert accepted == [True, True, False, False, False, False]
            await writer.wait_idle()
            st = writer.statistics()
            assert (st.written, st.skipped, st.submitted) == (2, 4, 2)
            assert store.stats().skipped == 4
            # the skipped blocks are simply offered again later
            assert all(writer.submit_nowait(b) for b in blocks[2:4])
            await writer.wait_idle()
            assert writer.statistics().written == 4


async def test_room_pending_and_one_idle_notice(tmp_path):
    """What the KV prefix actor relies on: ``room`` says how many submits succeed now, ``pending``
    (also in the store's stats) counts blocks not handled yet, ``notify_idle`` sends once the queue empties."""
    with BlockStore.open(tmp_path, FP) as store:
        blocks = blocks_for(store, 6, n_blocks=5)
        send, receive = trio.open_memory_channel(10)
        async with open_kv_writer(store, capacity=3) as writer:
            writer.notify_idle(send, "idle-now")  # nothing pending: sent at once
            assert receive.receive_nowait() == "idle-now"
            assert writer.room == 3
            assert [writer.submit_nowait(b) for b in blocks[:writer.room]] == [True] * 3
            assert (writer.room, writer.pending, store.stats().pending) == (0, 3, 3)
            assert not writer.submit_nowait(blocks[3])  # no room: refused (counted skipped)
            writer.notify_idle(send, "after-3")
            with trio.fail_after(10):
                assert await receive.receive() == "after-3"
            assert (writer.pending, store.stats().pending, store.stats().written) == (0, 0, 3)
            with pytest.raises(trio.WouldBlock):
                receive.receive_nowait()  # one notice per request
            assert writer.room == 3


async def test_blocks_abandoned_on_cancellation_are_counted_not_written(tmp_path):
    with BlockStore.open(tmp_path, FP) as store:
        blocks = blocks_for(store, 7, n_blocks=4, width=256)
        with trio.CancelScope() as scope:
            async with open_kv_writer(store, capacity=4, drain_on_exit=False) as writer:
                assert all(writer.submit_nowait(b) for b in blocks)
                scope.cancel()
        st = store.stats()
        assert st.written + st.not_written == 4 and st.pending == 0
        assert writer.statistics().abandoned == st.not_written >= 3


async def test_byte_bound_on_the_queue(tmp_path):
    with BlockStore.open(tmp_path, FP) as store:
        blocks = blocks_for(store, 3, n_blocks=3, width=64)
        async with open_kv_writer(store, capacity=8, max_queued_bytes=int(blocks[0].nbytes * 1.5)) as writer:
            assert [writer.submit_nowait(b) for b in blocks] == [True, False, False]


@pytest.fixture
def writer_log():
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    lg = logging.getLogger("hf2q.actors.kv_writer")
    h = Keep(level=logging.WARNING)
    lg.addHandler(h)
    yield records
    lg.removeHandler(h)


async def test_io_errors_are_counted_logged_and_survived(tmp_path, writer_log, monkeypatch):
    with BlockStore.open(tmp_path, FP) as store:
        b1, b2, b3 = blocks_for(store, 4, n_blocks=3)
        async with open_kv_writer(store, capacity=4) as writer:
            # a real fault: the block directory disappears under the server
            shutil.rmtree(tmp_path / "blocks")
            assert writer.submit_nowait(b1)
            await writer.wait_idle()
            assert writer.statistics().errors == 1 and writer.state == "idle"
            assert "failed" in writer.history
            # an injected fault in the sync phase (disk full at fsync): temp removed, nothing indexed
            (tmp_path / "blocks").mkdir()
            real_fsync = store_module.os.fsync

            def full_disk(fd):
                raise OSError(errno.ENOSPC, "No space left on device")
            monkeypatch.setattr(store_module.os, "fsync", full_disk)
            assert writer.submit_nowait(b2)
            await writer.wait_idle()
            monkeypatch.setattr(store_module.os, "fsync", real_fsync)
            assert writer.statistics().errors == 2
            assert list((tmp_path / "blocks").iterdir()) == []
            # a malformed block from a buggy caller is an error too, not a crash
            bogus = KVBlock(b3.block_hash, b3.parent_hash, [0] * BLOCK_TOKENS, b3.arrays)
            assert writer.submit_nowait(bogus)
            # and the actor keeps going
            assert writer.submit_nowait(b3) and writer.submit_nowait(b1)
            await writer.wait_idle()
            st = writer.statistics()
            assert (st.errors, st.written, st.state) == (3, 2, "idle")
        assert store.stats().errors == 3
        assert sorted(p.name for p in (tmp_path / "blocks").iterdir()) == sorted(
            f"{b.block_hash}.safetensors" for b in (b1, b3))
    assert writer_log and "could not persist" in writer_log[0].getMessage()
    assert writer_log[0].phase == "write"


async def test_cancellation_leaves_no_temp_and_no_torn_block(tmp_path):
    with BlockStore.open(tmp_path, FP) as store:
        blocks = blocks_for(store, 5, n_blocks=4, width=256)
        seen = set()
        with trio.CancelScope() as scope:
            async with open_kv_writer(store, capacity=4, drain_on_exit=False) as writer:
                for b in blocks:
                    writer.submit_nowait(b)
                while writer.state not in ("writing", "syncing"):
                    await trio.sleep(0)
                seen.add(writer.state)
                scope.cancel()  # cancel mid-block
                await trio.sleep(1)
        assert scope.cancelled_caught and seen
        for p in (tmp_path / "blocks").iterdir():
            assert not p.name.endswith(".tmp")
            verify_file(p)
        assert store.stats().written == len(list((tmp_path / "blocks").iterdir())) <= 1  # the queue was abandoned


def test_capacity_must_be_positive(tmp_path):
    with BlockStore.open(tmp_path, FP) as store:
        async def main():
            async with open_kv_writer(store, capacity=0):
                pass
        with pytest.raises(ValueError, match="capacity"):
            trio.run(main)
