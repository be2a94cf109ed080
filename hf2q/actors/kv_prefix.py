"""The KV prefix actor: restores persisted prompt KV into a slot and persists what a slot computed.

It sits beside the KV writer (``kv_writer.py``) and is the only actor that reads the
persistent store's index and blocks. A slot sends ``Restore`` right after it is assigned
(the store may reach further into the prompt than the slot's own cache), ``Persist`` once
its client has the answer and ``Overwrite`` before it drops its KV for another reason; each
is answered on its reply. Block reads are file I/O in a worker thread; imports and exports
are GPU transactions. Its lifecycle is the ``kv_prefix`` machine (``hf2q.statemachines.kv_prefix``).

Persisting never stalls serving and never silently loses a finished request's blocks: a
``Persist`` exports only as many blocks as the writer's queue has room for and keeps a
record (sequence, prompt, block spans) of the rest. When the writer's queue has emptied it
sends ``WriterIdle``, and the next batch is exported from the slot's *resident* KV — still
there, because a slot's KV is only overwritten after a ``Restore`` or an ``Overwrite``, and
those give up exactly the recorded blocks beyond what the slot keeps (counted
``not_written``). ``wait_flushed`` is the drain: it returns once every record has been
written or given up.

A cache that is not plain per-position K/V (a hybrid model's recurrent state and its MTP head's input
row, DeepSeek-V4's compact cache, a sliding-window model's window layers) no longer holds, after a
request, the state at most of its prompt's block ends; so on ``Restore`` the actor turns on the
sequence's ``keep_block_ends``, which captures that state at each block end while the prompt's prefill
has it, and a block exported later carries it. A restore of such a
cache starts at one of the slot's reuse points and stops at the deepest block whose end state is saved
(``kvstore.hydrate``).
"""

from __future__ import annotations

import collections
import logging
import math
from typing import Any, Awaitable, Callable

import attrs
import trio

from hf2q.actors.messages import Overwrite, Persist, Restore, WriterIdle
from hf2q.statemachines.base import Lifecycle
from hf2q.statemachines.kv_prefix import KV_PREFIX

log = logging.getLogger("hf2q.runtime")

Transact = Callable[[Callable[[Any], Any], str], Awaitable[Any]]


@attrs.define(eq=False)
class DeferredBlocks:
    """Blocks of ``prompt`` that ``seq`` holds and the writer had no room for yet, in chain order."""

    seq: Any
    prompt: tuple[int, ...]
    spans: collections.deque  # of BlockSpan


class KvPrefixActor:
    def __init__(self, transact: Transact, store=None):
        self.fsm = Lifecycle(KV_PREFIX)
        self._transact = transact
        self.store = store
        self.writer = None  # the running KV writer, once started
        self._counts: collections.Counter[str] = collections.Counter()
        self._deferred: collections.deque[DeferredBlocks] = collections.deque()
        self._deferred_blocks = 0
        self._none_deferred = trio.Event()
        self._none_deferred.set()
        self._idle_asked = False  # a WriterIdle is on its way
        self.inbox_send, self._inbox = trio.open_memory_channel(math.inf)

    @property
    def state(self) -> str:
        """The current state of this actor's machine."""
        return self.fsm.state

    @property
    def enabled(self) -> bool:
        return self.store is not None

    @property
    def counters(self) -> dict[str, int]:
        """This actor's counters for the runtime snapshot, with the blocks still pending."""
        out = dict(self._counts)
        if self.writer is not None and self.store is not None:
            st = self.store.stats()  # one consistent reading: a block is pending or written, never both
            out["kv_blocks_pending"], out["kv_blocks_written"] = st.pending, st.written
        return out

    async def run(self) -> None:
        async for msg in self._inbox:
            if isinstance(msg, Restore):
                self.fsm.fire("restore_requested")
                self._give_up(msg.seq, msg.cached)  # the request keeps only these tokens of the old KV
                covered = await self._restore(msg)
                self.fsm.fire("restored")
                msg.reply.set(covered)
            elif isinstance(msg, Persist):
                self.fsm.fire("persist_requested")
                self._record(msg)
                await self._export_batch(held=(msg.seq,))
                self.fsm.fire("exported")
                msg.reply.set()
            elif isinstance(msg, Overwrite):
                self._give_up(msg.seq, msg.keep)
                msg.reply.set()
            elif isinstance(msg, WriterIdle):
                self._idle_asked = False
                if self._deferred:
                    self.fsm.fire("writer_idle")
                    await self._export_batch(late=True)
                    self.fsm.fire("flushed")
            else:
                raise TypeError(f"unexpected message {msg!r}")

    async def wait_flushed(self) -> None:
        """Return once every recorded block was handed to the writer and the writer is idle."""
        while self._deferred_blocks or (self.writer is not None and self.writer.pending):
            await self._none_deferred.wait()
            if self.writer is not None:
                await self.writer.wait_idle()

    def abandon(self) -> int:
        """The actor has stopped: count what is still recorded (or was being exported) as never
        written; returns that count."""
        n = self._deferred_blocks
        if n:
            self._deferred.clear()
            self._note_deferred(-n)
            self._not_written(n)
        return n

    # ---- restore -------------------------------------------------------------------------

    async def _restore(self, msg: Restore) -> int:
        """Import the blocks the store holds beyond ``msg.cached`` tokens; returns the prompt tokens
        now cached. A block that vanished or fails verification ends the restore at the blocks before it."""
        from hf2q.kvstore.fingerprint import BLOCK_TOKENS
        from hf2q.kvstore.hydrate import end_rows_last_only, plan_restore

        seq = msg.seq
        keep_ends = getattr(seq, "keep_block_ends", None)
        if keep_ends is not None:  # the slot's sequence runs no forward until this reply: safe from here
            keep_ends(BLOCK_TOKENS)
        plan = plan_restore(self.store, msg.prompt, msg.cached, getattr(seq, "published_points", None),
                            getattr(seq, "persist_kind", ""))  # index lookups only
        if plan is None:
            return msg.cached
        blocks = []
        for imp in plan.imports:
            try:  # file I/O only (no MLX): a worker thread is fine here
                blocks.append((await trio.to_thread.run_sync(self.store.read, imp.meta), imp.n_tokens))
            except Exception as e:  # noqa: BLE001 — BlockUnavailable or an I/O error: stop here
                log.warning("kv restore stopped early: %s", e)
                break
        while blocks and not plan.imports[len(blocks) - 1].meta.has_end_state:
            blocks.pop()  # a restore stops only where the state its end needs is saved
        keep = plan.keep_tokens
        covered = keep + sum(n for _, n in blocks)
        if covered <= msg.cached:
            return msg.cached

        parts = end_rows_last_only([arrays for arrays, _ in blocks], getattr(seq, "persist_kind", ""))

        def import_blocks(runner):
            seq.trim(keep)
            try:
                for arrays, (_, n) in zip(parts, blocks):
                    runner.import_kv(seq, arrays, n)
            except BaseException:
                seq.trim(keep)  # never a half-restored slot (a block without its end state last)
                raise

        await self._transact(import_blocks, "kv import")
        self._counts["kv_blocks_restored"] += len(blocks)
        self._counts["kv_tokens_restored"] += covered - keep
        return covered

    # ---- persist -------------------------------------------------------------------------

    def _record(self, msg: Persist) -> None:
        """Record ``msg.prompt``'s blocks missing on disk. A record of the same sequence left from its
        previous request covers a prefix of this prompt (``Restore`` gave up the rest): it is replaced."""
        if self.writer is None:
            return
        for old in [r for r in self._deferred if r.seq is msg.seq]:
            self._deferred.remove(old)
            self._note_deferred(-len(old.spans))
        spans = self.store.missing_spans(msg.prompt)
        if spans:
            self._deferred.append(DeferredBlocks(msg.seq, msg.prompt, collections.deque(spans)))
            self._note_deferred(len(spans))

    def _ends_to_let_go(self, held, take, skipped) -> list[tuple[Any, set[int]]]:
        """The sequences holding captured block-end states that no export needs (each can be a recurrent
        state's worth of device memory), with the ends each lets go of: a ``Persist``'s (``held``, which
        runs no forward until its reply) all but those of its recorded blocks and of the ones exported now
        (``take``); any other sequence only those of its recorded blocks another request wrote meanwhile
        (``skipped``), since its slot may be capturing a newer prompt's."""
        out = []
        for seq in held:
            keep = {sp.end for rec in self._deferred if rec.seq is seq for sp in rec.spans}
            keep |= {sp.end for rec, sp in take if rec.seq is seq}
            drop = set(getattr(seq, "block_ends", None) or ()) - keep
            if drop:
                out.append((seq, drop))
        for seq in {id(s): s for s, _ in skipped if not any(s is h for h in held)}.values():
            drop = {end for s, end in skipped if s is seq} & set(getattr(seq, "block_ends", None) or ())
            if drop:
                out.append((seq, drop))
        return out

    def _give_up(self, seq, keep: int) -> None:
        """``seq`` keeps only its first ``keep`` tokens: its recorded blocks beyond them are lost."""
        lost = 0
        for rec in [r for r in self._deferred if r.seq is seq]:
            kept = collections.deque(sp for sp in rec.spans if sp.end <= keep)
            lost += len(rec.spans) - len(kept)
            rec.spans = kept
            if not kept:
                self._deferred.remove(rec)
        if lost:
            self._note_deferred(-lost)
            self._not_written(lost)
            log.info("kv persist: blocks not written, their slot's KV was needed first", extra={"blocks": lost})

    async def _export_batch(self, late: bool = False, held=()) -> None:
        """Export as many recorded blocks as the writer has room for and submit them; if some remain, ask
        the writer for a ``WriterIdle``. In the same GPU transaction, the block-end states that need no
        export are let go of: those of ``held`` sequences (a ``Persist``'s: its blocks already on disk) and
        of any sequence whose recorded block another request wrote meanwhile. ``late``: after their
        request's ``Persist`` (counted ``kv_blocks_saved_late`` too)."""
        from hf2q.kvstore import KVBlock

        take = []  # (record, span)
        skipped = []  # (sequence, block end) of recorded blocks already on disk
        room = self.writer.room if self.writer is not None else 0
        while room and self._deferred:
            rec = self._deferred[0]
            sp = rec.spans.popleft()
            if not rec.spans:
                self._deferred.popleft()
            if self.store.contains(sp.block_hash):
                self._note_deferred(-1)  # another request's copy of the same block got there first
                skipped.append((rec.seq, sp.end))
                continue
            take.append((rec, sp))  # still counted pending until the writer has it
            room -= 1
        let_go = self._ends_to_let_go(held, take, skipped)
        if take or let_go:
            def export(runner):  # a record is only kept while its sequence holds it; checked again here
                out = [runner.export_kv(rec.seq, sp.start, sp.end) if sp.end <= rec.seq.length else None
                       for rec, sp in take]
                for seq, drop in let_go:  # after the exports, which needed the ends they took
                    seq.forget_block_ends(set(seq.block_ends) - drop)
                return out

            exported = await self._transact(export, "kv export")
            self._note_deferred(-len(take))
            for (rec, sp), arrays in zip(take, exported):
                kind = getattr(rec.seq, "persist_kind", "")
                if arrays is not None and self.writer.submit_nowait(KVBlock.from_span(sp, rec.prompt, arrays, kind)):
                    self._counts["kv_blocks_saved"] += 1
                    self._counts["kv_blocks_saved_late"] += int(late)
                else:
                    self._not_written(1)
        if self._deferred and not self._idle_asked and self.writer is not None:
            self._idle_asked = True
            self.writer.notify_idle(self.inbox_send, WriterIdle())

    # ---- accounting ----------------------------------------------------------------------

    def _note_deferred(self, delta: int) -> None:
        self._deferred_blocks += delta
        self.store.note_pending(delta)
        if delta > 0:
            if self._none_deferred.is_set():
                self._none_deferred = trio.Event()
        elif self._deferred_blocks == 0:
            self._none_deferred.set()

    def _not_written(self, n: int) -> None:
        self._counts["kv_blocks_not_written"] += n
        self.store.note_not_written(n)
