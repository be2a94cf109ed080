"""The engine side of persisting caches that are not plain K/V: with ``keep_block_ends`` a prompt's
prefill captures the state at every block end while it has it, so the blocks exported after the
request (decode steps later, reuse points long aged out) still carry it; restoring up to any of them
continues exactly like a cold prefill of the same text."""

from __future__ import annotations

import numpy as np
import pytest

from hf2q.engine.kv_cache import PrefixNotReusable
from hf2q.kvstore import BLOCK_TOKENS as B

pytestmark = pytest.mark.slow

#: what splitting a prompt into two prefill transactions alone moves the logits by (f32: BLAS rounds by the
#: product's row count; measured up to 1.3e-5 for qwen35 with OpenBLAS's Zen kernels; deepseek4's bound is
#: tests/test_engine_deepseek4.py's for any chunk split)
SPLIT_TOL = {"qwen35": 3e-5, "deepseek4": 4e-5}
N_BLOCKS = 5  # more block ends than a DeepSeek-V4 cache keeps reuse points (4)


@pytest.fixture(scope="module", params=["qwen35", "deepseek4"])
def runner(request):
    from hf2q.engine.runner import MlxModelRunner

    if request.param == "qwen35":
        from tests.models.qwen35_chat import qwen35_chat_gguf as gguf
    else:
        from tests.models.deepseek4_chat import deepseek4_chat_gguf as gguf
    return MlxModelRunner.load(gguf())


def _text(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 5000, n).tolist()


def serve_and_export(runner, prompt: list[int], n_blocks: int, steps: int):
    """A slot's sequence after one request — ``prompt`` prefilled in one transaction with block-end capture
    on (its block ends all inside it), then ``steps`` decode steps — and its first ``n_blocks`` blocks
    exported from it: ``(seq, blocks)``."""
    seq = runner.new_sequence()
    seq.keep_block_ends(B)
    logits = runner.prefill(seq, prompt)
    for _ in range(steps):
        logits = runner.decode([seq], [int(np.argmax(logits))])[0]
    return seq, [runner.export_kv(seq, i * B, (i + 1) * B) for i in range(n_blocks)]


def restore_through_store(runner, kv_dir, text: list[int], blocks, cache_kind: str, headless_kind: str):
    """``blocks`` of ``text`` written to a real store and read back as a restarted server reads them, into a
    fresh sequence with block-end capture on (returned); a sequence of ``headless_kind`` (the same model
    without its draft head) finds none of them."""
    from hf2q.kvstore import BlockStore, KVBlock, plan_restore

    with BlockStore.open(kv_dir, f"{cache_kind}-fingerprint") as store:
        for span, arrays in zip(store.spans(text), blocks):
            store.write(KVBlock.from_span(span, text, arrays, cache_kind))
        restored = runner.new_sequence()
        restored.keep_block_ends(B)
        assert restored.persist_kind == cache_kind
        plan = plan_restore(store, text, 0, restored.published_points, restored.persist_kind)
        assert plan.cached_tokens == len(blocks) * B
        for imp in plan.imports:
            runner.import_kv(restored, store.read(imp.meta), imp.n_tokens)
        assert plan_restore(store, text, 0, (0,), headless_kind) is None
    return restored


@pytest.fixture(scope="module")
def served(runner):
    """A prompt of five blocks and more, and every full block exported after its request."""
    prompt = _text(N_BLOCKS * B + 30, seed=1)
    seq, blocks = serve_and_export(runner, prompt, N_BLOCKS, 6)
    return prompt, seq, blocks


def test_every_block_end_of_the_prompt_is_saved_with_its_state(runner, served):
    _, seq, blocks = served
    assert runner.persists_kv and seq.persist_kind in ("recurrent", "deepseek4")
    assert all(any(name.startswith("state.") for name in b) for b in blocks)
    # the export let go of the captured copies; the kept reuse points alone no longer reach block 1
    assert not seq.block_ends
    if seq.persist_kind == "deepseek4":
        assert B not in seq.reuse_points()


def test_restored_blocks_continue_like_a_cold_prefill(runner, served):
    """Up to block 2, whose end's reuse point had aged out before the prompt's forward ended."""
    prompt, _, blocks = served
    depth = 2
    text = prompt[:depth * B] + _text(40, seed=depth)  # another request sharing the first blocks
    restored = runner.new_sequence()
    restored.keep_block_ends(B)
    for i, block in enumerate(blocks[:depth]):  # only the last block's end state is needed
        runner.import_kv(restored, block if i == depth - 1 else _without_state(block), B)
    got = runner.prefill(restored, text[depth * B:])
    # a cold sequence computing the same text in two transactions (the restored prefix, the rest); the
    # restored rows were computed inside the served prompt's one longer transaction, so the two differ by
    # the rounding of a different split (BLAS rounds by the product's row count), no more
    cold = runner.new_sequence()
    runner.prefill(cold, text[:depth * B])
    want = runner.prefill(cold, text[depth * B:])
    assert float(np.abs(got - want).max()) <= SPLIT_TOL[runner.arch]
    step = int(np.argmax(want))
    assert float(np.abs(runner.decode([restored], [step])[0] - runner.decode([cold], [step])[0]).max()) \
        <= SPLIT_TOL[runner.arch]
    # and the whole text in one transaction: only the rounding of a different split (docs/KVSTORE.md)
    one_shot = runner.prefill(runner.new_sequence(), text)
    assert float(np.abs(got - one_shot).max()) <= SPLIT_TOL[runner.arch]


def _without_state(block: dict) -> dict:
    return {k: v for k, v in block.items() if not k.startswith("state.")}


def test_a_block_without_its_end_state_is_never_the_last_one_restored(runner, served):
    prompt, _, blocks = served
    seq = runner.new_sequence()
    seq.keep_block_ends(B)
    runner.import_kv(seq, _without_state(blocks[0]), B)
    with pytest.raises(PrefixNotReusable, match="restored up to a block without"):
        runner.prefill(seq, prompt[B:B + 4])
    seq.trim(0)  # a failed restore goes back to where it started
    assert np.array_equal(runner.prefill(seq, prompt[:20]), runner.prefill(runner.new_sequence(), prompt[:20]))


def test_capture_is_off_by_default_and_a_trim_drops_later_block_ends(runner):
    prompt = _text(3 * B + 10, seed=3)
    plain = runner.new_sequence()
    runner.prefill(plain, prompt)
    assert not plain.block_ends
    seq = runner.new_sequence()
    seq.keep_block_ends(B)
    runner.prefill(seq, prompt)
    assert sorted(seq.block_ends) == [B, 2 * B, 3 * B]
    seq.trim(B)
    assert sorted(seq.block_ends) == [B]  # the others belong to a history the sequence no longer has
    seq.forget_block_ends(())  # what the KV prefix actor does once its block is on disk
    assert not seq.block_ends


async def test_the_prefix_actor_saves_what_is_missing_and_lets_go_of_the_rest(runner, tmp_path):
    """Through the KV prefix actor and the writer: a prompt whose first block is already on disk (another
    slot wrote it) has its other blocks saved with their end states, and the captured state of the one it
    does not export is let go of at once; a restore into a fresh sequence (which turns its capture on)
    then continues like the live one."""
    from hf2q.kvstore import BlockStore, KVBlock
    from tests.kvstore_support import persist_then_restore

    prompt = _text(3 * B + 20, seed=5)
    other = runner.new_sequence()
    other.keep_block_ends(B)
    runner.prefill(other, prompt[:B + 3])
    with BlockStore.open(tmp_path / "kv", "fp-" + runner.arch) as store:
        first = store.spans(prompt)[0]
        store.write(KVBlock.from_span(first, prompt, runner.export_kv(other, 0, B), other.persist_kind))
        seq, fresh = runner.new_sequence(), runner.new_sequence()
        seq.keep_block_ends(B)
        runner.prefill(seq, prompt)
        assert sorted(seq.block_ends) == [B, 2 * B, 3 * B]
        assert await persist_then_restore(runner, store, seq, prompt, fresh) == 3 * B
        assert not seq.block_ends  # two exported, the one already on disk let go of
        assert store.stats().written == 3
        assert [m.has_end_state for m in store.longest_prefix(prompt)] == [True, True, True]
    tail = prompt[3 * B:] + _text(250, seed=6)
    got = runner.prefill(fresh, tail)
    assert sorted(fresh.block_ends) == [4 * B]  # the restore turned the capture on
    live = runner.prefill(seq, tail[len(prompt) - 3 * B:])
    assert float(np.abs(got - live).max()) <= SPLIT_TOL[runner.arch]
