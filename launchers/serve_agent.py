#!/usr/bin/env python3
"""Start an hf2q server for an agentic coding client and print the client's configuration.

    python launchers/serve_agent.py                       # default model, 127.0.0.1:8080, 4 slots
    python launchers/serve_agent.py --model m.gguf --port 9000 --slots 2 --api-key KEY
    python launchers/serve_agent.py --config-out opencode.json   # also write the file

It refuses a busy port and a missing model before starting anything (exit 1 / 3, one
line), starts ``hf2q serve`` (the key travels in ``HF2Q_API_KEY``, never on the command
line, so ``ps`` does not show it), waits until ``/readyz`` says ready, prints OpenCode's
provider JSON on stdout, then stays in the foreground until the server exits. Ctrl-C or
SIGTERM is passed on to the server, which drains gracefully. With no ``--api-key`` a
random key is generated: a local server still should not be open to every local process.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NoReturn

EXIT_FAILURE, EXIT_INPUT = 1, 3


def fail(message: str, code: int) -> NoReturn:
    print(f"serve_agent: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def port_busy(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            fail(f"cannot bind {host}:{port}: {e.strerror}", EXIT_FAILURE)
    return False


def opencode_config(base_url: str, api_key: str, model_id: str, context: int | None, provider: str = "hf2q") -> dict:
    """OpenCode's custom-provider block for an OpenAI-compatible endpoint."""
    model: dict = {"name": f"{model_id} (hf2q)", "tool_call": True}
    if context:
        model["limit"] = {"context": context, "output": min(8192, max(256, context // 4))}
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {provider: {"npm": "@ai-sdk/openai-compatible", "name": "hf2q (local)",
                                "options": {"baseURL": base_url, "apiKey": api_key},
                                "models": {model_id: model}}},
        "model": f"{provider}/{model_id}",
    }


def _get(url: str, key: str, timeout: float = 2.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}


def wait_ready(proc: subprocess.Popen, base: str, key: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            fail(f"the server exited with code {proc.returncode} before it was ready", proc.returncode or 1)
        try:
            status, _ = _get(base + "/readyz", key)
            if status == 200:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.25)
    proc.terminate()
    fail(f"the server was not ready after {timeout:.0f} s", EXIT_FAILURE)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--client", choices=["opencode"], default="opencode")
    p.add_argument("--model", help="GGUF path (default: hf2q's built-in default model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--ctx", type=int, default=None, help="per-slot context (default: from the GGUF)")
    p.add_argument("--api-key", default=os.environ.get("HF2Q_API_KEY"), help="default: a fresh random key")
    p.add_argument("--config-out", help="also write the client configuration to this file")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--python", default=sys.executable, help="interpreter that has hf2q installed")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="extra `hf2q serve` flags after --")
    args = p.parse_args(argv)

    if args.model and not Path(args.model).expanduser().is_file():
        fail(f"model not found: {args.model}", EXIT_INPUT)
    if args.slots < 1:
        fail("--slots must be at least 1", EXIT_INPUT)
    if port_busy(args.host, args.port):
        fail(f"port {args.port} on {args.host} is busy; choose another with --port", EXIT_FAILURE)

    key = args.api_key or secrets.token_urlsafe(24)
    cmd = [args.python, "-m", "hf2q", "serve", "--host", args.host, "--port", str(args.port),
           "--slots", str(args.slots), "--operator-ui", "plain"]
    if args.model:
        cmd += ["--model", str(Path(args.model).expanduser())]
    if args.ctx:
        cmd += ["--ctx", str(args.ctx)]
    extra = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    cmd += extra
    env = dict(os.environ, HF2Q_API_KEY=key)
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)

    host = f"[{args.host}]" if ":" in args.host else args.host
    base = f"http://{host}:{args.port}"
    wait_ready(proc, base, key, args.ready_timeout)
    _, models = _get(base + "/v1/models", key)
    card = (models.get("data") or [{}])[0]
    model_id = card.get("id", "default")
    config = opencode_config(base + "/v1", key, model_id, card.get("max_model_len"))
    text = json.dumps(config, indent=2)
    if args.config_out:
        out = Path(args.config_out).expanduser()
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text + "\n")
        os.chmod(tmp, 0o600)  # it holds the API key
        os.replace(tmp, out)
    print(text, flush=True)
    print(f"serve_agent: {model_id} ready at {base}/v1 ({args.slots} slots); Ctrl-C stops the server",
          file=sys.stderr, flush=True)
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            continue


if __name__ == "__main__":
    raise SystemExit(main())
