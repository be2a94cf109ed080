"""The GPU-owner actor: the only engine caller, one transaction at a time, under a deadline.

Trio side of ``EngineThread``. ``transact(job)`` runs one GPU transaction and arms the
supervisor's deadline on it; an exception or an expired deadline poisons the engine
(``Supervisor.poison``) and raises ``EnginePoisoned`` — no further job is ever submitted.

``run_steps`` is the step loop and the one owner of a running request's tokens, in three
phases per step: *schedule* (take the slots' ``PrefillWork``, drop requests whose client
left, let the pure ``StepPlanner`` pick the decode batch and at most one prefill chunk),
*run* (one GPU transaction: every running request's decode batched into one
``runner.decode``, sampling in the thread right after the logits), *postprocess* (per
request: the stop rule ``DecodeLimits.after_token``, the ``Token`` or terminal event sent
straight to the request's channel, the token fed to the next step). Postprocessing has no
checkpoint, so the next step is submitted before any slot or HTTP task runs and the
engine thread does not idle through a trio round trip per token.
"""

from __future__ import annotations

import collections
import logging
import os
from typing import Any, Callable

import attrs
import outcome
import trio

from hf2q.actors.engine_thread import EngineThread
from hf2q.actors.messages import Generation, PrefillWork
from hf2q.actors.supervisor import EnginePoisoned
from hf2q.engine.decode_pipeline import DecodePipeline
from hf2q.engine.sampling import Sampler
from hf2q.engine.sampling.rows import Sampled, SampleError
from hf2q.engine.speculative import MtpDrafter, NgramDrafter
from hf2q.engine.step import Drafted, run_step
from hf2q.sched.contracts import Failed, PrefillProgress, Token
from hf2q.sched.planner import StepPlanner
from hf2q.statemachines.base import Lifecycle
from hf2q.statemachines.gpu_owner import GPU_OWNER

log = logging.getLogger("hf2q.gpu")

#: how often a pending transaction of a multi-process runner checks that every rank is alive
PEER_POLL_S = 0.5
#: how long shutdown waits for the engine thread of a poisoned engine (``wait_stopped``)
POISONED_STOP_WAIT_S = 3.0


def make_sampler(params):
    """The request's host sampler (a ``hf2q.engine.sampling`` chain, built in trio before any GPU work)."""
    return Sampler(params)


@attrs.define(eq=False)
class RunningRequest:
    """A request's token state, owned by the step loop from its first chunk to its terminal event.

    ``emitted`` / ``resident`` are the counts ``DecodeLimits.after_token`` needs; ``history``
    is what the sampler's penalties see; ``token`` is fed by the next step. Only the GPU
    owner's trio task writes these, between steps, when the engine thread is not reading them.
    """

    gen: Generation
    seq: Any
    sampler: Any
    constraint: Any
    history: list[int] = attrs.Factory(list)
    resident: int = 0  # tokens in the slot's KV
    emitted: int = 0
    token: int | None = None
    drafter: NgramDrafter | MtpDrafter | None = None  # when it decodes speculatively

    @property
    def slot(self) -> int:
        return self.gen.slot


def _run_once(then: Callable[[], None] | None) -> None:
    """Call ``then`` if given; returns None (so the caller's ``then`` is spent)."""
    if then is not None:
        then()


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
    def __init__(self, runner_factory: Callable[[], Any], supervisor, n_slots: int, draft_tokens: int = 0,
                 make_thread: Callable[..., Any] | None = None):
        # (factory, trio token) -> the engine thread: its own, or a lane of one shared by several models
        self._make_thread = make_thread or EngineThread
        self.fsm = Lifecycle(GPU_OWNER)
        self._factory = runner_factory
        self._supervisor = supervisor
        self._lock = trio.Lock()
        self._pending: _Pending | None = None
        self._thread: EngineThread | None = None
        self.planner = StepPlanner(n_slots)
        self.counters: collections.Counter[str] = collections.Counter()
        self._notices: list = []  # (handle, event) whose hooks run once the next step is submitted
        self.inbox_send, self._inbox = trio.open_memory_channel(float("inf"))
        # touched only by jobs in the engine thread; HF2Q_NO_DECODE_PIPELINE=1 keeps blocking steps
        self.pipeline = None if os.environ.get("HF2Q_NO_DECODE_PIPELINE") else DecodePipeline()
        self.dead_peer: Callable[[], str | None] | None = None
        self._stopped_loading = False  # stop() came while the thread was still loading the model
        self.draft_tokens = draft_tokens  # set to 0 at load when the runner cannot verify drafts
        self.mtp = False  # drafts come from the model's MTP head (``runner.drafts``), made in the engine thread

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

        self._thread = self._make_thread(self._factory, trio.lowlevel.current_trio_token())
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
        runner = box[0].value
        if self.draft_tokens and not (hasattr(runner, "verify") and getattr(runner, "rolls_back_drafts", True)):
            # a sliding window cannot be cut back inside a verified draft yet (nor a runner without verify)
            log.warning("speculative decoding is off: %s cannot verify drafts in the server", type(runner).__name__)
            self.draft_tokens = 0
        self.mtp = bool(self.draft_tokens and getattr(runner, "drafts", False))
        return runner

    async def transact(self, job: Callable[[Any], Any], what: str, then: Callable[[], None] | None = None) -> Any:
        """Run ``job(runner)`` in the engine thread as one guarded GPU transaction.

        Transactions run one at a time, in arrival order. If the caller is cancelled while its
        job runs (a running MLX step cannot be interrupted), the job stays on the books and the
        next transaction first waits for it — still under its deadline. ``then()`` runs right
        after the job reached the thread, or earlier when the job must wait for another one;
        always before this task first yields.
        """
        try:  # a free lock is taken without a checkpoint, so the job reaches the thread before
            self._lock.acquire_nowait()  # any other trio task runs (the step loop relies on it)
        except trio.WouldBlock:
            then = _run_once(then)  # whatever waits on ``then`` must not wait for another job
            await self._lock.acquire()
        try:
            if self._pending is not None:
                then = _run_once(then)
                await self._settle(self._pending)
            if self.fsm.state != "idle":
                raise EnginePoisoned(self._supervisor.detail)
            pending = _Pending(what, trio.current_time())
            self.fsm.fire("transaction_submitted")
            self._pending = pending
            if self.pipeline is not None and what != "step":
                job = self.pipeline.settled(job)  # other jobs see caches holding only fed tokens
            self._thread.submit(job, pending.finished)
            if then is not None:
                then()
            return await self._settle(pending)
        finally:
            self._lock.release()

    async def _settle(self, p: "_Pending") -> Any:
        limit = self._supervisor.deadline_s  # the supervisor arms every transaction
        deadline = p.started + limit if limit is not None else float("inf")
        dead = None
        # a thread shared by several models (actors/shared_engine.py): while the job still waits
        # behind another model's, its own time has not begun and the deadline moves with it
        queued = getattr(self._thread, "queued", None)
        polled = self.dead_peer is not None or queued is not None
        while not p.done.is_set():
            with trio.move_on_at(min(deadline, trio.current_time() + PEER_POLL_S) if polled else deadline):
                await p.done.wait()
            if p.done.is_set():
                break
            if self.dead_peer is not None:  # a tensor-parallel group: a rank that died leaves NCCL waiting
                dead = self.dead_peer()
                if dead is not None:
                    break
            if queued is not None and limit is not None and queued(limit):
                deadline = trio.current_time() + limit
            if trio.current_time() >= deadline:
                break
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
        self._stopped_loading = self.fsm.state == "loading"
        if self.fsm.state in ("loading", "idle", "busy"):
            self.fsm.fire("shut_down")

    async def wait_stopped(self, limit_s: float) -> bool:
        """After :meth:`stop`: wait (at most ``limit_s``) until the engine thread has finished the job it
        was running and its queued device work (``EngineThread.exited``) — the process must not exit
        under a running engine call. A thread still loading the model is not waited for; one of a
        poisoned engine only briefly (``POISONED_STOP_WAIT_S``): its fault has usually returned already
        and it only has to leave, but its job may also be hung, or wait on a dead rank. Whether the
        thread is done."""
        thread = self._thread
        if thread is None or thread.exited.is_set():
            return True
        if self._stopped_loading:
            return False
        if self._supervisor.poisoned:
            limit_s = min(limit_s, POISONED_STOP_WAIT_S)
        pause = 0.001  # a job is usually over within milliseconds: look often first
        with trio.CancelScope(deadline=trio.current_time() + limit_s, shield=True):  # also in a cancelled exit
            while not thread.exited.is_set():
                await trio.sleep(pause)
                pause = min(2 * pause, 0.02)
        return thread.exited.is_set()

    # ---- the step loop ---------------------------------------------------------------

    async def run_steps(self) -> None:
        decoding: dict[int, RunningRequest] = {}  # running requests: in every step until they end
        prefill: dict[int, PrefillWork] = {}
        starting: dict[int, RunningRequest] = {}  # prefilling requests, their sampler ready

        def take(msg) -> None:
            if not isinstance(msg, PrefillWork):
                raise TypeError(f"unexpected message {msg!r}")
            if msg.keep is not None:  # a request's first chunk: its sampler is built before any GPU work
                try:
                    starting[msg.slot] = self._start(msg)
                except Exception as e:  # noqa: BLE001 — bad parameters fail this request only
                    msg.reply.set(error=SampleError(400, "invalid_request", f"invalid sampling parameters: {e}"))
                    return
            prefill[msg.slot] = msg

        while True:
            # ---- schedule
            if not (decoding or prefill):
                self._notify()
                take(await self._inbox.receive())
            while True:  # whatever else is already posted joins this step
                try:
                    take(self._inbox.receive_nowait())
                except trio.WouldBlock:
                    break
            for slot in [s for s, r in decoding.items() if r.gen.handle.gone]:  # cancellation: at the boundary
                self._end(decoding.pop(slot), "cancelled")
            for slot in [s for s, w in prefill.items() if w.generation.handle.gone]:  # no GPU work for it
                starting.pop(slot, None)
                prefill.pop(slot).reply.set(skipped=True)
            if not (decoding or prefill):
                continue
            step = self.planner.plan(decoding, prefill)
            batch = [decoding[s] for s in step.decode]
            tokens = [r.token for r in batch]
            draft = self._draft(batch[0]) if len(batch) == 1 else None
            chunk = prefill.pop(step.prefill) if step.prefill is not None else None
            first = starting.pop(chunk.slot) if chunk is not None and chunk.final else None
            if chunk is not None and chunk.on_picked is not None:
                chunk.on_picked()
            # ---- run
            results = await self.transact(
                lambda runner, batch=batch, tokens=tokens, chunk=chunk, first=first, draft=draft: run_step(
                    runner, batch, tokens, chunk, self.pipeline, first, draft), "step", self._notify)
            self._count(batch, chunk)
            # ---- postprocess: book-keeping only, no checkpoint until the next step is submitted
            for run in batch:
                if not self._postprocess_step(run, results[run.slot]):
                    del decoding[run.slot]
            if chunk is not None:
                self._prefilled(chunk)
                if first is not None and self._postprocess(first, results.get(chunk.slot)):
                    decoding[chunk.slot] = first

    def _start(self, work: PrefillWork) -> RunningRequest:
        req = work.generation.handle.req
        params = req.params
        # drafts are verified only where the acceptance rule is all there is: no constraint to
        # advance token by token, no per-token logprobs to report
        drafter = None
        if self.draft_tokens and params.constraint is None and not params.logprobs:
            drafter = MtpDrafter(None, work.seq) if self.mtp else NgramDrafter(req.prompt_tokens)
        return RunningRequest(work.generation, work.seq, make_sampler(params), params.constraint,
                              resident=work.generation.prompt_len, drafter=drafter)  # once its last chunk is in

    def _draft(self, run: RunningRequest):
        """The tokens to verify after ``run``'s fed token this step, if any — or, for MTP drafts, the
        call that makes them in the engine thread (``run_step`` takes either)."""
        if run.drafter is None:
            return None
        lim = run.gen.limits
        room = min(self.draft_tokens, lim.max_tokens - run.emitted - 1, lim.ctx - run.resident - 2)
        if room <= 0:
            return None
        if isinstance(run.drafter, MtpDrafter):
            return lambda runner, drafter=run.drafter: drafter.draft(runner, room)
        return run.drafter.propose(room) or None

    def _postprocess_step(self, run: RunningRequest, result) -> bool:
        """A decode run's step result: one sampled token, or a verified draft's accepted tokens."""
        if not isinstance(result, Drafted):
            run.resident += 1  # the fed token is in the KV now
            run.gen.progress.resident_tokens = run.resident
            return self._postprocess(run, result)
        self.counters["drafted_tokens"] += result.drafted
        self.counters["accepted_draft_tokens"] += len(result.tokens) - 1
        for tok in result.tokens:  # each was fed (or is the next to feed) in this order
            run.resident += 1
            run.gen.progress.resident_tokens = run.resident
            if not self._postprocess(run, Sampled(tok, None, ())):
                return False
        return True

    def _count(self, batch: list, chunk) -> None:
        self.counters["gpu_steps"] += 1
        if batch:
            self.counters["decode_batches"] += 1
            self.counters["decode_batch_tokens"] += len(batch)
        if chunk is not None:
            self.counters["prefill_transactions"] += 1

    def _prefilled(self, chunk: PrefillWork) -> None:
        """The chunk is in the slot's KV: its progress, then the slot's reply."""
        gen, now = chunk.generation, trio.current_time()
        p = gen.progress
        p.prefilled_tokens += len(chunk.tokens)
        p.prefill_seconds += now - chunk.posted_at
        p.resident_tokens = p.cached_tokens + p.prefilled_tokens
        gen.handle.emit(PrefillProgress(p.resident_tokens, gen.prompt_len), self._notices)
        chunk.reply.set()

    def _postprocess(self, run: RunningRequest, result) -> bool:
        """Apply ``result`` (the request's freshly sampled token) to its request; False once the
        request ended with it. The stop rule runs here and nowhere else."""
        gen = run.gen
        if not isinstance(result, Sampled):
            err = result if isinstance(result, SampleError) else SampleError(500, "sampling_failed", "no token")
            return self._end(run, Failed(err.status, err.code, err.message))
        tok = result.token_id
        verdict = gen.limits.after_token(tok, run.emitted, run.resident)
        if verdict == "stop":  # end-of-generation / stop id: not sent
            return self._end(run, "stop")
        if not gen.handle.emit(Token(tok, result.logprob, result.top_logprobs), self._notices):
            return self._end(run, "cancelled")
        gen.progress.token_sent(trio.current_time())
        run.emitted += 1
        if verdict == "length":  # max_tokens, or no room left in the context
            return self._end(run, "length")
        run.history.append(tok)
        if run.drafter is not None:
            run.drafter.append(tok)
        run.token = tok
        return True

    def _notify(self) -> None:
        """Run the event hooks of the events sent since the last step was submitted."""
        notices, self._notices = self._notices, []
        for handle, event in notices:
            handle.notify(event)

    def _end(self, run: RunningRequest, terminal) -> bool:
        """Send the request's terminal event and hand the slot back what its KV now holds."""
        gen = run.gen
        if isinstance(terminal, str):
            terminal = gen.progress.finished(terminal, trio.current_time())
        gen.handle.finish(terminal, self._notices)  # no effect if it already ended (reader too slow)
        gen.kv_tail = run.history[:max(run.resident - gen.prompt_len, 0)]
        gen.ended.set()
        return False
