"""The GPU owner's pipelined decode (one step queued ahead on the device) against blocking steps.

Runs the MLX graph path of a real (tiny) runner on the CPU — the path GPUs take — with the
host decode step switched off. Reference: the same runtime with ``HF2Q_NO_DECODE_PIPELINE=1``
and the runner driven step by step; the pipelined runtime must produce the same T=0 tokens
while requests join, end at different lengths and continue in their slots, and every cache
must hold exactly the tokens its slot fed once the speculation is settled.
"""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import numpy as np
import pytest
import trio

from hf2q.engine.decode_pipeline import DecodePipeline
from hf2q.sched.contracts import RuntimeConfig
from hf2q.actors.runtime import open_runtime
from hf2q.sched.contracts import Finished, GenerationRequest, SamplingParams, Token
from tests.engine_support import convert_f32, load_runner, random_tokens


@pytest.fixture(scope="module")
def graph_runner(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("llama")
    path = convert_f32(src, tmp_path_factory.mktemp("pipe") / "m.gguf")

    def build():
        r = load_runner(path, src)
        r.host_decoder = None  # the MLX graph path, as on a GPU
        r.eos_token_ids = frozenset()  # random weights: let max_tokens end every request
        assert r.pipelines_decode
        return r
    return build


class _Run:
    """The fields of a DecodeRun the pipeline reads."""

    def __init__(self, seq, params):
        from hf2q.engine.sampling import Sampler

        self.seq, self.sampler, self.constraint = seq, Sampler(params), None


def test_pipeline_steps_equal_blocking_steps_and_settle_restores_the_caches(graph_runner):
    r = graph_runner()
    greedy = SamplingParams(temperature=0.0)
    prompts = [random_tokens(n, seed=n) for n in (4, 9, 6)]
    ref = [r.new_sequence() for _ in prompts]
    seqs = [r.new_sequence() for _ in prompts]
    first = [int(np.argmax(r.prefill(s, p))) for s, p in zip(ref, prompts)]
    for s, p in zip(seqs, prompts):
        r.prefill(s, p)
    runs = [_Run(s, greedy) for s in seqs]
    pipe = DecodePipeline()
    tok_ref, tok = list(first), list(first)
    # three rows for 3 steps, then row 1 ends (the batch shrinks), then row 2 too
    for batch in ([0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 2], [0, 2], [0]):
        logits = r.decode([ref[i] for i in batch], [tok_ref[i] for i in batch])
        for i, row in zip(batch, logits):
            tok_ref[i] = int(np.argmax(row))
        got = pipe.step(r, [runs[i] for i in batch], [tok[i] for i in batch])
        for i, res in zip(batch, got):
            tok[i] = res.token_id
        assert [tok[i] for i in batch] == [tok_ref[i] for i in batch]
    assert pipe.stats["hits"] == 3 and pipe.stats["settled"] == 2
    pipe.settle()
    assert [s.length for s in seqs] == [s.length for s in ref]
    np.testing.assert_allclose(r.decode(seqs, tok_ref), r.decode(ref, tok_ref), atol=1e-4)


class _Chunk:
    """The fields of a PrefillWork ``run_step`` reads."""

    def __init__(self, seq, keep, tokens):
        self.seq, self.keep, self.tokens, self.slot = seq, keep, tokens, 0


def test_a_prefill_on_a_cache_the_queued_step_holds_keeps_its_prefix(graph_runner):
    """A slot's next request reuses its whole history while another row keeps decoding: the step
    queued on the old batch is settled before the prefill trims, so no reused position is lost."""
    from hf2q.engine.step import run_step

    r = graph_runner()
    greedy = SamplingParams(temperature=0.0)
    a, b = r.new_sequence(), r.new_sequence()
    ta, tb = int(np.argmax(r.prefill(a, random_tokens(9, seed=1)))), int(np.argmax(r.prefill(b, random_tokens(5))))
    ra, rb = _Run(a, greedy), _Run(b, greedy)
    ra.slot, rb.slot = 0, 1
    pipe = DecodePipeline()
    got = pipe.step(r, [ra, rb], [ta, tb])  # both fed; a step queued ahead on both
    fed = a.length - 1
    new = random_tokens(3, seed=3)
    run_step(r, [rb], [got[1].token_id], _Chunk(a, fed, new), pipe)
    assert a.length == fed + len(new)
    ref = r.new_sequence()
    r.prefill(ref, random_tokens(9, seed=1) + [ta])
    np.testing.assert_allclose(r.prefill(a, [7]), r.prefill(ref, new + [7]), atol=1e-4, rtol=0)


async def _serve(build, prompts, max_tokens) -> tuple[dict[str, list[int]], dict]:
    out: dict[str, list[int]] = {}
    holder = []

    def factory():
        holder.append(build())
        return holder[0]

    async def one(rt, name, prompt, n):
        ch = await rt.submit(GenerationRequest(name, tuple(prompt), SamplingParams(max_tokens=n)))
        async with ch:
            evs = [e async for e in ch]
        assert isinstance(evs[-1], Finished)
        out[name] = [e.token_id for e in evs if isinstance(e, Token)]

    async with open_runtime(factory, RuntimeConfig(slots=3, ctx=128, prefill_chunk=16, gpu_deadline_s=300)) as rt:
        assert await rt.wait_ready()
        async with trio.open_nursery() as n:
            for i, (p, m) in enumerate(zip(prompts, max_tokens)):
                n.start_soon(one, rt, f"r{i}", p, m)
        # the first conversation continues in its slot (the prefix is reused): its cache must
        # hold exactly what was fed, not the speculative extra position
        cont = list(prompts[0]) + out["r0"] + random_tokens(5, seed=99)
        await one(rt, "cont", cont, 7)
        pipeline = rt._system.gpu.pipeline  # noqa: SLF001 — the test looks inside on purpose
        stats = dict(pipeline.stats) if pipeline is not None else None
    return out, stats


async def test_runtime_tokens_equal_with_and_without_the_pipeline(graph_runner, monkeypatch):
    prompts = [random_tokens(n, seed=10 + n) for n in (12, 30, 7)]
    max_tokens = [9, 4, 14]
    monkeypatch.setenv("HF2Q_NO_DECODE_PIPELINE", "1")
    blocking, _ = await _serve(graph_runner, prompts, max_tokens)
    monkeypatch.delenv("HF2Q_NO_DECODE_PIPELINE")
    pipelined, stats = await _serve(graph_runner, prompts, max_tokens)
    assert pipelined == blocking
    assert [len(pipelined[f"r{i}"]) for i in range(3)] == max_tokens
    assert stats["hits"] > 0 and stats["steps"] > stats["hits"]
