"""``hf2q serve`` stopped by signals mid-stream or mid-load: exit 0 every time, never an abort.

The engine thread is a daemon; an engine call still running when the interpreter finalizes returns
into a thread Python is tearing down and the process dies by SIGABRT (status -6, "terminate called
without an active exception"). So the runtime's shutdown waits for the engine thread's running job
(``hf2q/actors/engine_thread.py``), and a server stopped while the model still loads (which cannot be
interrupted) leaves without finalizing. The window is widest when the server is stopped at once
mid-decode: four streams are running, a first SIGTERM starts the drain, a second one stops it
(docs/API.md: a second signal stops at once) while every slot is still decoding. The model is the
tiny Gemma 4 served through MLX's graph with pipelined decode steps, as in the launcher test where
the abort was seen."""

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
ROUNDS = 3
STREAMS = 4
KEY = "shutdown-test-key"
#: the injected load's length, and the most a stop during it may take: a server that waited for the
#: load (or a good part of it) before leaving goes over by tens of seconds, a prompt exit stays far under
SLOW_LOAD_S = 120
STOP_DURING_LOAD_S = 30


@pytest.fixture(scope="module")
def gemma4_gguf() -> Path:
    from tests.models.gemma4_chat import gemma4_chat_gguf

    return gemma4_chat_gguf()


def start(gguf: Path, script: Path | None = None) -> tuple[subprocess.Popen, str]:
    """``hf2q serve`` on ``gguf`` (through ``script``, a driver that runs the CLI, if given)."""
    port = free_ports(1)[0]
    cli = [str(script)] if script is not None else ["-m", "hf2q"]
    proc = subprocess.Popen([sys.executable, *cli, "serve", "--model", str(gguf), "--model-name", "m",
                             "--port", str(port), "--slots", str(STREAMS), "--ctx", "4096", "--operator-ui", "plain"],
                            cwd=ROOT, env={**os.environ, "HF2Q_API_KEY": KEY}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_for(url: str, proc: subprocess.Popen, path: str = "/readyz", timeout: float = 180) -> None:
    """Until ``path`` answers 200 (``/health``: the server is up, the model may still be loading)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        try:
            if httpx.get(f"{url}{path}", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{path} never answered 200")


def ended(proc: subprocess.Popen) -> tuple[int, str]:
    """The server's exit status and the end of its log (it must have been signalled)."""
    try:
        return proc.wait(60), proc.stderr.read()[-1500:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def aborted(tail: str) -> bool:
    return "Fatal Python error" in tail or "terminate called" in tail


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


@pytest.mark.slow
def test_stopping_while_streaming_exits_0_every_time(gemma4_gguf):
    runs = []
    for _ in range(ROUNDS):
        proc, url = start(gemma4_gguf)
        tokens = [0] * STREAMS
        clients = [threading.Thread(target=stream, args=(url, tokens, i)) for i in range(STREAMS)]
        try:
            wait_for(url, proc)
            for c in clients:
                c.start()
            deadline = time.monotonic() + 60
            while min(tokens) < 2 and time.monotonic() < deadline:  # every slot decoding
                time.sleep(0.02)
            assert min(tokens) >= 2, tokens
            proc.send_signal(signal.SIGTERM)  # drain...
            time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)  # ...and stop at once, mid-step
        finally:
            runs.append(ended(proc))
            for c in clients:
                c.join(30)
    assert [code for code, _ in runs] == [0] * ROUNDS and not any(aborted(t) for _, t in runs), runs


SLOW_LOAD = r"""
import sys, time
sys.path.insert(0, {root!r})
from hf2q.api import command

real = command.runner_factory


def slow_factory(*args, **kw):
    build = real(*args, **kw)

    def load():  # a long load: MLX work in the engine thread, as a real load's reads and warm-up are
        import mlx.core as mx

        x = mx.random.normal((256, 256))
        until = time.monotonic() + {load_s}
        while time.monotonic() < until:
            mx.eval(x @ x)
        return build()
    return load


command.runner_factory = slow_factory
from hf2q.cli import main

sys.exit(main(sys.argv[1:]))
"""


def test_stopping_while_the_model_loads_exits_0(gemma4_gguf, tmp_path):
    """SIGTERM while the engine thread is still loading the model (which cannot be interrupted): the
    server leaves at once with status 0, without finalizing the interpreter under the load (nor waiting
    for the load to end: the bound is generous, a load-long wait is far above it)."""
    script = tmp_path / "slow_load.py"
    script.write_text(SLOW_LOAD.format(root=str(ROOT), load_s=SLOW_LOAD_S))
    proc, url = start(gemma4_gguf, script)
    signalled = None
    try:
        wait_for(url, proc, "/health")
        time.sleep(0.5)
        assert httpx.get(f"{url}/readyz", timeout=5).status_code == 503  # still loading
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
    finally:
        code, tail = ended(proc)
    took = time.monotonic() - signalled
    assert code == 0 and not aborted(tail), tail
    assert took < STOP_DURING_LOAD_S, f"the stop took {took:.0f} s, as if it waited for the load"
