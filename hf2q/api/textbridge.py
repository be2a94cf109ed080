"""The served model's text side, built from ``hf2q.text``: the real ``ChatModel`` of ``hf2q serve``.

``GGUFChatModel.prepare`` renders the GGUF's chat template (with ``tools`` when the
template has a tool syntax; otherwise the generic JSON tool instructions go into the system
message), tokenizes, and builds ``SamplingParams`` (stop token ids, and a constraint for
``response_format`` / forced tool calls). ``ChatOutputDecoder`` is the per-request pipeline
that turns generated ids into API deltas, in this order:

    ids → incremental detokenizer → stop strings (held back until they cannot match)
        → reasoning splitter (``<think>`` … → reasoning_content) → tool-call parser → deltas

Every call into ``hf2q.text`` goes through the few adapter functions at the top of this
module, so an API change there is a one-place change here. No MLX is imported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from hf2q.api.errors import ApiError
from hf2q.api.shapes import (ContentDelta, OutputDelta, ReasoningDelta, ToolCallArgs, ToolCallEnd, ToolCallStart,
                             new_tool_call_id)
from hf2q.api.validation import ChatRequest
from hf2q.errors import InputError
from hf2q.sched.requests import SamplingParams

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
    from hf2q.text.chat_template import ChatTemplate

    return ChatTemplate.from_gguf(path)


def _tool_syntax(template):
    from hf2q.text import toolcalls

    return toolcalls.detect_syntax(template)


def _tool_parser(syntax, tools):
    from hf2q.text import toolcalls

    return toolcalls.make_parser(syntax, tools)


def _generic_tool_instructions(tools) -> str:
    from hf2q.text import toolcalls

    return toolcalls.generic_tool_instructions(tools)


def _reasoning_splitter(template, enabled: bool):
    from hf2q.text import reasoning

    return reasoning.splitter_for(template, enabled=enabled)


def _stop_matcher(stops: Sequence[str]):
    from hf2q.engine.sampler import StopStringMatcher

    return StopStringMatcher(list(stops))


def _constraint(tokenizer, req: ChatRequest, syntax):
    """A ``SamplingParams.constraint`` for json_object / json_schema / forced tool calls, or None."""
    if req.response_format is None and not (req.tools_active and (req.tool_choice == "required"
                                                                     or req.forced_tool)):
        return None
    from hf2q.text import constrained

    return constrained.for_request(tokenizer, response_format=req.response_format, tools=list(req.tools),
                                   tool_choice=req.tool_choice, syntax=syntax)


# ---- the ChatModel --------------------------------------------------------------------------------

class GGUFChatModel:
    def __init__(self, tokenizer, template, model_id: str):
        self.tokenizer = tokenizer
        self.template = template
        self.model_id = model_id
        self.tool_syntax = _tool_syntax(template) if template is not None else None
        self.template_source = getattr(template, "source", None)

    @classmethod
    def from_gguf(cls, path: Path, model_id: str) -> "GGUFChatModel":
        tok = _load_tokenizer(path)
        try:
            tpl = _load_template(path)
        except InputError:
            raise
        return cls(tok, tpl, model_id)

    # -- rendering --

    def _messages_for_template(self, req: ChatRequest) -> tuple[list[dict], list[dict] | None]:
        messages = [dict(m) for m in req.messages]
        for m in messages:
            for call in m.get("tool_calls", ()):
                # templates iterate arguments as a mapping (Qwen, Llama 3); keep the string when not JSON
                try:
                    call["function"] = {**call["function"], "arguments": json.loads(call["function"]["arguments"])}
                except (ValueError, TypeError):
                    pass
        tools = [t for t in req.tools] if req.tools_active else None
        if tools and self.tool_syntax is None:
            # no tool syntax in this template: describe the tools and the generic call format in the system turn
            text = _generic_tool_instructions(tools)
            if messages and messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": (messages[0]["content"] or "") + "\n\n" + text}
            else:
                messages.insert(0, {"role": "system", "content": text})
            tools = None
        return messages, tools

    def render(self, req: ChatRequest) -> str:
        messages, tools = self._messages_for_template(req)
        kwargs = dict(req.chat_template_kwargs)
        if req.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
            kwargs.setdefault("enable_thinking", req.reasoning_effort not in ("none", "minimal"))
        try:
            return self.template.render(messages, tools=tools, add_generation_prompt=True, **kwargs)
        except InputError as e:
            raise ApiError(400, f"chat template: {e}", code="invalid_value", param="messages") from None

    def prepare(self, req: ChatRequest, max_context: int | None):
        from hf2q.api.chatmodel import PreparedChat

        text = self.render(req)
        tok = self.tokenizer
        bos_text = tok.token_text(tok.bos_id) if tok.bos_id is not None else None
        add_special = tok.add_bos and not (bos_text and text.startswith(bos_text))
        ids = tuple(tok.encode(text, add_special=add_special, parse_special=True))
        if max_context is not None and len(ids) >= max_context:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server's context is {max_context} per "
                                f"conversation", code="context_length_exceeded", param="messages")
        room = (max_context - len(ids)) if max_context else 4096
        max_tokens = min(req.max_tokens, room) if req.max_tokens else room
        bias = tuple((t, b) for t, b in req.logit_bias if 0 <= t < tok.vocab_size)
        params = SamplingParams(
            max_tokens=max(1, max_tokens),
            temperature=DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
            top_p=DEFAULT_TOP_P if req.top_p is None else req.top_p,
            top_k=DEFAULT_TOP_K if req.top_k is None else max(0, req.top_k),
            min_p=DEFAULT_MIN_P if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty, seed=req.seed,
            logit_bias=bias, logprobs=req.logprobs, top_logprobs=req.top_logprobs,
            stop_token_ids=frozenset(tok.eos_ids),
            constraint=_constraint(tok, req, self.tool_syntax))
        thinking = bool(req.chat_template_kwargs.get("enable_thinking", True)) and req.reasoning_effort != "none"
        tools = list(req.tools) if req.tools_active else None
        syntax = self.tool_syntax if self.tool_syntax is not None else "generic"

        def new_decoder():
            return ChatOutputDecoder(
                tok, req.stop,
                tool_parser=_tool_parser(syntax, tools) if tools else None,
                reasoning=_reasoning_splitter(self.template, thinking),
                prompt_ends_in_think=text.rstrip().endswith("<think>"))
        return PreparedChat(ids, params, new_decoder)

    def decode_tokens(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))


class GGUFEmbeddingModel:
    def __init__(self, tokenizer, model_id: str):
        self.tokenizer = tokenizer
        self.model_id = model_id

    @classmethod
    def from_gguf(cls, path: Path, model_id: str) -> "GGUFEmbeddingModel":
        return cls(_load_tokenizer(path), model_id)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special=True, parse_special=False))


# ---- the per-request output pipeline ------------------------------------------------------------

class ChatOutputDecoder:
    """Generated ids → ``OutputDelta`` records (see the module docstring for the order)."""

    def __init__(self, tokenizer, stops: Sequence[str], *, tool_parser=None, reasoning=None,
                 prompt_ends_in_think: bool = False):
        from hf2q.text.tokenizer import IncrementalDetokenizer

        self._detok = IncrementalDetokenizer(tokenizer, skip_special=True)
        self._stops = _stop_matcher(stops) if stops else None
        self._tools = tool_parser
        self._reasoning = reasoning
        if reasoning is not None and prompt_ends_in_think and hasattr(reasoning, "start_in_reasoning"):
            reasoning.start_in_reasoning()
        self._ids: dict[Any, int] = {}  # parser's call key → our index
        self._open: set[int] = set()
        self.stop_hit = False

    def feed(self, token_id: int) -> list[OutputDelta]:
        if self.stop_hit:
            return []
        return self._text(self._detok.push(token_id), final=False)

    def finish(self) -> list[OutputDelta]:
        out = self._text(self._detok.flush(), final=True)
        return out

    # -- stages --

    def _text(self, text: str, final: bool) -> list[OutputDelta]:
        if self._stops is not None:
            text, hit = self._stops.push(text, final=final) if not self.stop_hit else ("", False)
            if hit:
                self.stop_hit = True
                final = True
        out: list[OutputDelta] = []
        if self._reasoning is not None:
            parts = self._reasoning.push(text, final=final)  # [(kind, text)], kind in {"reasoning", "content"}
        else:
            parts = [("content", text)]
        for kind, piece in parts:
            if kind == "reasoning":
                if piece:
                    out.append(ReasoningDelta(piece))
            else:
                out.extend(self._content(piece, final))
        return out

    def _content(self, text: str, final: bool) -> list[OutputDelta]:
        if self._tools is None:
            return [ContentDelta(text)] if text else []
        out: list[OutputDelta] = []
        for ev in self._tools.feed(text, final=final):
            kind = type(ev).__name__
            if kind == "ContentDelta":
                if ev.text:
                    out.append(ContentDelta(ev.text))
            elif kind == "ToolCallStart":
                idx = len(self._ids)
                self._ids[ev.index] = idx
                self._open.add(idx)
                out.append(ToolCallStart(idx, new_tool_call_id(), ev.name))
            elif kind == "ToolCallArgsDelta":
                out.append(ToolCallArgs(self._ids[ev.index], ev.text))
            elif kind == "ToolCallEnd":
                idx = self._ids[ev.index]
                self._open.discard(idx)
                out.append(ToolCallEnd(idx))
        return out
