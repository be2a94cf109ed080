"""The runtime over the REAL engine (MlxModelRunner on SmolLM2-135M Q4_1 from PyPI).

Reference: the same engine driven directly, single-threaded, with the whole prompt in one
prefill and greedy decoding — no slots, no chunks, no batching. The runtime (chunked prefill,
two slots decoding in one batch, a reused prefix) must produce the same T=0 tokens. Then a
device error injected into the real engine path poisons the runtime.

One runtime and one reference runner only: on a busy CPU a model load costs ~10 s.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from hf2q.sched.contracts import AdmissionRejected, RuntimeConfig

from hf2q.actors.runtime import open_runtime
from hf2q.sched.contracts import Failed, Finished, GenerationRequest, SamplingParams, Token

pytestmark = pytest.mark.slow

runner_mod = pytest.importorskip("hf2q.engine.runner", reason="the MLX engine is not built yet")

CTX = 256
N_NEW = 6


def _build():
    from hf2q.fetch import SMOLLM2, fetch

    return runner_mod.MlxModelRunner.load(str(fetch(SMOLLM2)), ctx=CTX)


class ArmableFault:
    """The real runner, except that once armed its next decode raises (a simulated device error)."""

    def __init__(self, runner):
        self._runner = runner
        self.armed = False

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def decode(self, seqs, tokens):
        if self.armed:
            raise RuntimeError("simulated Metal command buffer error")
        return self._runner.decode(seqs, tokens)


def _prompts() -> list[list[int]]:
    from hf2q.fetch import SMOLLM2, fetch
    from hf2q.text.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_gguf(str(fetch(SMOLLM2)))
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    return [tok.encode(chat.format("What is the capital of France?"), add_special=False),
            tok.encode(chat.format("Name three colours of the rainbow."), add_special=False)]


def _direct_greedy(prompts, n) -> list[list[int]]:
    runner = _build()
    outs = []
    for prompt in prompts:
        seq = runner.new_sequence()
        logits = runner.prefill(seq, list(prompt))
        out = []
        for _ in range(n):
            t = int(np.argmax(logits))
            if t in runner.eos_token_ids:
                break
            out.append(t)
            logits = runner.decode([seq], [t])[0]
        outs.append(out)
    return outs


def _tokens(evs) -> list[int]:
    return [e.token_id for e in evs if isinstance(e, Token)]


async def _run_all(rt, prompts, max_tokens, prefix="r") -> dict[int, list]:
    results: dict[int, list] = {}
    async with trio.open_nursery() as n:
        for i, p in enumerate(prompts):
            async def run(i=i, p=p):
                ch = await rt.submit(GenerationRequest(f"{prefix}{i}", tuple(p), SamplingParams(max_tokens=max_tokens)))
                async with ch:
                    results[i] = [e async for e in ch]
            n.start_soon(run)
    return results


async def test_runtime_on_the_real_engine():
    prompts = _prompts()
    engine: list[ArmableFault] = []

    def factory():
        engine.append(ArmableFault(_build()))
        return engine[0]

    async with open_runtime(factory, RuntimeConfig(slots=2, ctx=CTX, prefill_chunk=8, gpu_deadline_s=300)) as rt:
        assert await rt.wait_ready(), rt.readiness()
        results = await _run_all(rt, prompts, N_NEW)
        # the first prompt again: its prefix is reused from the slot
        again = (await _run_all(rt, prompts[:1], N_NEW, "again"))[0]
        snap = rt.snapshot()
        # then the device fails in the middle of two requests
        engine[0].armed = True
        failing = await _run_all(rt, prompts, 20, "f")
        ready, detail = rt.readiness()
        with pytest.raises(AdmissionRejected) as e:
            await rt.submit(GenerationRequest("late", tuple(prompts[0])))

    reference = await trio.to_thread.run_sync(_direct_greedy, prompts, N_NEW)  # one thread for all MLX calls
    for i in range(2):
        assert isinstance(results[i][-1], Finished)
        assert _tokens(results[i]) == reference[i]
    assert again[0].cached_tokens == len(prompts[0]) - 1
    assert _tokens(again) == reference[0]
    assert snap.counters["decode_batch_tokens"] > snap.counters["decode_batches"]  # some step batched both
    for evs in failing.values():
        ends = [x for x in evs if isinstance(x, (Finished, Failed))]
        assert len(ends) == 1 and isinstance(ends[0], Failed) and ends[0].code == "engine_unhealthy"
    assert not ready and "Metal command buffer" in detail
    assert (e.value.status, e.value.code) == (503, "engine_unhealthy")


async def test_speculative_serving_on_the_real_engine():
    """An edit request (the answer repeats the prompt's code): drafts from the prompt are accepted,
    fewer forwards run, and the T=0 output is plain greedy decoding's, token for token."""
    from hf2q.fetch import SMOLLM2, fetch
    from hf2q.text.tokenizer import GGUFTokenizer

    code = ("def merge_intervals(intervals):\n    merged = []\n    for start, end in sorted(intervals):\n"
            "        if merged and start <= merged[-1][1]:\n            merged[-1][1] = max(merged[-1][1], end)\n"
            "        else:\n            merged.append([start, end])\n    return merged\n")
    tok = GGUFTokenizer.from_gguf(str(fetch(SMOLLM2)))
    prompt = tok.encode("<|im_start|>user\nRewrite this function, renaming merged to out:\n" + code
                        + "<|im_end|>\n<|im_start|>assistant\n", add_special=False)
    n = 48
    async with open_runtime(_build, RuntimeConfig(slots=1, ctx=CTX, draft_tokens=6, gpu_deadline_s=300)) as rt:
        assert await rt.wait_ready(), rt.readiness()
        ch = await rt.submit(GenerationRequest("edit", tuple(prompt), SamplingParams(max_tokens=n)))
        async with ch:
            events = [e async for e in ch]
        counters = rt.snapshot().counters
    reference = (await trio.to_thread.run_sync(_direct_greedy, [prompt], n))[0]
    assert _tokens(events) == reference
    assert counters["accepted_draft_tokens"] >= len(reference) // 3
    assert counters["gpu_steps"] < len(reference) * 2 // 3
