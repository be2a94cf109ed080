"""Stacked decode batches (``kv_cache.StackedDecode``) against per-sequence buffers.

The MLX graph path (the one GPUs take; the host decode step is switched off) runs the same
operations twice — once with ``stack_decode`` on, once off — and must give the same logits and
leave the same caches: through cache growth past ``GROW``, gemma3's sliding window, sequences
leaving and rejoining the batch, a prefill and a trim on a member, and an export while stacked.
"""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import numpy as np
import pytest

from hf2q.engine.kv_cache import GROW, StackedDecode
from tests.engine_support import convert_f32, load_runner, random_tokens


@pytest.fixture(scope="module")
def graph_runners(tiny_checkpoint, tmp_path_factory):
    """Per family: a runner that stacks and one that does not, over the same model."""
    from hf2q.engine.runner import MlxModelRunner

    out = {}
    for family in ("llama", "gemma3"):
        src = tiny_checkpoint(family)
        on = load_runner(convert_f32(src, tmp_path_factory.mktemp(family) / "m.gguf"), src)
        off = MlxModelRunner(on.gguf, on.model, on.dtype, None)
        for r, stack in ((on, True), (off, False)):
            r.host_decoder = None  # the MLX graph path, as on a GPU
            r.stack_decode = stack
        out[family] = (on, off)
    return out


def _same_caches(a, b):
    assert a.length == b.length
    n = a.length
    for li in range(a.n_layers):
        np.testing.assert_array_equal(np.array(a.keys[li][:, :n]), np.array(b.keys[li][:, :n]))
        np.testing.assert_array_equal(np.array(a.values[li][:, :n]), np.array(b.values[li][:, :n]))


class _Twin:
    """The same script on two sets of sequences: ``on`` decodes stacked, ``off`` does not."""

    def __init__(self, runners, prompts):
        self.r, self.r_off = runners
        self.on = [self.r.new_sequence() for _ in prompts]
        self.off = [self.r_off.new_sequence() for _ in prompts]
        for a, b, p in zip(self.on, self.off, prompts):
            self.r.prefill(a, p)
            self.r_off.prefill(b, p)

    def decode(self, rows, toks):
        got = self.r.decode([self.on[i] for i in rows], toks)
        stack = self.r._stack
        stacked = stack is not None and stack.holds([self.on[i] for i in rows])
        want = self.r_off.decode([self.off[i] for i in rows], toks)
        assert self.r_off._stack is None
        np.testing.assert_array_equal(got, want)
        return [int(t) for t in np.argmax(want, -1)], stacked


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_stacked_decode_equals_per_sequence_buffers(family, graph_runners):
    """Four sequences of different lengths, two of them crossing a growth step of the stack
    (250 + 10 > 256): every step's logits equal, and every cache equal once handed back."""
    tw = _Twin(graph_runners[family], [random_tokens(n, seed=n) for n in (3, 250, 20, 247)])
    r = tw.r
    toks = [7, 8, 9, 10]
    stack = None
    for _ in range(10):
        toks, stacked = tw.decode([0, 1, 2, 3], toks)
        assert stacked and (stack is None or r._stack is stack)  # one stack for all ten steps
        stack = r._stack
    assert stack.capacity == 2 * GROW
    for a, b in zip(tw.on, tw.off):
        _same_caches(a, b)  # reading keys hands every row back
    assert stack.caches == [] and not any(s.stacked for s in tw.on)


def test_members_leave_rejoin_prefill_trim_and_export(graph_runners):
    # gemma3: sliding window 16, so attention sees a window of the stack
    tw = _Twin(graph_runners["gemma3"], [random_tokens(n, seed=40 + n) for n in (9, 30, 14)])
    r, r_off = tw.r, tw.r_off
    toks = [11, 12, 13]
    for _ in range(3):
        toks, _ = tw.decode([0, 1, 2], toks)
    # row 1 leaves: the batch changes, the stack is rebuilt over rows 0 and 2
    toks02, stacked = tw.decode([0, 2], [toks[0], toks[2]])
    assert stacked and not tw.on[1].stacked
    # a prefill on a member of the live stack (the slot's next turn) hands the stack back first
    more = random_tokens(5, seed=77)
    np.testing.assert_array_equal(r.prefill(tw.on[0], more), r_off.prefill(tw.off[0], more))
    assert not tw.on[2].stacked
    toks, stacked = tw.decode([0, 1, 2], [3, toks[1], toks02[1]])
    assert stacked
    # a trim while stacked (the pipeline settling its speculation) keeps the row in the stack
    for s in (tw.on[1], tw.off[1]):
        s.trim(s.length - 1)
    assert tw.on[1].stacked and tw.on[1].length == tw.off[1].length
    toks, stacked = tw.decode([0, 1, 2], toks)
    assert stacked
    # an export while stacked reads the sequence's own positions
    n = tw.on[2].length
    got, want = tw.on[2].export(n - 4, n), tw.off[2].export(n - 4, n)
    assert got.keys() == want.keys()
    for k in got:
        np.testing.assert_array_equal(got[k], want[k])
    for a, b in zip(tw.on, tw.off):
        _same_caches(a, b)


def test_uneven_lengths_are_not_stacked(graph_runners):
    """Padding a 10-token cache to a 2,000-token one would spend memory the KV budget does not
    count: such a batch keeps per-sequence buffers, with the same results."""
    prompts = [random_tokens(10, seed=1), random_tokens(2000, seed=2)]
    tw = _Twin(graph_runners["llama"], prompts)
    r = tw.r
    assert not StackedDecode.fits(tw.on)
    toks, stacked = tw.decode([0, 1], [5, 6])
    assert not stacked and r._stack is None
    even = [r.new_sequence(), r.new_sequence()]
    for s, n in zip(even, (200, 260)):
        r.prefill(s, random_tokens(n, seed=n))
    assert StackedDecode.fits(even)
    assert not StackedDecode.fits([even[0], even[0]])  # one sequence twice
    assert not StackedDecode.fits(even[:1])  # nothing to stack


async def test_runtime_tokens_equal_with_and_without_stacking(tiny_checkpoint, tmp_path_factory, monkeypatch):
    """Through the real runtime (pipelined GPU-style steps, requests joining, ending at different
    lengths and one continuing in its slot): the same T=0 tokens with stacked batches as with
    per-sequence buffers, and the stacked run did stack."""
    from hf2q.engine import kv_cache
    from tests.test_decode_pipeline import _serve

    src = tiny_checkpoint("llama")
    path = convert_f32(src, tmp_path_factory.mktemp("stack-rt") / "m.gguf")

    def build():
        r = load_runner(path, src)
        r.host_decoder = None  # the MLX graph path, as on a GPU
        r.eos_token_ids = frozenset()
        return r
    prompts = [random_tokens(n, seed=20 + n) for n in (12, 30, 7)]
    max_tokens = [9, 4, 14]
    monkeypatch.setenv("HF2Q_NO_STACKED_DECODE", "1")
    plain, _ = await _serve(build, prompts, max_tokens)
    monkeypatch.delenv("HF2Q_NO_STACKED_DECODE")
    made = []
    real_init = kv_cache.StackedDecode.__init__
    monkeypatch.setattr(kv_cache.StackedDecode, "__init__", lambda self, caches: made.append(len(caches))
                        or real_init(self, caches))
    stacked, _ = await _serve(build, prompts, max_tokens)
    assert stacked == plain
    assert made and max(made) == 3


def test_stacking_and_handing_back_hold_at_most_one_extra_layer():
    """Stacking copies every member's K/V, and handing back copies it out again: done layer by
    layer, so memory never holds more than one layer twice (not the whole cache twice)."""
    import mlx.core as mx

    from hf2q.engine.kv_cache import SequenceCache

    L, H, D, cap = 8, 4, 64, 2 * GROW
    seqs = []
    for _ in range(4):
        s = SequenceCache(L, H, D, mx.float32)
        s.reserve(cap)
        s.advance(cap - 10)
        seqs.append(s)
    mx.eval([a for s in seqs for a in s._keys + s._values])
    layer = 4 * 2 * H * cap * D * 4  # one layer's K and V for the four rows, float32
    for step in ("stack", "hand back"):
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        if step == "stack":
            stack = StackedDecode(seqs)
            mx.eval(stack.arrays())  # whatever is still lazy is paid here, inside the window
        else:
            stack.dissolve()
        assert mx.get_peak_memory() - base <= 1.5 * layer, step
    assert [s.capacity for s in seqs] == [cap] * 4 and not any(s.stacked for s in seqs)
