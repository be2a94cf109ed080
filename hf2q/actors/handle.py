"""One request's side of its event channel: ordered events, exactly one terminal event.

The runtime owns the send side; the API reads the receive side. The channel buffer is
``token_buffer + 1``: ordinary events may fill ``token_buffer`` places, so the terminal
event always fits without waiting — no actor ever blocks on a client. A
reader that leaves ``token_buffer`` events unread is too slow and is ended on its own.
Closing the receive side is the client's cancel signal, observed via ``gone``.
"""

from __future__ import annotations

from typing import Callable

import trio

from hf2q.sched.contracts import Failed, Finished, GenerationRequest


class RequestHandle:
    def __init__(self, req: GenerationRequest, token_buffer: int, hooks: list[Callable], now: float):
        self.req = req
        self.send, self.receive = trio.open_memory_channel(token_buffer + 1)
        self._limit = token_buffer
        self._hooks = hooks
        self.submitted_at = now
        self.terminal: Finished | Failed | None = None
        self.too_slow = False

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def done(self) -> bool:
        return self.terminal is not None

    @property
    def gone(self) -> bool:
        """The client closed its side (cancel), or it was too slow and has been ended."""
        return self.done or self.send.statistics().open_receive_channels == 0

    def emit(self, event, defer: list | None = None) -> bool:
        """Send a non-terminal event; False when the request should stop (client gone or too slow).

        With ``defer``, the event hooks are not called now: ``(self, event)`` is appended to it
        for the caller to ``notify`` later (the GPU owner runs them while the engine computes)."""
        if self.gone:
            return False
        if self.send.statistics().current_buffer_used >= self._limit:
            self.too_slow = True
            self.finish(Failed(503, "reader_too_slow",
                               f"the client left {self._limit} events unread; request cancelled"), defer)
            return False
        try:
            self.send.send_nowait(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        self._notify_or_defer(event, defer)
        return True

    def finish(self, event: Finished | Failed, defer: list | None = None) -> bool:
        """Send the terminal event and close the channel; only the first call has any effect."""
        if self.terminal is not None:
            return False
        self.terminal = event
        try:
            self.send.send_nowait(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
            pass  # nobody is listening any more; the request still ended exactly once
        self.send.close()
        self._notify_or_defer(event, defer)
        return True

    def _notify_or_defer(self, event, defer: list | None) -> None:
        if defer is None:
            self.notify(event)
        else:
            defer.append((self, event))

    def notify(self, event) -> None:
        """Call the event hooks for ``event`` (a hook's failure is ignored)."""
        for hook in self._hooks:
            try:
                hook(self.request_id, event)
            except Exception:  # noqa: BLE001 — a metrics bug must not break serving
                pass
