"""Device-side sampling and the pipelined decode step.

References: the numpy ``Sampler`` (whose chain the device one follows) for the truncated
distribution and logprobs, empirical frequencies of seeded draws, and the synchronous
``runner.decode`` for the tokens a pipelined greedy run must produce.
"""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from hf2q.engine.sampling import Sampler, device_capable
from hf2q.engine.sampling.device import DeviceSampler, sample_rows
from hf2q.sched.contracts import SamplingParams
from tests.engine_support import convert_f32, load_runner, random_tokens

SETTINGS = [
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=0.5, top_k=12, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.9, top_p=0.9, min_p=0.02),
]


def _logits(seed: int, n: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 2.5, n).astype(np.float32)


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_truncated_distribution_equals_numpy_sampler(params):
    for seed in range(3):
        x = _logits(seed)
        ref = Sampler(params).truncated_probs(x.astype(np.float64))
        got = np.array(DeviceSampler(params).probabilities(mx.array(x)))
        np.testing.assert_allclose(got, ref, atol=2e-6)
        assert set(np.flatnonzero(got > 0)) == set(np.flatnonzero(ref > 0))


def test_draw_frequencies_follow_the_distribution():
    params = SamplingParams(temperature=1.1, top_k=6, seed=7)
    x = _logits(11, 32)
    want = Sampler(params).truncated_probs(x.astype(np.float64))
    s = DeviceSampler(params)
    draws = np.array([int(s.sample(mx.array(x))) for _ in range(3000)])
    freq = np.bincount(draws, minlength=x.size) / draws.size
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(want))
    assert np.abs(freq - want).max() < 0.035  # 3000 draws: σ ≤ 0.009 per bin


def test_same_seed_same_tokens_and_greedy_is_argmax():
    x = mx.array(np.stack([_logits(s) for s in range(4)]))
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=5), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.9, top_p=0.95, seed=5), SamplingParams(temperature=2.0, seed=1)]

    def run():
        samplers = [DeviceSampler(p) for p in params]
        return [np.array(sample_rows(x, samplers)[0]).tolist() for _ in range(5)]

    a, b = run(), run()
    assert a == b
    assert all(step[1] == int(np.argmax(np.array(x[1]))) for step in a)
    assert len({tuple(step) for step in a}) > 1  # the key advances every step


def test_logprob_is_log_softmax_of_the_raw_logits():
    x = _logits(3)
    toks, lps = sample_rows(mx.array(x[None]), [DeviceSampler(SamplingParams(temperature=0.7, seed=2))])
    tok = int(np.array(toks)[0])
    _, ref_lp, _ = Sampler(SamplingParams(temperature=0.0)).sample(x, [])  # logprob of argmax, same normaliser
    ref = float(x[tok] - (x[int(np.argmax(x))] - ref_lp))
    assert float(np.array(lps)[0]) == pytest.approx(ref, abs=1e-4)


def test_device_capable_excludes_host_only_settings():
    assert device_capable(SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, logprobs=True))
    for p in (SamplingParams(repetition_penalty=1.1), SamplingParams(frequency_penalty=0.2),
              SamplingParams(presence_penalty=0.2), SamplingParams(logit_bias=((3, 1.0),)),
              SamplingParams(logprobs=True, top_logprobs=2), SamplingParams(constraint=object())):
        assert not device_capable(p)


@pytest.fixture(scope="module")
def llama(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("llama")
    return load_runner(convert_f32(src, tmp_path_factory.mktemp("llama") / "m.gguf"), src)


@pytest.fixture(params=["host-decode", "mlx-graph"])
def runner(request, llama, monkeypatch):
    """The tiny runner on one decode path: the CPU host step, or the MLX graph (the GPU path)."""
    if request.param == "mlx-graph":
        monkeypatch.setattr(llama, "host_decoder", None)
    elif llama.host_decoder is None:
        pytest.skip("no host decoder on this backend")
    return llama


def test_pipelined_greedy_equals_sync_decode(runner):
    r = runner
    prompts = [random_tokens(n, seed=n) for n in (5, 13)]
    greedy = [DeviceSampler(SamplingParams(temperature=0.0)) for _ in prompts]
    sync = [r.new_sequence() for _ in prompts]
    pipe = [r.new_sequence() for _ in prompts]
    first = [int(np.argmax(r.prefill(s, p))) for s, p in zip(sync, prompts)]
    for s, p in zip(pipe, prompts):
        r.prefill(s, p)
    want, tok = [], list(first)
    for _ in range(8):
        tok = [int(t) for t in np.argmax(r.decode(sync, tok), -1)]
        want.append(tok)
    got = []
    pending = r.decode_async(pipe, first, greedy)
    for _ in range(7):
        nxt = r.decode_async(pipe, pending, greedy)  # queued before the previous step is read
        got.append(pending.result()[0].tolist())
        pending = nxt
    got.append(pending.result()[0].tolist())
    assert got == want
    assert [s.length for s in pipe] == [s.length for s in sync]
    # a caller that stops after reading step k trims the one speculative position
    pipe[0].trim(pipe[0].length - 1)
    ref = r.new_sequence()
    r.prefill(ref, prompts[0] + [first[0]] + [w[0] for w in want[:6]])
    np.testing.assert_allclose(r.decode([pipe[0]], [want[6][0]])[0], r.decode([ref], [want[6][0]])[0],
                               atol=1e-4)


def test_generate_pipelined_equals_host_path(llama, monkeypatch):
    from hf2q.engine.generate import generate_once

    r = llama
    monkeypatch.setattr(r, "host_decoder", None)  # the MLX graph path (as on a GPU): generate pipelines it
    assert r.pipelines_decode
    prompt = random_tokens(9, seed=4)
    pipelined = SamplingParams(temperature=0.0, max_tokens=12)
    host = SamplingParams(temperature=0.0, max_tokens=12, logit_bias=((7, 0.0),))  # no effect, forces the host
    assert device_capable(pipelined) and not device_capable(host)

    def run(params, ignore_eos=False):
        seen: list[int] = []
        out = generate_once(r, prompt, params, on_token=seen.append, ignore_eos=ignore_eos)
        return out["finish_reason"], out["generated_tokens"], seen

    a, b = run(pipelined), run(host)
    assert a == b and a[0] == "length" and a[1] == 12 and len(a[2]) == 12
    monkeypatch.setattr(r, "eos_token_ids", frozenset({a[2][4]}))  # stop on the fifth token (read a step late)
    c, d = run(pipelined), run(host)
    assert c == d and c[0] == "stop" and c[1] == 5 and c[2] == a[2][:4]
    # --ignore-eos: the same stop token is emitted and decoding runs the whole budget, on both paths
    assert run(pipelined, ignore_eos=True) == run(host, ignore_eos=True) == a


def test_warm_up_leaves_no_trace(runner):
    from hf2q.engine.generate import generate_once
    from hf2q.engine.runner import warm_up

    r = runner
    prompt = random_tokens(7, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    seen_before: list[int] = []
    generate_once(r, prompt, params, on_token=seen_before.append)
    stats = dict(r.stats)
    warm_up(r)
    assert r.stats == stats  # the warm-up request is not counted
    seen_after: list[int] = []
    generate_once(r, prompt, params, on_token=seen_after.append)
    assert seen_after == seen_before and len(seen_after) == 6


def test_warm_up_covers_the_gpu_row_tiles_and_fits_small_contexts(runner, monkeypatch):
    """mlx-cuda compiles its quantized matmul per row tile (16 / 32 / 64 rows) on first use: the
    warm-up prefills chunks of 64, 24 and 8 rows so no user's prompt pays that (48 s on an H200),
    and still fits a context too small for them."""
    from hf2q.engine.runner import warm_up

    r = runner
    chunks: list[int] = []
    real = r.prefill
    monkeypatch.setattr(r, "prefill", lambda seq, toks: chunks.append(len(toks)) or real(seq, toks))
    warm_up(r)
    assert chunks[:3] == [64, 24, 8]
    chunks.clear()
    monkeypatch.setattr(r, "n_ctx", 14)
    warm_up(r)  # no "context length exceeded"
    assert sum(chunks[:-1]) <= 14 - 6 and len(chunks) >= 2
