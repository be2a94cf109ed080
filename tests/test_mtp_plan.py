"""The MTP draft head in the memory plan and with an 8-bit KV cache (``--speculative mtp``).

The plan (``engine/memory_plan.py``) is read from the GGUF header alone; the references here are
what the engine really allocates on the tiny Qwen 3.5 checkpoint with its hand-made ``mtp.*`` head:
the bytes of every K/V array of a live sequence, the head's loaded weights, and, for ``q8``, plain
greedy decoding of the same cache type.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from hf2q.engine.memory_plan import check_model, kv_need, mtp_position_bytes, rank_need
from hf2q.errors import InputError
from hf2q.formats.gguf_file import open_gguf
from hf2q.sched.contracts import ModelFacts, RuntimeConfig, SamplingParams
from tests.engine_support import random_tokens
from tests.models.mtp_runners import runner_cache


@pytest.fixture(scope="module")
def gguf(tiny_checkpoint, tmp_path_factory):
    from tests.engine_support import convert_f32

    return convert_f32(tiny_checkpoint("qwen35_parity_mtp"), tmp_path_factory.mktemp("mtp-plan") / "dense.gguf")


_runner = runner_cache()  # shared by the tests of this module


def _held_kv(seq) -> int:
    """Bytes of every K/V array the sequence holds (an 8-bit layer: its codes and scales)."""
    return sum(a.nbytes for buf in seq.keys + seq.values if buf is not None
               for a in (buf if isinstance(buf, tuple) else (buf,)))


# ---------------------------------------------------------------------------- the plan vs a real slot


def test_planned_block_end_bytes_equal_the_hidden_rows_a_sequence_keeps(gguf):
    """With the head, each captured block end also keeps the main model's hidden row before it (the head
    pairs it with the block's next token): the plan's per-end bytes are those rows."""
    from hf2q.engine.memory_plan import end_hidden_bytes
    from hf2q.kvstore import BLOCK_TOKENS

    hp = open_gguf(gguf).hparams
    runner = _runner(gguf, True, "f16")
    seq = runner.new_sequence()
    seq.keep_block_ends(BLOCK_TOKENS)
    runner.prefill(seq, random_tokens(2 * BLOCK_TOKENS + 20, seed=2))
    ends = seq.block_ends
    assert sorted(ends) == [BLOCK_TOKENS, 2 * BLOCK_TOKENS]
    held = {n: np.array(e.hidden).nbytes for n, e in ends.items()}
    need = kv_need(hp, runner.dtype.size, mtp=True)
    assert set(held.values()) == {end_hidden_bytes(hp, runner.dtype.size)} == {need.block_end_bytes()}
    assert kv_need(hp, runner.dtype.size).block_end_bytes() == 0  # without the head nothing beside the state
    # the sequence's own account holds them too: letting the ends go frees those rows (their states are also
    # reuse points at these lengths, so they stay)
    assert all(n in seq.recurrent.points for n in ends)
    before = seq.recurrent.nbytes
    seq.forget_block_ends(())
    assert before - seq.recurrent.nbytes == sum(held.values())


@pytest.mark.parametrize("kv_type", ["f16", "q8"])
def test_planned_kv_bytes_equal_a_real_slots_with_the_head(gguf, kv_type):
    hp = open_gguf(gguf).hparams
    for mtp in (False, True):
        runner = _runner(gguf, mtp, kv_type)
        seq = runner.new_sequence()
        runner.prefill(seq, random_tokens(30, seed=1))
        if mtp:
            runner.draft(seq, 5, 3)  # a draft's rows live in room the sequence reserved, counted like the rest
        need = kv_need(hp, runner.dtype.size, kv_type=kv_type, mtp=mtp)
        assert _held_kv(seq) == need.per_token * seq.capacity
        assert runner.kv_bytes_per_token == need.per_token
        facts = ModelFacts.of(runner, RuntimeConfig(slots=2, ctx=64))  # what admission budgets with
        assert facts.budget_bytes(RuntimeConfig(slots=2, ctx=64)) == 2 * 64 * need.per_token
    head = mtp_position_bytes(hp, 4, kv_type)
    assert head > 0
    assert kv_need(hp, 4, kv_type=kv_type, mtp=True).per_token == kv_need(hp, 4, kv_type=kv_type).per_token + head


@pytest.mark.parametrize("size", [1, 2])
def test_planned_head_weights_equal_what_the_engine_loads(gguf, size):
    """On one rank, and on each of two (the head's block is cut like a main block)."""
    from hf2q.engine.models import build_model
    from hf2q.engine.tensor_parallel import shard_gguf

    g = open_gguf(gguf)
    loaded = []
    for rank in range(size):
        model = build_model(shard_gguf(g, rank, size), mx.float32)
        before = model.weights_nbytes()
        model.enable_mtp()
        head = model.mtp
        norms = [head.enorm, head.hnorm, head.head_norm, head.block.attn_norm, head.block.post_norm,
                 head.block.mixer.q_norm, head.block.mixer.k_norm]
        loaded.append(model.weights_nbytes() - before + sum(n.nbytes for n in norms))
    plain = rank_need(g, size, 0, float_bytes=4, scale_bytes=4)
    with_head = rank_need(g, size, 0, float_bytes=4, scale_bytes=4, mtp=True)
    assert len(set(loaded)) == 1  # even shares, so the most loaded rank's head is any rank's
    assert with_head.weights - plain.weights == loaded[0] > 0


def test_the_pre_load_check_counts_the_head(gguf):
    from hf2q.engine.device_probe import probe

    g = open_gguf(gguf)
    device = probe()
    kw = dict(ctx=2048, slots=2, kv_budget=None, device=device)
    plain = check_model(g, 1, limit=1 << 40, **kw)
    spec = check_model(g, 1, limit=1 << 40, mtp=True, **kw)
    elem = device.activation_bytes()
    assert spec.kv - plain.kv == 2 * 2048 * mtp_position_bytes(g.hparams, elem)
    assert spec.weights > plain.weights
    with pytest.raises(InputError, match="--memory-limit"):  # fits without the head, not with it
        check_model(g, 1, limit=(plain.total + spec.total) // 2, mtp=True, **kw)
    check_model(g, 1, limit=(plain.total + spec.total) // 2, **kw)


def test_info_states_what_the_head_adds(gguf, cli):
    from hf2q.engine.memory_plan import head_tensors, tensor_bytes

    r = cli("info", gguf, "--json", "--ctx", "1024", "--kv-cache-type", "q8")
    assert r.code == 0, r.err
    info = json.loads(r.out)
    g = open_gguf(gguf)
    elem = info["kv_dtype_bytes"]
    assert info["mtp_kv_bytes_per_token"] == mtp_position_bytes(g.hparams, elem, "q8")
    assert info["mtp_kv_bytes_per_slot"] == 1024 * info["mtp_kv_bytes_per_token"]
    assert info["mtp_weight_bytes"] == sum(tensor_bytes(g.tensors[n], elem, 0) for n in head_tensors(g)) > 0  # f32
    text = cli("info", gguf, "--ctx", "1024")
    assert text.code == 0 and "MTP head:" in text.out and "--speculative mtp" in text.out


# ---------------------------------------------------------------------------- drafting over an 8-bit head layer


def test_the_q8_head_drafts_from_its_8_bit_rows(gguf):
    """The head's K/V rows are stored in the 8-bit layout and read as stored: its draft logits stay within
    the 8-bit rounding of the float head's, and drafting leaves the sequence where it was."""
    prompt = random_tokens(40, seed=4)
    rows = {}
    for kv_type in ("f16", "q8"):
        runner = _runner(gguf, True, kv_type)
        seq = runner.new_sequence()
        runner.prefill(seq, prompt)
        layer = seq.keys[runner.model.mtp.kv_index]
        assert isinstance(layer, tuple) == (kv_type == "q8")  # codes + scales, like every main layer
        _, rows[kv_type] = runner.model.mtp.draft_logits(seq, prompt[-1], 3)
        assert seq.length == len(prompt)
    spread = float(np.std(rows["f16"]))
    assert spread > 0.3
    assert 0 < float(np.abs(rows["q8"] - rows["f16"]).max()) < 0.05 * spread


def test_greedy_output_is_identical_plain_q8_and_mtp_q8(gguf):
    from hf2q.engine.generate import generate_once

    params = SamplingParams(max_tokens=16, temperature=0.0)
    prompt = random_tokens(12, seed=7) * 3
    plain = generate_once(_runner(gguf, False, "q8"), prompt, params, ignore_eos=True)
    spec = generate_once(_runner(gguf, True, "q8"), prompt, params, ignore_eos=True, draft_tokens=3)
    assert spec["tokens"] == plain["tokens"] and spec["drafted_tokens"] > 0


async def test_the_runtime_decodes_with_mtp_drafts_over_a_q8_cache(gguf):
    from hf2q.actors.runtime import open_runtime
    from hf2q.engine.generate import generate_once
    from hf2q.sched.contracts import GenerationRequest, RuntimeConfig, Token

    prompt, n = random_tokens(40, seed=13), 16
    config = RuntimeConfig(slots=2, ctx=256, draft_tokens=3, prefill_chunk=16, gpu_deadline_s=300)
    async with open_runtime(lambda: _runner(gguf, True, "q8", fresh=True), config) as rt:
        assert await rt.wait_ready(), rt.readiness()
        ch = await rt.submit(GenerationRequest("r", tuple(prompt), SamplingParams(max_tokens=n)))
        async with ch:
            events = [e async for e in ch]
        counters = rt.snapshot().counters
    ref = generate_once(_runner(gguf, False, "q8"), prompt, SamplingParams(max_tokens=n, temperature=0.0))
    expected = ref["tokens"][:-1] if ref["finish_reason"] == "stop" else ref["tokens"]
    assert [e.token_id for e in events if isinstance(e, Token)] == expected
    assert counters["drafted_tokens"] > 0


def test_generate_cli_mtp_q8_is_byte_identical(gguf, cli):
    args = ["generate", "--model", str(gguf), "--prompt", "hello there", "--raw", "--max-tokens", "10",
            "--ignore-eos", "--kv-cache-type", "q8"]
    plain = cli(*args)
    mtp = cli(*args, "--speculative", "mtp", "--draft-tokens", "2")
    assert plain.code == 0 and mtp.code == 0, mtp.err
    assert mtp.out == plain.out and mtp.out.strip()


def test_a_draft_row_is_never_written_inside_the_sequence(gguf):
    runner = _runner(gguf, True, "f16")
    seq = runner.new_sequence()
    runner.prefill(seq, random_tokens(8, seed=2))
    k = mx.zeros((seq.kv_heads, 1, seq.head_dim))
    with pytest.raises(ValueError, match="length"):
        seq.write_ahead(runner.model.mtp.kv_index, seq.length - 1, k, k)
