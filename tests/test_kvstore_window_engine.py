"""The engine side of persisting a sliding-window model's cache (gemma3 off the CPU host step, gemma4):
after a request a window layer holds only its last rows, so with ``keep_block_ends`` a prompt's prefill
copies each window layer's last ``window`` rows at every block end it reaches, and a block exported
later carries them (``state.k.{i}`` / ``state.v.{i}``) beside the full-attention layers' K/V. Restoring
up to such a block continues exactly like a cold prefill split at the same block end.

The tiny checkpoints have a 16-token window, so a 256-token block is many windows long.
"""

from __future__ import annotations

import numpy as np
import pytest

from hf2q.engine.kv_cache import PrefixNotReusable
from hf2q.kvstore import BLOCK_TOKENS as B
from tests.engine_support import convert_f32, load_runner, random_tokens

pytestmark = pytest.mark.slow  # converts a checkpoint and prefills ~800 tokens per family

#: restored against cold, split at the same block end (f32): the restored window buffer holds only the
#: window's rows where the cold one still holds hundreds of masked ones, so attention sums in another
#: order (typically 3e-6 to 6e-6 on these models, 1.2e-5 the most seen)
TOL = 2e-5
#: what splitting a prompt into two prefill transactions alone moves the logits by (f32)
SPLIT_TOL = 1e-4
N_BLOCKS = 3


@pytest.fixture(scope="module", params=["gemma3", "gemma4", "gemma4_e2b"])
def runner(request, tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint(request.param)
    gguf = convert_f32(src, tmp_path_factory.mktemp(request.param) / "f32.gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF2Q_NO_HOST_DECODE", "1")  # gemma3 on the CPU: the MLX graph, whose window layers keep the window
        runner = load_runner(gguf, src)
    assert runner.window_layers is not None and runner.window_layers[0] < B
    return runner


@pytest.fixture(scope="module")
def served(runner):
    """A slot's sequence after one request: a prompt of three blocks and more, prefilled in transactions
    that end off the block ends (the ends fall inside them), then decode steps; and its blocks exported."""
    prompt = random_tokens(N_BLOCKS * B + 30, seed=1)
    seq = runner.new_sequence()
    seq.keep_block_ends(B)
    for first in range(0, len(prompt), 200):
        logits = runner.prefill(seq, prompt[first:first + 200])
    for _ in range(6):
        logits = runner.decode([seq], [int(np.argmax(logits))])[0]
    blocks = [runner.export_kv(seq, i * B, (i + 1) * B) for i in range(N_BLOCKS)]
    return prompt, seq, blocks


def _state(block: dict) -> list[str]:
    return sorted(k for k in block if k.startswith("state."))


def _without_state(block: dict) -> dict:
    return {k: v for k, v in block.items() if not k.startswith("state.")}


def test_every_block_end_of_the_prompt_is_saved_with_the_window_rows(runner, served):
    _, seq, blocks = served
    window, layers = runner.window_layers
    assert runner.persists_kv and seq.persist_kind == "window"
    # the live window no longer holds the first block end's rows: only the capture had them
    assert seq.window.base > B - window
    for block in blocks:
        assert _state(block) == sorted(f"state.{kv}.{i}" for i in layers for kv in "kv")
        assert all(block[f"state.k.{i}"].shape[1] == window for i in layers)
        assert not any(f"k.{i}" in block for i in layers)  # the window layers' block rows are not kept
        assert all(block[f"k.{i}"].shape[1] == B for i in range(seq.n_layers) if i not in layers)
    assert not seq.block_ends  # the export let go of the captured copies


def test_restored_blocks_continue_like_a_cold_prefill(runner, served):
    """Up to block 2 (block 1 imported without its end rows: only the last block's are needed)."""
    prompt, _, blocks = served
    depth = 2
    text = prompt[:depth * B] + random_tokens(40, seed=depth)  # another request sharing the first blocks
    restored = runner.new_sequence()
    for i, block in enumerate(blocks[:depth]):
        runner.import_kv(restored, block if i == depth - 1 else _without_state(block), B)
    assert restored.reuse_points() == (0, depth * B)
    first = runner.prefill(restored, text[depth * B:])
    cold = runner.new_sequence()  # the same text in the same two transactions (the restored prefix, the rest)
    runner.prefill(cold, text[:depth * B])
    want = runner.prefill(cold, text[depth * B:])
    assert float(np.abs(first - want).max()) <= TOL
    for _ in range(3):
        step = int(np.argmax(want))
        got, want = runner.decode([restored], [step])[0], runner.decode([cold], [step])[0]
        assert float(np.abs(got - want).max()) <= TOL
    # and the whole text in one transaction: only the rounding of a different split
    one_shot = runner.prefill(runner.new_sequence(), text)
    assert float(np.abs(first - one_shot).max()) <= SPLIT_TOL


def test_a_block_without_its_end_rows_is_never_the_last_one_restored(runner, served):
    prompt, _, blocks = served
    seq = runner.new_sequence()
    runner.import_kv(seq, _without_state(blocks[0]), B)
    with pytest.raises(PrefixNotReusable, match="restored up to a block without"):
        runner.prefill(seq, prompt[B:B + 4])
    seq.trim(0)  # a failed restore goes back to where it started
    assert np.array_equal(runner.prefill(seq, prompt[:20]), runner.prefill(runner.new_sequence(), prompt[:20]))
    bad = dict(blocks[0])
    name = next(iter(_state(bad)))
    bad[name] = bad[name][:, 1:]
    with pytest.raises(ValueError, match="window layer .* has shape"):
        runner.import_kv(runner.new_sequence(), bad, B)


def test_capture_is_off_by_default_and_follows_the_history(runner):
    prompt = random_tokens(2 * B + 10, seed=3)
    plain, seq = runner.new_sequence(), runner.new_sequence()
    seq.keep_block_ends(B)
    for s in (plain, seq):
        runner.prefill(s, prompt)
    assert not plain.block_ends and sorted(seq.block_ends) == [B, 2 * B]
    assert seq.window_nbytes > plain.window_nbytes  # the copies count in the slot's bytes
    seq.trim(B)  # the ends of a history the sequence no longer has go with it
    assert list(seq.block_ends) == [B]
    seq.forget_block_ends(())  # what the KV prefix actor does once a block is on disk
    assert not seq.block_ends and seq.window_nbytes <= plain.window_nbytes


async def test_the_prefix_actor_saves_and_restores_through_the_store(runner, tmp_path, monkeypatch):
    """Through the KV prefix actor and the writer: a prompt's blocks saved with their end rows, then a
    restore into a fresh sequence continues like a cold prefill split there. Both blocks carry rows, and
    the window buffers are built once, from the last one's (the first's would be replaced at once)."""
    from hf2q.engine.kv_cache import SequenceCache
    from hf2q.kvstore import BlockStore
    from tests.kvstore_support import persist_then_restore

    rebuilds, put = [], SequenceCache._put_window
    monkeypatch.setattr(SequenceCache, "_put_window", lambda self, *a: (rebuilds.append(a[0]), put(self, *a))[1])

    prompt = random_tokens(2 * B + 20, seed=5)
    seq, fresh = runner.new_sequence(), runner.new_sequence()
    seq.keep_block_ends(B)
    for part in (prompt[:2 * B], prompt[2 * B:]):  # the cold prompt's split below
        runner.prefill(seq, part)
    runner.decode([seq], [7])
    with BlockStore.open(tmp_path / "kv", "fp-" + runner.arch) as store:
        assert await persist_then_restore(runner, store, seq, prompt, fresh) == 2 * B
        assert not seq.block_ends and store.stats().written == 2
        assert [(m.cache_kind, m.has_end_state) for m in store.longest_prefix(prompt)] == [("window", True)] * 2
    assert rebuilds == [2 * B]
    got = runner.prefill(fresh, prompt[2 * B:])
    cold = runner.new_sequence()
    runner.prefill(cold, prompt[:2 * B])
    assert float(np.abs(got - runner.prefill(cold, prompt[2 * B:])).max()) <= TOL


def test_an_8bit_cache_saves_its_window_rows_as_codes(runner):
    """``--kv-cache-type q8``: the window rows at a block end are the cache's own codes and scales, which a
    restore puts back as they are."""
    from hf2q.engine.runner import MlxModelRunner

    if runner.arch != "gemma4":
        pytest.skip("one family is enough for the codec path")
    q8 = MlxModelRunner.load(runner.gguf.path, kv_cache_type="q8")
    prompt = random_tokens(B + 30, seed=7)
    live = q8.new_sequence()
    live.keep_block_ends(B)
    q8.prefill(live, prompt[:B])
    want = q8.prefill(live, prompt[B:])
    block = q8.export_kv(live, 0, B)
    layer = min(q8.window_layers[1])
    assert block[f"state.k.{layer}"].dtype == np.uint8 and f"state.k.{layer}.scales" in block
    restored = q8.new_sequence()
    q8.import_kv(restored, block, B)
    assert float(np.abs(q8.prefill(restored, prompt[B:]) - want).max()) <= TOL


def test_the_memory_plan_counts_the_captured_block_ends(runner):
    """``serve --kv-persist`` budgets each slot's captured block ends: ``BLOCK_ENDS_KEPT`` of what one
    capture adds to a sequence's window bytes in the engine."""
    from hf2q.engine.device_probe import DeviceFacts
    from hf2q.engine.memory_plan import check_model
    from hf2q.engine.recurrent_policy import BLOCK_ENDS_KEPT

    if runner.arch != "gemma4":  # the plan reads the file's pattern: llama.cpp's default, not the checkpoint's
        pytest.skip("the tiny Gemma 3 file has no sliding_window_pattern key (tests' load_runner supplies it)")
    seq = runner.new_sequence()
    seq.keep_block_ends(B)
    runner.prefill(seq, random_tokens(B, seed=9))
    before = seq.window_nbytes
    seq.forget_block_ends(())
    one_end = before - seq.window_nbytes
    assert one_end > 0
    device = DeviceFacts("cpu", "cpu", 1 << 40)
    plan = {persist: check_model(runner.gguf.path, 1, ctx=1024, slots=2, kv_budget=None, limit=None, device=device,
                                 kv_persist=persist).kv for persist in (False, True)}
    assert plan[True] - plan[False] == 2 * BLOCK_ENDS_KEPT * one_end


def test_a_window_wider_than_a_block_saves_every_row_it_needs():
    """Real Gemma windows (512, 1024) span several blocks: an end inside the first window saves the whole
    prefix, a later one its last ``window`` rows; a restore makes exactly them the window buffer."""
    import mlx.core as mx

    from hf2q.engine.kv_cache import ForwardBatch, SequenceCache, SlidingWindow

    window, n = 300, 2 * B + 20
    rng = np.random.default_rng(0)
    rows = {name: rng.standard_normal((1, 1, n, 4)).astype(np.float32) for name in ("k0", "v0", "k1", "v1")}
    seq = SequenceCache(2, 1, 4, mx.float32, window=SlidingWindow(window, frozenset({0})))
    seq.keep_block_ends(B)
    batch = ForwardBatch([seq], n)
    for layer in (0, 1):
        batch.update(layer, mx.array(rows[f"k{layer}"]), mx.array(rows[f"v{layer}"]))
    batch.finish()
    first, second = seq.export(0, B), seq.export(B, 2 * B)
    np.testing.assert_array_equal(first["state.k.0"], rows["k0"][0, :, :B])  # the whole prefix
    np.testing.assert_array_equal(second["state.v.0"], rows["v0"][0, :, 2 * B - window:2 * B])
    np.testing.assert_array_equal(second["k.1"], rows["k1"][0, :, B:2 * B])
    restored = SequenceCache(2, 1, 4, mx.float32, window=SlidingWindow(window, frozenset({0})))
    restored.import_({k: v for k, v in first.items() if not k.startswith("state.")}, B)
    restored.import_(second, B)
    assert restored.window.base == 2 * B - window and restored.reuse_points() == (0, 2 * B)
    np.testing.assert_array_equal(np.array(restored.keys[0][:, :window]), rows["k0"][0, :, 2 * B - window:2 * B])
    np.testing.assert_array_equal(np.array(restored.keys[1][:, :2 * B]), rows["k1"][0, :, :2 * B])


def test_a_slot_holding_the_first_block_imports_only_the_rest(runner, served, tmp_path):
    """A slot whose own cache covers the first block and some more (another request's): the restore plan
    trims it to its block-aligned reuse point and imports the block after it, which brings the end rows."""
    from hf2q.kvstore import BlockStore, KVBlock
    from hf2q.kvstore.hydrate import plan_restore

    prompt, _, blocks = served
    text = prompt[:2 * B] + random_tokens(30, seed=8)
    slot = runner.new_sequence()
    runner.prefill(slot, prompt[:B])
    runner.prefill(slot, random_tokens(60, seed=9))  # diverges from the prompt after its first block
    with BlockStore.open(tmp_path / "kv", "fp-" + runner.arch) as store:
        for span, block in zip(store.spans(text), blocks):
            store.write(KVBlock.from_span(span, text, block, slot.persist_kind))
        plan = plan_restore(store, text, B, slot.published_points, slot.persist_kind)
        assert (plan.keep_tokens, len(plan.imports), plan.cached_tokens) == (B, 1, 2 * B)
        slot.trim(plan.keep_tokens)
        runner.import_kv(slot, store.read(plan.imports[0].meta), B)
    cold = runner.new_sequence()
    runner.prefill(cold, text[:2 * B])
    assert float(np.abs(runner.prefill(slot, text[2 * B:]) - runner.prefill(cold, text[2 * B:])).max()) <= TOL
