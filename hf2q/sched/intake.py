"""Checks a request must pass before it is queued: refusals that need no slot and no GPU (pure).

An out-of-range token id would fault (and poison) the engine, so it is caught here; a
request that can never fit the per-slot context or the KV budget is refused with 400 at
once instead of waiting forever in the queue.
"""

from __future__ import annotations

from hf2q.sched.budget import KvBudget
from hf2q.engine.vision.prompt_images import IMAGE_ID_BASE
from hf2q.sched.contracts import AdmissionRejected, EmbeddingRequest, GenerationRequest, ModelFacts


def check_generation(req: GenerationRequest, facts: ModelFacts, budget: KvBudget) -> None:
    """Raise ``AdmissionRejected`` (400) for a generation request that can never run."""
    prompt = req.prompt_tokens
    if req.params.max_tokens < 1:
        raise AdmissionRejected(400, "invalid_request", "max_tokens must be at least 1")
    never = budget.never_fits(len(prompt), req.params.max_tokens)
    if never is not None:
        raise AdmissionRejected(400, never.code, never.message)
    vocab = facts.vocab_size
    bad = next((t for t in prompt if not 0 <= t < vocab and not (facts.takes_images and t >= IMAGE_ID_BASE)), None)
    if bad is not None:
        raise AdmissionRejected(400, "invalid_request", f"token id {bad} is outside the vocabulary ({vocab})")


def check_embedding(req: EmbeddingRequest, facts: ModelFacts) -> None:
    """Raise ``AdmissionRejected`` (400) for an embedding request the model cannot answer."""
    if not facts.is_embedding_model:
        raise AdmissionRejected(400, "invalid_request", "this model does not produce embeddings")
    if not req.inputs or any(len(x) == 0 for x in req.inputs):
        raise AdmissionRejected(400, "invalid_request", "embedding inputs must be non-empty")
    for i, x in enumerate(req.inputs):  # an id the model lacks would fault the engine, not just this request
        bad = next((t for t in x if not 0 <= t < facts.vocab_size), None)
        if bad is not None:
            raise AdmissionRejected(400, "invalid_request",
                                    f"input[{i}]: token id {bad} is outside the vocabulary (0..{facts.vocab_size - 1})")
    limit = min(facts.n_ctx_train, facts.ctx)
    over = next((i for i, x in enumerate(req.inputs) if len(x) > limit), None)
    if over is not None:  # refused whole and never truncated, as llama-server refuses it
        raise AdmissionRejected(400, "context_length_exceeded",
                                f"input[{over}] ({len(req.inputs[over])} tokens) is larger than the model's "
                                f"context ({limit} tokens); inputs are not truncated")
