"""Gemma 4 on the 8-bit KV cache (``--kv-cache-type q8|q8-rotated``): its global and sliding layers of two
head sizes, stored as pieces of the narrowest (``models/gemma4.py::cache_layout``) and read as stored.

With random weights the distance to the f16 cache says nothing, so the properties held here are exact
ones: the engine on q8 equals the engine on an f16 cache that holds the same rows dequantized (every
layer kind, the E2B layers that share K/V, the MoE blocks); chunked prefill equals one-shot; a window
that moves on and the snapshot of a prompt end keep the codes themselves; a stacked batch decodes as
its rows alone; the bytes the cache allocates are what admission and ``info`` count.
"""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from hf2q.engine.kv_cache import ForwardBatch, SequenceCache, SlidingWindow
from hf2q.engine.memory_plan import kv_need
from hf2q.engine.runner import MlxModelRunner
from tests.engine_support import convert_f32, random_tokens

PROMPT = 400  # the tight window below moves its first position past 256 within it
CHUNK = 64


@pytest.fixture(scope="module")
def gemma4_runners(tiny_checkpoint, tmp_path_factory):
    """``runners(family)`` → the f16 runner of that tiny Gemma 4 and its q8 / q8-rotated twins (one model). The
    f16 runner runs the MLX graph as the 8-bit ones do (the CPU's host decode step takes float caches only), so
    what a comparison sees is the cache alone."""
    made = {}

    def get(family: str) -> dict[str, MlxModelRunner]:
        if family not in made:
            gguf = convert_f32(tiny_checkpoint(family), tmp_path_factory.mktemp(family) / "f32.gguf")
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("HF2Q_NO_HOST_DECODE", "1")
                f16 = MlxModelRunner.load(gguf)
            made[family] = {t: f16 if t == "f16" else MlxModelRunner(f16.gguf, f16.model, f16.dtype, None, t)
                            for t in ("f16", "q8", "q8-rotated")}
        return made[family]
    return get


def _tight(runner, interval: int = 16, keep: int = 2) -> SequenceCache:
    """``runner.new_sequence()`` with window points every ``interval`` tokens, the newest ``keep``: the same
    engine code, its window moving on (and its prompt ends becoming snapshots) within a few hundred tokens."""
    n_layers, heads, dim = runner.model.kv_shape
    window, layers = runner.model.sliding_window_layers
    return SequenceCache(n_layers, heads, dim, runner.dtype, codec=runner.kv_codec,
                         window=SlidingWindow(window, layers, interval=interval, keep=keep))


def _run(runner, seq, tokens, chunk=CHUNK, decode=6) -> np.ndarray:
    """Last logits of every prefill chunk, then of ``decode`` greedy steps."""
    rows = [runner.prefill(seq, tokens[a:a + chunk]) for a in range(0, len(tokens), chunk)]
    for _ in range(decode):
        rows.append(runner.decode([seq], [int(np.argmax(rows[-1]))])[0])
    return np.stack(rows)


def _planes(seq, layer):
    return [np.array(a) for a in (*seq.keys[layer], *seq.values[layer])]


@pytest.mark.parametrize("family", ["gemma4", "gemma4_e2b", "gemma4_moe"])
@pytest.mark.parametrize("kind", ["q8", "q8-rotated"])
def test_q8_equals_the_f16_engine_over_the_dequantized_rows(gemma4_runners, family, kind, monkeypatch):
    """The q8 runner against the f16 runner whose every new K/V row is replaced, as it is written, by the
    row the q8 run stored there, decoded (rotated back for ``q8-rotated``): the same values attended, so the
    logits agree to float32 rounding — through prefill chunks past window moves and decode steps, in the
    global layers (two 32-wide pieces a head) and the sliding ones, and in E2B's KV-shared layers. (Fed its
    own rows instead, a float32 difference of 1e-7 now and then lands a code on the other side of a rounding
    step, which random weights amplify.)"""
    runners = gemma4_runners(family)
    q8, f16 = runners[kind], runners["f16"]
    codec, update = q8.kv_codec, ForwardBatch.update
    tokens = random_tokens(PROMPT, seed=21)
    stored = []

    def recorded(self, layer, k, v):
        stored.append([codec.encode(x) for x in (k, v)])
        return update(self, layer, k, v)

    monkeypatch.setattr(ForwardBatch, "update", recorded)
    seq = _tight(q8)
    got = _run(q8, seq, tokens)
    assert seq.window.base > 0  # the window layers let go of their oldest positions meanwhile
    want_rows = iter(stored)

    def dequantized(self, layer, k, v):
        back = [codec.decode(*planes) for planes in next(want_rows)]
        if codec.rotated:
            back = [codec.rotate(x) for x in back]
        return update(self, layer, *back)

    monkeypatch.setattr(ForwardBatch, "update", dequantized)
    want = _run(f16, _tight(f16), tokens)
    assert next(want_rows, None) is None
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, atol=2e-5 * scale, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_chunked_prefill_equals_one_shot(gemma4_runners):
    """Chunks of 64 and 150 tokens against one 400-token prefill: the same greedy tokens and logits, and
    the global layers' stored codes the same (each row is encoded on its own) but for a few one level apart,
    where BLAS's rounding by row count put a value on the other side of a rounding edge; such a code moves
    the logits by up to ~3e-4 here (measured with OpenBLAS's Zen kernels), a whole level's step, so the
    logits are held to 5e-4."""
    r = gemma4_runners("gemma4")["q8-rotated"]
    tokens = random_tokens(PROMPT, seed=22)
    one = _tight(r)
    want = _run(r, one, tokens, chunk=PROMPT)
    glob = min(set(range(one.n_layers)) - one.window.layers)
    for chunk in (CHUNK, 150):
        seq = _tight(r)
        got = _run(r, seq, tokens, chunk=chunk)
        assert (got.argmax(-1)[-6:] == want.argmax(-1)[-6:]).all()
        np.testing.assert_allclose(got[-6:], want[-6:], atol=5e-4, rtol=0)
        codes = np.array(mx.view(seq.keys[glob][0][:, :seq.length], mx.uint8)).astype(int)
        ref = np.array(mx.view(one.keys[glob][0][:, :one.length], mx.uint8)).astype(int)
        assert np.abs(codes - ref).max() <= 1 and (codes != ref).mean() < 1e-3


def test_window_moves_and_snapshots_keep_the_codes(gemma4_runners):
    """A 100-token prompt, then an answer long enough that the prompt end ages out of the kept points
    (a snapshot of its window is taken) and the window buffers move on: the snapshot holds the window's
    codes and scales bit for bit as they were, trimming back to it puts them back, and continuing from
    there equals a cold prompt on the 8-bit cache."""
    r = gemma4_runners("gemma4_e2b")["q8"]
    first = random_tokens(100, seed=23)
    slot = _tight(r, interval=32, keep=2)
    logits = _run(r, slot, first, decode=0)[-1]
    w = slot.window
    layer = min(w.layers)
    cut = slice(100 - w.size + 1 - w.base, 100 - w.base)
    before = [p[:, cut] for p in _planes(slot, layer)]
    assert isinstance(slot.keys[layer], tuple) and slot.keys[layer][0].dtype == mx.uint32
    token = int(np.argmax(logits))
    for _ in range(260):
        token = int(np.argmax(r.decode([slot], [token])[0]))
    assert 100 in w.snapshots and not w.reachable(100) and w.base > 100
    first_kept, keys, values = w.snapshots[100]
    assert first_kept == 100 - w.size + 1
    for got, want in zip([np.array(a) for a in (*keys[layer], *values[layer])], before):
        np.testing.assert_array_equal(got, want)
    slot.trim(100)
    assert w.base == first_kept
    for got, want in zip(_planes(slot, layer), before):
        np.testing.assert_array_equal(got[:, :w.size - 1], want)
    more = random_tokens(150, seed=24)
    got = _run(r, slot, more)
    cold = _tight(r, interval=32, keep=2)
    _run(r, cold, first, decode=0)
    want = _run(r, cold, more)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_stacked_batch_decodes_as_its_rows_alone(gemma4_runners):
    """Three rows at different lengths decoded together (their K/V planes stacked, ``StackedDecode``)
    give each row's logits decoded alone."""
    r = gemma4_runners("gemma4")["q8-rotated"]
    prompts = [random_tokens(n, seed=n) for n in (300, 330, 360)]
    batch = [r.new_sequence() for _ in prompts]
    fed = [[int(np.argmax(_run(r, s, p, decode=0)[-1])) for s, p in zip(batch, prompts)]]
    rows, stacked = [], 0
    for _ in range(5):
        rows.append(r.decode(batch, fed[-1]))
        fed.append([int(t) for t in np.argmax(rows[-1], -1)])
        stacked += r._stack is not None
    assert stacked == 5
    for i, prompt in enumerate(prompts):
        seq = r.new_sequence()
        _run(r, seq, prompt, decode=0)
        alone = np.stack([r.decode([seq], [fed[j][i]])[0] for j in range(5)])
        np.testing.assert_allclose(alone, np.stack([row[i] for row in rows]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["gemma4", "gemma4_e2b"])
def test_bytes_are_what_the_cache_allocates(gemma4_runners, family):
    """The 8-bit figures admission and ``info`` use (``memory_plan.kv_need``) are the arrays' real size:
    per position and layer, the padded cache heads' K and V rows of 32 codes plus one float32 scale (the
    window buffers and the prompt end's snapshot included)."""
    r = gemma4_runners(family)["q8"]
    n_layers, heads, dim = r.model.kv_shape
    seq = r.new_sequence()
    _run(r, seq, random_tokens(300, seed=25), decode=2)
    assert seq.position_bytes == heads * 2 * (dim + 4)
    snapshots = [buf for _, keys, values in seq.window.snapshots.values() for buf in (*keys.values(), *values.values())]
    held = sum(a.nbytes for buf in seq.keys + seq.values + snapshots if buf is not None for a in buf)
    assert seq.nbytes == held
    need = kv_need(r.gguf.hparams, 4, kv_type="q8")
    assert (need.per_token, need.window_bytes()) == (r.kv_bytes_per_token, r.kv_bytes_per_slot)
    assert r.kv_bytes_per_token == seq.bytes_per_token
    f16 = gemma4_runners(family)["f16"]
    assert f16.kv_bytes_per_token > 3 * r.kv_bytes_per_token  # float32 on the CPU: 8 bytes a value pair
