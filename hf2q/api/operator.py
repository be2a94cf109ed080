"""The operator's view of a running server: a live dashboard, plain log lines, or JSON lines.

``--operator-ui auto`` picks the rich dashboard when stderr is an interactive terminal and
the log format is text; otherwise one line per request event (``plain``), which becomes one
JSON object per line under ``--log-format json``. Everything shown comes from the runtime's
``snapshot()`` and its event hook — ids, counts, phases, rates. Prompt and completion text
never reach this module.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import trio

from hf2q.sched.contracts import AdmissionRejected, Admitted, Failed, Finished

log = logging.getLogger("hf2q.operator")


def choose_mode(requested: str, log_format: str, stream=None) -> str:
    stream = stream or sys.stderr
    if requested == "auto":
        return "dashboard" if log_format == "text" and stream.isatty() else "plain"
    return requested


class EventLogger:
    """Runtime event hook → one log line per admission, finish and failure (``plain`` / JSON)."""

    def __call__(self, request_id: str, event: Any) -> None:
        if isinstance(event, Admitted):
            log.info("admitted", extra={"request_id": request_id, "slot": event.slot,
                                        "prompt_tokens": event.prompt_tokens, "cached_tokens": event.cached_tokens})
        elif isinstance(event, Finished):
            log.info("finished", extra={"request_id": request_id, "reason": event.reason,
                                        "prompt_tokens": event.prompt_tokens, "cached_tokens": event.cached_tokens,
                                        "completion_tokens": event.completion_tokens,
                                        "ttft_ms": round(event.time_to_first_token_ms, 1),
                                        "prefill_tps": round(event.prefill_tokens_per_sec, 1),
                                        "decode_tps": round(event.decode_tokens_per_sec, 1)})
        elif isinstance(event, Failed):
            log.warning("failed", extra={"request_id": request_id, "status": event.status, "code": event.code})
        elif isinstance(event, AdmissionRejected):
            log.info("rejected", extra={"request_id": request_id, "status": event.status, "code": event.code})


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render_dashboard(snap, *, model_id: str, url: str, started: float):
    """A rich renderable of one snapshot (kept pure so tests can render it to text)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    if snap is None:
        return Text(f"hf2q serve {url} — {model_id} — starting…")
    up = time.monotonic() - started
    state = "[green]ready[/]" if snap.ready else f"[red]{snap.state}[/] {snap.detail}"
    head = Text.from_markup(
        f"[bold]hf2q serve[/] {url}  model [cyan]{model_id}[/]  {state}  ctx {snap.ctx}  "
        f"queue {snap.queue_depth}  KV {_fmt_bytes(snap.kv_bytes_resident)} / {_fmt_bytes(snap.kv_budget_bytes)}  "
        f"up {int(up)}s")
    t = Table(expand=False, box=None, pad_edge=False)
    for col in ("slot", "phase", "request", "cached", "new", "prefill %", "ETA", "gen", "tok/s", "resident"):
        t.add_column(col, justify="right" if col not in ("phase", "request") else "left")
    for s in snap.slots:
        eta = f"{s.prefill_eta_s:.1f}s" if s.prefill_eta_s is not None else "-"
        t.add_row(str(s.slot), s.phase, s.request_id or "-", str(s.cached_tokens), str(s.new_tokens),
                  f"{s.prefill_percent:.0f}" if s.phase != "idle" else "-", eta, str(s.generated_tokens),
                  f"{s.decode_tokens_per_sec:.1f}" if s.decode_tokens_per_sec else "-", str(s.resident_tokens))
    c = snap.counters
    foot = Text(f"requests {c.get('requests', 0)}  finished {c.get('finished', 0)}  "
                f"cancelled {c.get('cancelled', 0)}  failed {c.get('failed', 0)}  "
                f"prompt tok {c.get('prompt_tokens', 0)}  cached tok {c.get('cached_tokens', 0)}  "
                f"completion tok {c.get('completion_tokens', 0)}")
    return Group(head, t, foot)


def render_models_dashboard(entries, *, url: str, budget_bytes: int, started: float):
    """A several-model server's frame: one row per model — where it is, what it is doing (from
    its runtime's snapshot while resident) and what it has cost the model memory so far."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    entries = list(entries)
    resident = sum(e.need_bytes for e in entries if e.state in ("loading", "ready", "draining"))
    head = Text.from_markup(f"[bold]hf2q serve[/] {url}  {len(entries)} models  memory {_fmt_bytes(resident)} / "
                            f"{_fmt_bytes(budget_bytes)}  up {int(time.monotonic() - started)}s")
    t = Table(expand=False, box=None, pad_edge=False)
    for col in ("model", "kind", "state", "active", "busy", "queue", "KV", "tok/s", "memory", "loads", "evicted"):
        t.add_column(col, justify="left" if col in ("model", "kind", "state") else "right", no_wrap=True,
                     overflow="fold" if col == "model" else "ellipsis")
    colour = {"ready": "green", "loading": "yellow", "draining": "yellow", "failed": "red"}
    for e in entries:
        snap = _snap(e.runtime) if e.state == "ready" and e.runtime is not None else None
        state = f"[{colour[e.state]}]{e.state}[/]" if e.state in colour else e.state
        if snap is not None and not snap.ready:
            state = f"[red]{snap.state}[/]"
        busy = [s for s in snap.slots if s.phase != "idle"] if snap is not None else []
        t.add_row(e.model_id, e.kind, Text.from_markup(state), str(e.active),
                  f"{len(busy)}/{len(snap.slots)}" if snap is not None else "-",
                  str(snap.queue_depth) if snap is not None else "-",
                  _fmt_bytes(snap.kv_bytes_resident) if snap is not None else "-",
                  f"{sum(s.decode_tokens_per_sec for s in busy):.1f}" if busy else "-",
                  _fmt_bytes(e.need_bytes), str(e.loads), str(e.evictions))
    failed = [f"{e.model_id}: {e.detail}" for e in entries if e.state == "failed"]
    return Group(head, t, *(Text(line, style="red") for line in failed))


@contextmanager
def _logs_above(stream) -> Iterator[None]:
    """Point the hf2q log handlers that write to the terminal at ``stream`` for a while.

    A handler keeps the stderr it was built with, so a line it writes ("model loaded; ready")
    lands in the middle of the dashboard and strands the frame drawn so far above it; through
    the ``Live``'s own stderr proxy the line is printed above the dashboard, which then redraws
    in place.
    """
    moved = []
    for h in logging.getLogger("hf2q").handlers:
        if isinstance(h, logging.StreamHandler) and not getattr(h.stream, "closed", False) \
                and getattr(h.stream, "isatty", lambda: False)():  # a closed stream is no terminal
            moved.append((h, h.setStream(stream)))
    try:
        yield
    finally:
        for h, old in moved:
            h.setStream(old)


async def run_dashboard(runtime, *, model_id: str, url: str, refresh_s: float = 0.5, console=None) -> None:
    """Redraw the dashboard until cancelled (rich ``Live`` on stderr)."""
    started = time.monotonic()
    await _redraw(lambda: render_dashboard(_snap(runtime), model_id=model_id, url=url, started=started),
                  refresh_s, console)


async def run_models_dashboard(registry, *, url: str, refresh_s: float = 0.5, console=None) -> None:
    """A several-model server's dashboard (``render_models_dashboard`` of the registry), until cancelled."""
    started = time.monotonic()
    await _redraw(lambda: render_models_dashboard(registry.entries.values(), url=url,
                                                  budget_bytes=registry.budget_bytes, started=started),
                  refresh_s, console)


async def _redraw(frame, refresh_s: float, console) -> None:
    from rich.console import Console
    from rich.live import Live

    console = console or Console(stderr=True)
    with Live(frame(), console=console, refresh_per_second=max(1, int(1 / refresh_s)), transient=False,
              redirect_stderr=True) as live, \
            _logs_above(sys.stderr):  # Live has swapped sys.stderr for its proxy by now
        while True:
            await trio.sleep(refresh_s)
            live.update(frame())


async def run_status_lines(runtime, *, interval_s: float = 30.0) -> None:
    """In plain mode: a periodic one-line summary while anything is busy."""
    while True:
        await trio.sleep(interval_s)
        snap = _snap(runtime)
        if snap is None:
            continue
        busy = [s for s in snap.slots if s.phase != "idle"]
        if busy or snap.queue_depth:
            log.info("status", extra={"state": snap.state, "busy_slots": len(busy), "queued": snap.queue_depth,
                                      "kv_bytes": snap.kv_bytes_resident,
                                      "decode_tps": round(sum(s.decode_tokens_per_sec for s in busy), 1)})


def _snap(runtime):
    try:
        return runtime.snapshot()
    except Exception:  # noqa: BLE001 — the view must never take the server down
        return None
