"""The runtime over the REAL engine (MlxModelRunner on SmolLM2-135M Q4_1 from PyPI).

Reference: the same runner driven directly, single-threaded, with the whole prompt in one
prefill and greedy decoding — no slots, no chunks, no batching. The runtime (chunked prefill,
two slots decoding in one batch, a reused prefix) must produce the same T=0 tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from hf2q.actors.runtime import RuntimeConfig, open_runtime
from hf2q.sched.requests import Failed, Finished, GenerationRequest, SamplingParams, Token

pytestmark = pytest.mark.slow

runner_mod = pytest.importorskip("hf2q.engine.runner", reason="the MLX engine is not built yet")

CTX = 512
N_NEW = 8


def _build():
    from hf2q.fetch import SMOLLM2, fetch

    cls = runner_mod.MlxModelRunner
    path = str(fetch(SMOLLM2))
    if hasattr(cls, "load"):
        return cls.load(path, ctx=CTX)
    return cls(path, ctx=CTX)


def _prompts() -> list[list[int]]:
    from hf2q.fetch import SMOLLM2, fetch
    from hf2q.text.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_gguf(str(fetch(SMOLLM2)))
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    return [tok.encode(chat.format("What is the capital of France?"), add_special=False),
            tok.encode(chat.format("Name three colours of the rainbow."), add_special=False)]


def _direct_greedy(runner, prompt, n):
    seq = runner.new_sequence()
    logits = runner.prefill(seq, list(prompt))
    out = []
    for _ in range(n):
        t = int(np.argmax(logits))
        if t in runner.eos_token_ids:
            break
        out.append(t)
        logits = runner.decode([seq], [t])[0]
    return out


async def test_runtime_matches_the_engine_driven_directly():
    prompts = _prompts()
    results: dict[int, list] = {}
    async with open_runtime(_build, RuntimeConfig(slots=2, ctx=CTX, prefill_chunk=8,
                                                  gpu_deadline_s=300)) as rt:
        assert await rt.wait_ready(), rt.readiness()
        async with trio.open_nursery() as n:
            for i, p in enumerate(prompts):
                async def run(i=i, p=p):
                    ch = await rt.submit(GenerationRequest(f"r{i}", tuple(p), SamplingParams(max_tokens=N_NEW)))
                    async with ch:
                        results[i] = [e async for e in ch]
                n.start_soon(run)
        # the same first prompt again: its prefix is reused from the slot
        ch = await rt.submit(GenerationRequest("again", tuple(prompts[0]), SamplingParams(max_tokens=N_NEW)))
        async with ch:
            again = [e async for e in ch]
        snap = rt.snapshot()

    def toks(evs):
        return [e.token_id for e in evs if isinstance(e, Token)]

    reference = await trio.to_thread.run_sync(lambda: [_direct_greedy(r, p, N_NEW) for r, p in
                                                       [(_build(), q) for q in prompts]])
    for i in range(2):
        assert isinstance(results[i][-1], Finished)
        assert toks(results[i]) == reference[i]
    assert again[0].cached_tokens == len(prompts[0]) - 1
    assert toks(again) == reference[0]
    assert snap.counters["decode_batch_tokens"] > snap.counters["decode_batches"]  # some batch had both


class FaultAfter:
    """The real runner, except that its ``nth`` decode raises (a simulated device error)."""

    def __init__(self, runner, nth: int):
        self._runner, self._left = runner, nth

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def decode(self, seqs, tokens):
        self._left -= 1
        if self._left == 0:
            raise RuntimeError("simulated Metal command buffer error")
        return self._runner.decode(seqs, tokens)


async def test_real_engine_fault_fails_in_flight_requests_once():
    prompts = _prompts()
    async with open_runtime(lambda: FaultAfter(_build(), 3), RuntimeConfig(slots=2, ctx=CTX,
                                                                          gpu_deadline_s=300)) as rt:
        assert await rt.wait_ready()
        results: dict[int, list] = {}
        async with trio.open_nursery() as n:
            for i, p in enumerate(prompts):
                async def run(i=i, p=p):
                    ch = await rt.submit(GenerationRequest(f"r{i}", tuple(p), SamplingParams(max_tokens=20)))
                    async with ch:
                        results[i] = [e async for e in ch]
                n.start_soon(run)
        for evs in results.values():
            ends = [e for e in evs if isinstance(e, (Finished, Failed))]
            assert len(ends) == 1 and isinstance(ends[0], Failed) and ends[0].code == "engine_unhealthy"
        ready, detail = rt.readiness()
        assert not ready and "Metal command buffer" in detail
