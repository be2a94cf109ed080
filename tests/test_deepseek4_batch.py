"""Batched decode on DeepSeek-V4's compact cache: the rows' compressed entries live in shared buffers
(``deepseek4_cache.EntryBatch``) while the same sequences decode together, written in place as blocks
close. Reference: each sequence decoding alone in a cache of its own (``tests/test_engine_deepseek4.py``
checks that path against transformers).
"""

from __future__ import annotations

import numpy as np
import pytest

from hf2q.engine.runner import MlxModelRunner
from tests.engine_support import random_tokens
from tests.test_engine_deepseek4 import deepseek4_gguf

#: different window starts and entry counts; the longest crosses its entry buffers' growth (256
#: sparse entries: 1,024 tokens) while batched
LENGTHS = (150, 603, 1021)
STEPS = 9
TOL = 4e-5


@pytest.fixture(scope="module")
def runner():
    return MlxModelRunner.load(deepseek4_gguf())


def _pair(runner, n: int, seed: int):
    text = random_tokens(n, low=3, high=49152, seed=seed)
    batched, alone = runner.new_sequence(), runner.new_sequence()
    for seq in (batched, alone):
        for start in range(0, n, 512):
            runner.prefill(seq, text[start:start + 512])
    return batched, alone


def _sparse(seq):
    """The first layer with compressed entries and an indexer (ratio 4)."""
    return next(i for i, s in enumerate(seq.specs) if s.overlap)


def test_batched_rows_equal_each_alone_and_share_entry_rows(runner):
    pairs = [_pair(runner, n, seed=40 + k) for k, n in enumerate(LENGTHS)]
    rows = [b for b, _ in pairs]
    layer = _sparse(rows[0])
    shared = None
    for step, t in enumerate(random_tokens(STEPS, low=3, high=49152, seed=49)):
        both = runner.decode(rows, [t] * len(rows))
        for b, (_, alone) in enumerate(pairs):
            assert float(np.abs(both[b] - runner.decode([alone], [t])[0]).max()) < TOL, f"row {b} step {step}"
        held = [seq.entries[layer].rows for seq in rows]
        assert all(h is held[0] and h.n_rows == len(rows) for h in held)
        shared = shared or held[0]
        assert held[0] is shared  # the same rows every step: nothing is stacked again
    assert shared.capacity == 512 and rows[2].entries[layer].count > 256  # grown in place, while batched
    counts = [seq.entries[layer].count for seq in rows]
    assert counts == [(n + STEPS) // 4 for n in LENGTHS]
    # each slot counts its row's share of the shared buffers
    for i, e in enumerate(rows[0].entries):
        if e is not None:
            assert sum(seq.entries[i].nbytes for seq in rows) == e.rows.buf.nbytes

    # a member leaves: the two left get new shared rows, the one gone a buffer of its own again
    for t in random_tokens(3, low=3, high=49152, seed=50):
        both = runner.decode([rows[0], rows[2]], [t, t])
        for b, k in ((0, 0), (1, 2)):
            assert float(np.abs(both[b] - runner.decode([pairs[k][1]], [t])[0]).max()) < TOL
    assert rows[1].entries[layer].rows.n_rows == 1 and rows[0].entries[layer].rows.n_rows == 2
    assert float(np.abs(runner.decode([rows[1]], [5])[0] - runner.decode([pairs[1][1]], [5])[0]).max()) < TOL
    # HF2Q_NO_STACKED_DECODE's way (no sharing): a row of the shared batch and one of its own batch by
    # stacking their entries per step, and still decode as each alone
    runner.model.share_entries = False
    try:
        for t in random_tokens(2, low=3, high=49152, seed=51):
            both = runner.decode([rows[0], rows[1]], [t, t])
            for b, k in ((0, 0), (1, 1)):
                assert float(np.abs(both[b] - runner.decode([pairs[k][1]], [t])[0]).max()) < TOL
    finally:
        runner.model.share_entries = True
