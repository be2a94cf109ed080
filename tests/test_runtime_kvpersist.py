"""Persistent prefix KV through the runtime: blocks exported after a request, restored by a
"restarted" runtime (a fresh runner and a freshly opened store on the same directory); a full
writer queue defers blocks instead of dropping them; and the real ``hf2q serve`` process,
stopped by SIGTERM right after a long request, restores all of its complete blocks."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest
import trio

from hf2q.actors import system as system_module
from hf2q.actors.runtime import open_runtime
from hf2q.kvstore import BLOCK_TOKENS, BlockStore, block_hashes
from hf2q.sched.contracts import GenerationRequest, RuntimeConfig, SamplingParams
from tests.fakes import FakeModelRunner
from tests.test_runtime import collect, greedy, terminal, tokens_of

FP = "fake-model-fingerprint-v1"


def _prompt(n: int) -> list[int]:
    return [(i * 13) % 90 + 3 for i in range(n)]


@contextlib.asynccontextmanager
async def _runtime_with_store(tmp_path, slots: int):
    """A ready runtime over a fresh fake runner and a block store in ``tmp_path``."""
    fake = FakeModelRunner()
    store = BlockStore.open(tmp_path, FP, None)
    async with open_runtime(fake.factory(), RuntimeConfig(slots=slots, prefill_chunk=128), kv_store=store) as rt:
        await rt.wait_ready()
        yield fake, store, rt


async def test_blocks_saved_then_restored_after_restart(tmp_path):
    prompt = _prompt(2 * BLOCK_TOKENS + 100)
    async with _runtime_with_store(tmp_path, 1) as (fake, store, rt):
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


def _slow_stage(store, seconds: float):
    """Make every block write take ``seconds`` longer (the writer stages in a worker thread)."""
    stage = store.stage

    def slow(block):
        time.sleep(seconds)
        return stage(block)
    store.stage = slow


def _assert_blocks_hold_their_tokens(store, prompt, n_blocks):
    """Each stored block's payload is the KV of exactly its own tokens (the fake exports token ids)."""
    metas = store.longest_prefix(prompt)
    assert len(metas) == n_blocks
    for i, meta in enumerate(metas):
        assert store.read(meta)["tokens"].tolist() == list(prompt[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])


async def _until(predicate, timeout: float = 20.0):
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


async def test_a_full_writer_defers_blocks_and_writes_them_once_idle(tmp_path, monkeypatch):
    monkeypatch.setattr(system_module, "KV_WRITER_QUEUE", 2)
    prompt = _prompt(20 * BLOCK_TOKENS + 1)  # 20 full blocks; the writer queue holds 2
    fake = FakeModelRunner(n_ctx_train=8192)
    with BlockStore.open(tmp_path, FP, None) as store:
        _slow_stage(store, 0.02)
        async with open_runtime(fake.factory(), RuntimeConfig(slots=1), kv_store=store) as rt:
            await rt.wait_ready()
            ev = await collect(await rt.submit(GenerationRequest("a", tuple(prompt), SamplingParams(max_tokens=3))))
            assert terminal(ev).reason == "length" and tokens_of(ev) == greedy(fake, prompt, 3)
            await _until(lambda: "kv_blocks_saved" in rt.snapshot().counters)  # the Persist was handled
            c = rt.snapshot().counters
            # every block is pending or written (one reading of the store's counts), some still pending
            assert c["kv_blocks_pending"] + c["kv_blocks_written"] == 20 and c["kv_blocks_pending"] > 0
            # no drain, no new request: the writer going idle is what brings the rest to disk
            await _until(lambda: store.stats().written == 20)
            c = rt.snapshot().counters
            assert (c["kv_blocks_saved"], c["kv_blocks_saved_late"], c["kv_blocks_pending"]) == (20, 18, 0)
            assert c.get("kv_blocks_not_written", 0) == 0
        st = store.stats()
        assert (st.written, st.pending, st.not_written, st.skipped) == (20, 0, 0, 0)
        _assert_blocks_hold_their_tokens(store, prompt, 20)
    # every deferred block came from the slot's resident KV: one export per writer batch, none recomputed
    assert [n for k, n in fake.calls if k == "export_kv"] == [BLOCK_TOKENS] * 20
    assert sum(fake.prefill_sizes) == len(prompt)


async def test_blocks_a_slot_overwrites_before_the_writer_gets_them_are_counted_not_written(tmp_path, monkeypatch):
    """Request b reuses the slot right after a: a's recorded blocks inside the prefix b shares are
    still written (from b's KV, same tokens); those beyond it are lost and counted, never written wrong."""
    monkeypatch.setattr(system_module, "KV_WRITER_QUEUE", 1)
    shared = 5 * BLOCK_TOKENS + 10
    a = _prompt(10 * BLOCK_TOKENS + 1)
    b = a[:shared] + [(i * 7) % 80 + 5 for i in range(3 * BLOCK_TOKENS)]
    fake = FakeModelRunner(n_ctx_train=8192)
    with BlockStore.open(tmp_path, FP, None) as store:
        _slow_stage(store, 0.3)  # the writer is still on a's first block when b takes the slot
        async with open_runtime(fake.factory(), RuntimeConfig(slots=1), kv_store=store) as rt:
            await rt.wait_ready()
            chan_a = await rt.submit(GenerationRequest("a", tuple(a), SamplingParams(max_tokens=2)))
            chan_b = await rt.submit(GenerationRequest("b", tuple(b), SamplingParams(max_tokens=2)))
            ev_a, ev_b = await collect(chan_a), await collect(chan_b)
            assert ev_b[0].cached_tokens == shared
            assert tokens_of(ev_b) == greedy(fake, b, 2)
            assert await rt.drain(30)
            c = rt.snapshot().counters
        st = store.stats()
        # a: blocks 0-4 shared with b, 5-9 overwritten by b's tail; b: 8 blocks
        assert st.not_written == 5 and c["kv_blocks_not_written"] == 5
        assert st.written == 8 and st.pending == 0 and c["kv_blocks_pending"] == 0
        _assert_blocks_hold_their_tokens(store, b, 8)
        assert len(store.longest_prefix(a)) == 5


@pytest.fixture(scope="module")
def long_context_tiny_gguf(tmp_path_factory) -> Path:
    """The tiny random-weight llama (SmolLM2's tokenizer) converted to GGUF with an 8k context, so a
    prompt of 18 blocks fits and prefills in a second on the CPU."""
    from hf2q.cli import main
    from tests.models.tiny import checkpoint

    src = tmp_path_factory.mktemp("tiny-llama-8k")
    shutil.copytree(checkpoint("llama"), src, dirs_exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["max_position_embeddings"] = 8192
    (src / "config.json").write_text(json.dumps(cfg))
    out = src / "tiny-8k.gguf"
    assert main(["convert", str(src), "-q", "f16", "-o", str(out), "--no-integrity"]) == 0
    return out


@contextlib.contextmanager
def _killed_on_exit(proc):
    """Whatever happens in the block, the server process does not outlive it."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _serve_one_request(model: Path, kv_dir: Path, body: dict) -> tuple[dict, dict, list[dict]]:
    """Start ``hf2q serve --kv-persist``, answer ``body``, scrape /metrics, SIGTERM; → (reply,
    kv metrics, JSON log records)."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.test_server_command import start_server, wait_ready

    proc, url = start_server("--log-format", "json", "serve", "--model", str(model), "--port", "0", "--slots", "1",
                             "--ctx", "8192", "--kv-persist", str(kv_dir))
    with _killed_on_exit(proc):
        wait_ready(url, proc, timeout=60)
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
        metrics = {s.name: s.value for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
                   for s in f.samples if s.name.startswith("hf2q_kv_persist_blocks")}
        proc.send_signal(signal.SIGTERM)
        rc, err = proc.wait(60), proc.stderr.read()
    assert rc == 0, err
    return reply, metrics, [json.loads(ln) for ln in err.splitlines() if ln.startswith("{")]


def test_sigterm_right_after_a_long_request_keeps_every_complete_block(tmp_path, long_context_tiny_gguf):
    """A real server answers an 18-block prompt (more than the writer queue holds) and is stopped
    with SIGTERM at once; the restarted server restores every complete block of it."""
    words = " ".join(f"w{i % 97}" for i in range(1650))
    body = {"temperature": 0, "max_tokens": 6, "messages": [{"role": "user", "content": words}]}
    first, m1, log1 = _serve_one_request(long_context_tiny_gguf, tmp_path / "kv", body)
    n_prompt = first["usage"]["prompt_tokens"]
    full = (n_prompt - 1) // BLOCK_TOKENS  # the last token is always recomputed
    assert full > system_module.KV_WRITER_QUEUE + 1 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert m1["hf2q_kv_persist_blocks_pending"] + m1["hf2q_kv_persist_blocks_written_total"] in (0, full)
    stopped = [r for r in log1 if r.get("msg") == "kv persist: stopped"]
    assert len(stopped) == 1, log1
    assert (stopped[0]["blocks_written"], stopped[0]["blocks_pending_at_stop"],
            stopped[0]["blocks_not_written"]) == (full, 0, 0)

    second, m2, log2 = _serve_one_request(long_context_tiny_gguf, tmp_path / "kv", body)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == full * BLOCK_TOKENS
    assert m2["hf2q_kv_persist_blocks"] == full and m2["hf2q_kv_persist_blocks_not_written_total"] == 0
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


async def test_next_turn_sent_at_once_reuses_the_slot_still_saving_its_blocks(tmp_path):
    """An agent sends turn 2 as soon as turn 1's last event arrives, while turn 1's slot is still
    exporting its blocks to the store: turn 2 waits for that slot instead of starting cold elsewhere."""
    turn1 = _prompt(2 * BLOCK_TOKENS + 40)
    async with _runtime_with_store(tmp_path, 2) as (fake, store, rt):
        first = await collect(await rt.submit(GenerationRequest("a", tuple(turn1), SamplingParams(max_tokens=5))))
        turn2 = turn1 + tokens_of(first) + [7, 8, 9]
        assert rt.snapshot().slots[first[0].slot].phase != "idle"  # still saving: the case under test
        ev = await collect(await rt.submit(GenerationRequest("b", tuple(turn2), SamplingParams(max_tokens=5))))
        assert ev[0].slot == first[0].slot
        assert ev[0].cached_tokens == len(turn1) + len(tokens_of(first)) - 1
        assert tokens_of(ev) == greedy(fake, turn2, 5)
    store.close()
