"""Part e of the reliability suite: an engine fault and an engine hang injected mid-stream.

The server is ``bench/reliability_faulty_serve.py`` (``hf2q serve`` with an armable runner).
Streams are started, and once each has its first token the engine is made to raise (SIGUSR1)
or to block (SIGUSR2, with a short ``--gpu-deadline``). Every in-flight request must then end
exactly once with a 503 error (``engine_unhealthy``) — one error frame then ``[DONE]`` for a
stream (or, for a stream submitted only after the fault, the 503 envelope a new request gets), a 503
envelope otherwise — within a deadline; ``/readyz`` must turn 503, a new request
must be refused 503, and SIGTERM must still drain and exit.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx

from reliability_common import PYTHON, ROOT, ServeProcess, Tally, sse_events

GPU_DEADLINE_S = 3.0
END_WITHIN_S = 30.0
STREAMS = 3
COMMAND = (PYTHON, str(ROOT / "bench" / "reliability_faulty_serve.py"))


def _stream(url: str, started: threading.Event, out: list, i: int) -> None:
    body = {"messages": [{"role": "user", "content": f"Write a long story about the number {i}."}],
            "stream": True, "max_tokens": 400, "temperature": 0}
    lines: list[str] = []
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=END_WITHIN_S + 30) as r:
            if not r.headers.get("content-type", "").startswith("text/event-stream"):
                r.read()  # refused before its stream began (submitted after the fault): a JSON envelope
                out[i] = ("refused", r.status_code, r.json())
                return
            for line in r.iter_lines():
                lines.append(line)
                if '"content"' in line and len([x for x in lines if x.startswith("data: ")]) >= 3:
                    started.set()
        out[i] = ("ok", sse_events(lines))
    except (httpx.HTTPError, ValueError) as e:
        out[i] = ("transport", f"{type(e).__name__}: {e}")


def _plain(url: str, out: list, i: int) -> None:
    body = {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 400, "temperature": 0}
    try:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=END_WITHIN_S + 30)
        out[i] = ("ok", r.status_code, r.json())
    except (httpx.HTTPError, ValueError) as e:
        out[i] = ("transport", f"{type(e).__name__}: {e}")


def _check_stream_failed(result, tally: Tally, name: str) -> None:
    if result is None:
        tally.fail("hangs", f"{name}: did not end within {END_WITHIN_S:.0f} s of the fault")
        return
    if result[0] == "refused":  # a stream that had not begun when the engine failed: 503 like any new request
        if result[1] != 503 or result[2].get("error", {}).get("code") != "engine_unhealthy":
            tally.fail("wrong_status", f"{name}: refused with {result[1:]!r}"[:300])
        return
    if result[0] != "ok":
        tally.fail("lost_streams", f"{name}: {result[1]}")
        return
    events = result[1]
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    finishes = [c for c in events if isinstance(c, dict) for ch in c.get("choices", []) if ch.get("finish_reason")]
    if len(errors) > 1 or events.count("[DONE]") > 1 or (errors and finishes):
        tally.fail("duplicated_streams", f"{name}: {len(errors)} errors, {len(finishes)} finishes")
    elif len(errors) != 1 or events[-1] != "[DONE]" or errors[0]["error"].get("code") != "engine_unhealthy":
        tally.fail("incomplete_streams", f"{name}: ended without one engine_unhealthy error then [DONE]: "
                                         f"{events[-2:]}")


def one_injection(work, model, kind: str, tally: Tally) -> int:
    server = ServeProcess(["--model", str(model), "--slots", "2", "--ctx", "1024",
                           "--gpu-deadline", str(GPU_DEADLINE_S)], work / f"fault-{kind}.log", command=COMMAND).start()
    try:
        started = threading.Event()
        results: list = [None] * (STREAMS + 1)
        threads = [threading.Thread(target=_stream, args=(server.url, started, results, i), daemon=True)
                   for i in range(STREAMS)]
        threads.append(threading.Thread(target=_plain, args=(server.url, results, STREAMS), daemon=True))
        for t in threads:
            t.start()
        if not started.wait(60):
            tally.fail("hangs", f"{kind}: no stream produced tokens within 60 s")
        server.proc.send_signal(signal.SIGUSR1 if kind == "fault" else signal.SIGUSR2)
        t0 = time.monotonic()
        for t in threads:
            t.join(max(0.1, END_WITHIN_S + GPU_DEADLINE_S - (time.monotonic() - t0)))
        tally.info[f"{kind}_requests_ended_s"] = round(time.monotonic() - t0, 2)
        for i in range(STREAMS):
            tally.cases += 1
            _check_stream_failed(results[i], tally, f"{kind} stream {i}")
        tally.cases += 1
        plain = results[STREAMS]
        if plain is None:
            tally.fail("hangs", f"{kind} non-streamed request did not end")
        elif plain[0] != "ok" or plain[1] != 503 or plain[2].get("error", {}).get("code") != "engine_unhealthy":
            tally.fail("wrong_status", f"{kind} non-streamed request: {plain[1:]!r}"[:300])
        tally.cases += 2
        r = httpx.get(server.url + "/readyz", timeout=5)
        if r.status_code != 503:
            tally.fail("wrong_status", f"{kind}: /readyz {r.status_code} after the fault")
        r = httpx.post(server.url + "/v1/chat/completions", timeout=10,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        if r.status_code != 503:
            tally.fail("wrong_status", f"{kind}: a new request got {r.status_code}, expected 503")
    finally:
        t0 = time.monotonic()
        code = server.terminate(60)
        tally.cases += 1
        tally.info[f"{kind}_sigterm_exit"] = code
        tally.info[f"{kind}_sigterm_seconds"] = round(time.monotonic() - t0, 2)
        if code is None:
            tally.fail("hangs", f"{kind}: SIGTERM did not stop the server within 60 s")
        elif code != 0:
            tally.fail("wrong_exit_codes", f"{kind}: exit {code} after SIGTERM")
        log = server.log()
        tally.check_log(log, f"{kind} server", expected="InjectedEngineFault")
    return server.peak_rss


def run(work, model, tally: Tally) -> None:
    peak = 0
    for kind in ("fault", "hang"):
        peak = max(peak, one_injection(work, model, kind, tally))
    tally.info["peak_rss_bytes"] = peak
