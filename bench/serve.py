"""Serving benchmark: hf2q serve vs llama.cpp's llama-server on the same GGUF, JSON out.

    python bench/serve.py                         # default model (SmolLM2 Q4_1), both servers
    python bench/serve.py --model m.gguf --skip-peer --out serve.json

For each server (started here on free ports, 4 slots / ``--parallel 4``, same per-slot
context, same threads):

* aggregate completion tokens/s and TTFT p50/p95 with 1 client and with 4 concurrent
  clients (each client sends ``--requests`` streamed chat requests back to back,
  temperature 0, distinct prompts, ``--max-tokens`` each), the median per-stream decode rate
  after the first token, and (hf2q) the GPU steps and mean decode batch from ``/metrics``;
* TTFT of a ~20 KB conversation sent cold, then of the next turn of the same conversation
  (the server may reuse the cached prefix), and their ratio.

* CPU seconds per completion token of this client process and of the server process (from
  ``/proc``), since both share the machine's cores with the engine.

TTFT is measured by the client: request sent → first content/tool delta received.
Nothing is hard-coded: both servers answer the same HTTP requests.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import chat_model, emit, process_cpu_s  # noqa: E402 (bench/ is on the path of a bench script)

TOPICS = ["a lighthouse keeper", "a lost robot", "the first snow", "a city of bridges", "an old violin",
          "a desert train", "a quiet library", "a comet", "a clockmaker", "a river otter", "a glass garden",
          "a night market", "a paper boat", "a mountain radio", "a sleepy dragon", "a copper key"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def long_context(n_bytes: int = 20_000) -> str:
    """A deterministic ~20 KB document (varied words so tokenisation is realistic)."""
    words = ["alpha", "beta", "gamma", "delta", "server", "cache", "token", "slot", "prefill", "decode", "request", "stream", "memory", "budget", "kernel", "thread", "queue", "batch", "model", "layer", "vector", "matrix"]
    out, i = [], 0
    while sum(len(w) + 1 for w in out) < n_bytes:
        out.append(words[(i * 7 + i // 3) % len(words)] + (str(i % 97) if i % 5 == 0 else ""))
        i += 1
    return " ".join(out)


async def stream_chat(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int,
                      extra: dict | None = None) -> dict:
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    t0 = time.perf_counter()
    ttft = None
    last = None
    pieces = 0
    usage = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices") or ():
                d = ch.get("delta") or {}
                if d.get("content") or d.get("tool_calls") or d.get("reasoning_content"):
                    pieces += 1
                    last = time.perf_counter() - t0
                    if ttft is None:
                        ttft = last
    total = time.perf_counter() - t0
    completion = (usage or {}).get("completion_tokens", pieces)
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    # the streaming decode rate the client saw: tokens after the first over first → last delta
    stream_tps = (completion - 1) / (last - ttft) if ttft is not None and last and last > ttft else None
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total, "completion_tokens": completion,
            "stream_decode_tokens_per_sec": stream_tps,
            "prompt_tokens": (usage or {}).get("prompt_tokens"), "cached_tokens": cached}


async def scrape_counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """hf2q's step counters from /metrics (empty for a server without them)."""
    try:
        text = (await client.get(url + "/metrics")).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("hf2q_gpu_steps_total", "hf2q_decode_batches_total", "hf2q_decode_batch_tokens_total",
                    "hf2q_gpu_busy_seconds_total"):
            out[name[len("hf2q_"):-len("_total")]] = float(value)
    return out


async def load_run(url: str, clients: int, requests: int, max_tokens: int, server_pid: int | None = None) -> dict:
    results: list[dict] = []
    async with httpx.AsyncClient(timeout=600) as client:
        async def one_client(ci: int):
            for k in range(requests):
                topic = TOPICS[(ci * requests + k) % len(TOPICS)]
                msgs = [{"role": "user", "content": f"Write a long, detailed story about {topic}. "
                                                    f"(client {ci}, request {k})"}]
                results.append(await stream_chat(client, url, msgs, max_tokens))

        # warm-up (loads lazily-initialised kernels on both servers)
        await stream_chat(client, url, [{"role": "user", "content": "Hi"}], 4)
        before = await scrape_counters(client, url)
        cpu0 = (process_cpu_s(), process_cpu_s(server_pid) if server_pid else None)
        t0 = time.perf_counter()
        async with trio.open_nursery() as n:
            for ci in range(clients):
                n.start_soon(one_client, ci)
        wall = time.perf_counter() - t0
        cpu1 = (process_cpu_s(), process_cpu_s(server_pid) if server_pid else None)
        after = await scrape_counters(client, url)
    toks = sum(r["completion_tokens"] for r in results)
    ttfts = [r["ttft_s"] for r in results]
    rates = [r["stream_decode_tokens_per_sec"] for r in results if r["stream_decode_tokens_per_sec"]]
    out = {"clients": clients, "requests": len(results), "completion_tokens": toks, "wall_s": round(wall, 3),
           "aggregate_tokens_per_sec": round(toks / wall, 2),
           # per stream, after its first token (TTFT excluded): what the decode loop delivers
           "stream_decode_tokens_per_sec_p50": round(percentile(rates, 0.5), 2) if rates else None,
           "ttft_p50_ms": round(percentile(ttfts, 0.5) * 1000, 1),
           "ttft_p95_ms": round(percentile(ttfts, 0.95) * 1000, 1),
           # where the machine's cores went, per completion token (the client shares the machine)
           "client_cpu_ms_per_token": round((cpu1[0] - cpu0[0]) / toks * 1000, 3) if toks else None}
    if server_pid and toks:
        out["server_cpu_ms_per_token"] = round((cpu1[1] - cpu0[1]) / toks * 1000, 3)
    if before and after:
        d = {k: after[k] - before.get(k, 0.0) for k in after}
        out["gpu_steps"] = int(d["gpu_steps"])
        out["decode_batches"] = int(d["decode_batches"])
        out["mean_decode_batch"] = round(d["decode_batch_tokens"] / d["decode_batches"], 3) if d["decode_batches"] else None
        if "gpu_busy_seconds" in d:  # the engine's share of the window, and its time per step
            out["engine_busy_fraction"] = round(d["gpu_busy_seconds"] / wall, 3)
            out["engine_ms_per_step"] = round(d["gpu_busy_seconds"] / d["gpu_steps"] * 1000, 2) if d["gpu_steps"] else None
    return out


async def cached_turn(url: str, context_bytes: int) -> dict:
    doc = long_context(context_bytes)
    system = {"role": "system", "content": "You answer questions about this document.\n\n" + doc}
    turn1 = [system, {"role": "user", "content": "Summarise the document in one sentence."}]
    async with httpx.AsyncClient(timeout=900) as client:
        cold = await stream_chat(client, url, turn1, 16)
        # the next turn: the same conversation plus the assistant reply and a new question
        turn2 = turn1 + [{"role": "assistant", "content": "It is a list of systems words."},
                         {"role": "user", "content": "Which word appears most often?"}]
        warm = await stream_chat(client, url, turn2, 16)
    return {"context_bytes": len(doc), "prompt_tokens": cold["prompt_tokens"],
            "cold_ttft_ms": round(cold["ttft_s"] * 1000, 1), "cached_ttft_ms": round(warm["ttft_s"] * 1000, 1),
            "cached_tokens": warm["cached_tokens"],
            "cached_over_cold": round(warm["ttft_s"] / cold["ttft_s"], 4) if cold["ttft_s"] else None}


def wait_http_ready(url: str, proc: subprocess.Popen, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before ready ({url})")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def start_hf2q(model: Path, slots: int, ctx: int, log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "hf2q", "serve", "--model", str(model), "--port", str(port), "--slots",
           str(slots), "--ctx", str(ctx), "--operator-ui", "plain"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    wait_http_ready(url, proc, "/readyz", 600)
    return proc, url


def start_llama_server(model: Path, slots: int, ctx: int, threads: int, log,
                       gpu_layers: int = 0) -> tuple[subprocess.Popen, str]:
    from tests.tools import llama_cpp

    exe = llama_cpp.tool("llama-server")
    if exe is None:
        raise RuntimeError("llama-server is not built (python -m tests.tools.llama_cpp)")
    port = free_port()
    # llama-server divides -c among --parallel slots; give every slot the same ctx as ours
    cmd = [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "--parallel", str(slots),
           "-c", str(ctx * slots), "-t", str(threads), "--jinja", "-ngl", str(gpu_layers), "--no-webui"]
    env = {**llama_cpp.env(), "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_http_ready(url, proc, "/health", 300)
    return proc, url


def measure(url: str, args, pid: int | None = None) -> dict:
    out = {"one_client": trio.run(load_run, url, 1, args.requests, args.max_tokens, pid),
           "four_clients": trio.run(load_run, url, 4, args.requests, args.max_tokens, pid)}
    if not args.skip_cached:
        out["cached_turn"] = trio.run(cached_turn, url, args.context_bytes)
    one, four = out["one_client"]["aggregate_tokens_per_sec"], out["four_clients"]["aggregate_tokens_per_sec"]
    out["four_over_one"] = round(four / one, 3) if one else None
    return out


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF (default: the built-in default chat model)")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--ctx", type=int, default=8192, help="per-slot context for both servers")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server threads")
    p.add_argument("--requests", type=int, default=3, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--context-bytes", type=int, default=20_000)
    p.add_argument("--skip-peer", action="store_true", help="only measure hf2q")
    p.add_argument("--skip-ours", action="store_true", help="only measure llama-server")
    p.add_argument("--skip-cached", action="store_true", help="skip the 20 KB cached-turn measurement")
    p.add_argument("--gpu-layers", type=int, default=0, help="llama-server -ngl (99 on a GPU machine)")
    p.add_argument("--out", help="write the JSON here as well as to stdout")
    p.add_argument("--server-log", default=os.devnull)
    args = p.parse_args(argv)

    model = chat_model(args.model)
    report: dict = {"model": str(model), "slots": args.slots, "ctx": args.ctx, "requests_per_client": args.requests,
                    "max_tokens": args.max_tokens, "cpu_count": os.cpu_count(), "time": time.strftime("%FT%TZ", time.gmtime())}
    with open(args.server_log, "ab") as log:
        if not args.skip_ours:
            proc, url = start_hf2q(model, args.slots, args.ctx, log)
            try:
                report["hf2q"] = measure(url, args, proc.pid)
            finally:
                stop(proc)
        if not args.skip_peer:
            proc, url = start_llama_server(model, args.slots, args.ctx, args.threads, log, args.gpu_layers)
            try:
                report["llama_server"] = measure(url, args, proc.pid)
            finally:
                stop(proc)
    if "llama_server" in report and "hf2q" in report:
        ours, peer = report["hf2q"], report["llama_server"]
        report["hf2q_over_llama_server"] = {
            k: round(ours[k]["aggregate_tokens_per_sec"] / peer[k]["aggregate_tokens_per_sec"], 3)
            if peer[k]["aggregate_tokens_per_sec"] else None for k in ("one_client", "four_clients")}
    return emit(report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
