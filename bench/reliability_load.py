"""Part d of the reliability suite: many concurrent streams over 4 slots, some dropped mid-stream.

Each client thread streams chat requests back to back until the time is up; one in
``disconnect_every`` closes its connection after a chunk or two. Every stream read to its end
must be whole (one role chunk, one ``finish_reason``, one ``[DONE]``, one id), none may go
unanswered; afterwards the slots must be idle within 0.5 s and ``/metrics`` must count exactly
the requests sent.
"""

from __future__ import annotations

import random
import re
import threading
import time

import httpx

from reliability_common import ServeProcess, Tally, check_stream, sse_events

IDLE_WITHIN_S = 0.5
SLOTS = 4
QUESTIONS = ("Name a colour.", "Count to five.", "What is 2+2?", "Say a word that rhymes with cat.",
             "Give me a fruit.", "Name a planet.", "What day comes after Monday?", "Spell 'dog'.")


def serve_args(streams: int) -> list[str]:
    return ["--slots", str(SLOTS), "--queue-capacity", str(streams), "--ctx", "512"]


def _one_stream(client: httpx.Client, rng: random.Random, disconnect: bool, tally: Tally, lock) -> None:
    body = {"messages": [{"role": "user", "content": rng.choice(QUESTIONS)}], "stream": True,
            "max_tokens": rng.randint(8, 40), "temperature": 0}
    lines, name = [], f"stream {body['messages'][0]['content']!r}"
    try:
        with client.stream("POST", "/v1/chat/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                with lock:
                    what = "server_5xx" if r.status_code >= 500 else "wrong_status"
                    tally.fail(what, f"{name}: {r.status_code} {r.read()[:160]!r}")
                return
            keep = rng.randint(1, 2)
            for line in r.iter_lines():
                lines.append(line)
                if disconnect and sum(1 for x in lines if x.startswith("data: ")) >= keep:
                    return  # closing the response drops the connection mid-stream
    except httpx.TimeoutException:
        with lock:
            tally.fail("hangs", f"{name}: no end within 120 s")
        return
    except httpx.TransportError as e:
        with lock:
            tally.fail("lost_streams", f"{name}: {type(e).__name__}: {e}")
        return
    with lock:
        content = check_stream(sse_events(lines), tally, name)
        if content is not None and not content:
            tally.fail("incomplete_streams", f"{name}: empty content")


def _metric(text: str, name: str, labels: str = "") -> float:
    total = 0.0
    for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        if labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def run(server: ServeProcess, tally: Tally, *, streams: int, seconds: float, disconnect_every: int, seed: int) -> None:
    lock = threading.Lock()
    before = httpx.get(server.url + "/metrics").text
    sent = [0]
    disconnects = [0]
    deadline = time.monotonic() + seconds

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        with httpx.Client(base_url=server.url) as c:
            while time.monotonic() < deadline:
                drop = disconnect_every > 0 and rng.randrange(disconnect_every) == 0
                with lock:
                    sent[0] += 1
                    tally.cases += 1
                    disconnects[0] += drop
                _one_stream(c, rng, drop, tally, lock)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        server.sample()
        time.sleep(0.5)
        if time.monotonic() > deadline + 300:
            tally.fail("hangs", "clients still running 300 s after the load ended")
            break
    ended = time.monotonic()
    idle_after = None
    while time.monotonic() - ended < 10:
        text = httpx.get(server.url + "/metrics").text
        if _metric(text, "hf2q_slots_active") == 0 and _metric(text, "hf2q_requests_queued") == 0:
            idle_after = time.monotonic() - ended
            break
        time.sleep(0.02)
    if idle_after is None or idle_after > IDLE_WITHIN_S:
        tally.fail("slow_to_idle", f"slots idle {idle_after} s after the load (limit {IDLE_WITHIN_S} s)")
    after = httpx.get(server.url + "/metrics").text
    route = 'route="/v1/chat/completions"'
    counted = _metric(after, "hf2q_requests_total", route) - _metric(before, "hf2q_requests_total", route)
    if counted != sent[0]:
        tally.fail("metrics_mismatch", f"/metrics counts {counted:.0f} chat requests, {sent[0]} were sent")
    cancelled = _metric(after, "hf2q_cancellations_total") - _metric(before, "hf2q_cancellations_total")
    if cancelled > disconnects[0]:
        tally.fail("metrics_mismatch", f"{cancelled:.0f} cancellations for {disconnects[0]} disconnects")
    tally.info.update(requests=sent[0], disconnects=disconnects[0], cancellations_counted=cancelled,
                      idle_after_s=None if idle_after is None else round(idle_after, 3),
                      completion_tokens=_metric(after, "hf2q_completion_tokens_total")
                      - _metric(before, "hf2q_completion_tokens_total"))
