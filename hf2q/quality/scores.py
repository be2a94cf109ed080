"""How good a conversion is, as numbers: perplexity, KL divergence from a reference, top-1 agreement.

The definitions are llama-perplexity's (``--kl-divergence``), so a figure here can be set beside
one from llama.cpp on the same text and context:

* the text is tokenized once (BOS as the model asks) and cut into ``n_ctx``-token windows; each
  window's first token is replaced by BOS when the model adds one; only the second half of each
  window is scored (position ``i`` predicts token ``i + 1`` for ``i`` from ``n_ctx // 2`` to
  ``n_ctx - 2``), so every scored token has at least half a window of context;
* a figure's error bar is the standard error of its mean (zero below eleven samples), PPL's is
  the same carried through ``exp``; ``ln(PPL(Q)/PPL(base))`` carries the covariance of the two;
* the percentiles interpolate linearly between sorted per-token KL values.

* the KL sum leaves out the tokens whose reference log-probability is at or below
  :data:`KL_FLOOR` (llama.cpp keeps the reference as 16-bit integers over that range only).

The reference's log-probabilities stay float here rather than llama.cpp's 16-bit integers.

Pure numpy: no model, no files.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

#: the percentiles llama-perplexity prints, as fractions
KL_PERCENTILES = (0.999, 0.99, 0.95, 0.90, 0.10, 0.05, 0.01, 0.001)
#: reference log-probabilities at or below this (nats) are left out of the KL sum, as llama.cpp does
KL_FLOOR = -16.0
#: rows per block when a window's log-probabilities are turned into float64 sums
_ROW_BLOCK = 16


def first_scored(n_ctx: int) -> int:
    """The first position of a window whose prediction is scored."""
    return n_ctx // 2


def windows(tokens: np.ndarray | list[int], n_ctx: int, chunks: int | None = None,
            bos_id: int | None = None) -> np.ndarray:
    """The ``[n_chunk, n_ctx]`` token windows llama-perplexity scores and llama-imatrix runs, BOS (when
    given) in front.

    ``chunks`` caps their number (None: every whole window). ValueError when the text holds fewer
    than two windows' worth of tokens — llama.cpp refuses that too."""
    tokens = np.asarray(tokens, dtype=np.int32)
    if n_ctx < 4:
        raise ValueError(f"context {n_ctx} is too small to score (at least 4 tokens)")
    if tokens.size < 2 * n_ctx:
        raise ValueError(f"the corpus tokenizes to {tokens.size} tokens; a context of {n_ctx} needs "
                         f"at least {2 * n_ctx} (a longer corpus or a smaller --n-ctx)")
    n = tokens.size // n_ctx if chunks is None else min(chunks, tokens.size // n_ctx)
    out = tokens[: n * n_ctx].reshape(n, n_ctx).copy()
    if bos_id is not None:
        out[:, 0] = bos_id
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities, float64 (max subtracted, exponentials summed in float64)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@attrs.frozen
class TokenScores:
    """Per scored token: the converted model's NLL, the reference's NLL, KL(ref ‖ converted),
    whether both put the same token on top, and p(target) converted minus reference."""
    nll: np.ndarray
    nll_ref: np.ndarray
    kld: np.ndarray
    same_top: np.ndarray
    p_diff: np.ndarray


def score_window(logits: np.ndarray, ref_logprobs: np.ndarray, targets: np.ndarray) -> TokenScores:
    """Scores of the rows ``logits[i]`` (the converted model) predicting ``targets[i]``, against
    ``ref_logprobs`` (the reference's log-probabilities of the same rows, from :func:`log_softmax`)."""
    logits = np.asarray(logits)
    targets = np.asarray(targets, dtype=np.int64)
    n = logits.shape[0]
    if targets.shape != (n,):
        raise ValueError(f"{n} rows of logits but {targets.shape} targets")
    nll, nll_ref, kld = (np.empty(n) for _ in range(3))
    same = np.zeros(n, dtype=bool)
    for a in range(0, n, _ROW_BLOCK):
        b = min(n, a + _ROW_BLOCK)
        # rounded as the reference's rows are kept (a float32 scratch file in `hf2q quality`), so a model
        # scored against itself gives 0, not a KL of ±1e-8 from that rounding (printed as -0.000000)
        lp = log_softmax(logits[a:b]).astype(ref_logprobs.dtype).astype(np.float64)
        rows = np.arange(b - a)
        nll[a:b] = -lp[rows, targets[a:b]]
        lq = np.asarray(ref_logprobs[a:b], dtype=np.float64)
        nll_ref[a:b] = -lq[rows, targets[a:b]]
        kld[a:b] = np.where(lq > KL_FLOOR, np.exp(lq) * (lq - lp), 0.0).sum(axis=-1)
        same[a:b] = lp.argmax(axis=-1) == lq.argmax(axis=-1)
    p_diff = np.exp(-nll) - np.exp(-nll_ref)
    return TokenScores(nll, nll_ref, kld, same, p_diff)


def concat(parts: list[TokenScores]) -> TokenScores:
    if not parts:
        raise ValueError("nothing was scored")
    return TokenScores(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in attrs.fields(TokenScores)))


def mean_and_error(values: np.ndarray, min_count: int = 11) -> tuple[float, float]:
    """Mean and its standard error (population variance over ``count - 1``), as llama.cpp computes
    them; the error is 0 below ``min_count`` samples or when the variance rounds to ≤ 0."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return 0.0, 0.0
    mean = float(v.mean())
    var = float(np.square(v).mean()) - mean * mean
    err = math.sqrt(var / (v.size - 1)) if var > 0 and v.size >= min_count else 0.0
    return mean, err


def _covariance_of_means(a: np.ndarray, b: np.ndarray) -> float:
    if a.size < 10:
        return 0.0
    return (float((a * b).mean()) - float(a.mean()) * float(b.mean())) / (a.size - 1)


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama-perplexity's percentile: linear between the two nearest of ``n`` sorted values."""
    v = sorted_values
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    p = fraction * (v.size - 1)
    i = int(p)
    p -= i
    return float((1 - p) * v[i] + p * v[min(i + 1, v.size - 1)])


def perplexity(nll: np.ndarray) -> dict:
    """``{"ppl", "ppl_err", "tokens"}`` from per-token NLLs (llama-perplexity's final estimate)."""
    mean, err = mean_and_error(nll, min_count=2)
    ppl = math.exp(mean)
    return {"ppl": ppl, "ppl_err": ppl * err, "tokens": int(np.asarray(nll).size)}


def summarize(s: TokenScores) -> dict:
    """Every statistic llama-perplexity ``--kl-divergence`` prints, as one flat dict."""
    n = s.nll.size
    ln_q, ln_q_err = mean_and_error(s.nll)
    ln_b, ln_b_err = mean_and_error(s.nll_ref)
    cov = _covariance_of_means(s.nll, s.nll_ref)
    ratio_err = math.sqrt(max(0.0, ln_q_err ** 2 + ln_b_err ** 2 - 2 * cov))
    ppl_q, ppl_b = math.exp(ln_q), math.exp(ln_b)
    kl_mean, kl_err = mean_and_error(s.kld)
    kl_sorted = np.sort(s.kld)
    top = float(s.same_top.mean())
    mse, mse_err = mean_and_error(np.square(s.p_diff))
    rms = math.sqrt(mse)
    dp_mean, dp_err = mean_and_error(s.p_diff)
    out = {
        "tokens": int(n),
        "ppl": ppl_q, "ppl_err": ppl_q * ln_q_err,
        "ppl_ref": ppl_b, "ppl_ref_err": ppl_b * ln_b_err,
        "ln_ppl_ratio": ln_q - ln_b, "ln_ppl_ratio_err": ratio_err,
        "ppl_cor": cov / (ln_q_err * ln_b_err) if ln_q_err > 0 and ln_b_err > 0 else 0.0,
        "kld_mean": kl_mean, "kld_mean_err": kl_err,
        "kld_max": float(kl_sorted[-1]), "kld_median": float(np.median(kl_sorted)), "kld_min": float(kl_sorted[0]),
        "same_top": top, "same_top_err": math.sqrt(top * (1 - top) / (n - 1)) if n > 1 else 0.0,
        "dp_mean": dp_mean, "dp_mean_err": dp_err,
        "dp_rms": rms, "dp_rms_err": 0.5 / rms * mse_err if rms > 0 else 0.0,
        "dp_max": float(np.max(s.p_diff)), "dp_min": float(np.min(s.p_diff)),
    }
    for f in KL_PERCENTILES:
        out[f"kld_p{f * 100:g}"] = percentile(kl_sorted, f)
    return out
