"""The persistent KV store is keyed by the engine too: blocks written by one backend/device/KV
dtype (``ModelRunner.kv_identity``) are never imported by another, and are by the same one.

Goes through ``hf2q serve``'s own opener (``hf2q.api.command.kv_store_opener``) and the real
runtime, which opens the store once the runner has loaded and reported its identity."""

from __future__ import annotations

import argparse

import pytest

from hf2q.sched.contracts import RuntimeConfig

from hf2q.actors.runtime import open_runtime
from hf2q.api.command import kv_store_opener
from hf2q.errors import InputError
from hf2q.kvstore import BLOCK_TOKENS, BlockStore
from hf2q.kvstore.blockfile import FORMAT_VERSION
from hf2q.kvstore.fingerprint import model_fingerprint
from hf2q.sched.contracts import GenerationRequest, SamplingParams
from tests.fakes import FakeModelRunner
from tests.test_runtime import collect, greedy, terminal, tokens_of

CPU = "mlx-cpu-cpu-float32"
GPU = "mlx-cuda-gpu-float16"


def _prompt(n: int) -> list[int]:
    return [(i * 17) % 90 + 3 for i in range(n)]


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 8)  # the fingerprint hashes content only
    return path


def _args(kv_dir, budget=None, payload="kv"):
    return argparse.Namespace(kv_persist=str(kv_dir), kv_persist_budget=budget, kv_persist_payload=payload)


def test_fingerprint_folds_in_the_engine_identity(model_file):
    base = model_fingerprint(model_file, None, "{{x}}", FORMAT_VERSION)
    cpu = model_fingerprint(model_file, None, "{{x}}", FORMAT_VERSION, kv_identity=CPU)
    gpu = model_fingerprint(model_file, None, "{{x}}", FORMAT_VERSION, kv_identity=GPU)
    assert len({base, cpu, gpu}) == 3
    assert model_fingerprint(model_file, None, "{{x}}", FORMAT_VERSION, kv_identity=CPU) == cpu
    assert model_fingerprint(model_file, None, "{{x}}", FORMAT_VERSION, kv_identity="") == base


async def _serve_once(opener, identity: str, prompt, rid: str):
    fake = FakeModelRunner(kv_identity=identity)
    async with open_runtime(fake.factory(), RuntimeConfig(slots=1, prefill_chunk=128),
                            kv_store_opener=opener) as rt:
        assert await rt.wait_ready()
        store = rt.kv_store
        ev = await collect(await rt.submit(GenerationRequest(rid, tuple(prompt), SamplingParams(max_tokens=4))))
        assert await rt.drain(10)
        counters = rt.snapshot().counters
    return fake, store, ev, counters


async def test_blocks_of_one_engine_are_not_hydrated_by_another(tmp_path, model_file):
    kv = tmp_path / "kv"
    opener = kv_store_opener(_args(kv), model_file, "{{x}}")
    prompt = _prompt(2 * BLOCK_TOKENS + 40)

    cpu1, store1, ev1, c1 = await _serve_once(opener, CPU, prompt, "a")
    assert c1["kv_blocks_saved"] == 2 and ev1[0].cached_tokens == 0
    assert store1.fingerprint == model_fingerprint(model_file, None, "{{x}}", FORMAT_VERSION, kv_identity=CPU)
    assert tokens_of(ev1) == greedy(cpu1, prompt, 4)

    # a "GPU" server on the same directory: same model file, other engine → nothing reused
    gpu, _, ev2, c2 = await _serve_once(opener, GPU, prompt, "b")
    assert ev2[0].cached_tokens == 0 and terminal(ev2).cached_tokens == 0
    assert c2.get("kv_blocks_restored", 0) == 0
    assert not any(k == "import_kv" for k, _ in gpu.calls)
    assert gpu.prefill_sizes and sum(gpu.prefill_sizes) == len(prompt)
    assert tokens_of(ev2) == greedy(gpu, prompt, 4)

    # the first engine again: its own blocks come back from disk
    cpu2, _, ev3, c3 = await _serve_once(opener, CPU, prompt, "c")
    assert ev3[0].cached_tokens == 2 * BLOCK_TOKENS and c3["kv_blocks_restored"] == 2
    assert [n for k, n in cpu2.calls if k == "import_kv"] == [BLOCK_TOKENS, BLOCK_TOKENS]
    assert sum(cpu2.prefill_sizes) == len(prompt) - 2 * BLOCK_TOKENS
    assert tokens_of(ev3) == greedy(cpu2, prompt, 4)

    # both engines' blocks sit side by side in the one directory, each under its own fingerprint
    with BlockStore.open(kv, store1.fingerprint) as s:
        assert s.recovery.blocks == 4 and s.recovery.own_blocks == 2


async def test_the_runtime_closes_the_store_it_opened(tmp_path, model_file):
    kv = tmp_path / "kv"
    opener = kv_store_opener(_args(kv), model_file, None)
    _, _, _, counters = await _serve_once(opener, CPU, _prompt(BLOCK_TOKENS + 5), "a")
    assert counters["kv_blocks_saved"] == 1
    from hf2q.cli import main

    # `hf2q cache clear` refuses (exit 3) while a server holds the store: the runtime let it go
    assert main(["cache", "clear", "--kv-path", str(kv), "--yes"]) == 0
    assert list((kv / "blocks").iterdir()) == []


def test_opener_checks_the_directory_before_any_model_loads(tmp_path, model_file):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(InputError, match="--kv-persist"):
        kv_store_opener(_args(blocker / "kv"), model_file, None)
    with pytest.raises(InputError, match="must not be negative"):
        kv_store_opener(_args(tmp_path / "kv", budget=-1), model_file, None)
    assert kv_store_opener(argparse.Namespace(kv_persist=None, kv_persist_budget=None), model_file, None) is None


async def test_serve_stores_blocks_in_the_payload_it_is_told(tmp_path, model_file):
    """``serve --kv-persist-payload kv-f16`` reaches the store: new block files carry that payload and
    a restart restores from them."""
    from hf2q.cli import build_parser
    from hf2q.kvstore.blockfile import BLOCK_SUFFIX, read_block

    args = build_parser().parse_args(["serve", "--kv-persist", str(tmp_path / "kv"), "--kv-persist-payload", "kv-f16"])
    assert args.kv_persist_payload == "kv-f16"
    opener = kv_store_opener(args, model_file, None)
    prompt = _prompt(2 * BLOCK_TOKENS + 9)
    _, store, ev, counters = await _serve_once(opener, CPU, prompt, "a")
    assert counters["kv_blocks_saved"] == 2 and store.payload_kind == "kv-f16"
    files = sorted((tmp_path / "kv").rglob("*" + BLOCK_SUFFIX))
    assert len(files) == 2 and all(read_block(f)[0].payload_kind == "kv-f16" for f in files)
    runner, _, ev2, c2 = await _serve_once(opener, CPU, prompt, "b")
    assert ev2[0].cached_tokens == 2 * BLOCK_TOKENS and c2["kv_blocks_restored"] == 2
    assert tokens_of(ev2) == greedy(runner, prompt, 4)
