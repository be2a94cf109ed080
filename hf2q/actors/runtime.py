"""The serving runtime's public face: ``open_runtime`` and the ``Runtime`` handle.

This is the only module the HTTP layer imports from ``hf2q.actors``. It starts the actor
system (supervisor, GPU owner, admission, one actor per slot) inside a nursery and hands
back a ``Runtime`` whose methods are safe to call from any trio task::

    async with open_runtime(lambda: MlxModelRunner(path), RuntimeConfig(slots=4)) as rt:
        events = await rt.submit(GenerationRequest("req-1", prompt_ids, params))
        async with events:                      # closing it cancels the request
            async for ev in events:             # Admitted, PrefillProgress*, Token*, then
                ...                             # exactly one Finished or Failed

Contract of the per-request channel (the HTTP side: docs/API.md):

- ``Admitted(slot, prompt_tokens, cached_tokens)`` once a slot is assigned (a queued
  request may wait for it), then ``PrefillProgress(done, total)`` after every prefill
  transaction (``done`` counts prompt positions now in the KV, cached ones included),
  ``Token`` per generated token, and exactly one terminal ``Finished`` or ``Failed``;
  the channel is closed right after the terminal event.
- ``Token.logprob`` is None for a plain greedy request that did not ask for logprobs (its
  token is the argmax, picked for the whole batch at once); otherwise the sampler's value.
- End-of-sequence and ``stop_token_ids`` tokens end the request with
  ``Finished("stop")`` and are *not* sent as ``Token``; ``max_tokens`` or a full
  per-slot context ends it with ``Finished("length")``.
- Closing the receive side cancels the request at the next GPU step boundary; its
  slot is freed exactly once. A reader that lets ``token_buffer`` undelivered events
  pile up is too slow: that request alone ends with ``Failed(503, "reader_too_slow")``
  (the terminal event always fits) and the other slots keep running.
- Failures of one request alone: sampling parameters its sampler refuses →
  ``Failed(400, "invalid_request")``; an exception while sampling →
  ``Failed(500, "sampling_failed")``. The engine stays healthy.
- After an engine fault or a GPU step that outlives ``gpu_deadline_s`` every active and
  queued request receives ``Failed(503, "engine_unhealthy", …)``; later submissions
  raise ``AdmissionRejected(503, "engine_unhealthy")``; ``readiness()`` is
  ``(False, detail)`` for good.
"""

from __future__ import annotations

import math
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import numpy as np
import trio

from hf2q.sched.contracts import (
    EmbeddingRequest,
    EventHook,
    GenerationRequest,
    RunnerFactory,
    RuntimeConfig,
    RuntimeSnapshot,
)

class Runtime:
    """Handle on a running actor system. Create it with ``open_runtime``."""

    def __init__(self, system):
        self._system = system

    async def submit(self, req: GenerationRequest) -> trio.MemoryReceiveChannel:
        """Queue ``req`` and return its event channel; raises ``AdmissionRejected``."""
        return await self._system.submit(req)

    async def embed(self, req: EmbeddingRequest) -> np.ndarray:
        """L2-normalised embeddings ``[len(req.inputs), dim]`` computed by the GPU owner."""
        return await self._system.embed(req)

    def readiness(self) -> tuple[bool, str]:
        """``(True, "ready")`` when generation can be admitted, else ``(False, why)``; never touches the engine."""
        return self._system.readiness()

    def snapshot(self) -> RuntimeSnapshot:
        """A consistent, cheap picture of every slot, the queue, KV bytes and counters."""
        return self._system.snapshot()

    async def drain(self, timeout: float = math.inf) -> bool:
        """Stop admitting (503 ``not_ready``) and wait for queued and running requests to end.

        Returns True when everything finished within ``timeout``; otherwise the
        remaining requests end with ``Failed(503, "not_ready", "server shutting down")``
        and False is returned.
        """
        return await self._system.drain(timeout)

    def add_event_hook(self, hook: EventHook) -> None:
        """Also call ``hook(request_id, event)`` for every event (see ``EventHook``)."""
        self._system.hooks.append(hook)

    async def wait_ready(self) -> bool:
        """Wait until the model is loaded (True) or the engine failed to load (False)."""
        return await self._system.wait_ready()

    @property
    def config(self) -> RuntimeConfig:
        return self._system.config

    @property
    def kv_store(self):
        """The persistent prefix KV store in use (None without one, or until an opener ran)."""
        return self._system.kv_store

    @property
    def runner_info(self) -> dict[str, Any]:
        """Static facts about the loaded model: vocab_size, n_ctx_train, kv_bytes_per_token,
        eos_token_ids, is_embedding_model, ctx (effective per-slot context). Empty before ready."""
        return dict(self._system.runner_info)


@asynccontextmanager
async def open_runtime(runner_factory: RunnerFactory, config: RuntimeConfig = RuntimeConfig(), *,
                       kv_store=None, kv_store_opener=None, engine_thread=None) -> AsyncIterator[Runtime]:
    """Start the actor system; yield a ``Runtime`` at once (the model loads in the background).

    ``readiness()`` turns true when ``runner_factory()`` returned inside the GPU-owner
    thread. Leaving the block cancels every actor: requests still running get
    ``Failed(503, "not_ready", "server shutting down")``. Call ``drain`` first for a
    graceful stop. ``kv_store`` is an ``hf2q.kvstore`` store for persistent prefix KV; or
    ``kv_store_opener(kv_identity) -> store`` opens one once the model is loaded, keyed by the
    runner's ``kv_identity`` (backend, device, KV dtype), and closes it when the runtime ends.
    ``engine_thread(factory, trio_token)`` makes the engine thread (default: a thread of its own;
    a several-model server passes ``SharedEngineThread.lane`` so every model shares one).
    """
    from hf2q.actors.system import ActorSystem

    system = ActorSystem(runner_factory, config, kv_store=kv_store, kv_store_opener=kv_store_opener,
                         engine_thread=engine_thread)
    failure: BaseException | None = None
    async with trio.open_nursery() as nursery:
        await nursery.start(system.run)
        try:
            yield Runtime(system)
        except BaseException as e:  # re-raised below, unwrapped by the nursery's exception group
            failure = e
        await system.shutdown()
        nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure
