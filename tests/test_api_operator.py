"""The operator view: what a dashboard frame and the plain/JSON event lines show — and never show.

A real runtime (fake runner) serves a slow request whose prompt carries a marker; the
rendered dashboard must list the slot's phase, request id and token counts but not the
marker, and the event hook's log records (JSON formatter) must carry ids and counts only.
"""

from __future__ import annotations

import io
import json
import logging

import httpx
import trio
from rich.console import Console
from test_api_support import open_test_server

from hf2q.api.operator import EventLogger, choose_mode, render_dashboard
from hf2q.logs import JsonFormatter

MARKER = "PURPLE-OCTOPUS-PROMPT"


def test_choose_mode():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert choose_mode("auto", "text", Tty()) == "dashboard"
    assert choose_mode("auto", "json", Tty()) == "plain"
    assert choose_mode("auto", "text", io.StringIO()) == "plain"
    assert choose_mode("dashboard", "text", io.StringIO()) == "dashboard"


async def test_dashboard_and_event_lines_show_numbers_not_text():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    op_log = logging.getLogger("hf2q.operator")
    op_log.addHandler(handler)
    old_level = op_log.level
    op_log.setLevel(logging.INFO)
    try:
        async with open_test_server(slots=2, token_delay=0.05) as srv, \
                httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
            srv.runtime.add_event_hook(EventLogger())
            body = {"messages": [{"role": "user", "content": MARKER}], "max_tokens": 30}
            frame = None
            async with trio.open_nursery() as n:
                n.start_soon(lambda: c.post("/v1/chat/completions", json=body,
                                            headers={"x-request-id": "op-req-1"}))
                for _ in range(100):
                    await trio.sleep(0.05)
                    snap = srv.runtime.snapshot()
                    if any(s.phase == "decoding" and s.generated_tokens > 2 for s in snap.slots):
                        console = Console(record=True, width=160, file=io.StringIO())
                        console.print(render_dashboard(snap, model_id="scripted", url=srv.url, started=0.0))
                        frame = console.export_text()
                        break
        assert frame is not None
        assert "op-req-1" in frame and "decoding" in frame and "idle" in frame
        assert MARKER not in frame
        records = [json.loads(line) for line in stream.getvalue().splitlines()]
        kinds = [r["msg"] for r in records if r.get("request_id") == "op-req-1"]
        assert kinds == ["admitted", "finished"]
        fin = next(r for r in records if r["msg"] == "finished")
        assert fin["completion_tokens"] == 30 and fin["reason"] == "length"
        assert MARKER not in stream.getvalue()
    finally:
        op_log.removeHandler(handler)
        op_log.setLevel(old_level)


async def test_a_log_line_during_the_dashboard_prints_above_it_and_the_frame_redraws_in_place():
    """The first "starting" frame must not stay stranded above the table when the server logs "ready"."""
    from hf2q.api.operator import run_dashboard

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    class Starting:  # no snapshot yet: the dashboard shows its "starting…" frame
        def snapshot(self):
            raise RuntimeError("not loaded")

    screen = Terminal()
    console = Console(file=screen, force_terminal=True, width=120)
    handler = logging.StreamHandler(screen)  # the handler writes to the same terminal, as on a real one
    root = logging.getLogger("hf2q")
    saved = root.handlers[:]
    root.handlers[:] = [handler]
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: run_dashboard(Starting(), model_id="m", url="http://x", refresh_s=0.05,
                                                     console=console))
            await trio.sleep(0.2)
            logging.getLogger("hf2q.serve").warning("model loaded; ready")
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()
    finally:
        root.handlers[:] = saved
    assert handler.stream is screen  # given back when the dashboard ends
    out = screen.getvalue()
    before, _, after = out.partition("model loaded; ready")
    assert after, out
    # the frame drawn so far was erased (cursor up + erase line) before the line, then drawn again below it
    assert before.endswith("\x1b[2K"), repr(before[-80:])
    assert "starting…" in after
