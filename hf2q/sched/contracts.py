"""The serving runtime's contracts: everything that crosses between the HTTP layer and the actors.

A leaf module (stdlib and attrs only), so the API and every actor import the same types
without importing one another: the runtime's knobs (``RuntimeConfig``), its refusals
(``AdmissionRejected``, caught by type), the operator's picture (``RuntimeSnapshot``), the
request records and the events of a request's channel. The API turns an OpenAI request
into a ``GenerationRequest``; the runtime answers on a per-request trio memory channel with
the events below, ending with exactly one ``Finished`` or ``Failed``.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

RunnerFactory = Callable[[], Any]
"""Builds the ``ModelRunner``; called once, inside the GPU-owner thread (MLX streams are per thread)."""

EventHook = Callable[[str, Any], None]
"""``hook(request_id, event)``: called (in trio, never blocking) for every event sent on a request's
channel and for every ``AdmissionRejected`` (with the request id of the rejected request)."""


@attrs.frozen
class RuntimeConfig:
    """Knobs of the serving runtime (``hf2q serve`` flags map 1:1)."""

    slots: int = 4
    #: per-slot context in tokens, never divided by ``slots``; None = the model's training context
    ctx: int | None = None
    #: shared physical KV budget in bytes; None = enough for every slot at full ``ctx``
    kv_budget_bytes: int | None = None
    #: requests allowed to wait for a slot; beyond this ``submit`` raises 429
    queue_capacity: int = 32
    #: tokens per prefill transaction (one bounded GPU step); None = the model family's candidate
    #: (``hf2q.sched.transactions``)
    prefill_chunk: int | None = None
    #: seconds one GPU transaction may run before the engine is declared hung; None = no deadline
    gpu_deadline_s: float | None = 120.0
    #: undelivered events a request channel may hold before its reader counts as too slow
    token_buffer: int = 1024
    #: called for every event (metrics); see ``EventHook``
    on_event: EventHook | None = None
    #: most prompt-lookup (n-gram) draft tokens verified per forward for a lone decoding request
    #: (``hf2q.engine.speculative``); 0 = plain decoding
    draft_tokens: int = 0

    def check(self) -> None:
        """Raise ``ValueError`` for knobs no runtime can start with."""
        if self.slots < 1:
            raise ValueError("RuntimeConfig.slots must be at least 1")
        if (self.prefill_chunk is not None and self.prefill_chunk < 1) or self.token_buffer < 1 \
                or self.queue_capacity < 0:
            raise ValueError("prefill_chunk and token_buffer must be positive, queue_capacity non-negative")
        if self.draft_tokens < 0:
            raise ValueError("RuntimeConfig.draft_tokens must be non-negative")


class AdmissionRejected(Exception):
    """``submit``/``embed`` refused the request; carries the HTTP answer (docs/API.md errors).

    ``status``/``code``: 400 ``context_length_exceeded`` | ``kv_budget_unsatisfiable``
    (can never fit; ``retry_after`` is None), 429 ``queue_full`` | ``slot_budget_exceeded``,
    503 ``not_ready`` | ``engine_unhealthy`` (``retry_after`` = 1 second).
    """

    def __init__(self, status: int, code: str, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"AdmissionRejected({self.status}, {self.code!r}, {self.message!r})"


@attrs.frozen
class ModelFacts:
    """What the loaded model tells the runtime, read once after loading (``Runtime.runner_info``)."""

    vocab_size: int
    n_ctx_train: int
    kv_bytes_per_token: int
    eos_token_ids: frozenset[int]
    is_embedding_model: bool
    ctx: int  # the effective per-slot context
    #: False when a cache cannot be trimmed to any earlier position (hybrid recurrent models):
    #: prefix reuse then goes back only to the reuse points a slot reports when it is released
    trims_prefix: bool = True
    #: GGUF ``general.architecture`` (the family's policies key on it: ``hf2q.sched.transactions``)
    arch: str | None = None
    #: the runner encodes images: their token ids (``hf2q.engine.vision.prompt_images``) lie above the vocabulary
    takes_images: bool = False

    @classmethod
    def of(cls, runner, config: RuntimeConfig) -> "ModelFacts":
        ctx = int(config.ctx or runner.n_ctx_train)
        hard = getattr(runner, "n_ctx", None)  # a runner built for a fixed context refuses more
        if hard:
            ctx = min(ctx, int(hard))
        return cls(int(runner.vocab_size), int(runner.n_ctx_train), int(runner.kv_bytes_per_token),
                   frozenset(int(t) for t in runner.eos_token_ids), bool(runner.is_embedding_model), ctx,
                   bool(getattr(runner, "trims_prefix", True)),
                   getattr(runner, "arch", None), getattr(runner, "images", None) is not None)

    def budget_bytes(self, config: RuntimeConfig) -> int:
        """The shared KV budget: the configured one, else every slot at full context."""
        if config.kv_budget_bytes is not None:
            return int(config.kv_budget_bytes)
        return config.slots * self.ctx * self.kv_bytes_per_token

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in attrs.fields(type(self))}


@attrs.frozen
class SlotSnapshot:
    """What the operator view and /metrics may show about one slot (never prompt text)."""

    slot: int
    phase: str  # the slot machine's state: idle, admitted, prefilling, decoding, finishing, ...
    request_id: str | None
    cached_tokens: int  # tokens of the current prompt reused from the slot (or disk)
    new_tokens: int  # prompt tokens that must be computed
    prefilled_tokens: int  # of new_tokens, done so far
    prefill_percent: float
    prefill_eta_s: float | None
    generated_tokens: int
    decode_tokens_per_sec: float
    resident_tokens: int  # tokens whose KV the slot holds (also when idle)


@attrs.frozen
class RuntimeSnapshot:
    ready: bool
    state: str  # supervisor machine state: starting, ready, draining, stopped, poisoned
    detail: str
    slots: tuple[SlotSnapshot, ...]
    queue_depth: int
    kv_bytes_resident: int
    kv_budget_bytes: int
    ctx: int
    #: monotonically increasing counters for /metrics: requests, admitted, finished, failed,
    #: cancelled, rejected_<code>, prompt_tokens, cached_tokens, completion_tokens,
    #: gpu_steps, gpu_busy_s (seconds the engine thread spent in jobs, a float), decode_batches,
    #: decode_batch_tokens, prefill_transactions, kv_blocks_saved, kv_blocks_restored
    counters: dict[str, float]


# ---- requests --------------------------------------------------------------------------


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
    #: prompt tokens the conversation's next request repeats (0: unknown); a prefill transaction ends there
    stable_prefix: int = 0


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
