"""``hf2q chat``: a terminal conversation with a model, in this process or through a running server.

Both backends produce the same thing, the ``delta`` objects of OpenAI-style streamed chunks
(``content``, ``reasoning_content``, ``tool_calls``): the server sends them over SSE, and the
in-process backend builds them with the server's own text pipeline (``GGUFChatModel`` and its
output decoder), so a reply looks the same either way. The pure parts — parsing what the user
typed, the conversation history, turning deltas into styled text — know nothing of terminals or
sockets, so tests drive them directly; ``run`` is the only place with a prompt and a console.

Ctrl-C while a reply streams stops that reply (the partial text stays in the history, as it was
shown); Ctrl-C at an empty prompt asks for a second one, which leaves (exit 130). ``/exit`` and
Ctrl-D leave with 0.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hf2q.errors import InputError, UsageError

PROMPT = "you> "
HELP = ("commands: /reset (forget the conversation), /system TEXT (set the system message and reset), "
        "/exit (or Ctrl-D); Ctrl-C stops a reply")


# ---- what the user typed ------------------------------------------------------------------------

@dataclass(frozen=True)
class Command:
    """One input line: ``say`` (a message to send), ``reset``, ``system``, ``exit``, ``help`` or ``none``."""

    kind: str
    text: str = ""


_COMMANDS = {"/reset": "reset", "/system": "system", "/exit": "exit", "/quit": "exit", "/help": "help"}


def parse_line(line: str) -> Command:
    """A line starting with ``/`` is a command (``//text`` sends ``/text``); a blank line is nothing."""
    stripped = line.strip()
    if not stripped:
        return Command("none")
    if stripped.startswith("//"):
        return Command("say", stripped[1:])
    if not stripped.startswith("/"):
        return Command("say", stripped)
    word, _, rest = stripped.partition(" ")
    kind = _COMMANDS.get(word.lower())
    if kind is None:
        raise UsageError(f"unknown command {word!r}; {HELP}")
    if kind == "system":
        return Command("system", rest.strip())
    if rest.strip():
        raise UsageError(f"{word} takes no argument")
    return Command(kind)


# ---- the conversation -----------------------------------------------------------------------------

@dataclass
class History:
    """The messages sent with every request: the system message (kept across ``/reset``) and the turns."""

    system: str | None = None
    turns: list[dict] = field(default_factory=list)

    def messages(self, pending_user: str | None = None) -> list[dict]:
        out = [{"role": "system", "content": self.system}] if self.system else []
        out += self.turns
        if pending_user is not None:
            out.append({"role": "user", "content": pending_user})
        return out

    def record(self, user: str, assistant: dict) -> None:
        self.turns += [{"role": "user", "content": user}, assistant]

    def reset(self) -> None:
        self.turns.clear()

    def set_system(self, text: str) -> None:
        """A new system message starts a new conversation (the old turns were answered under the old one)."""
        self.system = text or None
        self.reset()


# ---- turning deltas into styled text --------------------------------------------------------------

REASONING, CONTENT, TOOL = "reasoning", "content", "tool"


@dataclass
class _Call:
    name: str = ""
    call_id: str = ""
    arguments: str = ""


class ReplyRenderer:
    """Streamed ``delta`` objects → ``(style, text)`` pieces to print, and the assistant message they add up to.

    Reasoning and answer are set apart by a line break where one follows the other; a tool call
    prints as ``→ name(arguments)`` with its arguments as they stream.
    """

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, _Call] = {}
        self._last: str | None = None
        self._open_call: int | None = None

    def _switch(self, kind: str, out: list[tuple[str, str]]) -> None:
        if self._open_call is not None and kind != TOOL:
            out.append((TOOL, ")"))
            self._open_call = None
        if self._last is not None and self._last != kind:
            out.append((CONTENT, "\n"))
        self._last = kind

    def feed(self, delta: dict) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if text := delta.get("reasoning_content"):
            self._switch(REASONING, out)
            self.reasoning.append(text)
            out.append((REASONING, text))
        if text := delta.get("content"):
            self._switch(CONTENT, out)
            self.content.append(text)
            out.append((CONTENT, text))
        for tc in delta.get("tool_calls") or ():
            index = int(tc.get("index", 0))
            fn = tc.get("function") or {}
            call = self.calls.get(index)
            if call is None:
                self._switch(TOOL, out)
                if self._open_call is not None:
                    out.append((TOOL, ")\n"))
                call = self.calls[index] = _Call(name=fn.get("name") or "", call_id=tc.get("id") or "")
                self._open_call = index
                out.append((TOOL, f"→ {call.name}("))
            if args := fn.get("arguments"):
                call.arguments += args
                out.append((TOOL, args))
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What closes the reply on screen: an open call's parenthesis and the final line break."""
        out = [(TOOL, ")")] if self._open_call is not None else []
        self._open_call = None
        return out + [(CONTENT, "\n")]

    def message(self, *, complete: bool = True) -> dict:
        """The assistant turn for the history; a stopped reply keeps its text but no half-written calls."""
        msg: dict = {"role": "assistant", "content": "".join(self.content)}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if complete and self.calls:
            msg["tool_calls"] = [{"id": c.call_id or f"call_{i}", "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for i, c in sorted(self.calls.items())]
        return msg


def sse_deltas(lines: Iterable[str]) -> Iterator[dict]:
    """The ``delta`` objects of an SSE stream of chat-completion chunks; an error frame is an error."""
    for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, ": keep-alive" comments
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            raise InputError(f"the server sent a frame that is not JSON: {data[:80]!r}") from None
        if "error" in obj:
            err = obj["error"] if isinstance(obj["error"], dict) else {"message": obj["error"]}
            raise InputError(f"server error: {err.get('message', err)}")
        for choice in obj.get("choices") or ():
            if choice.get("delta"):
                yield choice["delta"]


# ---- backends ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Options:
    """Request settings shared by both backends (None: the model's default)."""

    temperature: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    thinking: bool = True
    tools: tuple[dict, ...] = ()
    tool_choice: str | None = None  # auto | required | none | a function's name

    def body(self, messages: list[dict]) -> dict:
        body: dict = {"messages": messages}
        for key in ("temperature", "max_tokens", "seed"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        if not self.thinking:
            body["chat_template_kwargs"] = {"enable_thinking": False}
        if self.tools:
            body["tools"] = list(self.tools)
        if self.tool_choice in ("auto", "required", "none"):
            body["tool_choice"] = self.tool_choice
        elif self.tool_choice:
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice}}
        return body


class HttpBackend:
    """A running OpenAI-compatible server (``/v1/chat/completions``, streamed)."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0):
        import httpx

        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0))
        self._httpx = httpx

    def describe(self) -> str:
        return self.url

    def stream(self, body: dict, on_delta: Callable[[dict], None]) -> None:
        httpx = self._httpx
        try:
            with self._client.stream("POST", self.url + "/chat/completions", json={**body, "stream": True}) as r:
                if r.status_code != 200:
                    r.read()
                    raise InputError(f"server answered {r.status_code}: {_error_message(r)}")
                for delta in sse_deltas(r.iter_lines()):
                    on_delta(delta)
        except httpx.HTTPError as e:
            raise InputError(f"cannot talk to {self.url}: {e}") from None

    def close(self) -> None:
        self._client.close()


def _error_message(response) -> str:
    try:
        err = response.json().get("error", {})
        return err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except ValueError:
        return response.text[:200]


class _Stopped(Exception):
    """Raised from the token callback to end an in-process generation (a stop string was hit)."""


class LocalBackend:
    """The model loaded in this process; prompts and replies go through the server's text pipeline."""

    def __init__(self, model_path: Path, ctx: int | None = None, kv_cache_type: str = "f16"):
        from hf2q.api.textbridge import GGUFChatModel
        from hf2q.engine.factory import load_runner
        from hf2q.engine.generate import check_generative_model

        header = check_generative_model(model_path)
        self.model_path = model_path
        self.chat_model = GGUFChatModel.from_gguf(model_path, model_path.stem)
        self.runner = load_runner(header, ctx=ctx, kv_cache_type=kv_cache_type)
        if self.runner.is_embedding_model:
            raise InputError(f"{model_path.name} is an embedding model; chat needs a chat model")

    def describe(self) -> str:
        return self.model_path.name

    def stream(self, body: dict, on_delta: Callable[[dict], None]) -> None:
        from hf2q.api.errors import ApiError
        from hf2q.api.shapes import delta_json
        from hf2q.api.validation import parse_chat_request
        from hf2q.engine.generate import generate_once

        try:
            prepared = self.chat_model.prepare(parse_chat_request(body), self.runner.n_ctx)
        except ApiError as e:
            raise InputError(e.message) from None
        decoder = prepared.new_decoder()

        def emit(deltas) -> None:
            for d in deltas:
                if (dj := delta_json(d)) is not None:
                    on_delta(dj)

        def on_token(token: int) -> None:
            emit(decoder.feed(token))
            if decoder.stop_hit:
                raise _Stopped

        try:
            generate_once(self.runner, list(prepared.prompt_tokens), prepared.params, on_token=on_token)
        except _Stopped:
            pass
        emit(decoder.finish())

    def close(self) -> None:
        pass


# ---- the terminal loop -----------------------------------------------------------------------------

_STYLES = {REASONING: "dim", CONTENT: "", TOOL: "cyan"}


def _read_line() -> str:
    return input(PROMPT)


def chat_loop(backend, options: Options, history: History, console, read_line=_read_line) -> int:
    """Prompt, send, stream, repeat; returns the exit code."""
    interrupted_at_prompt = False
    while True:
        try:
            line = read_line()
        except EOFError:
            console.print()
            return 0
        except KeyboardInterrupt:
            if interrupted_at_prompt:
                console.print()
                return 130
            interrupted_at_prompt = True
            console.print("\n(Ctrl-C again, /exit or Ctrl-D to leave)", style="dim")
            continue
        interrupted_at_prompt = False
        try:
            cmd = parse_line(line)
        except UsageError as e:
            console.print(str(e), style="yellow", markup=False)
            continue
        if cmd.kind == "none":
            continue
        if cmd.kind == "exit":
            return 0
        if cmd.kind == "help":
            console.print(HELP, style="dim", markup=False)
            continue
        if cmd.kind == "reset":
            history.reset()
            console.print("(conversation reset)", style="dim")
            continue
        if cmd.kind == "system":
            history.set_system(cmd.text)
            console.print("(system message set; conversation reset)" if cmd.text else
                          "(system message cleared; conversation reset)", style="dim")
            continue
        _one_reply(backend, options, history, cmd.text, console)


def _one_reply(backend, options: Options, history: History, text: str, console) -> None:
    renderer = ReplyRenderer()

    def show(pieces) -> None:
        for style, piece in pieces:
            console.print(piece, style=_STYLES[style] or None, end="", markup=False, highlight=False,
                          soft_wrap=True)

    complete = True
    try:
        backend.stream(options.body(history.messages(text)), lambda d: show(renderer.feed(d)))
    except KeyboardInterrupt:
        complete = False
        show(renderer.finish())
        console.print("(stopped)", style="dim")
    except InputError as e:
        show(renderer.finish())
        console.print(f"error: {e}", style="red", markup=False)
        return  # the turn did not happen
    else:
        show(renderer.finish())
    history.record(text, renderer.message(complete=complete))


def _load_tools(path: str | None) -> tuple[dict, ...]:
    if not path:
        return ()
    try:
        tools = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"cannot read --tools: {e.strerror}: {path}") from None
    except json.JSONDecodeError as e:
        raise InputError(f"--tools {path}: not JSON: {e.msg} (line {e.lineno})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InputError(f"--tools {path}: expected a JSON array of tool objects")
    return tuple(tools)


def _own_ctrl_c() -> None:
    """Ctrl-C must stop a reply even when this process inherited SIGINT as ignored (a parent that ignores it, such
    as a background job or a test runner, passes that on, and Python then installs no KeyboardInterrupt handler)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def run(args) -> int:
    _own_ctrl_c()
    from rich.console import Console

    try:
        import readline  # noqa: F401 — line editing and history for input()
    except ImportError:
        pass
    if args.url and args.model:
        raise UsageError("give --model (in process) or --url (a server), not both")
    if args.tool_choice and not args.tools:
        raise UsageError("--tool-choice needs --tools")
    if args.url and getattr(args, "kv_cache_type", "f16") != "f16":
        raise UsageError("--kv-cache-type is for a model loaded here; a server sets its own (serve --kv-cache-type)")
    options = Options(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                      thinking=not args.no_thinking, tools=_load_tools(args.tools), tool_choice=args.tool_choice)
    console = Console(highlight=False)
    if args.url:
        backend = HttpBackend(args.url, args.api_key)
    else:
        if args.model:
            model_path = Path(args.model)
        else:
            from hf2q.fetch import default_chat_model

            model_path = default_chat_model()
        console.print(f"loading {model_path.name}…", style="dim", markup=False)
        backend = LocalBackend(model_path, ctx=args.ctx, kv_cache_type=getattr(args, "kv_cache_type", "f16"))
    console.print(f"hf2q chat — {backend.describe()}\n{HELP}", style="dim", markup=False)
    try:
        return chat_loop(backend, options, History(system=args.system), console)
    finally:
        backend.close()
