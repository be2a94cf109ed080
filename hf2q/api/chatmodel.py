"""What the HTTP layer needs from a served model's text side, as a narrow protocol.

The routes depend only on this: ``prepare`` renders + tokenizes a validated request into a
``PreparedChat`` (prompt ids, sampling parameters, a fresh ``OutputDecoder``), and the
decoder turns generated token ids into ``OutputDelta`` records. ``hf2q.api.textbridge``
implements it over ``hf2q.text`` (GGUF tokenizer, chat template, tool-call / reasoning
parsers, stop strings, constrained decoding); tests may implement it over anything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import attrs

from hf2q.api.shapes import OutputDelta
from hf2q.api.validation import ChatRequest
from hf2q.sched.contracts import SamplingParams


class OutputDecoder(Protocol):
    def feed(self, token_id: int) -> list[OutputDelta]:
        """Deltas made visible by one more generated token (text held back by a stop-string prefix is not)."""

    def finish(self) -> list[OutputDelta]:
        """Flush held-back text at the end of generation."""

    @property
    def stop_hit(self) -> bool:
        """A stop string (or the end of a forced tool call) was reached: the API ends the request."""

    @property
    def stop_cause(self) -> str | None:
        """Why ``stop_hit``: ``stop_string``, ``tool_call_repeat`` or ``tool_call_limit`` (the metrics label)."""


@attrs.frozen
class PreparedChat:
    prompt_tokens: tuple[int, ...]
    params: SamplingParams
    new_decoder: Callable[[], OutputDecoder]
    #: prompt tokens the conversation's next request repeats (0: unknown; ``GenerationRequest.stable_prefix``)
    stable_prefix: int = 0


class ChatModel(Protocol):
    model_id: str

    def prepare(self, req: ChatRequest, max_context: int | None, stable_prefix: bool = True) -> PreparedChat:
        """Raises ``ApiError`` (400) for requests this model cannot serve. ``stable_prefix``: whether the
        serving cache needs ``PreparedChat.stable_prefix`` (only one that cannot trim to any position does)."""

    def decode_tokens(self, ids: Sequence[int]) -> str:
        """Plain detokenisation (for logprobs' ``token`` strings)."""


class EmbeddingModel(Protocol):
    model_id: str

    def encode(self, text: str) -> list[int]:
        ...
