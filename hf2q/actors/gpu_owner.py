"""The GPU-owner actor: the only engine caller, one transaction at a time, under a deadline.

Trio side of ``EngineThread``. ``transact(job)`` runs one GPU transaction and arms the
supervisor's deadline on it; an exception or an expired deadline poisons the engine
(``Supervisor.poison``) and raises ``EnginePoisoned`` — no further job is ever submitted.

``run_steps`` is the step loop: slots post ``PrefillWork``; every step batches the decode of
every running ``DecodeRun`` into one ``runner.decode`` and runs at most one prefill
transaction, chosen round-robin by the pure ``StepPlanner`` (SPEC §5). A run stays in the
loop's table from its first token to its last, so the next step is submitted as soon as the
previous one returns — before any slot or HTTP task handles the tokens — and the engine
thread does not idle through a trio round trip per token. Sampling happens in the thread,
right after the logits (the plain greedy rows of a batch in one vectorised argmax).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable

import numpy as np
import outcome
import trio

from hf2q.actors.decode_pipeline import DecodePipeline
from hf2q.actors.engine_thread import EngineThread
from hf2q.actors.messages import (
    ENDED,
    SKIPPED,
    DecodeRun,
    Leave,
    PrefillWork,
    Sampled,
    SampleError,
)
from hf2q.errors import InputError
from hf2q.sched.planner import StepPlanner
from hf2q.statemachines.base import Lifecycle
from hf2q.statemachines.gpu_owner import GPU_OWNER

log = logging.getLogger("hf2q.gpu")

#: how often a pending transaction of a multi-process runner checks that every rank is alive
PEER_POLL_S = 0.5


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


def plain_greedy(sampler, constraint) -> bool:
    """True when ``sampler`` would return the argmax of the raw logits: the engine's ``Sampler`` at
    temperature 0 with no bias, penalty, constraint or logprobs. Such rows skip its float64 pass
    over the vocabulary (~0.4 ms a row); their ``Sampled.logprob`` is None (nobody asked for it)."""
    mod = sys.modules.get("hf2q.engine.sampler")  # no Sampler exists before that module is imported
    if constraint is not None or mod is None or type(sampler) is not mod.Sampler:
        return False
    p = sampler.params
    return (p.temperature == 0.0 and not p.logprobs and not p.logit_bias and p.repetition_penalty == 1.0
            and not p.frequency_penalty and not p.presence_penalty)


def sample_rows(works, logits) -> list[Sampled | SampleError]:
    """One sampled token per row of ``logits`` for ``works`` (decode runs), in order."""
    logits = np.asarray(logits)
    out: list = [None] * len(works)
    fast = [i for i, w in enumerate(works) if plain_greedy(w.sampler, w.constraint)]
    if fast:
        rows = logits if len(fast) == len(works) else logits[fast]  # no copy of a whole [N, vocab] batch
        picked = np.argmax(rows, axis=1)
        finite = np.isfinite(rows[np.arange(len(fast)), picked])
        for i, tok, ok in zip(fast, picked.tolist(), finite.tolist()):
            if ok:  # a non-finite best logit: the sampler reports it (an error of this request)
                out[i] = Sampled(int(tok), None, ())
    for i, w in enumerate(works):
        if out[i] is None:
            out[i] = guarded_sample(w, logits[i])
    return out


def run_step(runner, decode: list[DecodeRun], tokens: list[int], prefill: PrefillWork | None,
             pipeline: DecodePipeline | None = None) -> dict[int, Any]:
    """One decode-first mixed step, in the GPU thread: slot → Sampled | SampleError | None.

    Every run of ``decode`` is fed its token of ``tokens`` in one batched ``runner.decode``
    — or, when ``pipeline`` can serve the batch (MLX graph, device-sampled rows), through the
    step it queued last time, queueing the next one before this one is read. A runner with
    ``decode_with_prefill`` takes the decode and the prefill chunk as one call (the CPU host
    step runs both as rows of one pass over the weights).
    Errors raised by the runner propagate (they poison the engine).
    """
    results: dict[int, Any] = {}
    pipelined = pipeline is not None and bool(decode) and pipeline.usable(runner, decode)
    if pipeline is not None and not pipelined:
        pipeline.settle()
    if prefill is not None and prefill.keep is not None:
        prefill.seq.trim(prefill.keep)  # its own cache: no decode row of this step reads it
    prefill_logits = None
    if pipelined:
        for r, res in zip(decode, pipeline.step(runner, decode, tokens)):
            results[r.slot] = res
    elif decode:
        seqs = [r.seq for r in decode]
        if prefill is not None and hasattr(runner, "decode_with_prefill"):
            logits, prefill_logits = runner.decode_with_prefill(seqs, tokens, prefill.seq, prefill.tokens)
        else:
            logits = runner.decode(seqs, tokens)
        for r, res in zip(decode, sample_rows(decode, logits)):
            results[r.slot] = res
    if prefill is not None:
        if prefill_logits is None:
            prefill_logits = runner.prefill(prefill.seq, prefill.tokens)
        results[prefill.slot] = guarded_sample(prefill, prefill_logits) if prefill.final else None
    return results


def _after_settling(pipeline: DecodePipeline, job: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def settled_job(runner):
        pipeline.settle()
        return job(runner)
    return settled_job


def post(run: DecodeRun, outcome_) -> None:
    """Hand a step's outcome to the run's slot; a slot that already ended has closed its side."""
    try:
        run.outbox.send_nowait(outcome_)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


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
        # touched only by jobs in the engine thread; HF2Q_NO_DECODE_PIPELINE=1 keeps blocking steps
        self.pipeline = None if os.environ.get("HF2Q_NO_DECODE_PIPELINE") else DecodePipeline()
        self.dead_peer: Callable[[], str | None] | None = None

    # ---- loading and single transactions ----------------------------------------------

    @property
    def state(self) -> str:
        """The current state of this actor's machine."""
        return self.fsm.state

    @property
    def busy_s(self) -> float:
        """Seconds the engine thread has spent running transactions (read at any time)."""
        return self._thread.busy_s if self._thread is not None else 0.0

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
        # a runner over several processes says when one of them died (polled from trio: thread-safe)
        self.dead_peer = getattr(box[0].value, "dead_peer", None)
        return box[0].value

    async def transact(self, job: Callable[[Any], Any], what: str) -> Any:
        """Run ``job(runner)`` in the engine thread as one guarded GPU transaction.

        Transactions run one at a time, in arrival order. If the caller is cancelled while its
        job runs (a running MLX step cannot be interrupted), the job stays on the books and the
        next transaction first waits for it — still under its deadline.
        """
        try:  # a free lock is taken without a checkpoint, so the job reaches the thread before
            self._lock.acquire_nowait()  # any other trio task runs (the step loop relies on it)
        except trio.WouldBlock:
            await self._lock.acquire()
        try:
            if self._pending is not None:
                await self._settle(self._pending)
            if self.fsm.state != "idle":
                raise EnginePoisoned(self._supervisor.detail)
            pending = _Pending(what, trio.current_time())
            self.fsm.fire("transaction_submitted")
            self._pending = pending
            if self.pipeline is not None and what != "step":
                job = _after_settling(self.pipeline, job)  # other jobs see caches holding only fed tokens
            self._thread.submit(job, pending.finished)
            return await self._settle(pending)
        finally:
            self._lock.release()

    async def _settle(self, p: "_Pending") -> Any:
        limit = self._supervisor.deadline_s  # the supervisor arms every transaction
        deadline = p.started + limit if limit is not None else float("inf")
        dead = None
        with trio.move_on_at(deadline):
            if self.dead_peer is None:
                await p.done.wait()
            else:  # a tensor-parallel group: a rank that died leaves NCCL waiting until the deadline
                while not p.done.is_set() and dead is None:
                    with trio.move_on_after(PEER_POLL_S):
                        await p.done.wait()
                    dead = None if p.done.is_set() else self.dead_peer()
        self._pending = None
        if p.result is None and dead is not None:
            self.fsm.fire("faulted")
            self._supervisor.poison(f"GPU {p.what} cannot finish: {dead}")
            raise EnginePoisoned(self._supervisor.detail)
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
        decoding: dict[int, DecodeRun] = {}  # running requests: in every step until they end
        prefill: dict[int, PrefillWork] = {}

        def drop_run(slot: int) -> None:
            run = decoding.pop(slot, None)
            if run is not None:
                post(run, SKIPPED)

        def take(msg) -> None:
            if isinstance(msg, PrefillWork):
                drop_run(msg.slot)  # never both on one slot: its Leave came first, this is a safeguard
                prefill[msg.slot] = msg
            elif isinstance(msg, Leave):
                drop_run(msg.slot)
            else:
                raise TypeError(f"unexpected message {msg!r}")

        while True:
            if not (decoding or prefill):
                take(await self._inbox.receive())
            while True:  # whatever else is already posted joins this step
                try:
                    take(self._inbox.receive_nowait())
                except trio.WouldBlock:
                    break
            for slot in [s for s, r in decoding.items() if r.is_gone()]:  # cancellation: at the boundary
                drop_run(slot)
            for slot in [s for s, w in prefill.items() if w.is_gone()]:  # left before the step: no GPU work
                prefill.pop(slot).reply.set(skipped=True)
            if not (decoding or prefill):
                continue
            step = self.planner.plan(decoding, prefill)
            batch = [decoding[s] for s in step.decode]
            tokens = [r.token for r in batch]
            chunk = prefill.pop(step.prefill) if step.prefill is not None else None
            if chunk is not None and chunk.on_picked is not None:
                chunk.on_picked()
            results = await self.transact(
                lambda runner, batch=batch, tokens=tokens, chunk=chunk: run_step(runner, batch, tokens, chunk,
                                                                                 self.pipeline), "step")
            self.stats["gpu_steps"] += 1
            if batch:
                self.stats["decode_batches"] += 1
                self.stats["decode_batch_tokens"] += len(batch)
            if chunk is not None:
                self.stats["prefill_transactions"] += 1
            # only book-keeping here, no checkpoint: the loop submits the next step before any slot
            # or HTTP task runs; the slots read their outboxes while the engine computes
            for run in batch:
                r = results[run.slot]
                run.resident += 1  # the fed token is in the KV now
                post(run, r)
                if not self._advance(run, r):
                    decoding.pop(run.slot, None)
                    post(run, ENDED)
            if chunk is not None:
                r = results.get(chunk.slot)
                if isinstance(r, SampleError):
                    chunk.reply.set(error=r)
                else:
                    chunk.reply.set(r)
                if chunk.final and chunk.run is not None and self._advance(chunk.run, r):
                    decoding[chunk.slot] = chunk.run

    @staticmethod
    def _advance(run: DecodeRun, result) -> bool:
        """Make ``result``'s token the one ``run`` feeds next; False when the request ends with it
        (the same ``DecodeLimits`` verdict the slot reaches) or sampling failed."""
        if not isinstance(result, Sampled):
            return False
        tok = result.token_id
        if run.limits.after_token(tok, run.emitted, run.resident) is not None:
            return False
        run.emitted += 1
        run.history.append(tok)
        run.token = tok
        return True
