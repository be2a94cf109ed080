"""A decode row's traced q/k norms and RoPE (``layers.qk_rotation``) give the logits of the plain ops, bit for bit,
and a stacked batch's positions are one array a step.

The reference is the same F32 GGUF loaded with ``HF2Q_NO_STEP_COMPILE=1``, both on the MLX graph path
(``HF2Q_NO_HOST_DECODE=1``: the CPU host decode step builds no graph), over single and stacked decodes whose
sequences stand at different positions, for qwen3 (q/k norms), llama (none, interleaved RoPE) and gemma3 (sandwich
norms, local layers on their own RoPE base).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine_support import convert_f32, random_tokens

FAMILIES = ("qwen3", "llama", "gemma3")


@pytest.fixture(scope="module")
def f32_gguf(tiny_checkpoint, tmp_path_factory):
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = convert_f32(tiny_checkpoint(family), tmp_path_factory.mktemp(family) / "f32.gguf")
        return made[family]

    return get


def _load(path, monkeypatch, compiled: bool):
    from hf2q.engine.runner import MlxModelRunner

    with monkeypatch.context() as m:
        m.setenv("HF2Q_NO_HOST_DECODE", "1")
        m.setenv("HF2Q_NO_STEP_COMPILE", "" if compiled else "1")
        if compiled:
            m.delenv("HF2Q_NO_STEP_COMPILE")
        return MlxModelRunner.load(path)


def _decodes(runner) -> list[np.ndarray]:
    toks = random_tokens(30, seed=3)
    a, b, c = runner.new_sequence(), runner.new_sequence(), runner.new_sequence()
    runner.prefill(a, toks[:9])
    runner.prefill(b, toks[9:12])
    runner.prefill(c, toks[12:20])
    out = [runner.decode([a], [toks[20]]), runner.decode([b], [toks[21]])]
    for i in range(3):  # stacked: three rows at three positions, then again one step on
        out.append(runner.decode([a, b, c], [toks[22 + i], toks[25 + i], toks[27 - i]]))
    out.append(runner.decode([c], [toks[29]]))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_decode_equals_plain(family, f32_gguf, monkeypatch):
    path = f32_gguf(family)
    compiled, plain = _load(path, monkeypatch, True), _load(path, monkeypatch, False)
    assert compiled.host_decoder is None and plain.host_decoder is None
    attn = compiled.model.layers[0].attn
    assert attn._rotate is not None and plain.model.layers[0].attn._rotate is None
    for i, (got, ref) in enumerate(zip(_decodes(compiled), _decodes(plain))):
        assert np.array_equal(got, ref), f"decode {i}: max diff {np.abs(got - ref).max()}"


def test_stacked_batch_positions_are_one_array(f32_gguf, monkeypatch):
    """A stacked decode's RoPE offsets are the array its cache writes use (not a second one per step)."""
    from hf2q.engine.kv_cache import ForwardBatch

    runner = _load(f32_gguf("qwen3"), monkeypatch, True)
    seqs = [runner.new_sequence() for _ in range(2)]
    for s, n in zip(seqs, (4, 7)):
        runner.prefill(s, random_tokens(n))
    made = []
    real_init = ForwardBatch.__init__

    def spy(self, *a, **k):
        real_init(self, *a, **k)
        made.append(self)

    with monkeypatch.context() as m:
        m.setattr(ForwardBatch, "__init__", spy)
        runner.decode(seqs, [5, 6])
    fb = made[-1]
    assert fb.stack is not None
    assert fb.offset is fb._offsets_mx and fb.offset_array is fb._offsets_mx
    assert fb._offsets_mx.tolist() == [4, 7]
