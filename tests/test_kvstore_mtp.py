"""Persisting a hybrid sequence that feeds an MTP draft head (``--speculative mtp`` with ``--kv-persist``).

The head keeps a K/V layer of its own, and the head's row at a position reads the main model's hidden row
before it, so a block of such a sequence carries the head's layer and, at its end, that hidden row
(``state.hidden``) beside the recurrent state. The reference is a cold sequence that prefilled the same
text in the same two transactions: after restoring, the main logits and the head's draft logits are the
cold ones (the head attends over its restored layer and starts from the restored row).
"""

from __future__ import annotations

import numpy as np
import pytest

from hf2q.engine.kv_layout import HIDDEN_STATE
from hf2q.kvstore import BLOCK_TOKENS as B
from tests.engine_support import random_tokens
from tests.test_kvstore_stateful_engine import SPLIT_TOL, restore_through_store

#: the restored rows were computed inside the first request's one transaction, the cold reference's in
#: two: the rounding of a different split (tests/test_kvstore_stateful_engine.py's for qwen35)
TOL = SPLIT_TOL["qwen35"]
BLOCKS = 2


@pytest.fixture(scope="module")
def gguf(tiny_checkpoint, tmp_path_factory):
    from tests.engine_support import convert_f32

    return convert_f32(tiny_checkpoint("qwen35_parity_mtp"), tmp_path_factory.mktemp("mtp") / "dense.gguf")


@pytest.fixture(scope="module")
def runner(gguf):
    from hf2q.engine.factory import load_runner

    r = load_runner(gguf, ctx=1024)
    r.enable_mtp()
    return r


@pytest.fixture(scope="module")
def served(runner):
    """A slot's sequence after one request (its prompt in one transaction, then decode steps) and its blocks."""
    from tests.test_kvstore_stateful_engine import serve_and_export

    prompt = random_tokens(BLOCKS * B + 20, seed=3)
    return prompt, serve_and_export(runner, prompt, BLOCKS, 3)[1]


def test_blocks_carry_the_heads_layer_and_the_row_it_reads_next(runner, served):
    _, blocks = served
    assert runner.persists_kv and runner.kv_identity.endswith("-mtp")
    n_layers = runner.model.kv_shape[0]
    head = runner.model.mtp.kv_index
    assert head == n_layers - 1
    for b in blocks:
        assert {f"k.{head}", f"v.{head}", HIDDEN_STATE, "state.conv.0"} <= b.keys()
        assert b[HIDDEN_STATE].shape == (runner.model.cfg.hidden,)


def _draft(runner, seq, pending: int, k: int = 3):
    return runner.model.mtp.draft_logits(seq, pending, k)


def test_restored_sequence_drafts_and_continues_like_a_cold_one(runner, served, tmp_path):
    prompt, blocks = served
    tail = random_tokens(30, seed=4)
    text = prompt[:BLOCKS * B] + tail
    # through the store, as a restarted server reads them: version 3, cache kind recurrent-mtp
    restored = restore_through_store(runner, tmp_path / "kv", text, blocks, "recurrent-mtp", "recurrent")
    got = runner.prefill(restored, tail)
    cold = runner.new_sequence()
    runner.prefill(cold, text[:BLOCKS * B])
    want = runner.prefill(cold, tail)
    assert float(np.abs(got - want).max()) <= TOL
    pending = int(np.argmax(want))
    (got_draft, got_logits) = _draft(runner, restored, pending)
    (want_draft, want_logits) = _draft(runner, cold, pending)
    assert got_draft == want_draft
    assert float(np.abs(got_logits - want_logits).max()) <= TOL
    step = runner.decode([restored], [pending])[0]
    assert float(np.abs(step - runner.decode([cold], [pending])[0]).max()) <= TOL


def test_the_heads_input_row_is_what_the_draft_needs(runner, served):
    """Without the saved row the head's first restored position pairs with zeros: its drafts move; and a
    block that lacks the row is refused, the sequence left as it was."""
    prompt, blocks = served
    tail = random_tokens(30, seed=4)
    zeroed = runner.new_sequence()
    zeroed.keep_block_ends(B)
    for b in blocks[:-1]:
        runner.import_kv(zeroed, b, B)
    runner.import_kv(zeroed, {**blocks[-1], HIDDEN_STATE: np.zeros_like(blocks[-1][HIDDEN_STATE])}, B)
    want = runner.prefill(zeroed, tail)
    cold = runner.new_sequence()
    runner.prefill(cold, prompt[:BLOCKS * B])
    runner.prefill(cold, tail)
    pending = int(np.argmax(want))
    assert float(np.abs(_draft(runner, zeroed, pending)[1] - _draft(runner, cold, pending)[1]).max()) > 1e-3
    lacking = runner.new_sequence()
    lacking.keep_block_ends(B)
    with pytest.raises(ValueError, match="hidden"):
        runner.import_kv(lacking, {k: v for k, v in blocks[0].items() if k != HIDDEN_STATE}, B)
    assert lacking.length == 0


def _serve(model, kv_dir, body: dict, times: int) -> tuple[list[dict], list[dict]]:
    from tests.test_kvstore_stateful_serve import serve_requests

    return serve_requests(model, kv_dir, body, times, "--speculative", "mtp")


@pytest.mark.slow  # two real servers
def test_restarted_mtp_server_resumes_the_prefix(gguf, tmp_path):
    """T=0 answers identical cold, reused in the slot and restored from disk by a restarted server, which
    reports the restored blocks as cached tokens."""
    from hf2q.kvstore.blockfile import read_meta
    from tests.test_kvstore_stateful_serve import _top_logprobs

    words = " ".join(f"w{(i * 7) % 89}" for i in range(210))
    body = {"temperature": 0, "max_tokens": 6, "logprobs": True, "top_logprobs": 3,
            "messages": [{"role": "user", "content": words}]}
    (cold, reused), log = _serve(gguf, tmp_path / "kv", body, 2)
    n_prompt = cold["usage"]["prompt_tokens"]
    assert (n_prompt - 1) // B == BLOCKS, n_prompt
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert reused["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    stopped = [r for r in log if r.get("msg") == "kv persist: stopped"]
    assert len(stopped) == 1 and stopped[0]["blocks_written"] == BLOCKS, log[-5:]
    metas = [read_meta(p) for p in sorted((tmp_path / "kv" / "blocks").glob("*.safetensors"))]
    assert len(metas) == BLOCKS and all(m.cache_kind == "recurrent-mtp" and m.has_end_state for m in metas)

    (restored,), _ = _serve(gguf, tmp_path / "kv", body, 1)
    assert restored["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCKS * B
    assert cold["choices"][0]["message"] == reused["choices"][0]["message"] == restored["choices"][0]["message"]
    for j, (got, want) in enumerate(zip(_top_logprobs(restored), _top_logprobs(cold), strict=True)):
        assert got.keys() == want.keys(), j
        assert max(abs(got[t] - want[t]) for t in want) <= TOL, (j, got, want)
