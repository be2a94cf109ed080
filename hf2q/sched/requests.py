"""Records that cross the boundary between the HTTP layer and the serving runtime.

Pure data (attrs, frozen): the API turns an OpenAI request into a ``GenerationRequest``;
the runtime answers on a per-request trio memory channel with the events below, ending
with exactly one ``Finished`` or ``Failed``.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    #: an object with ``.allowed_mask() -> np.ndarray[bool] | None``, ``.advance(token)`` and
    #: ``.is_accepting()``, produced by ``hf2q.text.constrained``; None = unconstrained.
    constraint: Any = None


@attrs.frozen
class GenerationRequest:
    request_id: str
    prompt_tokens: tuple[int, ...]
    params: SamplingParams = SamplingParams()


@attrs.frozen
class EmbeddingRequest:
    request_id: str
    inputs: tuple[tuple[int, ...], ...]


# ---- events on the per-request channel -------------------------------------------------

@attrs.frozen
class Admitted:
    """The request got a slot; ``cached_tokens`` of its prompt need no recomputation."""

    slot: int
    prompt_tokens: int
    cached_tokens: int


@attrs.frozen
class PrefillProgress:
    done_tokens: int
    total_tokens: int


@attrs.frozen
class Token:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class Finished:
    reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    time_to_first_token_ms: float
    prefill_tokens_per_sec: float
    decode_tokens_per_sec: float


@attrs.frozen
class Failed:
    """A terminal error: ``status`` is the HTTP status the API should answer with."""

    status: int
    code: str
    message: str


TERMINAL = (Finished, Failed)
