"""Qwen 3.5 MoE's shared expert (``hf2q/engine/models/qwen35_moe.py``) on the file hf2q's own converter writes.

Quantizing, the converter stores the shared expert's gate ``ffn_gate_inp_shexp`` as ``[hidden]`` (llama.cpp's
converter: ``[1, hidden]``; llama.cpp's loader takes either): the engine's logits of that q8_0 file, over prefill
chunks of many tokens and decode steps, are near transformers' forward pass (the q8_0 tolerances of
``tests/test_engine_qwen35.py``). Quantized, the shared expert's gate and up are one
product built from the stored blocks (``layers.load_products``), bit for bit the unfused load's."""

from __future__ import annotations

import numpy as np
import pytest

from hf2q.engine.runner import MlxModelRunner
from tests.engine_support import random_tokens
from tests.test_engine_qwen35 import CHUNK, DECODE, PROMPT, TOL_Q8_MAX, TOL_Q8_MEAN, _reference, _run


@pytest.fixture(scope="module")
def converted(tiny_checkpoint, tmp_path_factory):
    """``get(TYPE)``: the tiny qwen35_moe checkpoint through ``hf2q convert -q TYPE`` (once per type)."""
    from hf2q.cli import main

    src, made = tiny_checkpoint("qwen35_moe"), {}

    def get(quant: str):
        if quant not in made:
            out = tmp_path_factory.mktemp("qwen35moe") / f"{quant}.gguf"
            assert main(["convert", str(src), "-q", quant, "-o", str(out), "--no-integrity"]) == 0
            made[quant] = out
        return made[quant]

    get.src = src
    return get


def test_hf2q_converted_q8_0_logits_match_transformers(converted):
    from hf2q.formats.gguf_file import open_gguf

    path = converted("q8_0")
    assert open_gguf(path).tensor("blk.0.ffn_gate_inp_shexp.weight").shape == (64,)  # the one-row gate, as stored
    runner = MlxModelRunner.load(path)
    assert runner.arch == "qwen35moe"
    tokens = random_tokens(PROMPT + DECODE, seed=5)
    ref = _reference(converted.src, tokens)
    _, chunks, steps = _run(runner, tokens)  # prefill chunks of CHUNK tokens, then decode steps
    rows = [min(i + CHUNK, PROMPT) - 1 for i, _ in chunks] + list(range(PROMPT, PROMPT + DECODE))
    err = np.abs(np.stack([out for _, out in chunks] + steps) - ref[rows])
    assert err.max() < TOL_Q8_MAX and err.mean() < TOL_Q8_MEAN


def test_the_shared_expert_is_fused_as_read_and_equals_the_unfused_load(converted, monkeypatch):
    path = converted("q8_0")
    fused = MlxModelRunner.load(path)
    shared = fused.model.layers[0].ffn.shared
    assert len(shared.gate_up) == 1 and shared.gate_up[0][0].parts == [shared.gate, shared.up]
    monkeypatch.setenv("HF2Q_NO_FUSED_PROJ", "1")
    alone = MlxModelRunner.load(path)
    assert len(alone.model.layers[0].ffn.shared.gate_up) == 2
    tokens = random_tokens(PROMPT + DECODE, seed=6)
    for (_, a), (_, b) in zip(_run(fused, tokens)[1], _run(alone, tokens)[1]):  # chunks of many rows
        assert np.array_equal(a, b)
    for a, b in zip(_run(fused, tokens)[2], _run(alone, tokens)[2]):  # one-row decode steps: the fused product
        assert np.array_equal(a, b)
