"""The KV prefix actor lets go of block-end states no export needs inside its one export transaction.

Two slots answered the same hybrid (qwen35) prompt; the first block was already on disk. Each ``Persist``
and each later batch costs at most one engine transaction, and once everything is written neither
sequence still holds a captured state: not the first slot's block already stored, and not the second
slot's blocks that the first slot's export wrote while they waited in the record.
"""

from __future__ import annotations

import numpy as np
import pytest

from hf2q.kvstore import BLOCK_TOKENS as B



class CountingInbox:
    """The actor's inbox, counting the messages it has handed out (the one being handled is the n-th)."""

    def __init__(self, inner):
        self.inner, self.n = inner, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        msg = await self.inner.__anext__()
        self.n += 1
        return msg


async def test_one_transaction_per_message_and_no_state_left_behind(tmp_path):
    import trio

    from hf2q.actors.kv_prefix import KvPrefixActor
    from hf2q.actors.kv_writer import open_kv_writer
    from hf2q.actors.messages import Persist
    from hf2q.engine.runner import MlxModelRunner
    from hf2q.kvstore import BlockStore, KVBlock
    from tests.models.qwen35_chat import qwen35_chat_gguf

    runner = MlxModelRunner.load(qwen35_chat_gguf())
    prompt = np.random.default_rng(7).integers(10, 5000, 3 * B + 20).tolist()
    other = runner.new_sequence()
    other.keep_block_ends(B)
    runner.prefill(other, prompt[:B + 3])
    slots = []
    for _ in range(2):
        seq = runner.new_sequence()
        seq.keep_block_ends(B)
        runner.prefill(seq, prompt)
        assert sorted(seq.block_ends) == [B, 2 * B, 3 * B]
        slots.append(seq)
    transactions = []

    async def transact(fn, what):
        transactions.append((what, inbox.n))
        return fn(runner)

    with BlockStore.open(tmp_path / "kv", "fp-prefix-actor") as store:
        first = runner.export_kv(other, 0, B)
        store.write(KVBlock.from_span(store.spans(prompt)[0], prompt, first, other.persist_kind))
        actor = KvPrefixActor(transact, store)
        inbox = actor._inbox = CountingInbox(actor._inbox)
        async with open_kv_writer(store, capacity=1) as writer, trio.open_nursery() as nursery:
            actor.writer = writer
            persists = [Persist(seq, tuple(prompt)) for seq in slots]
            for p in persists:  # back to back: the second records blocks the first has yet to write
                actor.inbox_send.send_nowait(p)
            nursery.start_soon(actor.run)
            for p in persists:
                await p.reply.ready.wait()
            await actor.wait_flushed()
            nursery.cancel_scope.cancel()
        assert store.stats().written == 3
        assert [m.has_end_state for m in store.longest_prefix(prompt)] == [True, True, True]
    handled = [n for _, n in transactions]
    assert len(handled) == len(set(handled)), transactions  # never a second transaction for one message
    assert not slots[0].block_ends and not slots[1].block_ends
