"""``hf2q chat``: the pure parts (commands, history, delta rendering), then the real client in a
pseudo-terminal against a real ``hf2q serve`` on SmolLM2, and once in process.

The reference for what the client shows is the server's own non-streamed answer to the same
messages at temperature 0: a client that lost the history, kept it across ``/reset`` or dropped
streamed text prints something else.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pexpect
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf2q.chat import (
    CONTENT,
    REASONING,
    TOOL,
    Command,
    History,
    Options,
    ReplyRenderer,
    chat_loop,
    parse_line,
    sse_deltas,
)
from hf2q.errors import InputError, UsageError

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


# ---- pure parts ------------------------------------------------------------------------------------

def test_commands_are_parsed_and_bad_ones_refused():
    assert parse_line("  hello  ") == Command("say", "hello")
    assert parse_line("") == Command("none")
    assert parse_line("/reset") == Command("reset")
    assert parse_line("/EXIT") == Command("exit")
    assert parse_line("/system  Be terse. ") == Command("system", "Be terse.")
    assert parse_line("/system") == Command("system", "")
    assert parse_line("//etc/hosts") == Command("say", "/etc/hosts")
    with pytest.raises(UsageError, match="unknown command '/frobnicate'"):
        parse_line("/frobnicate")
    with pytest.raises(UsageError, match="takes no argument"):
        parse_line("/reset now")


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_any_line_is_a_message_a_command_or_one_clear_refusal(line):
    try:
        cmd = parse_line(line)
    except UsageError as e:
        assert "\n" not in str(e).strip() or "\n" in line
        return
    if not line.strip().startswith("/"):
        assert cmd == (Command("say", line.strip()) if line.strip() else Command("none"))


def test_history_keeps_system_across_reset_and_a_new_system_resets():
    h = History(system="S")
    h.record("q1", {"role": "assistant", "content": "a1"})
    assert h.messages("q2") == [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
                                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    h.reset()
    assert h.messages("q3") == [{"role": "system", "content": "S"}, {"role": "user", "content": "q3"}]
    h.record("q3", {"role": "assistant", "content": "a3"})
    h.set_system("")
    assert h.messages() == []


def test_renderer_sets_reasoning_apart_and_prints_tool_calls():
    r = ReplyRenderer()
    deltas = [{"role": "assistant", "content": ""}, {"reasoning_content": "let me "}, {"reasoning_content": "think"},
              {"content": "Calling."},
              {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
              {"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                               "function": {"name": "now", "arguments": "{}"}}]}]
    pieces = [p for d in deltas for p in r.feed(d)] + r.finish()
    assert [p for p in pieces if p[0] == REASONING] == [(REASONING, "let me "), (REASONING, "think")]
    shown = "".join(t for _, t in pieces)
    assert shown == 'let me think\nCalling.\n→ get_weather({"city": "Paris"})\n→ now({})\n'
    assert {s for s, _ in pieces} == {REASONING, CONTENT, TOOL}
    assert r.message() == {"role": "assistant", "content": "Calling.", "reasoning_content": "let me think",
                           "tool_calls": [
                               {"id": "call_a", "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                               {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}
    assert "tool_calls" not in r.message(complete=False)  # a stopped reply keeps no half-written call


def test_sse_frames_keepalives_and_errors():
    frames = [": keep-alive", "", 'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}', "",
              'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}', "data: [DONE]",
              'data: {"choices":[{"index":0,"delta":{"content":"after done"}}]}']
    assert list(sse_deltas(frames)) == [{"content": "Hi"}]
    with pytest.raises(InputError, match="server error: the engine is gone"):
        list(sse_deltas(['data: {"error":{"message":"the engine is gone","code":"engine_unhealthy"}}']))
    with pytest.raises(InputError, match="not JSON"):
        list(sse_deltas(["data: {oops"]))


def test_options_body_names_only_what_was_set():
    assert Options().body([]) == {"messages": []}
    assert Options(temperature=0.0, max_tokens=5, thinking=False).body([{"role": "user", "content": "x"}]) == {
        "messages": [{"role": "user", "content": "x"}], "temperature": 0.0, "max_tokens": 5,
        "chat_template_kwargs": {"enable_thinking": False}}
    tool = {"type": "function", "function": {"name": "f"}}
    assert Options(tools=(tool,), tool_choice="required").body([])["tool_choice"] == "required"
    assert Options(tools=(tool,), tool_choice="f").body([])["tool_choice"] == {"type": "function",
                                                                               "function": {"name": "f"}}


class _ScriptedBackend:
    """Replays deltas; ``interrupt_after`` raises Ctrl-C mid-reply as the terminal would."""

    def __init__(self, replies, interrupt_after=None):
        self.replies, self.interrupt_after, self.bodies = list(replies), interrupt_after, []

    def stream(self, body, on_delta):
        self.bodies.append(body)
        for i, d in enumerate(self.replies.pop(0)):
            if self.interrupt_after is not None and i == self.interrupt_after:
                self.interrupt_after = None
                raise KeyboardInterrupt
            on_delta(d)


def _lines(*items):
    it = iter(items)

    def read():
        item = next(it)
        if isinstance(item, BaseException) or (isinstance(item, type) and issubclass(item, BaseException)):
            raise item
        return item
    return read


def _console():
    from rich.console import Console

    buf = io.StringIO()
    return Console(file=buf, force_terminal=False, width=200), buf


def test_loop_ctrl_c_stops_a_reply_and_twice_at_the_prompt_leaves():
    backend = _ScriptedBackend([[{"content": "one "}, {"content": "two "}, {"content": "three"}],
                                [{"content": "ok"}]], interrupt_after=2)
    console, buf = _console()
    h = History()
    code = chat_loop(backend, Options(), h, console,
                     _lines("count", "/bogus", "again", KeyboardInterrupt, "/reset", KeyboardInterrupt,
                            KeyboardInterrupt))
    assert code == 130
    out = buf.getvalue()
    assert "one two \n(stopped)" in out and "three" not in out and "unknown command '/bogus'" in out
    assert "Ctrl-C again" in out and "(conversation reset)" in out
    # the stopped reply stayed in the history as shown; the second request carried it
    assert backend.bodies[1]["messages"] == [{"role": "user", "content": "count"},
                                             {"role": "assistant", "content": "one two "},
                                             {"role": "user", "content": "again"}]
    assert h.turns == []


def test_loop_ctrl_d_leaves_with_0_and_a_failed_turn_is_not_recorded():
    class Failing:
        def stream(self, body, on_delta):
            on_delta({"content": "par"})
            raise InputError("server answered 503: loading")

    console, buf = _console()
    h = History()
    assert chat_loop(Failing(), Options(), h, console, _lines("hi", EOFError)) == 0
    assert "error: server answered 503: loading" in buf.getvalue() and h.turns == []


def test_tools_file_errors_are_one_line(tmp_path):
    bad = tmp_path / "tools.json"
    bad.write_text('{"not": "a list"}')
    r = subprocess.run([sys.executable, "-m", "hf2q", "chat", "--url", "http://127.0.0.1:9/v1", "--tools", str(bad)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert r.returncode == 3 and r.stderr.strip().count("\n") == 0 and "JSON array" in r.stderr
    r = subprocess.run([sys.executable, "-m", "hf2q", "chat", "--url", "http://x/v1", "--model", "m.gguf"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "not both" in r.stderr


# ---- the real client in a pseudo-terminal ---------------------------------------------------------

@pytest.fixture(scope="module")
def server(smollm2_gguf):
    from tests.test_server_command import start_server, wait_ready

    proc, url = start_server("serve", "--model", str(smollm2_gguf), "--port", "0", "--slots", "1", "--ctx", "2048",
                             "--operator-ui", "plain", "--api-key", "k-chat")
    try:
        wait_ready(url, proc, {"Authorization": "Bearer k-chat"})
        yield url
    finally:
        proc.terminate()  # SIGTERM drains; a server that hangs on it fails the teardown
        proc.wait(60)


MAX_TOKENS = 40


def _reference(url: str, messages: list[dict]) -> str:
    r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": "Bearer k-chat"}, timeout=300,
                   json={"messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _client_cancellations(url: str) -> float:
    text = httpx.get(url + "/metrics", headers={"Authorization": "Bearer k-chat"}, timeout=30).text
    m = re.search(r'^hf2q_cancellations_total\{why="client"\} ([0-9.e+]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _spawn(*args: str):
    return pexpect.spawn(sys.executable, ["-m", "hf2q", "chat", *args], cwd=str(ROOT), encoding="utf-8",
                          timeout=120, dimensions=(40, 250), env={"PATH": "/usr/bin:/bin", "TERM": "xterm",
                                                                  "HOME": str(Path.home())})


def _send(child, line: str) -> None:
    """Type a line and wait for the terminal's echo of it, so what follows is the program's answer."""
    child.sendline(line)
    child.expect_exact(line)


def _answer_after(child, question: str) -> str:
    """Send a line; the text printed before the next prompt (escape codes removed)."""
    _send(child, question)
    child.expect_exact("you> ")
    return ANSI.sub("", child.before).strip()


def test_chat_against_the_real_server_in_a_terminal(server):
    q1, q2 = "What is the capital of France?", "And of Italy?"
    ref1 = _reference(server, [{"role": "user", "content": q1}])
    ref_follow = _reference(server, [{"role": "user", "content": q1}, {"role": "assistant", "content": ref1},
                                     {"role": "user", "content": q2}])
    ref2 = _reference(server, [{"role": "user", "content": q2}])
    assert ref_follow != ref2, "the history must change the answer for this test to see it"

    child = _spawn("--url", server + "/v1", "--api-key", "k-chat", "--temperature", "0",
                      "--max-tokens", str(MAX_TOKENS))
    try:
        child.expect_exact("you> ")
        assert _answer_after(child, q1) == ref1.strip()
        assert _answer_after(child, q2) == ref_follow.strip()  # the first turn went with the second
        _send(child, "/reset")
        child.expect_exact("(conversation reset)")
        child.expect_exact("you> ")
        assert _answer_after(child, q2) == ref2.strip()  # and /reset forgot it
        _send(child, "/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_ctrl_c_stops_a_reply_and_the_server_sees_the_client_leave(server):
    child = _spawn("--url", server + "/v1", "--api-key", "k-chat", "--max-tokens", "1500",
                      "--system", "You write very long stories.")
    try:
        child.expect_exact("you> ")
        before = _client_cancellations(server)
        _send(child, "Tell me a long story about a dragon and a knight.")
        child.expect(r"\w+ \w+ \w+")  # streamed words are arriving
        t0 = time.monotonic()
        child.sendintr()
        child.expect_exact("(stopped)")
        child.expect_exact("you> ")
        assert time.monotonic() - t0 < 10
        deadline = time.monotonic() + 20
        while _client_cancellations(server) <= before:
            assert time.monotonic() < deadline, "the server never saw the request cancelled"
            time.sleep(0.2)
        _answer_after(child, "/help")  # still talking
        child.sendeof()  # Ctrl-D leaves with 0
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_forced_tool_call_is_shown_as_the_server_makes_it(server, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER]))
    q = "What is the weather in Paris?"
    r = httpx.post(server + "/v1/chat/completions", headers={"Authorization": "Bearer k-chat"}, timeout=300,
                   json={"messages": [{"role": "user", "content": q}], "tools": [WEATHER],
                         "tool_choice": "required", "temperature": 0, "max_tokens": 64})
    assert r.status_code == 200, r.text
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    child = _spawn("--url", server + "/v1", "--api-key", "k-chat", "--temperature", "0", "--max-tokens", "64",
                   "--tools", str(tools), "--tool-choice", "required")
    try:
        child.expect_exact("you> ")
        shown = _answer_after(child, q)
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert f"→ {call['name']}(" in shown
    args = shown.split(f"→ {call['name']}(", 1)[1].rsplit(")", 1)[0]
    assert json.loads(args) == json.loads(call["arguments"])
    assert child.exitstatus == 0


def test_chat_in_process_matches_the_server(server, smollm2_gguf):
    q = "What is the capital of France?"
    ref = _reference(server, [{"role": "user", "content": q}])
    child = _spawn("--model", str(smollm2_gguf), "--temperature", "0", "--max-tokens", str(MAX_TOKENS))
    try:
        child.expect_exact("you> ", timeout=180)
        assert _answer_after(child, q) == ref.strip()
        child.sendintr()  # at the prompt: asks for a second
        child.expect_exact("Ctrl-C again")
        child.sendintr()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 130


def test_help_lists_the_commands():
    r = subprocess.run([sys.executable, "-m", "hf2q", "chat", "--help"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 0 and "--url" in r.stdout and "--api-key" in r.stdout


def test_ctrl_c_works_when_the_parent_left_sigint_ignored():
    """A chat started with SIGINT ignored (what a background job or some runners pass on) still takes Ctrl-C:
    at the prompt it asks for a second, then leaves with 130. No server is needed before the first message."""
    import signal

    child = pexpect.spawn(sys.executable, ["-m", "hf2q", "chat", "--url", "http://127.0.0.1:9/v1"], cwd=str(ROOT),
                          encoding="utf-8", timeout=60, dimensions=(40, 250),
                          env={"PATH": "/usr/bin:/bin", "TERM": "xterm", "HOME": str(Path.home())},
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        child.expect_exact("you> ")
        child.sendintr()
        child.expect_exact("Ctrl-C again", timeout=10)
        child.sendintr()
        child.expect(pexpect.EOF, timeout=10)
    finally:
        child.close(force=True)
    assert child.exitstatus == 130
