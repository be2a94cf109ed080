"""A mixture-of-experts model on the CPU: the host decode step's routed feed-forward (``cpu_decode.HostMoE``) and
the MLX graph's host layout (``expert_route``: pairs sorted by expert through the C kernel) against MLX's own
per-pair ``gather_qmm`` (``HF2Q_MOE_GROUPED=0``, no hf2q kernel on the experts), token for token, on a tiny
Qwen3-MoE converted by ``hf2q convert`` (q8_0, and q5_0 whose 5-bit codes a CPU load stores one a byte)."""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest

from hf2q.engine.cpu_decode import HostMoE
from hf2q.kernels import cpu_decode_ops, cpu_qmatvec
from tests.engine_support import load_runner, random_tokens

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu or cpu_qmatvec.kernel() is None
                                or cpu_decode_ops.library() is None, reason="the CPU's C kernels")

QUANTS = ["q8_0", "q5_0"]


@pytest.fixture(scope="module")
def moe_runners(tiny_checkpoint, tmp_path_factory):
    from hf2q.cli import main

    src = tiny_checkpoint("qwen3_moe")
    out = {}
    for quant in QUANTS:
        path = tmp_path_factory.mktemp(f"qwen3moe-{quant}") / "m.gguf"
        assert main(["convert", str(src), "-q", quant, "-o", str(path), "--no-integrity"]) == 0
        out[quant] = load_runner(path, src)
    return out


@contextmanager
def _mlx_experts(runner):
    """The MLX graph with MLX's own per-pair expert products (no host step, no sorted layout)."""
    host, runner.host_decoder = runner.host_decoder, None
    mp = pytest.MonkeyPatch()
    mp.setenv("HF2Q_MOE_GROUPED", "0")
    try:
        yield
    finally:
        mp.undo()
        runner.host_decoder = host


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, float(np.abs(want).max())))


@pytest.mark.parametrize("quant", QUANTS)
def test_the_host_decode_step_takes_the_moe_and_equals_mlx_token_for_token(quant, moe_runners):
    r = moe_runners[quant]
    assert r.host_decoder is not None and all("moe" in L for L in r.host_decoder.layers)
    assert all(layer.ffn.down_exps.bits in (4, 8) for layer in r.model.layers)  # q5_0 stored one code a byte
    prompts = [random_tokens(n, seed=300 + n) for n in (5, 19, 11)]
    host_seqs, mlx_seqs = [r.new_sequence() for _ in prompts], [r.new_sequence() for _ in prompts]
    toks = []
    for a, b, p in zip(host_seqs, mlx_seqs, prompts):
        got = r.prefill(a, p)
        with _mlx_experts(r):
            want = r.prefill(b, p)
        _close(got, want)
        toks.append(int(np.argmax(want)))
    for _ in range(8):
        host = r.decode(host_seqs, toks)
        with _mlx_experts(r):
            ref = r.decode(mlx_seqs, toks)
        _close(host, ref)
        assert list(np.argmax(host, -1)) == list(np.argmax(ref, -1))
        toks = [int(t) for t in np.argmax(ref, -1)]


def test_a_long_prefill_on_the_sorted_layout_equals_mlx_per_pair(moe_runners):
    """A chunk longer than the host step takes runs the MLX graph, its experts sorted on the host."""
    r = moe_runners["q8_0"]
    prompt = random_tokens(300, seed=9)
    got = r.prefill(r.new_sequence(), prompt)
    with _mlx_experts(r):
        want = r.prefill(r.new_sequence(), prompt)
    _close(got, want)


def test_a_token_gets_the_same_logits_alone_and_in_a_batch(moe_runners):
    """Each expert output is the kernel's sum for that row alone, so batching decode rows changes nothing."""
    r = moe_runners["q8_0"]
    prompts = [random_tokens(n, seed=400 + n) for n in (7, 13)]
    alone, together = [r.new_sequence() for _ in prompts], [r.new_sequence() for _ in prompts]
    for a, b, p in zip(alone, together, prompts):
        r.prefill(a, p)
        r.prefill(b, p)
    batch = r.decode(together, [11, 12])
    for i, (s, t) in enumerate(zip(alone, [11, 12])):
        np.testing.assert_array_equal(r.decode([s], [t])[0], batch[i])


def test_a_moe_it_cannot_read_keeps_the_mlx_graph(moe_runners):
    """Experts the C kernel cannot take (here: a down matrix that is no expert stack) leave the block, and so
    the model, to the MLX graph."""
    import copy

    from hf2q.engine.cpu_decode import HostDecoder

    r = moe_runners["q8_0"]
    ffn = r.model.layers[0].ffn
    assert HostMoE.takes(ffn)
    odd = copy.copy(ffn)
    odd.down_exps = ffn.router  # 2-D: no expert stack
    assert not HostMoE.takes(odd)
    model = copy.copy(r.model)
    model.layers = [copy.copy(layer) for layer in r.model.layers]
    model.layers[0].ffn = odd
    assert HostDecoder.supported(r.model) and not HostDecoder.supported(model)
