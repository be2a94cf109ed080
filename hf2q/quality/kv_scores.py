"""How far an 8-bit KV cache (``--kv-cache-type``) moves a model's predictions from its own f16 cache.

The same model, loaded once, runs the text's windows with each cache type; the f16 cache's
log-probabilities are the reference, so the figures (``scores.summarize``: KL, top-1 agreement,
perplexity) measure the cache storage alone, not the weights' quantization.
"""

from __future__ import annotations

import numpy as np

from hf2q.quality.scores import concat, first_scored, log_softmax, score_window, summarize, windows


def runners_by_kv_type(runner, kv_types) -> dict:
    """``runner``'s model behind one runner per KV cache type (the weights are shared, not reloaded)."""
    from hf2q.engine.runner import MlxModelRunner

    return {t: runner if t == runner.kv_cache_type else
            MlxModelRunner(runner.gguf, runner.model, runner.dtype, runner.n_ctx, t) for t in kv_types}


def scored_logits(runner, window: np.ndarray, chunk: int = 256) -> np.ndarray:
    """Float32 logits ``[n - 1 - first_scored(n), vocab]`` of the scored positions of one ``window``,
    fed in chunks of ``chunk`` tokens to a fresh sequence (every position attends over the cache)."""
    n = len(window)
    start = first_scored(n)
    seq = runner.new_sequence()
    rows = []
    for a in range(0, n - 1, chunk):
        b = min(a + chunk, n - 1)
        part = [int(t) for t in window[a:b]]
        if b <= start:
            runner.prefill(seq, part)
        else:
            rows.append(runner.verify(seq, part)[max(0, start - a):])
    return np.concatenate(rows)


def kv_type_scores(runners: dict, tokens, n_ctx: int, bos_id: int | None = None,
                   chunks: int | None = None) -> dict[str, dict]:
    """``{kv type: summarize(...)}`` of every runner but ``runners["f16"]`` (the reference) over the
    ``n_ctx``-token windows of ``tokens``."""
    reference = runners["f16"]
    start = first_scored(n_ctx)
    parts: dict[str, list] = {t: [] for t in runners if t != "f16"}
    for w in windows(tokens, n_ctx, chunks, bos_id):
        ref = log_softmax(scored_logits(reference, w))
        targets = w[start + 1:]
        for t in parts:
            parts[t].append(score_window(scored_logits(runners[t], w), ref, targets))
    return {t: summarize(concat(p)) for t, p in parts.items()}
