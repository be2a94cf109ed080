"""Sampler and stop strings against independent references.

References: transformers' logits processors (repetition penalty, top-k, top-p, min-p),
torch's log_softmax, a brute-force Python re-implementation of the OpenAI penalty
formula, and empirical frequencies of many seeded draws.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from hf2q.engine.sampling import Sampler
from hf2q.errors import InputError
from hf2q.sched.contracts import SamplingParams
from hf2q.text.stop_strings import StopStringMatcher


def _logits(seed=0, n=50):
    return np.random.default_rng(seed).normal(0, 2, n).astype(np.float32)


def test_greedy_is_argmax():
    x = _logits()
    tok, lp, _ = Sampler(SamplingParams(temperature=0.0)).sample(x, [])
    assert tok == int(np.argmax(x))
    assert lp == pytest.approx(float(torch.log_softmax(torch.tensor(x, dtype=torch.float64), -1)[tok]))


def test_logprobs_match_torch():
    x = _logits(1)
    tok, lp, top = Sampler(SamplingParams(temperature=0.7, seed=3, logprobs=True, top_logprobs=5)).sample(x, [])
    ref = torch.log_softmax(torch.tensor(x, dtype=torch.float64), -1)
    vals, idx = torch.topk(ref, 5)
    assert [t for t, _ in top] == idx.tolist()
    assert [v for _, v in top] == pytest.approx(vals.tolist())
    assert lp == pytest.approx(float(ref[tok]))


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    x = _logits(2)
    history = [3, 3, 7, 11, 42]
    ours = Sampler(SamplingParams(repetition_penalty=1.3)).process(x, history)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([history]), torch.tensor(x[None], dtype=torch.float64))
    assert ours == pytest.approx(ref[0].numpy())


def test_frequency_presence_penalty_formula():
    x = _logits(3)
    history = [1, 1, 1, 2, 9, 9]
    ours = Sampler(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)).process(x, history)
    expected = [float(v) for v in x]
    for tok in set(history):  # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
        expected[tok] -= history.count(tok) * 0.5 + 0.25
    assert ours == pytest.approx(expected)


def test_logit_bias_and_mask():
    x = np.zeros(10, dtype=np.float32)
    s = Sampler(SamplingParams(temperature=0.0, logit_bias=((4, 5.0), (2, -100.0))))
    assert s.sample(x, [])[0] == 4
    mask = np.zeros(10, dtype=bool)
    mask[[2, 7]] = True
    assert s.sample(x, [], mask=mask)[0] == 7  # 4 is forbidden, 2 is biased down
    with pytest.raises(InputError):
        Sampler(SamplingParams(logit_bias=((99, 1.0),))).sample(x, [])


def _hf_support(processor, x):
    out = processor(None, torch.tensor(x[None], dtype=torch.float64))[0]
    return set(np.flatnonzero(np.isfinite(out.numpy())).tolist())


@pytest.mark.parametrize("seed", range(5))
def test_truncation_support_matches_transformers(seed):
    from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    x = _logits(seed, 200)
    for params, proc in [
        (SamplingParams(temperature=1.0, top_k=17), TopKLogitsWarper(17)),
        (SamplingParams(temperature=1.0, top_p=0.8), TopPLogitsWarper(0.8)),
        (SamplingParams(temperature=1.0, min_p=0.1), MinPLogitsWarper(0.1)),
    ]:
        probs = Sampler(params).truncated_probs(Sampler(params).process(x))
        assert set(np.flatnonzero(probs > 0).tolist()) == _hf_support(proc, x)
        assert probs.sum() == pytest.approx(1.0)


def _brute_force_distribution(x, top_k, top_p, min_p, temperature):
    """llama.cpp order, written the slow obvious way: truncate untempered, then temper."""
    p = [math.exp(v) for v in x]
    z = sum(p)
    p = [v / z for v in p]
    order = sorted(range(len(x)), key=lambda i: (-p[i], i))
    kept = order[:top_k] if top_k else order
    if top_p < 1.0:
        out, mass = [], 0.0
        for i in kept:
            out.append(i)
            mass += p[i] / sum(p[j] for j in kept)
            if mass >= top_p - 1e-12:
                break
        kept = out
    pmax = max(p[i] for i in kept)
    kept = [i for i in kept if p[i] >= min_p * pmax]
    w = {i: math.exp(x[i] / temperature) for i in kept}
    z = sum(w.values())
    return {i: v / z for i, v in w.items()}


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p", "temperature"),
    [(8, 0.9, 0.05, 0.8), (0, 0.9, 0.05, 1.3), (0, 0.7, 0.0, 0.5), (0, 1.0, 0.2, 1.0), (3, 1.0, 0.0, 2.0), (0, 0.999, 0.0, 1.0)],
)
def test_truncation_matches_brute_force(top_k, top_p, min_p, temperature):
    for seed, n in ((7, 12), (8, 40), (9, 600)):  # 600 > 256 exercises the candidate shortcut
        x = _logits(seed, n).astype(np.float64)
        sampler = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
        probs = sampler.truncated_probs(sampler.process(x))
        ref = _brute_force_distribution(list(x), top_k, top_p, min_p, temperature)
        assert {int(i): probs[i] for i in np.flatnonzero(probs)} == pytest.approx(ref)


def test_distribution_matches_brute_force_and_draws():
    x = _logits(7, 12).astype(np.float64)
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05, seed=11)
    sampler = Sampler(params)
    probs = sampler.truncated_probs(sampler.process(x))
    ref = _brute_force_distribution(list(x), 8, 0.9, 0.05, 0.8)
    assert {i: probs[i] for i in np.flatnonzero(probs)} == pytest.approx(ref)
    # empirical frequencies of seeded draws agree with the distribution (chi-square, 99.9 %)
    n = 20000
    counts = np.bincount([sampler.sample(x, [])[0] for _ in range(n)], minlength=x.size)
    support = sorted(ref)
    assert set(np.flatnonzero(counts).tolist()) <= set(support)
    chi2 = sum((counts[i] - n * ref[i]) ** 2 / (n * ref[i]) for i in support)
    k = len(support) - 1  # 99.9 % quantile of chi-square(k), Wilson-Hilferty approximation
    assert chi2 < k * (1 - 2 / (9 * k) + 3.09 * math.sqrt(2 / (9 * k))) ** 3


def test_same_seed_same_tokens_different_seed_differs():
    rows = [_logits(s, 100) for s in range(30)]

    def run(seed):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [s.sample(r, [])[0] for r in rows]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_bad_params_are_input_errors():
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"min_p": 1.5}, {"top_k": -2}, {"repetition_penalty": 0}):
        with pytest.raises(InputError):
            Sampler(SamplingParams(**bad))
    with pytest.raises(InputError, match="excluded"):
        Sampler(SamplingParams()).sample(np.zeros(4), [], mask=np.zeros(4, dtype=bool))


# ---------------------------------------------------------------------------- stop strings

def _stream(text, stops, rng):
    m = StopStringMatcher(stops)
    out, i = [], 0
    while i < len(text):
        j = i + rng.randint(1, 4)
        safe, stopped = m.push(text[i:j])
        out.append(safe)
        i = j
        if stopped:
            return "".join(out), True, m
    return "".join(out) + m.flush(), False, m


@pytest.mark.parametrize("seed", range(30))
def test_stop_strings_across_chunk_boundaries(seed):
    rng = random.Random(seed)
    stops = ["</end>", "STOP", "ab"]
    text = "".join(rng.choice(["x", "y", "a", "<", "/", "e", "S", "T", "O", "P", "</en", "b "]) for _ in range(30))
    got, stopped, m = _stream(text, stops, rng)
    hits = [(text.find(s), s) for s in stops if s in text]
    if hits:
        first, _ = min(hits)
        assert stopped and got == text[:first] and m.matched in stops
        assert text[first:].startswith(m.matched)
    else:
        assert not stopped and got == text


def test_stop_holds_back_only_possible_prefixes():
    m = StopStringMatcher(["Observation:"])
    assert m.push("The answer. Obs") == ("The answer. ", False)
    assert m.push("tacle") == ("Obstacle", False)
    assert m.push(" Observ") == (" ", False)
    assert m.push("ation: x") == ("", True)
    assert m.push("more") == ("", True)


def test_no_stops_passes_through():
    m = StopStringMatcher(None)
    assert m.push("abc") == ("abc", False) and m.flush() == ""
