"""The KV-persist writer actor: persists blocks in the background, never slows prefill.

The runtime hands blocks over with ``writer.submit_nowait(block)``, which never waits: when
the bounded channel (``capacity`` blocks, optionally also ``max_queued_bytes``) is full the
block is refused, counted as ``skipped`` (in the store's stats, hence /metrics) and
``False`` is returned. The KV prefix actor does not let that happen to a finished request:
it submits only as many blocks as ``room`` allows, keeps a record of the rest and asks
``notify_idle`` for a message once the queue has emptied (``kv_prefix.py``). While a block
is queued or being written it counts as *pending* in the store's stats.

One task drains the channel, one block at a time, following the ``kv_writer`` state
machine: ``writing`` (``store.stage``: private temp file) → ``syncing`` (``store.commit``:
fsync → rename → directory fsync, index, evict) → ``idle``. The blocking I/O runs in
``trio.to_thread.run_sync`` (plain file I/O, no MLX, so any worker thread is fine); an
exception there (disk full, permission, a malformed block) is logged — rate-limited — and
counted, the machine passes through ``failed`` and the actor carries on.

Ordering and cancellation: blocks are written in submission order. Leaving
``open_kv_writer`` normally closes the channel and waits for queued blocks to be written
(``drain_on_exit=True``); cancellation abandons the queue, but a write already in a worker
thread completes (``to_thread`` is not abandoned), so no half-written block remains visible.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from functools import partial
from typing import AsyncIterator

import attrs
import trio

from hf2q.kvstore.store import BlockStore, KVBlock, StagedWrite
from hf2q.statemachines.base import fire
from hf2q.statemachines.kv_writer import SPEC

log = logging.getLogger("hf2q.actors.kv_writer")

_LOG_EVERY_S = 5.0


@attrs.frozen
class WriterStatistics:
    state: str
    capacity: int
    queued: int
    queued_bytes: int
    submitted: int
    skipped: int
    written: int
    already_stored: int
    errors: int
    abandoned: int  # still queued when the writer was cancelled (counted not_written in the store)


@attrs.define(slots=False, eq=False)
class KVWriter:
    """Handle to a running writer; create it with ``open_kv_writer``."""

    store: BlockStore
    capacity: int
    max_queued_bytes: int | None
    _send: trio.MemorySendChannel = attrs.field(repr=False)
    state: str = attrs.field(init=False, default="idle")
    _queued_bytes: int = attrs.field(init=False, default=0)
    _counts: dict = attrs.field(init=False, factory=lambda: dict.fromkeys(
        ("submitted", "skipped", "written", "already_stored", "errors", "abandoned"), 0))
    _pending: int = attrs.field(init=False, default=0)  # submitted, not yet handled
    _idle: trio.Event = attrs.field(init=False, factory=trio.Event)
    _on_idle: list = attrs.field(init=False, factory=list)  # (channel, message) sent once the queue is empty
    _last_log: float = attrs.field(init=False, default=float("-inf"))
    _suppressed: int = attrs.field(init=False, default=0)
    history: collections.deque = attrs.field(init=False, factory=lambda: collections.deque(maxlen=64))
    """The most recent states entered, oldest first (debugging, tests)."""

    def __attrs_post_init__(self) -> None:
        SPEC.attach(self, after_state_change=lambda: self.history.append(self.state))

    # ---- producer side (any trio task) ---------------------------------------------------

    def submit_nowait(self, block: KVBlock) -> bool:
        """Queue ``block`` for writing; False (and counted as skipped) if the queue is full or closed."""
        size = block.nbytes
        if self.max_queued_bytes is not None and self._queued_bytes + size > self.max_queued_bytes \
                and self._queued_bytes > 0:
            return self._skip()
        try:
            self._send.send_nowait((block, size))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            return self._skip()
        self._queued_bytes += size
        self._counts["submitted"] += 1
        if self._pending == 0:
            self._idle = trio.Event()
        self._pending += 1
        self.store.note_pending(1)
        return True

    @property
    def room(self) -> int:
        """Blocks ``submit_nowait`` accepts right now (the byte bound aside)."""
        return max(self.capacity - self._send.statistics().current_buffer_used, 0)

    @property
    def pending(self) -> int:
        """Blocks submitted and not yet handled (queued, or being written)."""
        return self._pending

    def notify_idle(self, send: trio.MemorySendChannel, message) -> None:
        """Send ``message`` on ``send`` (unbounded, never waits) once no block is pending — at once if none is."""
        if self._pending == 0:
            send.send_nowait(message)
        else:
            self._on_idle.append((send, message))

    def _skip(self) -> bool:
        self._counts["skipped"] += 1
        self.store.note_skipped()
        return False

    def statistics(self) -> WriterStatistics:
        return WriterStatistics(state=self.state, capacity=self.capacity,
                                queued=self._send.statistics().current_buffer_used,
                                queued_bytes=self._queued_bytes, **self._counts)

    async def wait_idle(self) -> None:
        """Return once every block submitted so far has been handled (written, skipped or failed)."""
        while self._pending:
            await self._idle.wait()

    # ---- consumer side (the actor task) -----------------------------------------------------

    async def run(self, receive: trio.MemoryReceiveChannel) -> None:
        async with receive:
            async for block, size in receive:
                committed = False
                try:
                    committed = await self._persist(block)
                except BaseException:  # cancelled mid-block: its write was rolled back
                    self._counts["abandoned"] += 1
                    self.store.note_not_written(1)
                    raise
                finally:
                    self._queued_bytes -= size
                    self._pending -= 1
                    if not committed:  # a commit settles its block's pending count with the write itself
                        self.store.note_pending(-1)
                    if self._pending == 0:
                        self._idle.set()
                        self._wake_idle_waiters()
        fire(self, "input_closed")

    def _abandon(self) -> None:
        """The actor has ended: whatever is still pending will never be written — count it so."""
        n, self._pending = self._pending, 0
        if n:
            self._counts["abandoned"] += n
            self.store.note_pending(-n)
            self.store.note_not_written(n)
        self._idle.set()

    def _wake_idle_waiters(self) -> None:
        waiters, self._on_idle = self._on_idle, []
        for send, message in waiters:
            try:
                send.send_nowait(message)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass  # that actor has ended: nobody is waiting any more

    async def _persist(self, block: KVBlock) -> bool:
        """Write ``block``; True once it is committed."""
        fire(self, "block_dequeued")
        try:
            staged: StagedWrite | None = await trio.to_thread.run_sync(self.store.stage, block)
        except Exception as e:  # noqa: BLE001 — an I/O fault must never crash the server
            self._failed(block, "write", e)
            return False
        if staged is None:
            self._counts["already_stored"] += 1
            fire(self, "block_already_stored")
            return False
        fire(self, "block_written")
        try:
            await trio.to_thread.run_sync(partial(self.store.commit, staged, settles_pending=True))
        except Exception as e:  # noqa: BLE001
            self._failed(block, "sync", e)
            return False
        except BaseException:
            self.store.abort(staged)
            raise
        self._counts["written"] += 1
        fire(self, "block_synced")
        return True

    def _failed(self, block: KVBlock, phase: str, exc: Exception) -> None:
        fire(self, "io_failed")
        self._counts["errors"] += 1
        self.store.note_error()
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S:
            log.warning("kv writer: could not persist a block", extra={
                "phase": phase, "block": block.block_hash[:12], "error": f"{type(exc).__name__}: {exc}",
                "suppressed_since_last": self._suppressed})
            self._last_log, self._suppressed = now, 0
        else:
            self._suppressed += 1
        fire(self, "recovered")


@contextlib.asynccontextmanager
async def open_kv_writer(store: BlockStore, capacity: int = 8, *, max_queued_bytes: int | None = None,
                         drain_on_exit: bool = True) -> AsyncIterator[KVWriter]:
    """Run a writer actor for ``store`` for the duration of the ``async with`` block.

    ``capacity`` bounds the queue in blocks (each holds its exported arrays in host memory);
    ``max_queued_bytes`` optionally bounds it in bytes too (a lone block is always accepted).
    """
    if capacity < 1:
        raise ValueError("kv writer capacity must be at least 1")
    send, receive = trio.open_memory_channel(capacity)
    writer = KVWriter(store, capacity, max_queued_bytes, send)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer.run, receive)
            try:
                yield writer
            finally:
                if not drain_on_exit:
                    nursery.cancel_scope.cancel()
                send.close()
    finally:
        writer._abandon()
