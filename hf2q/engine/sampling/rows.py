"""A GPU step's logits → one ``Sampled`` token (or a ``SampleError``) per request, in the engine thread.

Rows that only need the argmax (``plain_greedy``) are picked for the whole batch at once;
every other row runs its request's host ``Sampler`` with its constraint mask. A sampling
failure is that request's alone: the engine stays healthy.
"""

from __future__ import annotations

import attrs
import numpy as np

from hf2q.engine.sampling import plain_greedy
from hf2q.errors import InputError


@attrs.frozen
class SampleError:
    """Sampling failed for one request: bad input (400) or a sampler bug (500)."""

    status: int
    code: str
    message: str


@attrs.frozen
class Sampled:
    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...]


def sample(sampler, constraint, logits: np.ndarray, history: list[int]) -> Sampled:
    """Pick the next token (runs in the GPU thread, right after the forward)."""
    mask = None
    if constraint is not None:  # hf2q.text's constraint objects: allowed_mask() (or allowed(history))
        mask = constraint.allowed_mask() if hasattr(constraint, "allowed_mask") else constraint.allowed(history)
    token, logprob, top = sampler.sample(np.asarray(logits, dtype=np.float32), history, mask)
    if constraint is not None:
        constraint.advance(int(token))
    return Sampled(int(token), None if logprob is None else float(logprob),
                   tuple((int(t), float(p)) for t, p in (top or ())))


def guarded_sample(work, logits) -> Sampled | SampleError:
    """``sample`` for one request; its failure is that request's alone (the engine is fine)."""
    try:
        return sample(work.sampler, work.constraint, logits, work.history)
    except InputError as e:  # e.g. a logit_bias id outside the vocabulary, everything masked
        return SampleError(400, "invalid_request", str(e))
    except Exception as e:  # noqa: BLE001
        return SampleError(500, "sampling_failed", f"sampling failed: {type(e).__name__}: {e}")


def sample_rows(works, logits) -> list[Sampled | SampleError]:
    """One sampled token per row of ``logits`` for ``works`` (decode runs), in order."""
    logits = np.asarray(logits)
    out: list = [None] * len(works)
    fast = [i for i, w in enumerate(works) if plain_greedy(w.sampler, w.constraint)]
    if fast:
        rows = logits if len(fast) == len(works) else logits[fast]  # no copy of a whole [N, vocab] batch
        picked = np.argmax(rows, axis=1)
        finite = np.isfinite(rows[np.arange(len(fast)), picked])
        for i, tok, ok in zip(fast, picked.tolist(), finite.tolist()):
            if ok:  # a non-finite best logit: the sampler reports it (an error of this request)
                out[i] = Sampled(int(tok), None, ())
    for i, w in enumerate(works):
        if out[i] is None:
            out[i] = guarded_sample(w, logits[i])
    return out
