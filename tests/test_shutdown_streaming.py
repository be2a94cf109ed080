"""``hf2q serve`` stopped by signals while it streams: exit 0 every time, never an abort.

The engine thread is a daemon; a step still running when the interpreter finalizes returns into a
thread Python is tearing down and the process dies by SIGABRT (status -6, "terminate called without
an active exception"). The runtime's shutdown therefore waits for the engine thread's running job
before the process exits (``hf2q/actors/engine_thread.py``). The window is widest when the server is
stopped at once mid-decode: four streams are running, a first SIGTERM starts the drain, a second one
stops it (docs/API.md: a second signal stops at once) while every slot is still decoding. The model
is the tiny Gemma 4 served through MLX's graph with pipelined decode steps, as in the launcher test
where the abort was seen.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from hf2q.engine.tp_launch import free_ports

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 5
STREAMS = 4
KEY = "shutdown-test-key"


@pytest.fixture(scope="module")
def gemma4_gguf() -> Path:
    from tests.models.gemma4_chat import gemma4_chat_gguf

    return gemma4_chat_gguf()


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server never became ready")


def stream(url: str, tokens: list[int], i: int) -> None:
    """One streamed chat completion, counting its content chunks in ``tokens[i]`` until the server
    ends it (the stop cuts it short)."""
    body = {"model": "m", "max_tokens": 2000, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": f"Count to a thousand, {i}."}]}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    tokens[i] += 1
    except httpx.HTTPError:
        pass  # the connection ends with the server


def test_stopping_while_streaming_exits_0_every_time(gemma4_gguf):
    statuses, tails = [], []
    for _ in range(ROUNDS):
        port = free_ports(1)[0]
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, "-m", "hf2q", "serve", "--model", str(gemma4_gguf), "--model-name", "m",
                                 "--port", str(port), "--slots", str(STREAMS), "--ctx", "4096", "--operator-ui",
                                 "plain"], cwd=ROOT, env={**os.environ, "HF2Q_API_KEY": KEY},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            wait_ready(url, proc)
            tokens = [0] * STREAMS
            clients = [threading.Thread(target=stream, args=(url, tokens, i)) for i in range(STREAMS)]
            for c in clients:
                c.start()
            deadline = time.monotonic() + 60
            while min(tokens) < 2 and time.monotonic() < deadline:  # every slot decoding
                time.sleep(0.02)
            assert min(tokens) >= 2, tokens
            proc.send_signal(signal.SIGTERM)  # drain...
            time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)  # ...and stop at once, mid-step
            statuses.append(proc.wait(60))
            tails.append(proc.stderr.read()[-1500:])
            for c in clients:
                c.join(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert statuses == [0] * ROUNDS, tails
    assert not any("Fatal Python error" in t or "terminate called" in t for t in tails), tails
