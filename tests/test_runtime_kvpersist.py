"""Persistent prefix KV through the runtime: blocks exported after a request, restored by a
"restarted" runtime (a fresh runner and a freshly opened store on the same directory)."""

from __future__ import annotations


from hf2q.sched.contracts import RuntimeConfig


from hf2q.actors.runtime import open_runtime
from hf2q.kvstore import BLOCK_TOKENS, BlockStore, block_hashes
from hf2q.sched.contracts import GenerationRequest, SamplingParams
from tests.fakes import FakeModelRunner
from tests.test_runtime import collect, greedy, terminal, tokens_of

FP = "fake-model-fingerprint-v1"


def _prompt(n: int) -> list[int]:
    return [(i * 13) % 90 + 3 for i in range(n)]


async def test_blocks_saved_then_restored_after_restart(tmp_path):
    prompt = _prompt(2 * BLOCK_TOKENS + 100)
    fake = FakeModelRunner()
    store = BlockStore.open(tmp_path, FP, None)
    async with open_runtime(fake.factory(), RuntimeConfig(slots=1, prefill_chunk=128), kv_store=store) as rt:
        await rt.wait_ready()
        first = await collect(await rt.submit(GenerationRequest("a", tuple(prompt), SamplingParams(max_tokens=5))))
        assert await rt.drain(10)
        assert rt.snapshot().counters["kv_blocks_saved"] == 2
    assert [k for k, _ in fake.calls].count("export_kv") == 2
    store.close()
    # the chain of the two full blocks is on disk, as the store's own hashing says
    reopened = BlockStore.open(tmp_path, FP, None)
    assert [m.block_hash for m in reopened.longest_prefix(prompt)] == block_hashes(FP, prompt)[:2]

    fresh = FakeModelRunner()
    longer = prompt + [7, 8, 9]
    async with open_runtime(fresh.factory(), RuntimeConfig(slots=2, prefill_chunk=128), kv_store=reopened) as rt:
        await rt.wait_ready()
        ev = await collect(await rt.submit(GenerationRequest("b", tuple(longer), SamplingParams(max_tokens=5))))
        assert ev[0].cached_tokens == 2 * BLOCK_TOKENS and terminal(ev).cached_tokens == 2 * BLOCK_TOKENS
        assert rt.snapshot().counters["kv_blocks_restored"] == 2
    assert fresh.prefill_sizes == [len(longer) - 2 * BLOCK_TOKENS]  # only the tail was computed
    assert [n for k, n in fresh.calls if k == "import_kv"] == [BLOCK_TOKENS, BLOCK_TOKENS]
    # T=0 output is identical to computing everything cold
    assert tokens_of(ev) == greedy(fresh, longer, 5)
    assert tokens_of(first) == greedy(fake, prompt, 5)
    reopened.close()


async def test_corrupt_block_falls_back_to_what_is_good(tmp_path):
    prompt = _prompt(2 * BLOCK_TOKENS + 10)
    fake = FakeModelRunner()
    with BlockStore.open(tmp_path, FP, None) as store:
        async with open_runtime(fake.factory(), RuntimeConfig(slots=1), kv_store=store) as rt:
            await rt.wait_ready()
            await collect(await rt.submit(GenerationRequest("a", tuple(prompt), SamplingParams(max_tokens=2))))
            assert await rt.drain(10)
    with BlockStore.open(tmp_path, FP, None) as store:
        metas = store.longest_prefix(prompt)
        assert len(metas) == 2
        raw = bytearray(metas[1].path.read_bytes())
        raw[-3] ^= 0xFF  # corrupt the second block's body: its checksum no longer matches
        metas[1].path.write_bytes(bytes(raw))
        fresh = FakeModelRunner()
        async with open_runtime(fresh.factory(), RuntimeConfig(slots=1), kv_store=store) as rt:
            await rt.wait_ready()
            ev = await collect(await rt.submit(GenerationRequest("b", tuple(prompt), SamplingParams(max_tokens=4))))
    assert ev[0].cached_tokens == BLOCK_TOKENS
    assert tokens_of(ev) == greedy(fresh, prompt, 4)
    assert sum(fresh.prefill_sizes) == len(prompt) - BLOCK_TOKENS


async def test_a_full_writer_skips_blocks_instead_of_stalling(tmp_path):
    prompt = _prompt(20 * BLOCK_TOKENS + 1)  # 20 full blocks; the writer queue holds 8
    fake = FakeModelRunner(n_ctx_train=8192)
    with BlockStore.open(tmp_path, FP, None) as store:
        async with open_runtime(fake.factory(), RuntimeConfig(slots=1), kv_store=store) as rt:
            await rt.wait_ready()
            ev = await collect(await rt.submit(GenerationRequest("a", tuple(prompt), SamplingParams(max_tokens=3))))
            assert terminal(ev).reason == "length" and tokens_of(ev) == greedy(fake, prompt, 3)
            assert await rt.drain(30)
            c = rt.snapshot().counters
        # 8 queued (+1 handed straight to an idle writer), the rest skipped at once
        assert c["kv_blocks_saved"] in (8, 9) and c["kv_blocks_saved"] + c["kv_blocks_skipped"] == 20
        # what was accepted reached the disk: the leading blocks of the chain
        assert len(store.longest_prefix(prompt)) == c["kv_blocks_saved"]
