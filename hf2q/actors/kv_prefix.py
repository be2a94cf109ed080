"""The KV prefix actor: restores persisted prompt KV into a slot and persists what a slot computed.

It sits beside the KV writer (``kv_writer.py``) and is the only actor that reads the
persistent store's index and blocks. A slot sends ``Restore`` right after it is assigned
(the store may reach further into the prompt than the slot's own cache) and ``Persist``
once its client has the answer; each is answered on its reply. Block reads are file I/O
in a worker thread; imports and exports are GPU transactions; exported blocks go to the
writer without waiting (a full writer skips them — persistence never stalls serving).
Its lifecycle is the ``kv_prefix`` machine (``hf2q.statemachines.kv_prefix``).
"""

from __future__ import annotations

import collections
import logging
import math
from typing import Any, Awaitable, Callable

import trio

from hf2q.actors.messages import Persist, Restore
from hf2q.statemachines.base import Lifecycle
from hf2q.statemachines.kv_prefix import KV_PREFIX

log = logging.getLogger("hf2q.runtime")

Transact = Callable[[Callable[[Any], Any], str], Awaitable[Any]]


class KvPrefixActor:
    def __init__(self, transact: Transact, store=None):
        self.fsm = Lifecycle(KV_PREFIX)
        self._transact = transact
        self.store = store
        self.writer = None  # the running KV writer, once started
        self.counters: collections.Counter[str] = collections.Counter()
        self.inbox_send, self._inbox = trio.open_memory_channel(math.inf)

    @property
    def state(self) -> str:
        """The current state of this actor's machine."""
        return self.fsm.state

    @property
    def enabled(self) -> bool:
        return self.store is not None

    async def run(self) -> None:
        async for msg in self._inbox:
            if isinstance(msg, Restore):
                self.fsm.fire("restore_requested")
                covered = await self._restore(msg)
                self.fsm.fire("restored")
                msg.reply.set(covered)
            elif isinstance(msg, Persist):
                self.fsm.fire("persist_requested")
                await self._persist(msg)
                self.fsm.fire("exported")
                msg.reply.set()
            else:
                raise TypeError(f"unexpected message {msg!r}")

    async def _restore(self, msg: Restore) -> int:
        """Import the blocks the store holds beyond ``msg.cached`` tokens; returns the prompt tokens
        now cached. A block that vanished or fails verification ends the restore at the blocks before it."""
        from hf2q.kvstore.hydrate import plan_restore

        plan = plan_restore(self.store, msg.prompt, msg.cached)  # index lookups only
        if plan is None:
            return msg.cached
        blocks = []
        for imp in plan.imports:
            try:  # file I/O only (no MLX): a worker thread is fine here
                blocks.append((await trio.to_thread.run_sync(self.store.read, imp.meta), imp.n_tokens))
            except Exception as e:  # noqa: BLE001 — BlockUnavailable or an I/O error: stop here
                log.warning("kv restore stopped early: %s", e)
                break
        keep = plan.keep_tokens
        covered = keep + sum(n for _, n in blocks)
        if covered <= msg.cached:
            return msg.cached
        seq = msg.seq

        def import_blocks(runner):
            seq.trim(keep)
            for arrays, n in blocks:
                runner.import_kv(seq, arrays, n)

        await self._transact(import_blocks, "kv import")
        self.counters["kv_blocks_restored"] += len(blocks)
        self.counters["kv_tokens_restored"] += covered - keep
        return covered

    async def _persist(self, msg: Persist) -> None:
        if self.writer is None:
            return
        spans = self.store.missing_spans(msg.prompt)
        if not spans:
            return
        seq = msg.seq
        exported = await self._transact(
            lambda runner: [runner.export_kv(seq, sp.start, sp.end) for sp in spans], "kv export")
        from hf2q.kvstore import KVBlock

        for span, arrays in zip(spans, exported):
            if self.writer.submit_nowait(KVBlock.from_span(span, msg.prompt, arrays)):
                self.counters["kv_blocks_saved"] += 1
            else:
                self.counters["kv_blocks_skipped"] += 1
