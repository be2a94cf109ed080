"""Crash safety and sharing, with real processes: ``kill -9`` mid-write, and two writers on one directory.

Children are forked (no interpreter start-up per kill) and run the real writer actor or
store; the parent checks every surviving block with the full verifier and then lets
start-up recovery clean up.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import time

import numpy as np
import pytest
import trio

from hf2q.actors.kv_writer import open_kv_writer
from hf2q.kvstore import BLOCK_TOKENS, BlockStore, BlockUnavailable, KVBlock
from hf2q.kvstore.blockfile import read_block, verify_file

FP = hashlib.sha256(b"crash-model").hexdigest()


def payload(tokens, width):
    """KV arrays derived from the tokens alone, so any process can recompute what a block must hold."""
    seed = int.from_bytes(hashlib.sha256(np.asarray(tokens, "<u4").tobytes()).digest()[:8], "little")
    rng = np.random.default_rng(seed)
    return {f"layers.{i}.{kv}": rng.random((2, BLOCK_TOKENS, width), dtype=np.float32).astype(np.float16)
            for i in range(2) for kv in "kv"}


def make_prompt(seed, n_blocks):
    return np.random.default_rng(seed).integers(0, 50000, n_blocks * BLOCK_TOKENS).tolist()


def _fork(child_main) -> int:
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:
            code = child_main()
        except BaseException:  # noqa: BLE001
            import traceback
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def _writer_child(root, ready_w, seed) -> int:
    """Open the store (recovery), then persist blocks through the writer actor until killed.

    Signals the parent once the first block is durable, so every kill lands in steady-state writing.
    """
    store = BlockStore.open(root, FP, budget_bytes=6 << 20)
    rng = random.Random(seed)

    async def main():
        async with open_kv_writer(store, capacity=4) as writer:
            n = 0
            while True:
                toks = make_prompt(seed * 100_000 + n, 2)
                n += 1
                width = rng.choice((16, 64, 128, 256))  # 64 KiB … 1 MiB per block
                for span in store.missing_spans(toks):
                    while not writer.submit_nowait(KVBlock.from_span(span, toks, payload(toks[span.start:span.end],
                                                                                          width))):
                        await trio.sleep(0.001)
                if n == 1:
                    await writer.wait_idle()
                    os.write(ready_w, b"r")
    trio.run(main)
    return 0


@pytest.mark.slow
def test_kill_9_at_50_random_moments_leaves_only_verified_blocks_or_temps(tmp_path):
    rng = random.Random(1234)
    verified: set[tuple[str, int]] = set()
    temps_seen = 0
    for round_ in range(50):
        r, w = os.pipe()
        pid = _fork(lambda w=w, seed=round_ + 1: _writer_child(tmp_path, w, seed))
        os.close(w)
        assert os.read(r, 1) == b"r"
        os.close(r)
        time.sleep(rng.uniform(0.0, 0.08))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL  # it was killed, not exited
        for entry in os.scandir(tmp_path / "blocks"):
            if entry.name.endswith(".tmp"):
                temps_seen += 1
                continue
            key = (entry.name, entry.stat().st_size)
            if key not in verified:
                meta = verify_file(entry.path)  # raises on any torn / corrupt block
                assert meta.block_hash + ".safetensors" == entry.name
                verified.add(key)
    with BlockStore.open(tmp_path, FP) as store:
        rep = store.recovery
        assert rep.quarantined == () and rep.temps_in_use == 0
        assert not [p for p in (tmp_path / "blocks").iterdir() if p.name.endswith(".tmp")]
        assert rep.blocks == len(list((tmp_path / "blocks").iterdir())) > 0
        # every surviving block holds exactly the payload its tokens imply
        for p in (tmp_path / "blocks").iterdir():
            meta, arrays = read_block(p)
            expect = payload(list(meta.token_ids), arrays["layers.0.k"].shape[-1])
            assert all(np.array_equal(arrays[k], v) for k, v in expect.items())
    print(f"kill -9: {len(verified)} blocks verified, {temps_seen} temp files left by kills")
    assert len(verified) >= 50, "the writer child barely wrote anything before being killed"
    assert temps_seen >= 1, "no kill ever landed mid-write; the test did not exercise torn writes"


def _sharing_child(root, seed, budget) -> int:
    """Write and read back a set of prompts that overlaps with the other process's set."""
    store = BlockStore.open(root, FP, budget_bytes=budget)
    prompts = [make_prompt(s, 2) for s in range(8)]
    random.Random(seed).shuffle(prompts)
    bad = 0
    for _ in range(3):
        for toks in prompts:
            for span in store.missing_spans(toks):
                store.write(KVBlock.from_span(span, toks, payload(toks[span.start:span.end], 32)))
            for meta in store.longest_prefix(toks):
                try:
                    arrays = store.read(meta)
                except BlockUnavailable as e:
                    if "evicted" not in str(e):
                        bad += 1
                    continue
                expect = payload(list(meta.token_ids), 32)
                bad += not all(np.array_equal(arrays[k], v) for k, v in expect.items())
    bad += store.stats().errors + store.stats().quarantined + store.recovery.temps_removed
    store.close()
    return min(bad, 100)


@pytest.mark.slow
def test_two_processes_sharing_one_directory_do_not_corrupt_it(tmp_path):
    block = 4 * 2 * BLOCK_TOKENS * 32 * 2
    pids = [_fork(lambda: _sharing_child(tmp_path, 1, None)),
            _fork(lambda: _sharing_child(tmp_path, 2, 10 * block))]  # the second one also evicts
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    for p in (tmp_path / "blocks").iterdir():
        assert not p.name.endswith(".tmp")
        verify_file(p)
    with BlockStore.open(tmp_path, FP) as store:
        assert store.recovery.quarantined == () and store.recovery.temps_removed == 0


def test_recovery_leaves_a_live_writers_temp_alone(tmp_path):
    toks = make_prompt(7, 1)
    writer_store = BlockStore.open(tmp_path, FP)
    span = writer_store.spans(toks)[0]
    staged = writer_store.stage(KVBlock.from_span(span, toks, payload(toks, 8)))
    assert staged.tmp_path.exists()
    with BlockStore.open(tmp_path, FP) as other:  # a second server starting meanwhile
        assert other.recovery.temps_in_use == 1 and other.recovery.temps_removed == 0
        assert staged.tmp_path.exists()
        writer_store.commit(staged)
        assert len(other.longest_prefix(toks)) == 1  # found by probing, not by its own index
        arrays = other.read(other.longest_prefix(toks)[0])
        assert np.array_equal(arrays["layers.1.v"], payload(toks, 8)["layers.1.v"])
    writer_store.close()
