"""Helpers for the HTTP tests: a scripted text side and a real server on an ephemeral port.

``ScriptedChatModel`` implements ``hf2q.api.chatmodel.ChatModel`` with a byte-level
"tokenizer" (prompt ids = UTF-8 bytes of the rendered messages) and a decoder that maps a
generated id ``t`` to the letter ``chr(97 + t % 26)``; with tools it plays a scripted tool
call whose JSON arguments arrive a few characters per token. The runtime is the real actor
system (``hf2q.actors.runtime.open_runtime``) over the fake ModelRunner of ``tests/fakes``,
whose greedy next token is a known function of the history (``expected_next_token``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import attrs
import trio

from hf2q.sched.contracts import RuntimeConfig

from hf2q.actors.runtime import open_runtime
from hf2q.api.app import ServerContext
from hf2q.api.chatmodel import PreparedChat
from hf2q.api.server import serve
from hf2q.api.shapes import (
    ContentDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
    new_tool_call_id,
)
from hf2q.api.validation import ChatRequest
from hf2q.sched.contracts import SamplingParams
from tests.fakes import FakeModelRunner, expected_next_token

VOCAB = 256  # prompt ids are UTF-8 bytes

TOOL_ARGUMENTS = {"city": "Paris \"Ünïcødé\" ✓ \\n {}", "days": 3}


class LetterDecoder:
    def __init__(self):
        self.stop_hit = False
        self.stop_cause = None

    def feed(self, token_id: int):
        return [ContentDelta(chr(97 + token_id % 26))]

    def finish(self):
        return []


class ScriptedToolDecoder:
    """Emits one tool call whose arguments take ``ceil(len/3)`` tokens, then stops."""

    def __init__(self, name: str):
        self.name = name
        self.args = json.dumps(TOOL_ARGUMENTS, ensure_ascii=False)
        self.pos = -1
        self.stop_hit = False
        self.stop_cause = None

    def feed(self, token_id: int):
        if self.pos < 0:
            self.pos = 0
            return [ToolCallStart(0, new_tool_call_id(), self.name)]
        piece = self.args[self.pos:self.pos + 3]
        self.pos += 3
        out = [ToolCallArgs(0, piece)]
        if self.pos >= len(self.args):
            out.append(ToolCallEnd(0))
            self.stop_hit, self.stop_cause = True, "tool_call_limit"
        return out

    def finish(self):
        return []


@attrs.define
class ScriptedChatModel:
    runner: FakeModelRunner
    model_id: str = "scripted"
    last_prompt: tuple[int, ...] = ()
    tool_arguments: dict = attrs.field(factory=lambda: TOOL_ARGUMENTS)

    def prepare(self, req: ChatRequest, max_context: int | None, stable_prefix: bool = True) -> PreparedChat:
        text = "\n".join(f"{m['role']}: {m['content'] or ''}" for m in req.messages)
        ids = tuple(text.encode())
        self.last_prompt = ids
        params = SamplingParams(max_tokens=req.max_tokens or 16, temperature=req.temperature or 0.0,
                                logprobs=req.logprobs, top_logprobs=req.top_logprobs)
        if req.tools_active:
            name = req.forced_tool or req.tools[0]["function"]["name"]
            return PreparedChat(ids, params, lambda: ScriptedToolDecoder(name))
        return PreparedChat(ids, params, LetterDecoder)

    def decode_tokens(self, ids) -> str:
        return "".join(chr(97 + t % 26) for t in ids)

    def expected_text(self, n: int, prompt: tuple[int, ...] | None = None) -> str:
        """What greedy decoding of the fake model yields after the last prompt (independent rule)."""
        history = list(self.last_prompt if prompt is None else prompt)
        out = []
        for _ in range(n):
            t = expected_next_token(history, self.runner.vocab_size, self.runner.eos_token_id)
            history.append(t)
            out.append(chr(97 + t % 26))
        return "".join(out)


@attrs.define
class ByteEmbeddingModel:
    """Token ids = UTF-8 bytes (the fake embedding runner accepts any ids)."""

    model_id: str = "embedder"

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


@attrs.define
class ServerUnderTest:
    url: str
    model: ScriptedChatModel
    runtime: object
    runner: FakeModelRunner
    ctx: int
    handle: object
    stopped: trio.Event

    def inject_fault(self):
        self.runner.inject_fault("decode")

    def cancelled_count(self) -> int:
        return self.runtime.snapshot().counters.get("cancelled", 0)

    async def wait_idle(self):
        with trio.fail_after(10):
            while True:
                snap = self.runtime.snapshot()
                if snap.queue_depth == 0 and all(s.phase == "idle" for s in snap.slots):
                    return
                await trio.sleep(0.02)

    async def wait_stopped(self):
        with trio.fail_after(10):
            await self.stopped.wait()


@asynccontextmanager
async def open_test_server(*, api_key=None, cors_origins=(), max_request_bytes=1 << 20, slots=2,
                           queue_capacity=4, keepalive_s=15.0, token_delay=0.002, prefill_delay=0.0,
                           ctx=2048, prefill_chunk=2048, embeddings=False,
                           kv_store=None, chat_model=None, vocab=VOCAB) -> AsyncIterator[ServerUnderTest]:
    """``chat_model`` replaces the scripted text side (e.g. a real ``GGUFChatModel``; give the
    fake runner its ``vocab`` then)."""
    runner = FakeModelRunner(vocab_size=vocab, n_ctx_train=ctx, step_latency_s=token_delay,
                             prefill_latency_per_token_s=prefill_delay)
    model = chat_model if chat_model is not None else ScriptedChatModel(runner=runner)
    config = RuntimeConfig(slots=slots, ctx=ctx, queue_capacity=queue_capacity, prefill_chunk=prefill_chunk,
                           gpu_deadline_s=20)
    embed_runner = FakeModelRunner(vocab_size=VOCAB, is_embedding_model=True, embedding_dim=16)
    async with AsyncExitStack() as stack:
        runtime = await stack.enter_async_context(open_runtime(runner.factory(), config, kv_store=kv_store))
        embed_runtime = await stack.enter_async_context(
            open_runtime(embed_runner.factory(), RuntimeConfig(slots=1))) if embeddings else None
        nursery = await stack.enter_async_context(trio.open_nursery())
        assert await runtime.wait_ready()
        if embed_runtime is not None:
            assert await embed_runtime.wait_ready()
        sctx = ServerContext(runtime=runtime, chat_model=model, model_id=model.model_id, api_key=api_key,
                             cors_origins=tuple(cors_origins), max_request_bytes=max_request_bytes,
                             keepalive_s=keepalive_s, embed_runtime=embed_runtime,
                             embed_model=ByteEmbeddingModel() if embeddings else None, kv_store=kv_store)
        stopped = trio.Event()

        async def run_server(task_status=trio.TASK_STATUS_IGNORED):
            try:
                await serve(sctx, "127.0.0.1", 0, drain_timeout=5, graceful_timeout=1, task_status=task_status)
            finally:
                stopped.set()

        handle = await nursery.start(run_server)
        try:
            yield ServerUnderTest(handle.url, model, runtime, runner, ctx, handle, stopped)
        finally:
            handle.request_stop()
            with trio.move_on_after(10):
                await stopped.wait()
            nursery.cancel_scope.cancel()


async def sse_events(response) -> AsyncIterator[str]:
    """The ``data:`` payloads of an SSE response, in order (comments skipped)."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]
