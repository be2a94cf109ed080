"""Gemma 4's host decode step (``engine/cpu_decode_gemma4.py``) against the MLX graph with MLX's own ops.

The tiny random checkpoints of the three shapes (``tests/models/tiny.py``: dense with sliding and K-as-V global
layers; E2B-style with per-layer embeddings, KV-shared layers and a double-wide MLP on them; MoE with routed
experts beside each dense MLP), converted to quantized GGUFs so the C matvec, the segment kernel and the pieces
of the cache layout all take part. The reference is a second runner on the same file decoding through the MLX
graph with no hf2q kernel (``quantized_matmul``, MLX's gather for the experts, ``scaled_dot_product_attention``):
token for token over prompts longer than the 16-token window, batched rows at different window bases, short
prefill chunks as host rows and the mixed decode + prefill step. Transformers' logits are the reference of
``test_engine_gemma4.py`` and ``test_engine_gemma4_window.py``, which run this step on the CPU too.
"""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import numpy as np
import pytest

from hf2q.engine.cpu_decode_gemma4 import HostGemma4
from hf2q.kernels import cpu_qmatvec
from tests.engine_support import load_runner, random_tokens

pytestmark = pytest.mark.skipif(cpu_qmatvec.kernel() is None, reason="no C compiler")

CASES = [("gemma4", "q8_0"), ("gemma4_e2b", "q4_0"), ("gemma4_moe", "q8_0")]


def _all_linears(model):
    lins = [model.embed, model.lm_head]
    if model.ple_embed is not None:
        lins += [model.ple_embed, model.ple_model_proj]
    return lins + [lin for b in model.blocks for lin in b.linears()]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{q}" for f, q in CASES])
def pair(request, tiny_checkpoint, tmp_path_factory):
    """(host runner, graph runner) over one converted file: the second with no host step and no hf2q kernel
    in its products."""
    from hf2q.cli import main

    family, quant = request.param
    src = tiny_checkpoint(family)
    path = tmp_path_factory.mktemp(f"{family}-{quant}") / "m.gguf"
    assert main(["convert", str(src), "-q", quant, "-o", str(path), "--no-integrity"]) == 0
    host = load_runner(path, src)
    assert isinstance(host.host_decoder, HostGemma4) and host.window_layers is not None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF2Q_NO_HOST_DECODE", "1")
        graph = load_runner(path, src)
    assert graph.host_decoder is None
    for lin in _all_linears(graph.model):
        lin._host = None  # MLX's quantized_matmul for every few-row product
    return host, graph


@pytest.fixture
def graph_ops(monkeypatch):
    """The graph runner's experts through MLX's per-pair gather (not the host's sorted C segments)."""
    monkeypatch.setenv("HF2Q_MOE_GROUPED", "0")


def _close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * max(1.0, float(np.abs(want).max())))
    assert np.array_equal(np.argmax(got, -1), np.argmax(want, -1))


def _prefill(runner, seq, tokens, chunk: int = 128) -> np.ndarray:
    for first in range(0, len(tokens), chunk):
        logits = runner.prefill(seq, tokens[first:first + chunk])
    return logits


def test_batched_decode_across_window_moves_equals_the_graph(pair, graph_ops):
    """Three sequences (inside the first window, past several window moves) prefilled alike on both runners,
    then 24 greedy steps as one batch: the same logits and tokens at every step, the window buffers bounded."""
    host, graph = pair
    prompts = [random_tokens(n, seed=500 + n) for n in (5, 1500, 2600)]  # bases 0 and two past moves
    hs, gs = [host.new_sequence() for _ in prompts], [graph.new_sequence() for _ in prompts]
    toks = []
    for h, g, p in zip(hs, gs, prompts):
        want = _prefill(graph, g, p)
        _close(_prefill(host, h, p), want)  # 128-token chunks: host rows against the graph
        toks.append(int(np.argmax(want)))
    assert len({s.window.base for s in hs}) > 1
    for _ in range(24):
        got, want = host.decode(hs, toks), graph.decode(gs, toks)
        _close(got, want)
        toks = [int(t) for t in np.argmax(want, -1)]
    assert [s.window.base for s in hs] == [s.window.base for s in gs]
    assert max(s.window_nbytes for s in hs) <= host.kv_bytes_per_slot


def test_host_prefill_rows_equal_the_graph_prefill(pair, graph_ops):
    """Short chunks as rows of the host step (the runner's choice up to ``HOST_PREFILL_ROWS``) across the window:
    the logits of each chunk's end and the greedy continuation are the graph's."""
    host, graph = pair
    chunks = [random_tokens(n, seed=600 + n) for n in (11, 19, 30)]
    h, g = host.new_sequence(), graph.new_sequence()
    for chunk in chunks:
        got = host.host_decoder.prefill(h, np.asarray(chunk))
        _close(got, graph.prefill(g, chunk))
    tok = int(np.argmax(got))
    for _ in range(6):
        got, want = host.decode([h], [tok])[0], graph.decode([g], [tok])[0]
        _close(got, want)
        tok = int(np.argmax(want))


def test_mixed_step_equals_decode_then_prefill(pair):
    """The decode-first mixed step (decode rows riding on a prefill chunk's pass) gives each part's logits."""
    host = pair[0]
    a, b = host.new_sequence(), host.new_sequence()
    host.prefill(a, random_tokens(40, seed=7))
    chunk = random_tokens(9, seed=8)
    a2, b2 = host.new_sequence(), host.new_sequence()
    host.prefill(a2, random_tokens(40, seed=7))
    dec, pre = host.decode_with_prefill([a], [3], b, chunk)
    np.testing.assert_allclose(dec, host.decode([a2], [3]), rtol=0, atol=1e-5)
    np.testing.assert_allclose(pre, host.prefill(b2, chunk), rtol=0, atol=1e-5)
    assert (a.length, b.length) == (a2.length, b2.length) == (41, 9)
