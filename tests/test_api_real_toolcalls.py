"""Forced tool calls finish on the real default model (SmolLM2-135M), through the real HTTP API.

Ten tools of different shapes, each forced with ``tool_choice: "required"`` and with its name,
at temperature 0 and at 0.8 with three seeds: every reply must carry a call that parses and
whose arguments validate against the tool's own schema (``jsonschema``, independent of the
grammar that produced them), with ``finish_reason: "tool_calls"`` inside ``max_tokens: 256``.
Part of the rows are streamed, and there each call's deltas must arrive in frames of their
own before the final one, its arguments in at least two (one frame per argument piece, and the
parser passes on at most one piece per call per token: so the first piece left before the
call's last token did, sent as the call is generated, not saved for the end). A reply that
``max_tokens`` cuts inside a forced call must say ``length`` and carry no broken call.

The first nine tools ask for one call (``parallel_tool_calls: false``); the tenth allows
parallel calls, where a repeat of a call already made ends the reply.

The module prints the table tool × choice × temperature → completion tokens
(``pytest -s``); one server serves the whole module.
"""

from __future__ import annotations

import json
import queue
import threading
import time

import httpx
import pytest
import trio

from tests.test_api_real_model import real_server, sse_chunks

jsonschema = pytest.importorskip("jsonschema")  # test dependency (pyproject [test] extra)

pytestmark = [pytest.mark.slow]

MAX_TOKENS = 256
SEEDS = (1, 2, 3)
CONCURRENT = 8  # slots and requests in flight: 8 batch the decode steps ~30% faster than 4


ONE = {"parallel_tool_calls": False}


def _tool(name: str, description: str, properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(properties) if required is None else required}}}


WEATHER = _tool("get_weather", "Current weather in a city", {"city": {"type": "string"}})
CLOCK = _tool("get_time", "Current time in a time zone", {"timezone": {"type": "string",
                                                                       "description": "IANA name"}})

#: (row name, tools, the tool a named choice forces, prompt, extra request fields)
CASES = [
    ("string", [WEATHER], "get_weather", "What is the weather in Paris?", ONE),
    ("path", [_tool("read_file", "Read a file of the project",
                    {"path": {"type": "string", "description": "file path"}})],
     "read_file", "Show me what is in src/main.py.", ONE),
    ("free text", [_tool("save_note", "Save a note for the user", {"content": {"type": "string"}})],
     "save_note", "Remember that the meeting moved to Thursday at 3pm.", ONE),
    ("string+integer", [_tool("set_timer", "Start a named timer", {"label": {"type": "string"},
                                                                   "minutes": {"type": "integer"}})],
     "set_timer", "Set a tea timer for 5 minutes.", ONE),
    ("enum", [_tool("set_theme", "Change the colour theme", {"theme": {"type": "string",
                                                                       "enum": ["light", "dark", "auto"]}})],
     "set_theme", "Switch the app to dark mode.", ONE),
    ("nested object", [_tool("create_contact", "Add a contact", {"contact": {
        "type": "object", "properties": {"name": {"type": "string"},
                                         "address": {"type": "object", "properties": {
                                             "city": {"type": "string"}, "country": {"type": "string"}},
                                             "required": ["city", "country"]}},
        "required": ["name", "address"]}})],
     "create_contact", "Add Marie Curie, who lives in Paris, France, to my contacts.", ONE),
    ("array of strings", [_tool("tag_post", "Tag a blog post", {"tags": {"type": "array",
                                                                        "items": {"type": "string"}}})],
     "tag_post", "Tag my post with python, async and testing.", ONE),
    ("optional parameters", [_tool("search_docs", "Search the documentation", {
        "query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 50},
        "language": {"type": "string"}}, required=["query"])],
     "search_docs", "Search the docs for connection pooling.", ONE),
    ("two tools", [WEATHER, CLOCK], "get_time", "What time is it in Tokyo?", ONE),
    ("parallel calls", [WEATHER], "get_weather", "What is the weather in Paris and in London?",
     {"parallel_tool_calls": True}),
]

CHOICES = ("required", "named")


def rows():
    """Every (case, choice, temperature, seed, streamed) the table holds."""
    out = []
    for k, case in enumerate(CASES):
        for choice in CHOICES:
            runs = [(0.0, None)] + [(0.8, s) for s in SEEDS]
            for j, (temp, seed) in enumerate(runs):
                out.append((case, choice, temp, seed, (k + j) % 2 == 0))  # half of the rows streamed
    return out


def body_for(case, choice: str, temp: float, seed: int | None) -> dict:
    _name, tools, named, prompt, extra = case
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": named}}
    body = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "tools": tools,
            "tool_choice": tool_choice, "temperature": temp, "max_tokens": MAX_TOKENS, **extra}
    if seed is not None:
        body["seed"] = seed
    return body


async def streamed(c: httpx.AsyncClient, body: dict) -> dict:
    """A streamed reply folded into the unary shape, plus when each frame of it arrived."""
    calls: dict[int, dict] = {}
    frames = []  # (arrival time, tool-call indexes in this frame, finish_reason, indexes with arguments)
    content, finish, usage = [], None, None
    async for ch in sse_chunks(c, {**body, "stream_options": {"include_usage": True}}):
        usage = ch.get("usage") or usage
        for choice in ch["choices"]:
            delta = choice["delta"]
            content.append(delta.get("content") or "")
            idx, with_args = [], []
            for d in delta.get("tool_calls") or ():
                idx.append(d["index"])
                if d.get("function", {}).get("arguments"):
                    with_args.append(d["index"])
                call = calls.setdefault(d["index"], {"id": d.get("id"), "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
                call["function"]["name"] += d.get("function", {}).get("name", "")
                call["function"]["arguments"] += d.get("function", {}).get("arguments", "")
            frames.append((time.perf_counter(), idx, choice["finish_reason"], with_args))
            finish = choice["finish_reason"] or finish
    message = {"content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"choices": [{"message": message, "finish_reason": finish}], "usage": usage, "frames": frames}


def check_frames(frames: list) -> None:
    """Each call's deltas came before the final frame and before any later call's, its arguments
    in pieces (as generated)."""
    final_at = next(k for k, (_, _, reason, _) in enumerate(frames) if reason)
    first_frame_of: dict[int, int] = {}
    args_frames: dict[int, list[int]] = {}
    for k, (_, idx, _, with_args) in enumerate(frames):
        for i in idx:
            first_frame_of.setdefault(i, k)
        for i in with_args:
            args_frames.setdefault(i, []).append(k)
    assert first_frame_of and all(k < final_at for k in first_frame_of.values()), frames
    order = [first_frame_of[i] for i in sorted(first_frame_of)]
    assert order == sorted(order) and len(set(order)) == len(order), frames  # one frame per call, in order
    for i, first in first_frame_of.items():
        got = args_frames.get(i, [])
        assert len(got) >= 2 and got[0] > first, (i, frames)  # the start first, then pieces


def check_reply(case, choice: str, out: dict) -> int:
    """The reply's calls parse and validate; returns its completion tokens."""
    _name, tools, named, _prompt, _extra = case
    ch = out["choices"][0]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert ch["finish_reason"] == "tool_calls", ch
    calls = ch["message"].get("tool_calls") or []
    assert calls, ch
    for call in calls:
        name = call["function"]["name"]
        assert name in schemas and (choice == "required" or name == named), call
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
    if choice == "named":
        assert len(calls) == 1  # a named choice makes one call
    used = out["usage"]["completion_tokens"]
    assert used <= MAX_TOKENS
    return used


def table(results: dict) -> str:
    """tool × choice × temperature (seeds as ``/``-separated columns) → completion tokens."""
    head = f"{'tool':<20} {'choice':<9} {'T=0':>5}   {'T=0.8 (seeds ' + ', '.join(map(str, SEEDS)) + ')':<22}"
    lines = [head, "-" * len(head)]
    for case in CASES:
        for choice in CHOICES:
            greedy = results.get((case[0], choice, 0.0, None), "?")
            hot = " / ".join(str(results.get((case[0], choice, 0.8, s), "?")) for s in SEEDS)
            lines.append(f"{case[0]:<20} {choice:<9} {greedy!s:>5}   {hot}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def server_url():
    """One real server (SmolLM2, real runtime, real HTTP) for the module, on a thread of its own."""
    started: queue.Queue = queue.Queue()
    stop = threading.Event()

    async def run():
        try:
            async with real_server(slots=CONCURRENT) as (url, _runtime, _model):
                started.put(url)
                await trio.to_thread.run_sync(stop.wait)
        except BaseException as e:  # surfaced to the tests instead of a hang
            started.put(e)
            raise

    thread = threading.Thread(target=trio.run, args=(run,), daemon=True)
    thread.start()
    url = started.get(timeout=600)
    if isinstance(url, BaseException):
        raise url
    yield url
    stop.set()
    thread.join(120)


async def test_ten_tools_forced_calls_finish_and_validate(server_url):
    results: dict = {}
    greedy_calls: dict = {}
    pieces: dict = {}  # streamed row → argument frames per call
    failures: list[str] = []
    limit = trio.Semaphore(CONCURRENT)

    async def one(c, case, choice, temp, seed, stream):
        async with limit:
            body = body_for(case, choice, temp, seed)
            if stream:
                out = await streamed(c, body)
            else:
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                out = r.json()
        key = (case[0], choice, temp, seed)
        if stream:
            calls = out["choices"][0]["message"].get("tool_calls") or ()
            pieces[key] = [sum(i in f[3] for f in out["frames"]) for i in range(len(calls))]
        if temp == 0:
            greedy_calls[case[0], choice] = [(x["function"]["name"], x["function"]["arguments"])
                                             for x in out["choices"][0]["message"].get("tool_calls") or ()]
        try:
            results[key] = check_reply(case, choice, out)
            if stream:
                check_frames(out["frames"])
        except AssertionError as e:  # collect them all, so the table shows every row
            results[key] = f"X{out['usage']['completion_tokens'] if out.get('usage') else ''}"
            failures.append(f"{key} stream={stream}: {e} {out['choices'][0]}")

    async with httpx.AsyncClient(base_url=server_url, timeout=600) as c:
        async with trio.open_nursery() as n:
            for case, choice, temp, seed, stream in rows():
                n.start_soon(one, c, case, choice, temp, seed, stream)
        metrics = (await c.get("/metrics")).text
    from prometheus_client.parser import text_string_to_metric_families

    ended = {s.labels["why"]: s.value for f in text_string_to_metric_families(metrics)
             if f.name == "hf2q_cancellations" for s in f.samples if s.name.endswith("_total")}
    print("\nreplies ended early, by why:", ended)
    # no request here has a stop string: replies the calls ended are labelled for what ended them
    assert "stop_string" not in ended and ended.get("tool_call_limit", 0) > 0, ended
    print("\n" + table(results))
    print("\nstreamed rows, argument frames per call:")
    for key, n in sorted(pieces.items(), key=str):
        print(f"  {key[0]:<20} {key[1]:<9} T={key[2]} seed={key[3]}: {n}")
    free_text = [n for key, n in pieces.items() if key[0] == "free text"]
    assert free_text and all(n and min(n) >= 2 for n in free_text), pieces
    print("\ncalls at T=0:")
    for (name, choice), calls in greedy_calls.items():
        print(f"  {name:<20} {choice:<9} " + "; ".join(f"{n}({a})" for n, a in calls))
    assert not failures, "\n".join(failures)


async def test_max_tokens_cutting_a_forced_call_says_length_and_drops_it(server_url):
    case = CASES[5]  # the nested object: its call takes far more than 20 tokens, its name ~13
    async with httpx.AsyncClient(base_url=server_url, timeout=600) as c:
        body = {**body_for(case, "named", 0.0, None), "max_tokens": 20}
        unary = (await c.post("/v1/chat/completions", json=body)).json()
        stream = await streamed(c, body)
    for out in (unary, stream):
        ch = out["choices"][0]
        assert ch["finish_reason"] == "length", ch
        assert not (ch["message"]["content"] or "").strip(), ch  # nor the call's text given back as content
        assert out["usage"]["completion_tokens"] == 20
    assert "tool_calls" not in unary["choices"][0]["message"], unary  # never a broken call
    # the stream showed the call as it was written, and its end says it was cut
    (shown,) = stream["choices"][0]["message"].get("tool_calls") or [None]
    assert shown["function"]["name"] == case[2], shown
    with pytest.raises(ValueError):
        json.loads(shown["function"]["arguments"])
