"""The one thread that calls the model engine.

MLX streams belong to the thread that created them, so a single
``threading.Thread`` builds the runner (``runner_factory()`` runs *in* the thread) and
runs every job, in order, from a thread-safe queue. Results travel back to trio through the
trio token captured when the thread started (``run_sync_soon``: the thread does not wait for
trio to take the answer, it goes straight back to its queue) — never through
``trio.to_thread``, whose worker threads change between calls.

The thread is a daemon: a hung GPU step must not keep the process alive. A healthy one is
waited for at shutdown (``exited``, set once its last job has returned and the device work it
queued has finished): an engine call that returns into a thread while the interpreter finalizes
ends the process by SIGABRT (the extension's C++ frame cannot be unwound by the thread's forced
exit), so the runtime lets the interpreter exit only after the thread is done. ``join()`` returns
once the thread's Python state is gone, before its native end (the C++ thread-local destructors): what
the engine leaves in MLX's thread-local state must not need Python then, which is why its traced
graphs are kept per thread (``hf2q.engine.thread_compile``).
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from typing import Any, Callable

import outcome
import trio

log = logging.getLogger("hf2q.gpu")

THREAD_NAME = "hf2q-gpu-owner"

Job = Callable[[Any], Any]  # job(runner) -> result
Reply = Callable[[outcome.Outcome], None]  # runs in trio


class EngineThread:
    def __init__(self, runner_factory: Callable[[], Any], trio_token: trio.lowlevel.TrioToken):
        self._factory = runner_factory
        self._token = trio_token
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=THREAD_NAME, daemon=True)
        self.exited = threading.Event()
        #: seconds spent running jobs (written by the thread only; a float read is atomic)
        self.busy_s = 0.0

    def start(self, on_loaded: Reply) -> None:
        """Start the thread; ``on_loaded(outcome of runner_factory())`` is called in trio."""
        self._on_loaded = on_loaded
        self._thread.start()

    def submit(self, job: Job, reply: Reply) -> None:
        """Queue ``job``; ``reply(outcome)`` is called in trio when it has run."""
        self._jobs.put((job, reply))

    def stop(self) -> None:
        """Ask the thread to exit after the job it is running (if any)."""
        self._jobs.put(None)

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def _main(self) -> None:
        loaded = outcome.capture(self._factory)
        runner = loaded.value if isinstance(loaded, outcome.Value) else None
        if not send_reply(self._token, self._on_loaded, loaded) or runner is None:
            self.exited.set()
            return
        try:
            while True:
                item = self._jobs.get()
                if item is None:
                    return
                job, reply = item
                result, seconds = run_timed(job, runner)
                self.busy_s += seconds
                if not send_reply(self._token, reply, result):
                    return
        finally:
            finish_device_work()
            self.exited.set()


def engine_threads_finished(grace_s: float) -> bool:
    """Whether every engine thread has ended, each given ``grace_s`` to return. Once the runtime is
    over, one still running is loading the model or stuck in a GPU job: the process must then leave
    without finalizing the interpreter (``os._exit``), which would abort under it."""
    for t in threading.enumerate():
        if t.name == THREAD_NAME and t is not threading.current_thread():
            t.join(grace_s)
            if t.is_alive():
                return False
    return True


def leave_if_engine_busy(grace_s: float = 1.0) -> None:
    """After a server's runtime is over: if an engine thread still runs (stopped while loading, or
    stuck), flush and leave with status 0 at once (``engine_threads_finished``)."""
    if engine_threads_finished(grace_s):
        return
    import logging
    import os
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def finish_device_work() -> None:
    """Wait for the device work the engine queued and nobody reads any more (a pipelined decode step
    queued ahead of the last one read), so that an engine thread that says it is done is."""
    mx = sys.modules.get("mlx.core")
    if mx is None:
        return
    try:
        mx.synchronize()
    except Exception:  # noqa: BLE001 — a broken device must not keep the thread from reporting its exit
        log.exception("waiting for the engine's queued device work failed")


def run_timed(job: Job, runner: Any) -> tuple[outcome.Outcome, float]:
    """Run one job, capturing its result or exception, and how long it took (``busy_s``)."""
    t0 = time.perf_counter()
    result = outcome.capture(job, runner)
    return result, time.perf_counter() - t0


def send_reply(token: trio.lowlevel.TrioToken, reply: Reply, result: outcome.Outcome) -> bool:
    """Hand ``result`` to ``reply`` in trio without waiting for it; False once the trio run is
    over (nobody waits for the answer, so the engine thread should exit)."""
    try:
        token.run_sync_soon(_deliver, reply, result)
        return True
    except trio.RunFinishedError:
        return False


def _deliver(reply: Reply, result: outcome.Outcome) -> None:
    """Runs in trio's loop: a callback of ``run_sync_soon`` must never raise."""
    try:
        reply(result)
    except Exception:  # noqa: BLE001
        log.exception("engine reply callback failed")
