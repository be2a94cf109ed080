"""The scoring arithmetic of ``hf2q quality`` against independent computations (torch, numpy)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf2q.quality import scores


def test_log_softmax_matches_torch():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((7, 300)) * 8).astype(np.float32)
    ours = scores.log_softmax(x)
    ref = torch.log_softmax(torch.from_numpy(x).double(), dim=-1).numpy()
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-12)


def test_window_scores_match_torch_kl_nll_and_argmax():
    rng = np.random.default_rng(2)
    ref_logits = rng.standard_normal((40, 500)).astype(np.float32) * 2  # every log-prob above the floor
    conv_logits = ref_logits + rng.standard_normal((40, 500)).astype(np.float32) * 0.3
    targets = rng.integers(0, 500, 40)
    s = scores.score_window(conv_logits, scores.log_softmax(ref_logits), targets)
    lq = torch.log_softmax(torch.from_numpy(ref_logits).double(), -1)
    lp = torch.log_softmax(torch.from_numpy(conv_logits).double(), -1)
    kl = torch.nn.functional.kl_div(lp, lq, log_target=True, reduction="none").sum(-1).numpy()
    t = torch.from_numpy(targets)
    np.testing.assert_allclose(s.kld, kl, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(s.nll, -lp[torch.arange(40), t].numpy(), rtol=1e-12)
    np.testing.assert_allclose(s.nll_ref, -lq[torch.arange(40), t].numpy(), rtol=1e-12)
    np.testing.assert_array_equal(s.same_top, conv_logits.argmax(-1) == ref_logits.argmax(-1))
    np.testing.assert_allclose(s.p_diff, np.exp(-s.nll) - np.exp(-s.nll_ref), rtol=1e-12)


def test_kl_leaves_out_reference_tokens_below_the_floor():
    ref = np.array([[0.0, 0.0, -40.0]])
    conv = np.array([[0.0, 0.0, 5.0]])  # moves mass onto the token the reference all but rules out
    lq, lp = scores.log_softmax(ref), scores.log_softmax(conv)
    assert lq[0, 2] < scores.KL_FLOOR
    s = scores.score_window(conv, lq, np.array([0]))
    expected = sum(math.exp(lq[0, i]) * (lq[0, i] - lp[0, i]) for i in (0, 1))
    assert s.kld[0] == pytest.approx(expected, rel=1e-12)


def test_windows_cut_whole_chunks_and_put_bos_first():
    toks = np.arange(100, 100 + 45)
    w = scores.windows(toks, 10, bos_id=1)
    assert w.shape == (4, 10)
    assert (w[:, 0] == 1).all()
    np.testing.assert_array_equal(w[2, 1:], toks[21:30])
    assert scores.windows(toks, 10, chunks=2).shape == (2, 10)
    np.testing.assert_array_equal(scores.windows(toks, 10)[:, 0], toks[[0, 10, 20, 30]])
    with pytest.raises(ValueError, match="needs at least 40"):
        scores.windows(toks[:39], 20)
    assert scores.first_scored(512) == 256


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=50),
       st.floats(0, 1, allow_nan=False))
def test_percentile_is_linear_interpolation(values, fraction):
    v = np.sort(np.asarray(values, dtype=np.float32))
    expected = np.percentile(v.astype(np.float64), 100 * fraction, method="linear")
    assert scores.percentile(v, fraction) == pytest.approx(expected, rel=1e-5, abs=1e-3)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 20, allow_nan=False), min_size=11, max_size=80))
def test_mean_and_error_is_the_standard_error(values):
    v = np.asarray(values)
    mean, err = scores.mean_and_error(v)
    assert mean == pytest.approx(v.mean(), rel=1e-9, abs=1e-12)
    assert err == pytest.approx(v.std() / math.sqrt(v.size - 1), rel=1e-6, abs=1e-6)


def test_summary_of_identical_models_and_perplexity():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((60, 50)) * 3
    targets = rng.integers(0, 50, 60)
    s = scores.score_window(logits, scores.log_softmax(logits), targets)
    out = scores.summarize(s)
    assert out["kld_mean"] == pytest.approx(0, abs=1e-12) and out["kld_max"] == pytest.approx(0, abs=1e-12)
    assert out["same_top"] == 1.0 and out["ln_ppl_ratio"] == pytest.approx(0, abs=1e-12)
    nll = -scores.log_softmax(logits)[np.arange(60), targets]
    assert out["ppl"] == pytest.approx(math.exp(nll.mean()), rel=1e-12)
    assert scores.perplexity(nll)["ppl"] == pytest.approx(out["ppl"], rel=1e-12)
    assert out["ppl_cor"] == pytest.approx(1.0, rel=1e-6)


def test_a_model_scored_against_itself_is_exactly_zero():
    """The reference's log-probabilities are kept in float32; the same logits as the converted model must then
    give KL 0 and full agreement, not a rounding residue whose sign is the data's (``-0.000000`` in the text)."""
    for seed in range(8):
        rng = np.random.default_rng(seed)
        logits = (rng.standard_normal((32, 3000)) * 3).astype(np.float32)
        s = scores.score_window(logits, scores.log_softmax(logits).astype(np.float32), rng.integers(0, 3000, 32))
        assert (s.kld == 0).all() and s.same_top.all(), seed
