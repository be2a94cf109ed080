"""The served model's text side, built from ``hf2q.text``: the real ``ChatModel`` of ``hf2q serve``.

``GGUFChatModel.prepare`` renders the GGUF's chat template (with ``tools`` when the
template has a tool syntax; otherwise the generic JSON tool instructions go into the system
message), tokenizes, and builds ``SamplingParams`` (stop token ids, and a constraint for
``response_format`` / forced tool calls). ``ChatOutputDecoder`` is the per-request pipeline
that turns generated ids into API deltas, in this order:

    ids → incremental detokenizer → stop strings (held back until they cannot match)
        → reasoning splitter (``<think>`` … → reasoning_content) → tool-call parser → deltas

Message text is text: a control token's string inside a message (``<|im_end|>`` in user
content) is tokenized as plain text, never as the control token, while the template's own
markup keeps its special tokens. Contents that hold such a string are fenced with a per-request
random marker before rendering, and the rendered prompt is tokenized span by span
(``_fence_contents``, ``_Fence.spans``; docs/API.md, "Prompt text"); so are tool definitions.

Every call into ``hf2q.text`` goes through the few adapter functions at the top of this
module, so an API change there is a one-place change here. No MLX is imported.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from hf2q.api.errors import ApiError
from hf2q.api.images import IMAGE_MARKER
from hf2q.api.shapes import (
    ContentDelta,
    OutputDelta,
    ReasoningDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
    new_tool_call_id,
)
from hf2q.api.validation import ChatRequest
from hf2q.errors import InputError
from hf2q.sched.contracts import SamplingParams

# llama.cpp's server defaults: a request that names no sampling knob still samples sensibly
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_P = 0.95
DEFAULT_TOP_K = 40
DEFAULT_MIN_P = 0.05


# ---- adapters over hf2q.text (the only places that know its API) -------------------------------

def _load_tokenizer(path: Path):
    from hf2q.text.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_gguf(path)


def _load_template(path: Path):
    from hf2q.text.chat_template import CHATML, ChatTemplate

    return ChatTemplate.from_gguf(path, fallback=CHATML)  # llama.cpp also falls back to ChatML


def _tool_syntax(template) -> str:
    from hf2q.text import toolcalls

    return toolcalls.detect_syntax(getattr(template, "source", None))


def _tool_parser(syntax: str, tools):
    from hf2q.text import toolcalls

    return toolcalls.make_parser(syntax, tools)


def _generic_messages(messages: list[dict], tools, tool_choice) -> list[dict]:
    from hf2q.text.generic_tools import messages_for_generic_template

    return messages_for_generic_template(messages, tools, tool_choice)


def _reasoning_splitter(template, prompt: str, syntax: str | None):
    if getattr(template, "thinking_markers", None) is None:
        return None  # the template has no reasoning syntax: all output is content
    from hf2q.text import reasoning, toolcalls

    return reasoning.splitter_for(template, prompt, toolcalls.reasoning_exits(syntax) if syntax else ())


def _stop_matcher(stops: Sequence[str]):
    from hf2q.text.stop_strings import StopStringMatcher

    return StopStringMatcher(list(stops))


def _reasoning_closing(template, prompt: str, render_without_thinking) -> str:
    """Text closing the reasoning block ``prompt`` leaves open ("" when it leaves none)."""
    markers = getattr(template, "thinking_markers", None)
    if markers is None:
        return ""
    from hf2q.text import reasoning

    if not reasoning.prompt_opens_reasoning(prompt, *markers):
        return ""
    return reasoning.closing_text(prompt, render_without_thinking(), markers[1])


def _constraint(tokenizer, req: ChatRequest, syntax, max_tokens: int, opening=lambda: "", fence=("", "")):
    """A ``SamplingParams.constraint`` for json_object / json_schema / forced tool calls, or None.
    ``opening()``: what the reply writes before the constrained part (an open reasoning block's close);
    ``fence``: what a JSON reply is written between."""
    forced = _forced(req)
    if req.response_format is None and not forced:
        return None
    try:
        from hf2q.text import constrained
    except ImportError:
        if req.response_format is not None:
            raise ApiError(400, "response_format needs constrained decoding, which this build lacks",
                           code="invalid_value", param="response_format") from None
        return None  # forced tool calls then rest on the instructions alone
    try:
        return constrained.for_request(tokenizer, response_format=req.response_format, tools=list(req.tools),
                                       tool_choice=req.tool_choice, syntax=syntax,
                                       parallel=req.parallel_tool_calls, max_tokens=max_tokens,
                                       opening=opening(), fence=fence)
    except InputError as e:
        raise ApiError(400, str(e), code="invalid_value",
                       param="tool_choice" if forced else "response_format") from None


_UNKNOWN = object()

#: message fields whose text the template copies into the prompt
_TEXT_FIELDS = ("content", "reasoning_content")


class _Fence:
    """A random pair of markers around message text, so the rendered prompt can be cut back
    into template markup and message text (private-use characters plus a nonce: no request
    can contain them by accident or guess them on purpose)."""

    def __init__(self):
        nonce = secrets.token_hex(8)
        self.open, self.close = f"\ue000{nonce}\ue001", f"\ue002{nonce}\ue003"

    def wrap(self, text: str) -> str:
        return f"{self.open}{text}{self.close}"

    def spans(self, rendered: str) -> list[tuple[str, bool]]:
        """``(text, is_message_text)`` pieces in order. A marker the template cut away (it
        sliced the text) leaves its partner unmatched; the unmatched one is dropped and that
        text is treated as markup, as it would have been without fencing."""
        out: list[tuple[str, bool]] = []
        pos, opened = 0, None
        for m in re.finditer(re.escape(self.open) + "|" + re.escape(self.close), rendered):
            if m.group(0) == self.open:
                if opened is not None:
                    out.append((rendered[opened:m.start()], False))  # an open never closed
                else:
                    out.append((rendered[pos:m.start()], False))
                opened = m.end()
            elif opened is not None:
                out.append((rendered[opened:m.start()], True))
                opened = None
            else:
                out.append((rendered[pos:m.start()], False))  # a close never opened
            pos = m.end()
        out.append((rendered[opened if opened is not None else pos:], False))
        return [(t, fenced) for t, fenced in out if t]


# ---- the ChatModel --------------------------------------------------------------------------------

class GGUFChatModel:
    def __init__(self, tokenizer, template, model_id: str):
        self.tokenizer = tokenizer
        self.template = template
        self.model_id = model_id
        self.template_source = getattr(template, "source", None)
        self._tool_syntax: Any = _UNKNOWN
        #: the image side (``hf2q.api.images.VisionInput``) when an mmproj is served with the model
        self.vision = None

    @property
    def tool_syntax(self) -> str:
        """The template's tool-call syntax (``generic``: none, our JSON format is taught); detected once."""
        if self._tool_syntax is _UNKNOWN:
            self._tool_syntax = _tool_syntax(self.template)
        return self._tool_syntax

    @classmethod
    def from_gguf(cls, path: Path, model_id: str) -> GGUFChatModel:
        return cls(_load_tokenizer(path), _load_template(path), model_id)

    @functools.cached_property
    def _control_texts(self) -> tuple[str, ...]:
        """Every control token's string (what special-token parsing would turn into that token)."""
        tok = self.tokenizer
        return tuple(sorted({tok.token_text(i) for i in getattr(tok, "special_ids", ())} - {""}))

    def _fence_contents(self, req: ChatRequest) -> tuple[ChatRequest, _Fence | None]:
        """``req`` with every message text (and tool-definition string) that holds a control
        token's string fenced; ``(req, None)`` when none does."""
        controls = self._control_texts

        def holds_control(text) -> bool:  # substring search: fast on megabytes, unlike a regex alternation
            return isinstance(text, str) and any(c in text for c in controls)
        fence, changed = _Fence(), False

        def fenced(value):
            """Tool definitions: every string holding a control token's string, at any depth."""
            nonlocal changed
            if holds_control(value):
                changed = True
                return fence.wrap(value)
            if isinstance(value, dict):
                return {k: fenced(v) for k, v in value.items()}
            if isinstance(value, list):
                return [fenced(v) for v in value]
            return value
        messages = []
        for m in req.messages:
            hits = [k for k in _TEXT_FIELDS if holds_control(m.get(k))]
            if hits:
                m = {**m, **{k: fence.wrap(m[k]) for k in hits}}
                changed = True
            messages.append(m)
        tools = tuple(fenced(t) for t in req.tools)
        if not changed:
            return req, None
        return attrs.evolve(req, messages=tuple(messages), tools=tools), fence

    def _encode_prompt(self, spans: list[tuple[str, bool]], text: str,
                       images: Sequence[tuple[str, str]] = ()) -> tuple[int, ...]:
        """Prompt ids: markup with special-token parsing, message text without; BOS as the
        model asks unless the template wrote it. Each image marker becomes the image's tokens."""
        tok = self.tokenizer
        bos_text = tok.token_text(tok.bos_id) if tok.bos_id is not None else None
        add_special = tok.add_bos and not (bos_text and text.startswith(bos_text))
        if len(spans) == 1 and not spans[0][1] and not images:
            return tuple(tok.encode(text, add_special=add_special, parse_special=True))
        ids: list[int] = []
        pending = list(images)
        try:
            for piece, is_message_text in spans:
                for k, part in enumerate(piece.split(IMAGE_MARKER) if images else [piece]):
                    if k:
                        ids += self._image_tokens(pending)
                    ids += tok.encode(part, add_special=False, parse_special=not is_message_text)
            if pending:
                raise ApiError(400, f"the chat template dropped {len(pending)} of the request's images",
                               code="invalid_value", param="messages")
        except BaseException:
            if images:
                self.vision.release(ids)  # the images already added: no request will prefill them
            raise
        if add_special:
            edges = tok.encode("", add_special=True)  # [BOS] and/or [EOS], as the model asks
            head = edges[:1] if tok.add_bos and tok.bos_id is not None else []
            ids = head + ids + edges[len(head):]
        return tuple(ids)

    def _image_tokens(self, pending: list[tuple[str, str]]) -> list[int]:
        if not pending:
            raise ApiError(400, "the chat template repeated an image", code="invalid_value", param="messages")
        param, url = pending.pop(0)
        return self.vision.tokens(url, param)

    # -- rendering --

    def _messages_for_template(self, req: ChatRequest) -> tuple[list[dict], list[dict] | None]:
        messages = [dict(m) for m in req.messages]
        tools = list(req.tools) if req.tools_active else None
        if self.tool_syntax == "generic":
            # the template has no tool syntax: tools, past calls and results become plain turns. The
            # tools stay in the system block even for tool_choice "none" (a note says not to call
            # one), so that switching tool_choice between turns keeps the prompt's prefix cached
            return _generic_messages(messages, list(req.tools) if req.tools else None, req.tool_choice), None
        for m in messages:
            if m.get("tool_calls"):
                calls = []
                for call in m["tool_calls"]:
                    # templates iterate arguments as a mapping (Qwen, Llama 3); keep the string when not JSON
                    try:
                        call = {**call, "function": {**call["function"],
                                                     "arguments": json.loads(call["function"]["arguments"])}}
                    except (ValueError, TypeError):
                        pass
                    calls.append(call)
                m["tool_calls"] = calls
        if self.tool_syntax == "gemma4":
            from hf2q.text.gemma4_turns import fold_tool_responses, reads_only_native_responses

            if reads_only_native_responses(self.template.source):
                messages = fold_tool_responses(messages)
        elif self.tool_syntax == "deepseek":
            from hf2q.text.deepseek4_turns import results_in_call_order

            messages = results_in_call_order(messages)
        return messages, tools

    def render(self, req: ChatRequest, add_generation_prompt: bool = True) -> str:
        messages, tools = self._messages_for_template(req)
        kwargs = dict(req.chat_template_kwargs)
        if req.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
            kwargs.setdefault("enable_thinking", _thinking(req))
        if self.tool_syntax == "deepseek" and (schema := _deepseek_schema(req)) is not None:
            kwargs.setdefault("response_format", schema)  # the template asks for it in its system block
        try:
            return self.template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
        except InputError as e:
            msg = str(e) if str(e).startswith("chat template") else f"chat template: {e}"
            raise ApiError(400, msg, code="invalid_value", param="messages") from None

    def _without_thinking(self, req: ChatRequest, fence: _Fence | None) -> str | None:
        """The prompt rendered with thinking off (None when the template refuses that)."""
        off = attrs.evolve(req, chat_template_kwargs={**req.chat_template_kwargs, "enable_thinking": False},
                           reasoning_effort=None)
        try:
            rendered = self.render(off)
        except ApiError:
            return None
        return "".join(piece for piece, _ in fence.spans(rendered)) if fence is not None else rendered

    def _stable_prefix(self, req: ChatRequest, fence: _Fence | None, text: str, ids: Sequence[int]) -> int:
        """Prompt tokens before the generation prompt: the rendered history, which the conversation's
        next request repeats (a prefill transaction ends there, ``hf2q.sched.transactions``). 0 when
        the history does not lead the prompt or the generation prompt does not tokenize on its own."""
        try:
            history = self.render(req, add_generation_prompt=False)
        except ApiError:
            return 0
        if fence is not None:
            history = "".join(piece for piece, _ in fence.spans(history))
        if not history or len(history) >= len(text) or not text.startswith(history):
            return 0
        tail = self.tokenizer.encode(text[len(history):], add_special=False, parse_special=True)
        n = len(ids) - len(tail)
        return n if n > 0 and tuple(ids[n:]) == tuple(tail) else 0

    def prepare(self, req: ChatRequest, max_context: int | None, stable_prefix: bool = True):
        """``stable_prefix=False`` when the serving cache trims to any position: the boundary then moves no
        transaction that matters, and finding it would render the conversation a second time."""
        from hf2q.api.chatmodel import PreparedChat

        if req.images and self.vision is None:
            raise ApiError(400, f"model {self.model_id!r} does not accept image input (a text-only model, or "
                                f"served without its mmproj: hf2q serve --mmproj FILE)", code="invalid_value",
                           param=req.images[0][0])
        fenced, fence = self._fence_contents(req)
        rendered = self.render(fenced)
        spans = fence.spans(rendered) if fence is not None else [(rendered, False)]
        text = "".join(piece for piece, _ in spans)
        tok = self.tokenizer
        ids = self._encode_prompt(spans, text, req.images)
        if max_context is not None and len(ids) >= max_context:
            if req.images:
                self.vision.release(ids)
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server's context is {max_context} per "
                                f"conversation", code="context_length_exceeded", param="messages")
        room = (max_context - len(ids)) if max_context else 4096
        max_tokens = min(req.max_tokens, room) if req.max_tokens else room
        bad = next((t for t, _ in req.logit_bias if t >= tok.vocab_size), None)  # negatives: validation
        if bad is not None:
            if req.images:
                self.vision.release(ids)
            raise ApiError(400, f"logit_bias: token id {bad} is outside the vocabulary (0..{tok.vocab_size - 1})",
                           code="invalid_value", param="logit_bias")
        max_tokens = max(1, max_tokens)

        def closing() -> str:  # only a constrained reply asks: it renders the prompt once more
            return _reasoning_closing(self.template, text, lambda: self._without_thinking(fenced, fence))
        json_fence = _json_fence(self.tool_syntax, req)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
            top_p=DEFAULT_TOP_P if req.top_p is None else req.top_p,
            top_k=DEFAULT_TOP_K if req.top_k is None else min(max(0, req.top_k), tok.vocab_size),
            min_p=DEFAULT_MIN_P if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty, seed=req.seed,
            logit_bias=req.logit_bias, logprobs=req.logprobs, top_logprobs=req.top_logprobs,
            stop_token_ids=frozenset(tok.eos_ids),
            constraint=_constraint(tok, req, self.tool_syntax if req.tools_active else None, max_tokens,
                                   opening=closing, fence=json_fence))
        thinking = _thinking(req)
        tools = list(req.tools) if req.tools_active else None
        syntax = self.tool_syntax if tools else None

        def new_decoder():
            return ChatOutputDecoder(
                tok, req.stop,
                tool_parser=_tool_parser(syntax, tools) if tools else None,
                reasoning=_reasoning_splitter(self.template, text, syntax) if thinking else None,
                parallel_calls=req.parallel_tool_calls, fence=json_fence)
        boundary = self._stable_prefix(fenced, fence, text, ids) if stable_prefix else 0
        return PreparedChat(ids, params, new_decoder, boundary)

    def decode_tokens(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))


class GGUFEmbeddingModel:
    def __init__(self, tokenizer, model_id: str):
        self.tokenizer = tokenizer
        self.model_id = model_id

    @classmethod
    def from_gguf(cls, path: Path, model_id: str) -> GGUFEmbeddingModel:
        return cls(_load_tokenizer(path), model_id)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special=True, parse_special=False))


# ---- the per-request output pipeline ------------------------------------------------------------

def _squeezed(json_text: str) -> str:
    """JSON text without the whitespace between tokens; of a prefix, a prefix of the whole's."""
    out, in_string, escaped = [], False, False
    for ch in json_text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in " \t\n\r":
            continue
        out.append(ch)
    return "".join(out)


def _canonical(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, ensure_ascii=False)
    except ValueError:
        return arguments


class _Call:
    """A call the parser has started: held back until it may go out, then passed through."""

    def __init__(self, name: str):
        self.name = name
        self.arguments: list[str] = []
        self.index: int | None = None  # ours, once it went out


class ChatOutputDecoder:
    """Generated ids → ``OutputDelta`` records (see the module docstring for the order).

    Tool calls stream as the parser reads them: the start as soon as the name is known, then
    each piece of the arguments. The reply's calls end the reply (``stop_hit``) when a call
    repeats one already made (a small model, once it has made a call, tends to make it again:
    that is not a parallel call, and the repeat is dropped), and after the first call when
    ``parallel_calls`` is off (``parallel_tool_calls: false`` allows exactly one). A repeat is
    known only once the call is complete, so a call is held back while its name and arguments
    so far could still be the start of one already made (compared without the whitespace
    between JSON tokens), and goes out as soon as they differ from every earlier call.
    ``stop_cause`` says what ended the reply: ``stop_string``, ``tool_call_repeat`` or
    ``tool_call_limit``.
    """

    def __init__(self, tokenizer, stops: Sequence[str], *, tool_parser=None, reasoning=None,
                 parallel_calls: bool = True, fence: tuple[str, str] = ("", "")):
        from hf2q.text.tokenizer import IncrementalDetokenizer

        self._detok = IncrementalDetokenizer(tokenizer, skip_special=True)
        self._stops = _stop_matcher(stops) if stops else None
        self._tools = tool_parser
        self._reasoning = reasoning
        self._parallel = parallel_calls
        self._open: dict[int, _Call] = {}  # parser's call index → the call
        self._n_out = 0  # calls that went out
        self._made: set[tuple[str, str]] = set()  # (name, canonical arguments) of the complete calls
        self._made_text: list[tuple[str, str]] = []  # (name, squeezed arguments) of the same
        self._calls_ended = False
        self.stop_hit = False
        self.stop_cause: str | None = None
        self.truncated_call = False
        #: a JSON reply's fence, taken off its content (``deepseek4_turns.FencedContent``)
        self._fence = None
        if any(fence):
            from hf2q.text.deepseek4_turns import FencedContent

            self._fence = FencedContent(fence)

    def feed(self, token_id: int) -> list[OutputDelta]:
        if self.stop_hit:
            return []
        return self._text(self._detok.push(token_id), final=False)

    def finish(self) -> list[OutputDelta]:
        return self._text(self._detok.flush(), final=True)

    # -- stages --

    def _text(self, text: str, final: bool) -> list[OutputDelta]:
        if self._stops is not None and not self.stop_hit:
            text, hit = self._stops.push(text)
            if hit:
                self.stop_hit, self.stop_cause = True, "stop_string"
                final = True
            elif final:
                text += self._stops.flush()
        out: list[OutputDelta] = []
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text)
            if final:
                r2, c2 = self._reasoning.finish()
                reasoning, content = reasoning + r2, content + c2
            if reasoning:
                out.append(ReasoningDelta(reasoning))
        else:
            content = text
        out.extend(self._content(content, final))
        return out

    def _content(self, text: str, final: bool) -> list[OutputDelta]:
        if self._fence is not None:
            text = self._fence.feed(text) + (self._fence.finish() if final else "")
        if self._tools is None:
            return [ContentDelta(text)] if text else []
        if self._calls_ended:
            return []  # whatever follows the reply's last call is not part of the reply
        events = self._tools.feed(text) if text else []
        if final:
            events += self._tools.finish()
        out: list[OutputDelta] = []
        for ev in events:
            kind = type(ev).__name__
            if kind == "ContentDelta":
                if ev.text:
                    out.append(ContentDelta(ev.text))
            elif kind == "ToolCallStart":
                self._open[ev.index] = call = _Call(ev.name)
                self._release(call, out)
            elif kind == "ToolCallArgsDelta":
                call = self._open[ev.index]
                call.arguments.append(ev.text)
                if call.index is not None:
                    out.append(ToolCallArgs(call.index, ev.text))
                else:
                    self._release(call, out)
            elif kind == "ToolCallEnd":
                if not self._complete(self._open.pop(ev.index), out):
                    break
            elif kind in ("ToolCallMalformed", "ToolCallIncomplete"):
                self._open.pop(ev.index, None)  # never completes: gone from the final message
                if kind == "ToolCallIncomplete":
                    self.truncated_call = True  # the runtime's "length" becomes the finish reason
        return out

    def _may_repeat(self, call: _Call) -> bool:
        so_far = _squeezed("".join(call.arguments))
        return any(name == call.name and made.startswith(so_far) for name, made in self._made_text)

    def _release(self, call: _Call, out: list[OutputDelta]) -> None:
        """Let a held call go out once it can no longer be a repeat."""
        if call.index is not None or self._may_repeat(call):
            return
        call.index = self._n_out
        self._n_out += 1
        out.append(ToolCallStart(call.index, new_tool_call_id(), call.name))
        if call.arguments:
            out.append(ToolCallArgs(call.index, "".join(call.arguments)))

    def _complete(self, call: _Call, out: list[OutputDelta]) -> bool:
        """The call is whole: False (and the reply ends) when it repeats one already made."""
        arguments = "".join(call.arguments)
        canonical = _canonical(arguments)
        if (call.name, canonical) in self._made:
            # held back while it matched, so nothing of it went out (unless its text differed,
            # keys reordered: then what went out never completes, and is not in the message)
            self._end_calls("tool_call_repeat")
            return False
        if call.index is None:  # held to the end, and different after all
            call.index = self._n_out
            self._n_out += 1
            out += [ToolCallStart(call.index, new_tool_call_id(), call.name), ToolCallArgs(call.index, arguments)]
        out.append(ToolCallEnd(call.index))
        self._made.add((call.name, canonical))
        self._made_text.append((call.name, _squeezed(arguments)))
        if not self._parallel:
            self._end_calls("tool_call_limit")
            return False
        return True

    def _end_calls(self, cause: str) -> None:
        self._calls_ended = True
        self.stop_hit, self.stop_cause = True, cause


def _deepseek_schema(req) -> dict | None:
    from hf2q.text.deepseek4_turns import response_format_schema

    return None if _forced(req) else response_format_schema(req.response_format)


def _forced(req) -> bool:
    return req.tools_active and (req.tool_choice == "required" or req.forced_tool is not None)


def _json_fence(syntax, req) -> tuple[str, str]:
    """What a JSON reply is written between: DeepSeek-V4's fenced json block (as llama.cpp reads this
    family), nothing elsewhere."""
    if syntax != "deepseek" or _deepseek_schema(req) is None:
        return ("", "")
    from hf2q.text.deepseek4_turns import JSON_FENCE

    return JSON_FENCE


def _thinking(req) -> bool:
    """Whether the reply opens with reasoning: ``chat_template_kwargs.enable_thinking`` when given,
    else off for ``reasoning_effort`` none/minimal — one rule for the rendered prompt and the reader."""
    return bool(req.chat_template_kwargs.get("enable_thinking", req.reasoning_effort not in ("none", "minimal")))
