"""Persisting DeepSeek-V4's compact cache with its MTP head on (``--speculative mtp --model-draft`` with
``--kv-persist``).

The head's attention is one more window layer of the compact cache, and its row at a position pairs that
token with the trunk's streams before it, so a block (``cache_kind = deepseek4-mtp``, format version 3)
carries the head's window rows at its end like the trunk's, and the trunk streams before its end
(``state.hidden``). The reference is a cold sequence that prefilled the same text in the same two
transactions: after restoring, the main logits, the head's draft logits and the next step are the cold ones.
"""

from __future__ import annotations

import numpy as np
import pytest

from hf2q.engine.kv_layout import HIDDEN_STATE
from hf2q.kvstore import BLOCK_TOKENS as B
from tests.engine_support import random_tokens
from tests.test_kvstore_stateful_engine import restore_through_store

#: the same text in the same two transactions: only the order of float32 sums differs
TOL = 1e-5
BLOCKS = 2
K = 3


@pytest.fixture(scope="module")
def runner():
    from hf2q.engine.runner import MlxModelRunner
    from tests.test_deepseek4_mtp import companion_gguf
    from tests.test_engine_deepseek4 import deepseek4_gguf

    r = MlxModelRunner.load(deepseek4_gguf(), ctx=1024)
    r.enable_mtp(companion_gguf())
    return r


@pytest.fixture(scope="module")
def served(runner):
    """A slot's sequence after one request (its prompt in one transaction, then decode steps) and its blocks."""
    from tests.test_kvstore_stateful_engine import serve_and_export

    prompt = random_tokens(BLOCKS * B + 20, low=3, high=49152, seed=3)
    return prompt, serve_and_export(runner, prompt, BLOCKS, 3)[1]


def test_blocks_carry_the_heads_window_rows_and_the_streams_it_pairs_with(runner, served):
    _, blocks = served
    assert runner.persists_kv and runner.kv_identity.endswith("-mtp")
    head = runner.model.mtp.layer
    cfg = runner.model.cfg
    for b in blocks:
        assert {f"state.raw.{head}", HIDDEN_STATE, "state.raw.0"} <= b.keys()
        assert b[f"state.raw.{head}"].shape == b["state.raw.0"].shape  # a window layer's rows like the trunk's
        assert b[HIDDEN_STATE].shape == (cfg.hc_count, cfg.hidden)
    # the memory plan counts those streams for every captured end it budgets (``--kv-persist``)
    from hf2q.engine.memory_plan import end_hidden_bytes, kv_need
    from hf2q.engine.models.deepseek4_layout import compact_need

    hp, elem = runner.gguf.hparams, runner.dtype.size
    seq = runner.new_sequence()  # the streams as a sequence holds them at its captured ends (compute dtype)
    seq.keep_block_ends(B)
    runner.prefill(seq, random_tokens(BLOCKS * B + 20, low=3, high=49152, seed=5))
    held = {p: end.hidden.nbytes for p, end in seq.block_ends.items()}
    assert sorted(held) == [B * (i + 1) for i in range(BLOCKS)]
    streams = end_hidden_bytes(hp, elem)
    assert set(held.values()) == {streams}
    before = seq.nbytes  # the sequence's own account holds them: letting the ends go frees at least them
    seq.forget_block_ends(())
    assert before - seq.nbytes >= BLOCKS * streams
    assert kv_need(hp, elem, mtp=True).end_copy == compact_need(hp, elem, mtp=True).point_copy() + streams
    assert kv_need(hp, elem).end_copy == compact_need(hp, elem).point_copy()  # no streams without the head


def _draft(runner, seq, pending: int):
    return runner.draft_logits(seq, pending, K)


def _close(got, want) -> float:
    return float(np.abs(got - want).max()) / max(1.0, float(np.abs(want).max()))


def _cold(runner, text, tail):
    cold = runner.new_sequence()
    runner.prefill(cold, text)
    return cold, runner.prefill(cold, tail)


def test_restored_sequence_drafts_and_continues_like_a_cold_one(runner, served, tmp_path):
    prompt, blocks = served
    tail = random_tokens(30, low=3, high=49152, seed=4)
    text = prompt[:BLOCKS * B] + tail
    # through the store, as a restarted server reads them: version 3, cache kind deepseek4-mtp
    restored = restore_through_store(runner, tmp_path / "kv", text, blocks, "deepseek4-mtp", "deepseek4")
    got = runner.prefill(restored, tail)
    cold, want = _cold(runner, text[:BLOCKS * B], tail)
    assert _close(got, want) <= TOL
    pending = int(np.argmax(want))
    got_draft, got_logits = _draft(runner, restored, pending)
    want_draft, want_logits = _draft(runner, cold, pending)
    assert got_draft == want_draft
    assert _close(got_logits, want_logits) <= TOL
    assert _close(runner.decode([restored], [pending])[0], runner.decode([cold], [pending])[0]) <= TOL


def test_the_saved_streams_are_what_the_head_needs(runner, served):
    """Restored with zero streams the head's first position pairs with nothing: its drafts move; a block
    with end rows but without its streams is refused, the sequence left as it was."""
    prompt, blocks = served
    zeroed = runner.new_sequence()
    zeroed.keep_block_ends(B)
    for b in blocks[:-1]:
        runner.import_kv(zeroed, b, B)
    runner.import_kv(zeroed, {**blocks[-1], HIDDEN_STATE: np.zeros_like(blocks[-1][HIDDEN_STATE])}, B)
    right = runner.new_sequence()
    for b in blocks:
        runner.import_kv(right, b, B)
    cold, want = _cold(runner, prompt[:B], prompt[B:BLOCKS * B])
    pending = int(np.argmax(want))
    assert _close(_draft(runner, right, pending)[1], _draft(runner, cold, pending)[1]) <= TOL
    assert _close(_draft(runner, zeroed, pending)[1], _draft(runner, cold, pending)[1]) > 1e-3
    lacking = runner.new_sequence()
    with pytest.raises(ValueError, match="hidden"):
        runner.import_kv(lacking, {k: v for k, v in blocks[0].items() if k != HIDDEN_STATE}, B)
    assert lacking.length == 0


@pytest.mark.slow  # two real servers
def test_restarted_server_with_the_head_resumes_the_prefix(tmp_path):
    """``serve --speculative mtp --model-draft --kv-persist``: a cold server saves the prompt's two blocks
    (``deepseek4-mtp``, each with its end state); a restarted one restores them and answers with the cold
    greedy tokens and top-5 log-probabilities."""
    from tests.models.deepseek4_chat import deepseek4_chat_gguf
    from tests.test_deepseek4_mtp import companion_gguf
    from tests.test_kvstore_stateful_serve import check_restart_resumes

    check_restart_resumes(deepseek4_chat_gguf(), tmp_path / "kv", "deepseek4-mtp", 210, TOL,
                          "--speculative", "mtp", "--model-draft", str(companion_gguf()))
