"""The GPU-owner actor: the only engine caller, one transaction at a time, under a deadline.

Trio side of ``EngineThread``. ``transact(job)`` runs one GPU transaction and arms the
supervisor's deadline on it; an exception or an expired deadline poisons the engine
(``Supervisor.poison``) and raises ``EnginePoisoned`` — no further job is ever submitted.

``run_steps`` is the step loop: slots post ``DecodeWork`` / ``PrefillWork``; every step
batches all posted decodes into one ``runner.decode`` and runs at most one prefill
transaction, chosen round-robin by the pure ``StepPlanner`` (SPEC §5). After a step the
loop waits until every slot it served has answered (next work or ``Leave``), so each
decoding slot is in every batch. Sampling happens in the thread, right after the logits.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np
import outcome
import trio

from hf2q.actors.engine_thread import EngineThread
from hf2q.actors.messages import DecodeWork, Leave, PrefillWork, SampleError, Sampled
from hf2q.errors import InputError
from hf2q.sched.planner import StepPlanner
from hf2q.statemachines.base import Lifecycle
from hf2q.statemachines.gpu_owner import GPU_OWNER

log = logging.getLogger("hf2q.gpu")


class EnginePoisoned(Exception):
    """The engine faulted or hung; no GPU work will run again."""


def sample(sampler, constraint, logits: np.ndarray, history: list[int]) -> Sampled:
    """Pick the next token (runs in the GPU thread, right after the forward)."""
    mask = None
    if constraint is not None:  # hf2q.text's constraint objects: allowed_mask() (or allowed(history))
        mask = constraint.allowed_mask() if hasattr(constraint, "allowed_mask") else constraint.allowed(history)
    token, logprob, top = sampler.sample(np.asarray(logits, dtype=np.float32), history, mask)
    if constraint is not None:
        constraint.advance(int(token))
    return Sampled(int(token), None if logprob is None else float(logprob),
                   tuple((int(t), float(p)) for t, p in (top or ())))


def guarded_sample(work, logits) -> Sampled | SampleError:
    """``sample`` for one request; its failure is that request's alone (the engine is fine)."""
    try:
        return sample(work.sampler, work.constraint, logits, work.history)
    except InputError as e:  # e.g. a logit_bias id outside the vocabulary, everything masked
        return SampleError(400, "invalid_request", str(e))
    except Exception as e:  # noqa: BLE001
        return SampleError(500, "sampling_failed", f"sampling failed: {type(e).__name__}: {e}")


def run_step(runner, decode: list[DecodeWork], prefill: PrefillWork | None) -> dict[int, Any]:
    """One decode-first mixed step, in the GPU thread: slot → Sampled | SampleError | None.

    Errors raised by the runner propagate (they poison the engine).
    """
    results: dict[int, Any] = {}
    if decode:
        logits = runner.decode([w.seq for w in decode], [w.token for w in decode])
        for w, row in zip(decode, logits):
            results[w.slot] = guarded_sample(w, row)
    if prefill is not None:
        if prefill.keep is not None:
            prefill.seq.trim(prefill.keep)
        logits = runner.prefill(prefill.seq, prefill.tokens)
        results[prefill.slot] = guarded_sample(prefill, logits) if prefill.final else None
    return results


class _Pending:
    """One submitted GPU transaction, until its outcome is taken."""

    def __init__(self, what: str, started: float):
        self.what = what
        self.started = started
        self.done = trio.Event()
        self.result: outcome.Outcome | None = None

    def finished(self, result: outcome.Outcome) -> None:  # called in trio by the engine thread
        self.result = result
        self.done.set()


class GpuOwner:
    def __init__(self, runner_factory: Callable[[], Any], supervisor, n_slots: int, stats: dict[str, int]):
        self.fsm = Lifecycle(GPU_OWNER)
        self._factory = runner_factory
        self._supervisor = supervisor
        self._lock = trio.Lock()
        self._pending: _Pending | None = None
        self._thread: EngineThread | None = None
        self.planner = StepPlanner(n_slots)
        self.stats = stats
        self.inbox_send, self._inbox = trio.open_memory_channel(float("inf"))

    # ---- loading and single transactions ----------------------------------------------

    @property
    def state(self) -> str:
        """The current state of this actor's machine."""
        return self.fsm.state

    async def load(self) -> Any:
        """Start the thread and wait for ``runner_factory()`` (deadline applies); returns the runner."""
        done = trio.Event()
        box: list[outcome.Outcome] = []

        def loaded(result):
            box.append(result)
            done.set()

        self._thread = EngineThread(self._factory, trio.lowlevel.current_trio_token())
        self.fsm.fire("thread_started")
        self._thread.start(loaded)
        await done.wait()  # loading a big model may legitimately take long: no deadline here
        if isinstance(box[0], outcome.Error):
            err = box[0].error
            self.fsm.fire("faulted")
            self._supervisor.poison(f"model failed to load: {type(err).__name__}: {err}")
            raise EnginePoisoned(str(err))
        self.fsm.fire("loaded")
        return box[0].value

    async def transact(self, job: Callable[[Any], Any], what: str) -> Any:
        """Run ``job(runner)`` in the engine thread as one guarded GPU transaction.

        Transactions run one at a time, in arrival order. If the caller is cancelled while its
        job runs (a running MLX step cannot be interrupted), the job stays on the books and the
        next transaction first waits for it — still under its deadline.
        """
        async with self._lock:
            if self._pending is not None:
                await self._settle(self._pending)
            if self.fsm.state != "idle":
                raise EnginePoisoned(self._supervisor.detail)
            pending = _Pending(what, trio.current_time())
            self.fsm.fire("transaction_submitted")
            self._pending = pending
            self._thread.submit(job, pending.finished)
            return await self._settle(pending)

    async def _settle(self, p: "_Pending") -> Any:
        limit = self._supervisor.deadline_s  # the supervisor arms every transaction
        deadline = p.started + limit if limit is not None else float("inf")
        with trio.move_on_at(deadline):
            await p.done.wait()
        self._pending = None
        if p.result is None:
            self.fsm.fire("deadline_expired")
            self._supervisor.poison(f"GPU {p.what} did not finish within {limit:g} s (engine hung)",
                                    hung=True)
            raise EnginePoisoned(self._supervisor.detail)
        if isinstance(p.result, outcome.Error):
            err = p.result.error
            self.fsm.fire("faulted")
            log.error("engine fault during %s: %s: %s", p.what, type(err).__name__, err)
            self._supervisor.poison(f"engine fault during {p.what}: {type(err).__name__}: {err}")
            raise EnginePoisoned(self._supervisor.detail)
        self.fsm.fire("transaction_completed")
        return p.result.value

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.stop()
        if self.fsm.state in ("loading", "idle", "busy"):
            self.fsm.fire("shut_down")

    # ---- the step loop ---------------------------------------------------------------

    async def run_steps(self) -> None:
        decode: dict[int, DecodeWork] = {}
        prefill: dict[int, PrefillWork] = {}
        expected: set[int] = set()  # slots served by the last step that have not answered yet

        def take(msg) -> None:
            expected.discard(msg.slot)
            if isinstance(msg, DecodeWork):
                decode[msg.slot] = msg
            elif isinstance(msg, PrefillWork):
                prefill[msg.slot] = msg
            elif not isinstance(msg, Leave):
                raise TypeError(f"unexpected message {msg!r}")

        while True:
            while expected or not (decode or prefill):
                take(await self._inbox.receive())
            while True:  # whatever else is already posted joins this step
                try:
                    take(self._inbox.receive_nowait())
                except trio.WouldBlock:
                    break
            for table in (decode, prefill):  # clients that left before the step: no GPU work
                for slot in [s for s, w in table.items() if w.is_gone()]:
                    table.pop(slot).reply.set(skipped=True)
                    expected.add(slot)
            if not (decode or prefill):
                continue
            step = self.planner.plan(decode, prefill)
            batch = [decode.pop(s) for s in step.decode]
            chunk = prefill.pop(step.prefill) if step.prefill is not None else None
            if chunk is not None and chunk.on_picked is not None:
                chunk.on_picked()
            results = await self.transact(lambda runner: run_step(runner, batch, chunk), "step")
            self.stats["gpu_steps"] += 1
            if batch:
                self.stats["decode_batches"] += 1
                self.stats["decode_batch_tokens"] += len(batch)
            if chunk is not None:
                self.stats["prefill_transactions"] += 1
            for w in (*batch, *([chunk] if chunk else [])):
                r = results.get(w.slot)
                if isinstance(r, SampleError):
                    w.reply.set(error=r)
                else:
                    w.reply.set(r)
                expected.add(w.slot)
