"""Hostile requests against the real HTTP server (Hypercorn + the app + the actor runtime).

Each case is one a hostile or careless client sent and got a 500, a hang or a poisoned engine
(docs/API.md, "Errors"): JSON nested past any sane depth, text that is not Unicode, template
variables that shadow the request's own, bodies refused before they were read on a keep-alive
connection (raw sockets: a client library would reconnect and hide the desync), non-JSON and
cross-origin POSTs, an embedding id outside the vocabulary, and a chat template that loops for
ever. The probe answers quickly throughout.
"""

from __future__ import annotations

import functools
import json
import re
import socket
import threading
import time

import httpx
import pytest
import trio
from test_api_support import open_test_server

from tests.tools.raw_http import send_then_read

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def nested(depth: int, leaf: str = "1", key: str | None = None) -> str:
    if key is None:
        return "[" * depth + leaf + "]" * depth
    return f'{{"{key}":' * depth + leaf + "}" * depth


def chat_with(**extra) -> bytes:
    return json.dumps({**CHAT, **extra}).encode()


BAD_BODIES = [
    # (raw body, the field the 400 must name: exact, or a prefix ending in "*")
    (nested(10_000).encode(), "body[0]*"),
    (chat_with()[:-1] + b', "junk": ' + nested(10_000).encode() + b"}", "junk*"),
    (chat_with()[:-1] + b', "junk": ' + nested(10_000, key="a").encode() + b"}", "junk.a*"),
    (chat_with(chat_template_kwargs=json.loads(nested(900, key="x"))), "chat_template_kwargs.x*"),
    (chat_with(chat_template_kwargs={"messages": []}), "chat_template_kwargs.messages"),
    (chat_with(chat_template_kwargs={"tools": None}), "chat_template_kwargs.tools"),
    (chat_with(chat_template_kwargs={"add_generation_prompt": False}), "chat_template_kwargs.add_generation_prompt"),
    (chat_with(messages=[{"role": "user", "content": "hi \ud800 there"}]), "messages[0].content"),
    (chat_with(tools=[{"type": "function", "function": {"name": "get\udc00"}}]), "tools[0].function.name"),
    (chat_with(top_k=10**12), "top_k"),
    (chat_with(seed=2**80), "seed"),
    (chat_with(seed=-5), "seed"),
    (chat_with(logit_bias={"-3": 1}), "logit_bias"),
]


async def test_hostile_bodies_are_400_naming_the_field_and_the_server_stays_healthy():
    async with open_test_server(max_request_bytes=1 << 20) as srv, httpx.AsyncClient(base_url=srv.url) as c:
        for raw, field in BAD_BODIES:
            r = await c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (field, r.status_code, r.text[:300])
            err = r.json()["error"]
            if field.endswith("*"):
                assert err["param"].startswith(field[:-1]), (field, err)
            else:
                assert err["param"] == field, (field, err)
            assert err["param"] in err["message"] and len(err["message"]) < 300, err
        r = await c.post("/v1/chat/completions", json={**CHAT, "seed": -1, "top_k": 50})  # -1: a random seed
        assert r.status_code == 200, r.text


# ---- keep-alive after an early refusal --------------------------------------------------------

GET_MODELS = b"GET /v1/models HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k\r\n\r\n"


def _refused_then_get(url: str, head: bytes, body_bytes: int) -> tuple[list[int], bool, str]:
    return send_then_read(url, head, body_bytes, GET_MODELS)


REFUSED = {
    401: b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
         b"Content-Length: %d\r\n\r\n",
    405: b"PUT /v1/chat/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k\r\nContent-Length: %d\r\n\r\n",
    413: b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k\r\n"
         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n",
    415: b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k\r\n"
         b"Content-Type: text/plain\r\nContent-Length: %d\r\n\r\n",
}


@pytest.mark.parametrize("status", sorted(REFUSED))
async def test_a_refused_body_never_desyncs_the_connection(status):
    limit = 512 if status == 413 else 8 << 20
    async with open_test_server(api_key="k", max_request_bytes=limit) as srv:
        for size in (1_000, 500_000, 4_000_000):  # a small body already arrived; a large one is still coming
            statuses, closed, _ = await trio.to_thread.run_sync(_refused_then_get, srv.url, REFUSED[status], size)
            assert statuses == [status, 200] and not closed, (size, statuses)


def _chunked_upload_then_get(url: str, total: int) -> list[int]:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    chunk = b"x" * 65536

    def send():
        try:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k\r\n"
                      b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(total // len(chunk)):
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            s.sendall(b"0\r\n\r\n" + GET_MODELS)
        except OSError:
            pass
    sender = threading.Thread(target=send)
    sender.start()
    buf = b""
    try:
        while len(re.findall(rb"HTTP/1.1 \d+", buf)) < 2:
            data = s.recv(1 << 16)
            if not data:
                break
            buf += data
    except socket.timeout:
        pass
    finally:
        sender.join(10)
        s.close()
    return [int(x) for x in re.findall(rb"HTTP/1.1 (\d+)", buf)]


async def test_a_chunked_body_over_the_limit_never_desyncs_the_connection():
    """No Content-Length: the limit is found while reading, and the rest must still be drained."""
    async with open_test_server(api_key="k", max_request_bytes=256 << 10) as srv:
        statuses = await trio.to_thread.run_sync(_chunked_upload_then_get, srv.url, 4 << 20)
    assert statuses == [413, 200], statuses


# ---- head-of-line blocking ----------------------------------------------------------------------

def assert_probes_answered_promptly(lat: list[float]) -> None:
    """Nine in ten probes within 250 ms, none stalled (the work on the event loop took seconds
    before; a slower probe is the shared test machine, not the server)."""
    lat = sorted(lat)
    assert lat[int(len(lat) * 0.9) - 1] < 0.25 and lat[-1] < 1.5, lat[-5:]


async def _probe_latencies(url: str, until: trio.Event) -> list[float]:
    out = []
    async with httpx.AsyncClient(base_url=url) as c:
        while not until.is_set():
            t = time.perf_counter()
            r = await c.get("/health")
            out.append(time.perf_counter() - t)
            assert r.status_code == 200
            await trio.sleep(0.02)
    return out


@functools.lru_cache(maxsize=1)
def smollm2_chat_model(template_source: str | None = None):
    from hf2q.api.textbridge import GGUFChatModel
    from hf2q.fetch import SMOLLM2, fetch
    from hf2q.text.chat_template import ChatTemplate

    model = GGUFChatModel.from_gguf(fetch(SMOLLM2), "smollm2")
    if template_source is not None:
        model = GGUFChatModel(model.tokenizer, ChatTemplate(template_source), "smollm2")
    return model


async def _chat_while_probing(srv, body: dict) -> tuple[httpx.Response, list[float], float]:
    done = trio.Event()
    result = {}

    async def probe():
        result["lat"] = await _probe_latencies(srv.url, done)

    async with trio.open_nursery() as n:
        n.start_soon(probe)
        await trio.sleep(0.1)
        t = time.perf_counter()
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            r = await c.post("/v1/chat/completions", json=body)
        took = time.perf_counter() - t
        done.set()
    return r, result["lat"], took


async def test_health_answers_while_a_big_prompt_is_parsed_and_tokenized():
    model = smollm2_chat_model()
    text = "hello world, this is some text. " * 60_000  # 1.9 MB: seconds of tokenization
    async with open_test_server(max_request_bytes=64 << 20, chat_model=model, vocab=model.tokenizer.vocab_size,
                                ctx=4096) as srv:
        r, lat, took = await _chat_while_probing(srv, {**CHAT, "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert took > 0.5 and len(lat) >= 5, (took, len(lat))  # the probes ran while the prompt was prepared
    assert_probes_answered_promptly(lat)


async def test_content_length_over_the_limit_is_refused_before_the_body_is_read():
    async with open_test_server(max_request_bytes=1 << 20) as srv:
        def send_head_only():
            host, port = srv.url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 60000000\r\n\r\n")
                got = b""
                while b"request_too_large" not in got:  # answered though not one byte of the 60 MB was sent
                    data = s.recv(1 << 16)
                    if not data:
                        break
                    got += data
                return got
        head = await trio.to_thread.run_sync(send_head_only)
    assert head.startswith(b"HTTP/1.1 413") and b"request_too_large" in head, head[:300]


# ---- browser-driven requests ---------------------------------------------------------------------

async def test_post_needs_json_and_a_foreign_origin_cannot_change_state():
    async with open_test_server(cors_origins=("http://app.example",)) as srv, \
            httpx.AsyncClient(base_url=srv.url) as c:
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            r = await c.post("/v1/chat/completions", content=json.dumps(CHAT), headers={"content-type": ctype})
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", (ctype, r.text)
        r = await c.post("/v1/chat/completions", content=json.dumps(CHAT).encode(), headers={"content-type": ""})
        assert r.status_code == 415
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"content-type": "application/json; charset=utf-8"})
        assert r.status_code == 200
        # what a hostile page's form or fetch would send: refused, and the server keeps serving
        r = await c.post("/shutdown", content=b"x", headers={"origin": "http://evil.example",
                                                              "content-type": "text/plain"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
        r = await c.post("/shutdown", headers={"origin": "http://evil.example"})
        assert r.status_code == 403
        assert (await c.get("/readyz")).status_code == 200
        # the listed origin and the server's own origin are allowed
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"origin": "http://app.example"})
        assert r.status_code == 200
        own = srv.url.removesuffix("/")
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"origin": own})
        assert r.status_code == 200


# ---- embeddings ----------------------------------------------------------------------------------

async def test_an_out_of_vocabulary_embedding_id_is_400_and_never_poisons():
    async with open_test_server(embeddings=True) as srv, httpx.AsyncClient(base_url=srv.url) as c:
        for bad in ([1, 2, 256], [[5], [-1]], [[3, 10**12]]):
            r = await c.post("/v1/embeddings", json={"input": bad})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "input" and "vocabulary" in err["message"], err
        r = await c.post("/v1/embeddings", json={"input": ["still works", [1, 2, 3]]})
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 2
        assert (await c.get("/readyz")).status_code == 200


# ---- a template that never ends ------------------------------------------------------------------

LOOPING_TEMPLATE = ("{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}"
                    "{% endfor %}{% endfor %}{% endfor %}")


async def test_a_looping_chat_template_is_400_while_health_answers_and_stop_drains():
    model = smollm2_chat_model(LOOPING_TEMPLATE)
    async with open_test_server(chat_model=model, vocab=model.tokenizer.vocab_size) as srv:
        r, lat, took = await _chat_while_probing(srv, CHAT)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "chat template" in err["message"] and "looped more than" in err["message"], err
        assert took < 30
        assert len(lat) >= 3
        assert_probes_answered_promptly(lat)
        # a stop request while such a render runs still drains the server promptly
        async def in_flight(c):
            try:
                await c.post("/v1/chat/completions", json=CHAT)
            except httpx.TransportError:
                pass  # answered 400 or cut by the server's graceful close: either is fine here

        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c, trio.open_nursery() as n:
            n.start_soon(in_flight, c)
            await trio.sleep(0.2)
            t = time.perf_counter()
            srv.handle.request_stop()
            await srv.wait_stopped()
            assert time.perf_counter() - t < 10
            n.cancel_scope.cancel()


# ---- the error table -----------------------------------------------------------------------------

#: the constructors through which an error code reaches a client, and where each takes the code
#: (positional index; every one also accepts ``code=``)
_CODE_ARG = {"ApiError": None, "error_body": None, "invalid": 2, "Failed": 1, "SampleError": 1,
             "AdmissionRejected": 1, "Never": 0, "QueueFull": 0}


def emitted_error_codes() -> dict[str, str]:
    """Every literal error code handed to one of ``_CODE_ARG``'s constructors anywhere in hf2q,
    plus the HTTP layer's own map: code → the first file that emits it."""
    import ast
    from pathlib import Path

    from hf2q.api.errors import HTTP_ERROR_CODES

    root = Path(__file__).resolve().parents[1] / "hf2q"
    found = {c: "hf2q/api/errors.py" for c in HTTP_ERROR_CODES.values()}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name not in _CODE_ARG:
                continue
            args = [kw.value for kw in node.keywords if kw.arg == "code"]
            pos = _CODE_ARG[name]
            if pos is not None and len(node.args) > pos:
                args.append(node.args[pos])
            for a in args:
                if isinstance(a, ast.Constant) and isinstance(a.value, str):
                    found.setdefault(a.value, str(path.relative_to(root.parent)))
    return found


def documented_error_codes() -> set[str]:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "API.md").read_text()
    section = text.split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in section.splitlines() if line.startswith("|")]
    return {code for cells in rows if len(cells) > 2 for code in re.findall(r"`([a-z_]+)`", cells[2])}


def test_every_error_code_the_server_can_send_is_in_the_docs_table():
    emitted = emitted_error_codes()
    # the scan sees each place codes come from: validation, the HTTP layer, admission, the engine
    assert {"invalid_type", "not_found", "queue_full", "engine_unhealthy", "invalid_request",
            "context_length_exceeded", "sampling_failed", "reader_too_slow"} <= emitted.keys(), sorted(emitted)
    missing = {c: where for c, where in emitted.items() if c not in documented_error_codes()}
    assert not missing, f"error codes sent but not in docs/API.md's Errors table: {missing}"


async def test_an_out_of_vocabulary_logit_bias_id_is_400_naming_the_field():
    model = smollm2_chat_model()
    vocab = model.tokenizer.vocab_size
    async with open_test_server(chat_model=model, vocab=vocab) as srv, httpx.AsyncClient(base_url=srv.url) as c:
        for tok in (vocab, vocab + 7, 10**15):
            r = await c.post("/v1/chat/completions", json={**CHAT, "logit_bias": {str(tok): 5}})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "logit_bias" and str(tok) in err["message"], err
        r = await c.post("/v1/chat/completions", json={**CHAT, "logit_bias": {str(vocab - 1): -100}})
        assert r.status_code == 200, r.text
