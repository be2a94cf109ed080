"""The host back-end of the sampling chain: one row of logits → one token, in plain numpy.

It follows llama.cpp's default chain so that identical settings behave alike in both servers:

1. ``logit_bias`` is added, then the constraint ``mask`` removes forbidden tokens;
2. penalties over ``history`` (the caller chooses the window — the API passes the tokens
   generated so far): repetition penalty as in llama.cpp / HF (positive logits divided,
   negative ones multiplied), then OpenAI's ``frequency_penalty × count`` and
   ``presence_penalty × [count > 0]`` subtracted;
3. ``logprob`` / ``top_logprobs`` are read from this processed distribution (before
   temperature and truncation, so they do not depend on the sampling knobs);
4. temperature 0 → argmax; otherwise top-k, top-p, min-p truncate the (untempered)
   distribution, temperature rescales what is left, and one draw from the request's own
   seeded ``numpy`` generator picks the token (same seed + same logits → same tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hf2q.errors import InputError


def log_softmax(x: np.ndarray) -> np.ndarray:
    finite = np.isfinite(x)
    if not finite.any():
        raise InputError("every token is excluded: nothing can be sampled")
    m = x[finite].max()
    shifted = x - m
    with np.errstate(under="ignore"):
        lse = np.log(np.exp(shifted[finite]).sum())
    return shifted - lse


class Sampler:
    """Per-request sampler; keep one instance per request (it owns the RNG)."""

    def __init__(self, params):
        self.params = params
        if params.temperature < 0:
            raise InputError("temperature must be >= 0")
        if not 0.0 < params.top_p <= 1.0:
            raise InputError("top_p must be in (0, 1]")
        if not 0.0 <= params.min_p <= 1.0:
            raise InputError("min_p must be in [0, 1]")
        if params.top_k < 0:
            raise InputError("top_k must be >= 0")
        if params.repetition_penalty <= 0:
            raise InputError("repetition_penalty must be > 0")
        self.rng = np.random.default_rng(params.seed)
        bias = tuple(params.logit_bias or ())
        if bias:
            self._bias_ids = np.array([int(t) for t, _ in bias], dtype=np.int64)
            self._bias_values = np.array([float(v) for _, v in bias], dtype=np.float64)
        else:
            self._bias_ids = None

    # ---- processing ---------------------------------------------------------------------

    def process(self, logits: np.ndarray, history: Sequence[int] = (), mask: np.ndarray | None = None) -> np.ndarray:
        """Bias, mask and penalties applied; a float64 copy of the row."""
        p = self.params
        x = np.array(logits, dtype=np.float64).reshape(-1)
        if self._bias_ids is not None:
            if self._bias_ids.min() < 0 or self._bias_ids.max() >= x.size:
                raise InputError(f"logit_bias names a token outside the vocabulary (size {x.size})")
            np.add.at(x, self._bias_ids, self._bias_values)
        if mask is not None:
            mask = np.asarray(mask, dtype=bool)
            if mask.size < x.size:  # a mask over the tokenizer vocab; padded embedding rows are never allowed
                mask = np.concatenate([mask, np.zeros(x.size - mask.size, dtype=bool)])
            x[~mask[: x.size]] = -np.inf
        if len(history) and (p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty):
            ids, counts = np.unique(np.asarray(history, dtype=np.int64), return_counts=True)
            keep = (ids >= 0) & (ids < x.size)
            ids, counts = ids[keep], counts[keep]
            if p.repetition_penalty != 1.0:
                vals = x[ids]
                x[ids] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if p.frequency_penalty or p.presence_penalty:
                x[ids] -= counts * p.frequency_penalty + p.presence_penalty
        return x

    def candidates(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(token ids, probabilities)`` left after top-k / top-p / min-p and temperature.

        Works on a short candidate list instead of sorting the whole vocabulary: top-k and
        min-p select in O(vocab); top-p alone first tries the best 256 tokens and sorts
        everything only when their mass falls short of ``top_p`` (the result is exact).
        """
        p = self.params
        finite = np.isfinite(x)
        if not finite.any():
            raise InputError("every token is excluded: nothing can be sampled")
        m = x[finite].max()
        with np.errstate(under="ignore"):
            if p.top_k and p.top_k < finite.sum():
                cand = np.argpartition(-x, p.top_k - 1)[: p.top_k]
                z_kept = np.exp(x[cand] - m).sum()  # top-p renormalises over the top-k survivors
            else:
                z_kept = np.exp(x[finite] - m).sum()
                if p.min_p > 0.0:  # the min-p survivors are a best-first prefix: nothing else can remain
                    cand = np.flatnonzero(x >= m + np.log(p.min_p))
                elif p.top_p < 1.0 and finite.sum() > 256:
                    cand = np.argpartition(-x, 255)[:256]
                    if np.exp(x[cand] - m).sum() < p.top_p * z_kept:  # nucleus is wider: take everything
                        cand = np.flatnonzero(finite)
                else:
                    cand = np.flatnonzero(finite)
            if p.top_p < 1.0:
                # best first; ties keep the lower id, as a full stable sort would
                cand = np.sort(cand)
                cand = cand[np.argsort(-x[cand], kind="stable")]
                cum = np.cumsum(np.exp(x[cand] - m)) / z_kept
                cand = cand[: int(np.searchsorted(cum, p.top_p - 1e-12)) + 1]
        if p.min_p > 0.0:
            cand = cand[x[cand] >= m + np.log(p.min_p)]
        scaled = x[cand] / p.temperature
        w = np.exp(scaled - scaled.max())
        return cand, w / w.sum()

    def truncated_probs(self, x: np.ndarray) -> np.ndarray:
        """The sampling distribution over the whole vocabulary (sums to 1)."""
        ids, probs = self.candidates(x)
        out = np.zeros(np.asarray(x).size)
        out[ids] = probs
        return out

    # ---- sampling -----------------------------------------------------------------------

    def sample(self, logits: np.ndarray, history: Sequence[int] = (), mask: np.ndarray | None = None):
        """``(token_id, logprob, top_logprobs)`` for one row of logits.

        ``top_logprobs`` is a tuple of ``(token_id, logprob)`` best first, ``params.top_logprobs``
        long when ``params.logprobs`` is set, else empty.
        """
        p = self.params
        x = self.process(logits, history, mask)
        finite = np.isfinite(x)
        if not finite.any():
            raise InputError("every token is excluded: nothing can be sampled")
        if p.temperature == 0.0:
            token = int(np.argmax(x))
        else:
            ids, probs = self.candidates(x)
            cdf = np.cumsum(probs)
            pick = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
            token = int(ids[min(pick, ids.size - 1)])
        m = x[token] if p.temperature == 0.0 else x[finite].max()
        with np.errstate(under="ignore"):
            log_z = m + np.log(np.exp(x[finite] - m).sum())
        top: tuple[tuple[int, float], ...] = ()
        if p.logprobs and p.top_logprobs > 0:
            n = min(int(p.top_logprobs), x.size)
            idx = np.argpartition(-x, n - 1)[:n]
            idx = idx[np.lexsort((idx, -x[idx]))]
            top = tuple((int(i), float(x[i] - log_z)) for i in idx)
        return token, float(x[token] - log_z), top
