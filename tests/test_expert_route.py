"""The grouped layout of a mixture-of-experts feed-forward (``hf2q.engine.expert_route``): the pairs sorted into
one padded slab per expert, and the CPU's pairs sorted on the host through the C matvec kernel, give, pair for pair,
what one product per pair gives — with uneven loads, unused
experts and a capacity that is not a multiple of the step — within float32 rounding (a slab is one product of C rows
per expert, a pair one row, and BLAS rounds by the row count; measured ≤ 3e-7 on outputs of ~0.1). The family tests
(transformers logits) also pass with ``HF2Q_MOE_GROUPED=1``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from hf2q.engine import expert_route
from hf2q.engine.expert_route import ExpertRoute
from hf2q.engine.layers import Linear, silu
from hf2q.formats.gguf_file import GGUFTensor
from hf2q.ggml import codec
from hf2q.kernels import cpu_qmatvec, cpu_qmatvec_ref

E, OUT, IN = 6, 64, 256


def _experts(qtype, seed: int) -> Linear:
    w = (np.random.default_rng(seed).standard_normal((E * OUT, IN)) * 0.05).astype(np.float32)
    data = codec.quantize(w, qtype) if qtype != T.F32 else w
    return Linear(GGUFTensor("blk.0.ffn_up_exps.weight", qtype, (E, OUT, IN), data, data.nbytes), mx.float32)


def _routes(monkeypatch, idx):
    monkeypatch.setenv("HF2Q_MOE_GROUPED", "0")
    per_pair = ExpertRoute.of(idx, E)
    monkeypatch.setenv("HF2Q_MOE_GROUPED", "1")
    grouped = ExpertRoute.of(idx, E)
    assert not per_pair.grouped and grouped.grouped
    return per_pair, grouped


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.F32], ids=lambda t: t.name)
def test_grouped_experts_give_each_pair_its_own_product(qtype, monkeypatch):
    rng = np.random.default_rng(1)
    n, k = 37, 2
    # uneven loads: expert 0 takes most pairs, expert 4 none
    first = rng.choice([0, 0, 0, 1, 2], n)
    second = (first + 1 + rng.integers(0, 2, n)) % E
    second[second == 4] = 5
    idx = mx.array(np.stack([first, second], 1).astype(np.uint32))
    x = mx.array(rng.standard_normal((n, IN)).astype(np.float32))
    gate, down = _experts(qtype, 2), _experts(qtype, 3)
    down = Linear(GGUFTensor("d", T.F32, (E, IN, OUT),
                             (np.random.default_rng(4).standard_normal((E * IN, OUT)) * 0.05).astype(np.float32),
                             E * IN * OUT * 4), mx.float32)
    outs = []
    for route in _routes(monkeypatch, idx):
        h = silu(route.apply(gate, route.inputs(x)))
        outs.append(np.array(route.outputs(route.apply(down, h))))
    want, got = outs
    assert want.shape == got.shape == (n, k, IN)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    grouped = _routes(monkeypatch, idx)[1]
    assert grouped.capacity == 32 and grouped.capacity % expert_route.CAPACITY_STEP == 0  # 23 pairs on expert 0
    rows = np.array(grouped.tokens)
    assert (rows == n).sum() == E * grouped.capacity - n * k  # every pair once, the rest padding


def test_the_gpu_groups_only_many_pairs_and_the_cpu_never(monkeypatch):
    monkeypatch.delenv("HF2Q_MOE_GROUPED", raising=False)
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    assert expert_route.grouping(4096 * 8, 128) == on_gpu
    assert not expert_route.grouping(8 * 8, 128)  # a decode batch: one product per pair reads fewer experts


def _uneven_idx(rng, n: int) -> mx.array:
    """Two experts a token, expert 0 taking most pairs and expert 4 none."""
    first = rng.choice([0, 0, 0, 1, 2], n)
    second = (first + 1 + rng.integers(0, 2, n)) % E
    second[second == 4] = 5
    return mx.array(np.stack([first, second], 1).astype(np.uint32))


def _reference(lin: Linear, x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """float64 ``[N, k, out]``: each pair's token through its expert's dequantized (or float) matrix."""
    out = np.zeros((*idx.shape, lin.shape[1]))
    for e in range(lin.shape[0]):
        if lin.quantized:
            w = cpu_qmatvec_ref.dequantize(np.asarray(memoryview(lin.weight))[e].view(np.uint8),
                                           np.asarray(memoryview(lin.scales))[e], np.asarray(memoryview(lin.biases))[e],
                                           lin.bits)
        else:
            w = np.asarray(memoryview(lin.weight))[e].astype(np.float64)
        hit = idx == e
        out[hit] = x[np.nonzero(hit)[0]].astype(np.float64) @ w.T
    return out


needs_kernel = pytest.mark.skipif(mx.default_device() != mx.cpu or cpu_qmatvec.kernel() is None,
                                  reason="the host layout is the CPU's, with its C kernels")


@needs_kernel
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.F32], ids=lambda t: t.name)
def test_the_cpu_sorts_pairs_on_the_host_and_each_pair_gets_its_own_product(qtype, monkeypatch):
    rng = np.random.default_rng(5)
    n = 41
    idx = _uneven_idx(rng, n)
    x = rng.standard_normal((n, IN)).astype(np.float32)
    up = _experts(qtype, 6)
    monkeypatch.delenv("HF2Q_MOE_GROUPED", raising=False)
    host = ExpertRoute.of(idx, E)
    assert host.host is not None and 4 not in host.host.experts and sum(host.host.counts) == 2 * n
    got = np.array(host.outputs(host.apply(up, host.inputs(mx.array(x)))))
    want = _reference(up, x, np.array(idx))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * np.abs(want).max())
    monkeypatch.setenv("HF2Q_MOE_GROUPED", "0")
    per_pair = ExpertRoute.of(idx, E)
    assert per_pair.host is None and not per_pair.grouped
    mlx_pairs = np.array(per_pair.outputs(per_pair.apply(up, per_pair.inputs(mx.array(x)))))
    np.testing.assert_allclose(got, mlx_pairs, rtol=1e-5, atol=2e-6 * np.abs(want).max())


@needs_kernel
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_a_token_alone_gets_the_bits_it_gets_among_many(qtype, monkeypatch):
    """A decode step (one token) and a prefill chunk (many) give a token the same expert outputs exactly."""
    monkeypatch.delenv("HF2Q_MOE_GROUPED", raising=False)
    rng = np.random.default_rng(7)
    n = 29
    idx = _uneven_idx(rng, n)
    x = mx.array(rng.standard_normal((n, IN)).astype(np.float32))
    gate, down = (Linear(GGUFTensor(f"blk.0.ffn_{name}_exps.weight", qtype, (E, IN, IN),
                                    codec.quantize((rng.standard_normal((E * IN, IN)) * 0.05).astype(np.float32),
                                                   qtype), 0), mx.float32) for name in ("gate", "down"))

    def ffn(rows, ids):
        route = ExpertRoute.of(ids, E)
        return np.array(route.outputs(route.apply(down, silu(route.apply(gate, route.inputs(rows))))))

    many = ffn(x, idx)
    for i in (0, 3, n - 1):
        np.testing.assert_array_equal(ffn(x[i:i + 1], idx[i:i + 1]), many[i:i + 1])


@needs_kernel
@pytest.mark.parametrize("fused", [False, True], ids=["gate+up", "gate_up"])
def test_the_routed_block_in_one_host_pass_equals_mlx_per_pair(fused, monkeypatch):
    """``ExpertRoute.glu``: on the host (gather, gate|up, the activation, down, the weighted sum) as MLX per pair
    gives it, for two stacks (qwen3moe's SiLU) and one fused ``[gate | up]`` stack (gemma4's tanh-GELU)."""
    from hf2q.engine.layers import gelu_tanh

    rng = np.random.default_rng(11)
    n = 23
    idx = _uneven_idx(rng, n)
    x = mx.array(rng.standard_normal((n, IN)).astype(np.float32))
    weights = mx.array(rng.random((n, 2)).astype(np.float32))

    def stack(name, rows, seed):
        w = (np.random.default_rng(seed).standard_normal((E * rows, IN)) * 0.05).astype(np.float32)
        return Linear(GGUFTensor(f"blk.0.ffn_{name}_exps.weight", T.Q8_0, (E, rows, IN), codec.quantize(w, T.Q8_0),
                                 0), mx.float32)

    gate_up = [stack("gate_up", 2 * IN, 12)] if fused else [stack("gate", IN, 12), stack("up", IN, 13)]
    down = stack("down", IN, 14)
    act = gelu_tanh if fused else silu
    monkeypatch.delenv("HF2Q_MOE_GROUPED", raising=False)
    host = ExpertRoute.of(idx, E)
    assert host.host is not None
    got = np.array(host.glu(x, gate_up, down, act, weights))
    monkeypatch.setenv("HF2Q_MOE_GROUPED", "0")
    want = np.array(ExpertRoute.of(idx, E).glu(x, gate_up, down, act, weights))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
