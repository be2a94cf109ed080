"""A prefill-transaction actor: one bounded chunk of a prompt, posted to the GPU owner.

The slot runs one transaction per chunk (at most ``prefill_chunk`` tokens) and looks at
its client between them, so a cancelled 100k-token prompt stops within one chunk
. The transaction's life is the ``prefill_transaction`` machine:
``queued`` when posted, ``running`` once the GPU owner picks it for a step, then
``committed`` (its tokens are now in the slot's KV and ledger) or ``aborted`` (the client
left before the step, so no GPU work was spent).
"""

from __future__ import annotations

import trio

from hf2q.actors.messages import PrefillWork
from hf2q.statemachines.base import Lifecycle
from hf2q.statemachines.prefill import PREFILL_TRANSACTION


class PrefillTransaction:
    def __init__(self, work: PrefillWork):
        self.fsm = Lifecycle(PREFILL_TRANSACTION)
        self.work = work

    @property
    def state(self) -> str:
        """The current state of this actor's machine."""
        return self.fsm.state

    async def run(self, gpu_inbox) -> PrefillWork:
        """Post the chunk, wait for the GPU owner's answer, settle the machine; returns the work
        (``work.reply`` holds the first sampled token when ``work.final``)."""
        self.work.on_picked = lambda: self.fsm.fire("picked")
        self.work.posted_at = trio.current_time()
        gpu_inbox.send_nowait(self.work)
        await self.work.reply.ready.wait()
        if self.work.reply.skipped:
            self.fsm.fire("client_gone")
        elif self.work.reply.error is not None:
            self.fsm.fire("request_refused")
        else:
            self.fsm.fire("computed")
        return self.work

    def engine_failed(self) -> None:
        if self.fsm.state in ("queued", "running"):
            self.fsm.fire("engine_failed")
