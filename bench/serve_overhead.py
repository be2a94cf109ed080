"""Per-step overhead of the serving path, measured over a fake engine whose decode costs a fixed time.

    python bench/serve_overhead.py                      # runtime + HTTP, 1 and 4 clients, JSON out
    python bench/serve_overhead.py --latency-ms 20 --tokens 96 --out overhead.json

The engine is ``tests/fakes.FakeModelRunner`` with ``step_latency_s`` = ``--latency-ms``
(a sleep: like a GPU step it releases the GIL), so whatever the wall time per decode step
exceeds that latency by is the serving path's own cost — independent of how fast the real
kernels are this week. Two levels:

* ``runtime``: the actor system alone (``open_runtime``), N requests submitted together;
* ``http``: a real ``hf2q serve`` app (Hypercorn, the SmolLM2 text side: tokenizer, chat
  template, incremental detokeniser, SSE) over the same fake engine in a child process, and N
  concurrent streaming httpx clients in this process.

Per level and client count it reports the engine's idle gap between consecutive calls (median,
mean, p90: the serving path's own cost per step, sampling included), the share of the window
the engine was busy, the decode calls and their batch sizes (every step of an N-client run
should batch all N decodes once all have joined), tokens/s against the engine-only ceiling,
and for HTTP the server process's CPU time per token (the fake engine only sleeps, so all of
it is serving work that a real CPU engine would have to share its cores with).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import emit, process_cpu_s  # noqa: E402 (bench/ is on the path of a bench script)

VOCAB = 49152  # SmolLM2's: the fake engine's ids are real token ids for the text side
EOS = 2


def fake_runner(latency_s: float):
    from tests.fakes import FakeModelRunner

    return FakeModelRunner(vocab_size=VOCAB, n_ctx_train=8192, eos_token_id=EOS, step_latency_s=latency_s)


def summarise(clients: int, tokens: int, wall: float, batches: list[int], spans: list, latency_s: float) -> dict:
    """``spans``: (kind, start, end) of every engine call of the measured window, in order.

    The engine's idle gap between one call's return and the next call's entry is the time
    the serving path needed to turn a step's logits into the next step (sampling included);
    ``busy`` is the share of the window the engine was computing."""
    gaps = sorted(b[1] - a[2] for a, b in itertools.pairwise(spans))
    window = spans[-1][2] - spans[0][1] if spans else float("nan")
    busy = sum(e - s for _, s, e in spans) / window if spans else float("nan")
    full = sum(1 for b in batches if b == clients)
    return {"clients": clients, "completion_tokens": tokens, "wall_s": round(wall, 3), "engine_calls": len(spans),
            "decode_calls": len(batches), "decode_batch_sizes": dict(sorted(collections.Counter(batches).items())),
            "steps_with_all_clients": full,
            "idle_gap_ms_median": round(gaps[len(gaps) // 2] * 1000, 3) if gaps else None,
            "idle_gap_ms_mean": round(sum(gaps) / len(gaps) * 1000, 3) if gaps else None,
            "idle_gap_ms_p90": round(gaps[int(len(gaps) * 0.9)] * 1000, 3) if gaps else None,
            "engine_busy_fraction": round(busy, 4),
            "tokens_per_sec": round(tokens / wall, 2),
            "engine_ceiling_tokens_per_sec": round(clients / latency_s, 2) if latency_s else None}


# ---- level 1: the actor system alone -------------------------------------------------------------

async def runtime_level(clients: int, n_tokens: int, latency_s: float) -> dict:
    from hf2q.sched.contracts import RuntimeConfig
    from hf2q.actors.runtime import open_runtime
    from hf2q.sched.contracts import GenerationRequest, SamplingParams, Token

    fake = fake_runner(latency_s)
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0)
    stamps: list[float] = []
    counts = [0] * clients

    async with open_runtime(fake.factory(), RuntimeConfig(slots=4, gpu_deadline_s=None)) as rt:
        await rt.wait_ready()

        async def one(i: int, prompt):
            events = await rt.submit(GenerationRequest(f"r{i}", tuple(prompt), params))
            async with events:
                async for ev in events:
                    if isinstance(ev, Token):
                        stamps.append(time.perf_counter())
                        counts[i] += 1

        async with trio.open_nursery() as n:  # warm-up: one short request
            n.start_soon(one, 0, [5, 6, 7])
        fake.calls.clear()
        fake.spans.clear()
        stamps.clear()
        counts[0] = 0
        async with trio.open_nursery() as n:
            for i in range(clients):
                n.start_soon(one, i, [10 + i, 20 + i, 30 + i, 40])
    wall = max(stamps) - min(stamps)
    return summarise(clients, sum(counts), wall, fake.decode_batch_sizes, list(fake.spans), latency_s)


# ---- level 2: HTTP, the real text side --------------------------------------------------------------

async def _serve_fake(port_file: str, latency_s: float) -> None:
    """Child process: the real app + GGUF text side over the fake engine; stats on /metrics."""
    from hf2q.sched.contracts import RuntimeConfig
    from hf2q.actors.runtime import open_runtime
    from hf2q.api.app import ServerContext
    from hf2q.api.server import serve
    from hf2q.api.textbridge import GGUFChatModel
    from hf2q.fetch import SMOLLM2, fetch

    model = GGUFChatModel.from_gguf(Path(fetch(SMOLLM2)), "fake-smollm2")
    fake = fake_runner(latency_s)
    async with open_runtime(fake.factory(), RuntimeConfig(slots=4, ctx=8192, gpu_deadline_s=None)) as rt:
        await rt.wait_ready()
        ctx = ServerContext(runtime=rt, chat_model=model, model_id=model.model_id)
        async with trio.open_nursery() as n:
            handle = await n.start(serve, ctx, "127.0.0.1", 0)
            Path(port_file).write_text(json.dumps({"url": handle.url}))

            async def stats_dump():  # the parent reads the engine's calls through this file,
                written = -1  # rewritten once the engine has been quiet for a moment (not while measuring)
                while True:
                    n_calls = len(fake.calls)
                    await trio.sleep(0.25)
                    if len(fake.calls) == n_calls != written:
                        Path(port_file + ".calls").write_text(json.dumps(
                            {"batches": fake.decode_batch_sizes, "spans": fake.spans}))
                        written = n_calls
            n.start_soon(stats_dump)
            await handle.closed.wait()
            n.cancel_scope.cancel()


async def _stream(client: httpx.AsyncClient, url: str, i: int, n_tokens: int) -> tuple[int, list[float]]:
    body = {"model": "default", "messages": [{"role": "user", "content": f"Tell me a story, number {i}."}],
            "max_tokens": n_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    stamps, usage = [], None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            if any((c.get("delta") or {}).get("content") for c in obj.get("choices") or ()):
                stamps.append(time.perf_counter())
    return (usage or {}).get("completion_tokens", len(stamps)), stamps


async def http_level(url: str, calls_file: Path, clients: int, n_tokens: int, latency_s: float) -> dict:
    async with httpx.AsyncClient(timeout=300) as client:
        await _stream(client, url, 99, 4)  # warm-up
        await trio.sleep(0.8)
        seen = json.loads(calls_file.read_text())
        n_batches, n_spans = len(seen["batches"]), len(seen["spans"])
        results: list = []

        async def one(i):
            results.append(await _stream(client, url, i, n_tokens))
        async with trio.open_nursery() as n:
            for i in range(clients):
                n.start_soon(one, i)
        await trio.sleep(0.8)
    seen = json.loads(calls_file.read_text())
    stamps = [s for _, st in results for s in st]
    wall = max(stamps) - min(stamps)
    return summarise(clients, sum(n for n, _ in results), wall, seen["batches"][n_batches:],
                     seen["spans"][n_spans:], latency_s)


def run_http(clients_list, n_tokens: int, latency_s: float) -> dict:
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as d:
        port_file = Path(d) / "server.json"
        proc = subprocess.Popen([sys.executable, __file__, "--serve-fake", str(port_file),
                                 "--latency-ms", str(latency_s * 1000)], cwd=ROOT)
        try:
            deadline = time.monotonic() + 120
            while not port_file.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the fake server did not start")
                time.sleep(0.1)
            url = json.loads(port_file.read_text())["url"]
            calls = Path(str(port_file) + ".calls")
            while not calls.exists():
                time.sleep(0.1)
            for c in clients_list:
                cpu0 = process_cpu_s(proc.pid)
                res = trio.run(http_level, url, calls, c, n_tokens, latency_s)
                # the fake engine sleeps: every CPU second the server spent is the serving path's
                res["server_cpu_ms_per_token"] = round((process_cpu_s(proc.pid) - cpu0) * 1000
                                                       / max(res["completion_tokens"], 1), 3)
                out[f"{c}_clients"] = res
        finally:
            proc.terminate()
            proc.wait(30)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--latency-ms", type=float, default=20.0, help="fake decode step latency")
    p.add_argument("--tokens", type=int, default=96, help="max_tokens per request")
    p.add_argument("--clients", default="1,4")
    p.add_argument("--levels", default="runtime,http")
    p.add_argument("--out")
    p.add_argument("--serve-fake", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    latency = args.latency_ms / 1000.0
    if args.serve_fake:
        trio.run(_serve_fake, args.serve_fake, latency)
        return 0
    clients = [int(c) for c in args.clients.split(",")]
    report = {"latency_ms": args.latency_ms, "tokens": args.tokens, "cpu_count": os.cpu_count(),
              "load_avg": os.getloadavg(), "time": time.strftime("%FT%TZ", time.gmtime())}
    levels = args.levels.split(",")
    if "runtime" in levels:
        report["runtime"] = {f"{c}_clients": trio.run(runtime_level, c, args.tokens, latency) for c in clients}
    if "http" in levels:
        report["http"] = run_http(clients, args.tokens, latency)
    return emit(report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
