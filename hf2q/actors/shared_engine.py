"""One engine thread for several models: each model's GPU owner drives a *lane* of it.

A several-model server keeps the rule of ``engine_thread.py`` — one thread calls the engine
— across models: every model's runner is built, called and dropped by the same thread, in
the order the jobs arrive. Two consequences the registry relies on: models never run GPU
work at the same time (their steps interleave), and an evicted model's runner is released
before the next model's load, queued behind it, starts allocating.

A lane has ``EngineThread``'s interface (``start``, ``submit``, ``stop``, ``ident``,
``busy_s``, ``exited``) plus ``queued(limit)``: a model's transaction may wait behind another
model's job (a load included), and the GPU owner's deadline counts only from when the job
begins — unless the job ahead is itself past the deadline (hung), which then fails every
model in time. The price of sharing: models take turns, and a hung job stops every model.
"""

from __future__ import annotations

import gc
import queue
import sys
import threading
import time
from typing import Any, Callable

import outcome
import trio

from hf2q.actors.engine_thread import THREAD_NAME, Job, Reply, finish_device_work, run_timed, send_reply


class EngineLane:
    """One model's view of the shared thread (what ``GpuOwner`` calls its engine thread)."""

    def __init__(self, owner: "SharedEngineThread", runner_factory: Callable[[], Any]):
        self._owner = owner
        self.factory = runner_factory
        self.runner: Any = None
        self.exited = threading.Event()
        self.busy_s = 0.0  # written by the shared thread only
        self._submitted = 0  # jobs submitted: written in trio only
        self._started = 0  # jobs the thread has begun: written by the thread only

    def start(self, on_loaded: Reply) -> None:
        self._owner.post(("load", self, on_loaded))

    def submit(self, job: Job, reply: Reply) -> None:
        self._submitted += 1
        self._owner.post(("job", self, job, reply))

    def queued(self, limit: float) -> bool:
        """Whether a submitted job has not begun because another model's job runs — a load, or a
        transaction within ``limit`` seconds: the GPU owner's deadline counts from when it begins.
        Behind a job that outlived ``limit`` (hung) it is not excused, so it fails in time too."""
        if self._submitted <= self._started:
            return False
        kind, since = self._owner.current
        return kind == "load" or (kind is not None and time.monotonic() - since < limit)

    def stop(self) -> None:
        self._owner.post(("stop", self))

    @property
    def ident(self) -> int | None:
        return self._owner.ident


class SharedEngineThread:
    """The thread; ``lane`` is the ``make_thread`` a model's ``GpuOwner`` is given."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=THREAD_NAME, daemon=True)
        self._token: trio.lowlevel.TrioToken | None = None
        #: (kind, time.monotonic() it began) of the item running now, (None, 0.0) when idle;
        #: written by the thread only, read in trio (one atomic attribute)
        self.current: tuple[str | None, float] = (None, 0.0)

    def lane(self, runner_factory: Callable[[], Any], trio_token: trio.lowlevel.TrioToken) -> EngineLane:
        if self._token is None:
            self._token = trio_token
            self._thread.start()
        return EngineLane(self, runner_factory)

    def post(self, item) -> None:
        self._jobs.put(item)

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    @property
    def running(self) -> bool:
        """Whether a job is running now (a hung one stays running)."""
        return self.current[0] is not None

    async def release_memory(self) -> None:
        """Collect what dropped runners and caches left behind, in the thread (where MLX
        frees), and wait for it: an evicted model's memory is back before it counts as free."""
        if self._token is None:
            return
        done = trio.Event()
        self.post(("call", _collect, lambda _result: done.set()))
        await done.wait()

    def close(self) -> None:
        """Ask the thread to exit after the job it is running (if any)."""
        self._jobs.put(None)

    def _main(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            kind, lane = item[0], item[1]
            self.current = (kind, time.monotonic())
            if kind == "load":
                loaded = outcome.capture(lane.factory)
                if isinstance(loaded, outcome.Value):
                    lane.runner = loaded.value
                else:
                    lane.exited.set()
                ok = send_reply(self._token, item[2], loaded)
            elif kind == "job":
                job, reply = item[2], item[3]
                lane._started += 1
                if lane.runner is None:
                    result = outcome.Error(RuntimeError("this model's engine is stopped"))
                else:
                    result, seconds = run_timed(job, lane.runner)
                    lane.busy_s += seconds
                ok = send_reply(self._token, reply, result)
            elif kind == "stop":
                lane.runner = None
                finish_device_work()
                lane.exited.set()
                ok = True
            else:  # "call": item = ("call", fn, reply)
                ok = send_reply(self._token, item[2], outcome.capture(lane))
            self.current = (None, 0.0)
            if not ok:
                return  # the trio run is over


def _collect() -> None:
    gc.collect()
    mx = sys.modules.get("mlx.core")
    if mx is not None:
        getattr(mx, "clear_cache", lambda: None)()
