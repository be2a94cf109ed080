"""A slot actor: one request at a time on its slot's KV sequence, from assignment to release.

It owns the slot's ``transitions`` machine (``idle → admitted → prefilling → decoding →
finishing → idle``, with ``cancelled``/``failed``), the prompt's chunking (one bounded
prefill transaction per chunk, the client looked at between them) and the release. From
the last chunk on, the request's tokens belong to the GPU owner's step loop, which ends
the request (see ``hf2q.actors.messages``); the slot waits for that, persists the prompt's
KV, and reports ``Released`` to admission — exactly once per request.

What it is given is narrow (``SlotEnv``): the GPU owner's transaction call and inbox, the
KV prefix actor and admission's inbox; the transaction size comes with each assignment. It
never sees admission's ledger or budget: it tracks the tokens its own KV holds and reports them.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import attrs
import trio

from hf2q.actors.encoder import CANCELLED, ImageEncoder
from hf2q.actors.messages import Assignment, Evict, Generation, Overwrite, Persist, PrefillWork, Released, Restore
from hf2q.actors.prefill import PrefillTransaction
from hf2q.actors.progress import SlotProgress
from hf2q.actors.supervisor import EnginePoisoned
from hf2q.sched.contracts import Admitted, Failed, Finished
from hf2q.sched.transactions import plan_transactions
from hf2q.statemachines.base import Lifecycle
from hf2q.statemachines.slot import SLOT


@attrs.frozen
class SlotEnv:
    transact: Callable[[Callable[[Any], Any], str], Awaitable[Any]]  # one GPU transaction
    gpu_inbox: trio.MemorySendChannel  # PrefillWork
    kv_prefix: Any  # the KV prefix actor (``enabled``, ``inbox_send``)
    released: trio.MemorySendChannel  # admission's inbox


class SlotActor:
    def __init__(self, index: int, env: SlotEnv, inbox: trio.MemoryReceiveChannel):
        self.index = index
        self.fsm = Lifecycle(SLOT)
        self.env = env
        self.seq = None
        self.kv_tokens: list[int] = []  # what the slot's KV holds (the running request extends it)
        self._inbox = inbox  # Assignment | Evict, from admission
        self.progress = SlotProgress()
        self._txn: PrefillTransaction | None = None
        self.images = ImageEncoder(env.transact)  # the prompt's images, encoded before its prefill

    @property
    def state(self) -> str:
        """The current state of this actor's machine."""
        return self.fsm.state

    @property
    def resident_tokens(self) -> int:
        """Tokens whose KV the slot holds now (the operator view)."""
        return self.progress.resident_tokens if self.fsm.state != "idle" else len(self.kv_tokens)

    async def run(self) -> None:
        try:
            async for msg in self._inbox:
                if isinstance(msg, Evict):
                    if self.seq is not None and self.fsm.state == "idle":
                        seq = self.seq
                        if self.env.kv_prefix.enabled:  # blocks of it still waiting for the writer are lost
                            overwrite = Overwrite(seq, 0)
                            self.env.kv_prefix.inbox_send.send_nowait(overwrite)
                            await overwrite.reply.ready.wait()
                        await self.env.transact(lambda runner: seq.trim(0), "evict")
                        self.kv_tokens = []
                elif isinstance(msg, Assignment):
                    await self._serve(msg)
        except EnginePoisoned:
            return  # the supervisor already ended every request

    def engine_failed(self) -> None:
        """The engine was poisoned: settle the machine (the request itself is failed by admission)."""
        if self._txn is not None:
            self._txn.engine_failed()
        self.images.engine_failed()
        if self.fsm.state in ("admitted", "prefilling", "decoding", "finishing"):
            self.fsm.fire("engine_failed")

    # ---- one request ---------------------------------------------------------------------

    async def _serve(self, a: Assignment) -> None:
        h = a.handle
        prompt = tuple(h.req.prompt_tokens)
        self.fsm.fire("assigned")
        self.kv_tokens = list(prompt[:a.cached_tokens])  # admission routed on this common prefix
        self.progress = SlotProgress(h.request_id, len(prompt), a.cached_tokens, len(prompt) - a.cached_tokens,
                                     h.submitted_at, resident_tokens=a.cached_tokens)
        terminal = await self._generate(a, prompt)  # EnginePoisoned propagates: admission fails h
        if terminal is not None:
            h.finish(terminal)  # no effect if the handle already ended (reader too slow)
        t = h.terminal
        if isinstance(t, Finished) and t.reason in ("stop", "length"):
            self.fsm.fire("stop_reached")
        elif isinstance(t, Failed):
            self.fsm.fire("request_failed")
        else:
            self.fsm.fire("client_gone")
        # persistent KV: the client has its answer; save the prompt's full blocks still missing on disk
        if self.env.kv_prefix.enabled:
            persist = Persist(self.seq, prompt[:min(len(prompt), len(self.kv_tokens))])
            self.env.kv_prefix.inbox_send.send_nowait(persist)
            await persist.reply.ready.wait()
        # where a hybrid model's cache can be cut back to, for the next prompt's routing
        points = getattr(self.seq, "published_points", None)
        self.fsm.fire("released")
        self.env.released.send_nowait(Released(self.index, tuple(self.kv_tokens), points))

    async def _generate(self, a: Assignment, prompt: tuple[int, ...]) -> Finished | Failed | None:
        """Prefill ``prompt`` chunk by chunk; None once the GPU owner ended the request itself."""
        h, env, p = a.handle, self.env, self.progress
        cached = a.cached_tokens
        if self.seq is None:
            self.seq = await env.transact(lambda runner: runner.new_sequence(), "new_sequence")
        if env.kv_prefix.enabled:
            restore = Restore(self.seq, prompt, cached)
            env.kv_prefix.inbox_send.send_nowait(restore)
            await restore.reply.ready.wait()
            if restore.reply.result > cached:
                cached = restore.reply.result
                self.kv_tokens = list(prompt[:cached])
                p.cached_tokens, p.new_tokens, p.resident_tokens = cached, len(prompt) - cached, cached
        h.emit(Admitted(self.index, len(prompt), cached))
        gen = Generation(self.index, h, a.limits, p, len(prompt))
        self.fsm.fire("prefill_started")
        encoded = await self.images.prepare(h, self.seq, prompt, cached, restored=cached > a.cached_tokens)
        if encoded is not None:
            return p.finished("cancelled", trio.current_time()) if encoded == CANCELLED else encoded
        plan = plan_transactions(cached, len(prompt), a.prefill_chunk, h.req.stable_prefix)
        for i, (start, end) in enumerate(plan):
            if h.gone:
                return p.finished("cancelled", trio.current_time())
            work = PrefillWork(self.index, self.seq, cached if i == 0 else None, list(prompt[start:end]),
                               end == len(prompt), gen)
            self._txn = PrefillTransaction(work)
            await self._txn.run(env.gpu_inbox)  # the GPU owner reports its PrefillProgress
            self._txn = None
            if work.reply.skipped:
                return p.finished("cancelled", trio.current_time())
            if work.reply.error is not None:
                err = work.reply.error
                return Failed(err.status, err.code, err.message)
            self.kv_tokens.extend(work.tokens)
            self.fsm.fire("prefilled" if work.final else "chunk_prefilled")
        await gen.ended.wait()  # the GPU owner's step loop decodes it and sends its terminal event
        self.kv_tokens.extend(gen.kv_tail)
        return None
