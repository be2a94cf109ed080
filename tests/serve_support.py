"""A real ``hf2q serve`` process with a chat model and an embedding model, for HTTP tests."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx

from hf2q.engine.tp_launch import free_ports


@contextlib.contextmanager
def hf2q_server(args: list[str], log_dir: Path, ready=lambda url: True):
    """Yield the base URL of ``hf2q serve ARGS`` (port chosen here) once ``/readyz`` and ``ready(url)`` say so."""
    port = free_ports(1)[0]
    log = (log_dir / "serve.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "hf2q", "serve", *args, "--port", str(port),
                             "--operator-ui", "plain"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, "hf2q serve exited before it was ready"
            assert time.monotonic() < deadline, "hf2q serve not ready after 300 s"
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200 and ready(url):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        stop_server(proc)
        log.close()


def stop_server(proc: subprocess.Popen) -> None:
    """A clean drain first (SIGTERM); SIGKILL only if it takes over 30 s."""
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def chat_and_embedding_server(chat: Path, embedding: Path, log_dir: Path):
    """Yield the base URL of ``hf2q serve --model CHAT --embedding-model EMBEDDING`` once both answer."""
    def embeds(url: str) -> bool:
        return httpx.post(url + "/v1/embeddings", json={"input": "x"}, timeout=30).status_code == 200

    with hf2q_server(["--model", str(chat), "--embedding-model", str(embedding), "--slots", "1", "--ctx", "2048"],
                     log_dir, embeds) as url:
        yield url
