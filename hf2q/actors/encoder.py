"""The image-encode actor of a slot: each image of a prompt through the vision encoder, before its prefill.

An encode is GPU work like a prefill chunk, and just as bounded: the slot runs it as a series of
GPU transactions (``hf2q.engine.vision.encode_job``: a few vision blocks each), so the step loop's
decode steps for other slots take turns with them — the GPU owner's transactions run in arrival
order, and the step loop is always waiting for the next. Between two jobs the client is looked
at: one that left ends the encode (its partial state is dropped, nothing is cached). An image
that cannot be encoded fails its request alone. Encoded features are cached by image content
(the store's byte-bounded LRU), so a later request with the same image finds them and runs no
vision work. Each image's life is the ``image_encode`` machine.
"""

from __future__ import annotations

import collections
from typing import Any, Awaitable, Callable

from hf2q.sched.contracts import Failed
from hf2q.statemachines.base import Lifecycle
from hf2q.statemachines.image_encode import IMAGE_ENCODE

Transact = Callable[[Callable[[Any], Any], str], Awaitable[Any]]
#: what ``prepare`` returns when the client left mid-encode
CANCELLED = "cancelled"


def _names_images(prompt) -> bool:
    from hf2q.engine.vision.prompt_images import IMAGE_ID_BASE  # the id layout only (no MLX)

    return max(prompt, default=0) >= IMAGE_ID_BASE


def _plan(runner, seq, prompt, cached, restored):
    from hf2q.engine.vision.encode_job import plan_images  # runs in the engine thread

    return plan_images(runner, seq, prompt, cached, restored)


class ImageEncodeTransaction:
    """One image's encode: its jobs posted one at a time, the client looked at between them."""

    def __init__(self, job, handle):
        self.fsm = Lifecycle(IMAGE_ENCODE)
        self.job = job
        self.handle = handle  # the request it encodes for

    @property
    def state(self) -> str:
        return self.fsm.state

    async def run(self, transact: Transact) -> Failed | str | None:
        while True:
            if self.handle.gone:
                self.fsm.fire("client_gone")
                self.job = None  # the partial encode goes with it
                return CANCELLED
            step = await transact(self.job.step, "image encode")
            if step.outcome == "cached":
                self.fsm.fire("cache_hit")
                return None
            if step.outcome == "failed":
                self.fsm.fire("encode_failed")
                return Failed(step.status, "image_encode_failed", step.message)
            if step.outcome == "encoded":
                self.fsm.fire("finished")
                return None
            self.fsm.fire("started" if self.fsm.state == "queued" else "chunk_done")

    def engine_failed(self) -> None:
        if self.fsm.state in ("queued", "encoding"):
            self.fsm.fire("engine_failed")


class ImageEncoder:
    """A slot's image side: no GPU work for a prompt without images on a prefix of its own KV."""

    def __init__(self, transact: Transact):
        self._transact = transact
        self._serves_images: bool | None = None  # learnt from the runner's first answer
        self.outcomes: collections.Counter[str] = collections.Counter()  # final states, for the operator/tests
        self.current: ImageEncodeTransaction | None = None

    async def prepare(self, handle, seq, prompt: tuple[int, ...], cached: int,
                      restored: bool = False) -> Failed | str | None:
        """Encode the images ``prompt`` names past its ``cached`` tokens (and put the cached images'
        positions on ``seq``); None when the prefill may start, a ``Failed`` for the request, or
        ``CANCELLED`` when its client left. ``restored``: part of the cached prefix came from the
        persistent store, so ``seq``'s positions are set again even for a prompt without images."""
        if self._serves_images is False or not (restored or _names_images(prompt)):
            return None
        jobs = await self._transact(lambda runner: _plan(runner, seq, prompt, cached, restored), "image plan")
        self._serves_images = jobs is not None
        if jobs is None:
            return None
        if not isinstance(jobs, list):  # the prompt names an image no longer held
            return Failed(jobs.status, "image_encode_failed", jobs.message)
        for job in jobs:
            txn = self.current = ImageEncodeTransaction(job, handle)
            result = await txn.run(self._transact)  # EnginePoisoned: kept for engine_failed
            self.outcomes[txn.state] += 1
            self.current = None
            if result is not None:
                return result
        return None

    def engine_failed(self) -> None:
        if self.current is not None:
            self.current.engine_failed()
