"""Serve the app with Hypercorn's trio worker and drain it gracefully.

``serve(ctx, host, port)`` is a trio task (use ``nursery.start``; it reports the bound
URLs, so port 0 works for tests). A stop request — ``POST /shutdown``, SIGTERM (wired by
``hf2q serve``) or ``request_stop()`` — runs the drain: new work gets 503 ``not_ready``,
``/readyz`` turns 503, running requests finish (up to ``drain_timeout``; stragglers end
with a terminal error from the runtime), then Hypercorn stops accepting and closes.
"""

from __future__ import annotations

import errno
import logging
import socket
from functools import partial

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from hf2q.api.app import ServerContext, create_app
from hf2q.errors import ConversionError

log = logging.getLogger("hf2q.api")


def check_port_free(host: str, port: int) -> None:
    """Fail fast, before loading a model, when something already listens on ``host:port``."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConversionError(f"port {port} on {host} is busy (another server is listening); "
                                      f"pick another with --port") from None
            raise ConversionError(f"cannot bind {host}:{port}: {e.strerror}") from None


def hypercorn_config(host: str, port: int, *, graceful_timeout: float = 10.0) -> HypercornConfig:
    cfg = HypercornConfig()
    cfg.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    cfg.graceful_timeout = graceful_timeout
    cfg.keep_alive_timeout = 75  # agents reuse connections between turns
    cfg.accesslog = None
    cfg.errorlog = logging.getLogger("hf2q.hypercorn")
    cfg.h11_max_incomplete_size = 64 * 1024
    return cfg


class ServerHandle:
    """Returned through ``task_status``: the bound URLs and a way to stop the server."""

    def __init__(self, urls: list[str], stop: trio.Event, closed: trio.Event):
        self.urls = urls
        self._stop = stop
        #: set once Hypercorn has stopped (after the drain)
        self.closed = closed

    @property
    def url(self) -> str:
        return self.urls[0]

    def request_stop(self) -> None:
        self._stop.set()


async def serve(ctx: ServerContext, host: str = "127.0.0.1", port: int = 8080, *, drain_timeout: float = 30.0,
                graceful_timeout: float = 5.0, task_status=trio.TASK_STATUS_IGNORED) -> None:
    stop = trio.Event()
    ctx.on_shutdown_requested = stop.set
    app = create_app(ctx)
    cfg = hypercorn_config(host, port, graceful_timeout=graceful_timeout)

    async def drain_then_close() -> None:
        await stop.wait()
        ctx.draining = True
        log.info("draining", extra={"timeout_s": drain_timeout})
        try:
            clean = await ctx.runtime.drain(drain_timeout)
        except Exception:
            log.exception("drain failed")
            clean = False
        if ctx.embed_runtime is not None and ctx.embed_runtime is not ctx.runtime:
            try:
                await ctx.embed_runtime.drain(drain_timeout)
            except Exception:
                log.exception("embedding drain failed")
        log.info("drained", extra={"clean": clean})
        await trio.sleep(0.05)  # let the last SSE frames flush before Hypercorn closes

    closed = trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            try:
                urls = await nursery.start(partial(hypercorn_serve, app, cfg, shutdown_trigger=drain_then_close))
            except OSError as e:
                raise ConversionError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
            task_status.started(ServerHandle(urls, stop, closed))
    finally:
        closed.set()
