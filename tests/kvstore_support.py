"""Helpers shared by the persistent-store tests of caches that are not plain K/V."""

from __future__ import annotations


async def persist_then_restore(runner, store, seq, prompt, fresh) -> int:
    """Through a real KV prefix actor and writer on ``store``: persist what ``seq`` holds of ``prompt`` (and
    wait until it is written), then restore ``prompt`` into the empty sequence ``fresh``; → the restore's
    cached tokens. Engine work runs inline, as the runtime's one engine thread would run it."""
    import trio

    from hf2q.actors.kv_prefix import KvPrefixActor
    from hf2q.actors.kv_writer import open_kv_writer
    from hf2q.actors.messages import Persist, Restore

    async def transact(fn, what):
        return fn(runner)

    actor = KvPrefixActor(transact, store)
    async with open_kv_writer(store, capacity=8) as writer, trio.open_nursery() as nursery:
        actor.writer = writer
        nursery.start_soon(actor.run)
        persist = Persist(seq, tuple(prompt))
        actor.inbox_send.send_nowait(persist)
        await persist.reply.ready.wait()
        await actor.wait_flushed()
        restore = Restore(fresh, tuple(prompt), 0)
        actor.inbox_send.send_nowait(restore)
        await restore.reply.ready.wait()
        nursery.cancel_scope.cancel()
    return restore.reply.result
