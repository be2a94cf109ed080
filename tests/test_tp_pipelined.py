"""Pipelined decode (device-side sampling, the next step queued before the last is read) at TP = 2.

Rank 0 is the GPU-owner thread of the real actor runtime in a child process (``tp_launch.runner_factory``,
ring backend on 127.0.0.1); the reference is the same GGUF served at TP = 1 on MLX's graph path
(``HF2Q_NO_HOST_DECODE=1``), where the runtime pipelines with the same device sampler.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from hf2q.engine.distributed_runner import RING_PIPELINE_ENV

ROOT = Path(__file__).resolve().parents[1]
CTX = 256
GROUP_TIMEOUT_S = 240
PROMPTS = [[1, 504, 3094, 1210, 282, 253, 3467, 30, 1205], [1, 2129, 314, 5, 1140, 2616], [1, 77, 1900, 42]]
SAMPLED = {"temperature": 0.8, "seed": 7}
MAX_TOKENS = 8


async def collect(rt, request_id: str, prompt, params, on_token=None) -> list:
    """The request's token ids, then its terminal ``Failed`` as ``"failed STATUS CODE"`` if it failed."""
    from hf2q.sched.contracts import AdmissionRejected, Failed, GenerationRequest, Token

    try:
        events = await rt.submit(GenerationRequest(request_id, tuple(prompt), params))
    except AdmissionRejected as e:
        return [f"rejected {e.status} {e.code}"]
    out: list = []
    async with events:
        async for ev in events:
            if isinstance(ev, Token):
                out.append(ev.token_id)
                if on_token is not None:
                    on_token(len(out))
            elif isinstance(ev, Failed):
                out.append(f"failed {ev.status} {ev.code}")
    return out


async def serve_scenario(rt) -> dict:
    """Three concurrent greedy requests, then one sampled request: their tokens."""
    import trio

    from hf2q.sched.contracts import SamplingParams

    greedy = [None] * len(PROMPTS)

    async def one(i):
        greedy[i] = await collect(rt, f"g{i}", PROMPTS[i], SamplingParams(max_tokens=MAX_TOKENS))

    async with trio.open_nursery() as nursery:
        for i in range(len(PROMPTS)):
            nursery.start_soon(one, i)
    sampled = await collect(rt, "s", PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, **SAMPLED))
    return {"greedy": greedy, "sampled": sampled}


def runtime_config():
    from hf2q.sched.contracts import RuntimeConfig

    return RuntimeConfig(slots=3, ctx=CTX, prefill_chunk=4, gpu_deadline_s=60)


DRIVER = r"""
import collections, json, sys
sys.path.insert(0, {root!r})
import trio
from hf2q.actors.runtime import open_runtime
from hf2q.engine import distributed_runner, tp_launch
from tests.test_tp_pipelined import runtime_config, serve_scenario

sent = collections.Counter()  # commands rank 0 sent to the follower, by op (+ how a pipelined step got its ids)
_send = distributed_runner.send_message
def counting_send(sock, header, arrays=None):
    op = header["op"]
    if op == "decode_async":
        op += ".chained" if "after" in header else ".ids"
    sent[op] += 1
    return _send(sock, header, arrays)
distributed_runner.send_message = counting_send

async def main(path):
    async with open_runtime(tp_launch.runner_factory(path, 2, {ctx}), runtime_config()) as rt:
        assert await rt.wait_ready(), rt.readiness()
        sent.clear()  # start-up and warm-up
        out = await serve_scenario(rt)
        out["pipeline"] = dict(rt._system.gpu.pipeline.stats)
        out["sent"] = dict(sent)
        print(json.dumps(out))

trio.run(main, sys.argv[1])
"""


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tiny_checkpoint) -> Path:
    from hf2q.cli import main

    path = tmp_path_factory.mktemp("tp-pipelined") / "llama-q8_0.gguf"
    assert main(["convert", str(tiny_checkpoint("llama")), "--quant", "q8_0", "-o", str(path)]) == 0
    return path


async def test_pipelined_decode_at_two_ranks_serves_what_one_rank_serves(
        tiny_llama, tmp_path, monkeypatch):
    import trio

    from hf2q.actors.runtime import open_runtime
    from hf2q.engine.tp_launch import runner_factory

    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(root=str(ROOT), ctx=CTX))
    with trio.fail_after(GROUP_TIMEOUT_S):
        proc = await trio.run_process([sys.executable, str(script), str(tiny_llama)], cwd=ROOT,
                                      env={**os.environ, RING_PIPELINE_ENV: "1"},  # on by default on GPUs only
                                      capture_stdout=True, capture_stderr=True, check=False)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    got = json.loads(proc.stdout.decode().strip().splitlines()[-1])

    monkeypatch.setenv("HF2Q_NO_HOST_DECODE", "1")  # one rank on the graph path: it pipelines too
    async with open_runtime(runner_factory(tiny_llama, 1, CTX), runtime_config()) as rt:
        assert await rt.wait_ready()
        want = await serve_scenario(rt)
        assert rt._system.gpu.pipeline.stats["hits"] > 0

    assert got["greedy"] == want["greedy"] and all(len(t) == MAX_TOKENS for t in want["greedy"]), (got, want)
    # same seed, same draws: rank 0 samples with the request's key, as one rank does
    assert got["sampled"] == want["sampled"] and len(want["sampled"]) == MAX_TOKENS, (got, want)
    assert got["sampled"] != want["greedy"][0]
    # the steps were pipelined, and a queued step named its predecessor instead of carrying ids
    assert got["pipeline"]["hits"] >= MAX_TOKENS, got["pipeline"]
    assert got["sent"].get("decode", 0) == 0, got["sent"]
    assert got["sent"]["decode_async.chained"] > 2 * got["sent"].get("decode_async.ids", 0), got["sent"]


def test_rank0_chains_recent_steps_by_id_and_sends_ids_for_stale_ones(tiny_llama):
    """Rank 0's side alone (a one-process group, the follower's end of the control link read here):
    a step fed the last queued one names it, a step fed an old one carries its ids, and the sampled
    tokens are one process's ``decode_async`` with the same seed."""
    import socket

    import mlx.core as mx

    from hf2q.engine.distributed_runner import KEPT_STEPS, DistributedRunner, recv_message
    from hf2q.engine.runner import MlxModelRunner
    from hf2q.engine.sampling.device import DeviceSampler
    from hf2q.sched.contracts import SamplingParams

    params = SamplingParams(**SAMPLED)

    ref = MlxModelRunner.load(tiny_llama, ctx=CTX)
    seq = ref.new_sequence()
    first = int(ref.prefill(seq, PROMPTS[0]).argmax())
    want, sampler = [], DeviceSampler(params)
    pending = ref.decode_async([seq], [first], [sampler])
    for _ in range(KEPT_STEPS + 2):
        want.append(int(pending.result()[0][0]))
        pending = ref.decode_async([seq], pending, [sampler])

    lead, peer = socket.socketpair()
    local = MlxModelRunner.load(tiny_llama, ctx=CTX)
    group = mx.distributed.init()  # one process: the all_sum of the ids is the identity
    runner = DistributedRunner(local, [lead], [None, None], group)
    seq = runner.new_sequence()
    local.prefill(seq.local, PROMPTS[0])  # the follower's side is not running: no prefill command
    sampler = DeviceSampler(params)
    steps = [runner.decode_async([seq], [first], [sampler])]
    for _ in range(KEPT_STEPS + 1):
        steps.append(runner.decode_async([seq], steps[-1], [sampler]))
    stale = runner.decode_async([seq], steps[0], [DeviceSampler(params)])  # KEPT_STEPS + 1 steps old
    got = [int(p.result()[0][0]) for p in steps]
    assert got == want, (got, want)
    headers = [recv_message(peer) for _ in range(len(steps) + 2)]
    assert headers[0][0]["op"] == "new"
    first_step, *chained, last = headers[1:]
    assert "after" not in first_step[0] and first_step[1]["tokens"].tolist() == [first]
    assert [h["after"] for h, _ in chained] == list(range(len(chained)))
    assert "after" not in last[0] and last[1]["tokens"].tolist() == [got[0]] and stale.step == len(steps)
    lead.close()
    peer.close()


def test_ring_pipelining_is_opt_in(monkeypatch):
    from hf2q.engine.distributed_runner import pipelines_over

    monkeypatch.delenv(RING_PIPELINE_ENV, raising=False)
    assert pipelines_over("nccl") and not pipelines_over("ring")
    monkeypatch.setenv(RING_PIPELINE_ENV, "1")
    assert pipelines_over("ring")
