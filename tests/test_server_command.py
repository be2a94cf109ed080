"""``hf2q serve`` as a user runs it: a subprocess, real sockets, real signals.

Fast checks need no engine: a missing or non-GGUF model exits 3 and a busy port exits 1,
each with one ``hf2q: error:`` line and no traceback, before any model loads. The slow
check starts the real server on the built-in default model (SmolLM2), waits for
``/readyz``, chats through the ``openai`` SDK, checks the JSON operator log never carries
prompt text, then stops it with SIGTERM (graceful drain, exit 0).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def hf2q(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf2q", *args], check=False, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("hf2q: error: ") and "Traceback" not in stderr
    return lines[0]


def test_missing_model_exits_3(tmp_path):
    r = hf2q("serve", "--model", str(tmp_path / "nope.gguf"), "--port", "0")
    assert r.returncode == 3
    assert "not found" in one_error_line(r.stderr)


def test_non_gguf_model_exits_3(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    r = hf2q("serve", "--model", str(bad), "--port", "0")
    assert r.returncode == 3
    assert "not a GGUF" in one_error_line(r.stderr)


def test_busy_port_exits_1(smollm2_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = hf2q("serve", "--model", str(smollm2_path), "--port", str(port))
    assert r.returncode == 1
    line = one_error_line(r.stderr)
    assert str(port) in line and "busy" in line


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    from hf2q.fetch import SMOLLM2, fetch

    return fetch(SMOLLM2)


def start_server(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "hf2q", *args], stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, **(env or {})))
    deadline = time.monotonic() + 120
    url = None
    lines = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"(http://127\.0\.0\.1:\d+)", line)
        if m:
            url = m.group(1)
            break
    assert url, "".join(lines)
    return proc, url


def wait_ready(url: str, proc: subprocess.Popen, headers=None, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        r = httpx.get(url + "/readyz", headers=headers)
        if r.status_code == 200:
            return
        assert r.status_code == 503 and r.json()["ready"] is False
        time.sleep(0.5)
    raise AssertionError("server not ready")


@pytest.mark.slow
def test_serve_default_model_chat_then_sigterm_drains(tmp_path):
    secret_marker = "ZEBRA-SECRET-PROMPT-TEXT"
    proc, url = start_server("--log-format", "json", "serve", "--port", "0", "--slots", "2", "--ctx", "2048",
                             env={"HF2Q_API_KEY": "k-123"})
    auth = {"Authorization": "Bearer k-123"}
    try:
        assert httpx.get(url + "/v1/models").status_code == 401  # the key from the environment is enforced
        assert httpx.get(url + "/health").status_code == 200  # probes answer without it
        wait_ready(url, proc, auth)
        import openai

        client = openai.OpenAI(base_url=url + "/v1", api_key="k-123", max_retries=0)
        models = client.models.list()
        assert models.data[0].id == "SmolLM2-135M-Instruct.Q4_1"
        out = client.chat.completions.create(
            model=models.data[0].id, temperature=0, max_tokens=12,
            messages=[{"role": "user", "content": f"What is the capital of France? {secret_marker}"}])
        assert out.choices[0].message.content.strip()
        assert out.usage.completion_tokens <= 12
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, err
    assert secret_marker not in err
    records = [json.loads(ln) for ln in err.splitlines() if ln.startswith("{")]
    assert any(r.get("msg") == "finished" and r.get("completion_tokens") for r in records), err
    assert any(r.get("msg") == "draining" for r in records), err


def test_tensor_parallel_that_cannot_split_exits_3(smollm2_path):
    r = hf2q("serve", "--model", str(smollm2_path), "--port", "0", "--tensor-parallel", "2")
    assert r.returncode == 3
    assert "--tensor-parallel" in one_error_line(r.stderr)


_PREFLIGHT = """
import json, sys
from hf2q.api.command import preflight
from hf2q.cli import build_parser
from hf2q.errors import InputError

args = build_parser().parse_args(["serve", *sys.argv[1:]])
try:
    preflight(args)
    outcome = "passed"
except InputError as e:
    outcome = "refused: " + str(e)
print(json.dumps({"outcome": outcome, "mlx": sorted(m for m in sys.modules if m == "mlx" or m.startswith("mlx."))}))
"""


@pytest.mark.parametrize("extra, outcome", [
    ((), "passed"),
    (("--memory-limit", "64K"), "refused"),
    (("--tensor-parallel", "2"), "refused"),
], ids=["fits", "over-the-memory-limit", "cannot-split"])
def test_serve_preflight_never_imports_mlx(smollm2_path, extra, outcome):
    """The start-up checks run in the main thread, which never imports MLX (only the engine thread does)."""
    r = subprocess.run([sys.executable, "-c", _PREFLIGHT, "--model", str(smollm2_path), "--port", "0", *extra],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["outcome"].startswith(outcome), got
    assert got["mlx"] == []


@pytest.mark.parametrize("flag, value, says", [
    ("--gpu-deadline", "-1", "positive"),
    ("--gpu-deadline", "nan", "positive"),
    ("--max-request-bytes", "-1", "positive"),
    ("--queue-capacity", "-1", "negative"),
    ("--kv-cache-budget", "0", "positive"),
])
def test_invalid_serve_values_exit_2_before_starting(tmp_path, flag, value, says):
    r = hf2q("serve", "--model", str(tmp_path / "never-read.gguf"), "--port", "0", flag, value)
    assert r.returncode == 2
    line = one_error_line(r.stderr)
    assert flag in line and says in line, line


def test_kv_budget_smaller_than_one_request_exits_2(smollm2_path):
    r = hf2q("serve", "--model", str(smollm2_path), "--port", "0", "--kv-cache-budget", "1")
    assert r.returncode == 2
    line = one_error_line(r.stderr)
    assert "--kv-cache-budget" in line and "too small" in line and "bytes" in line, line


def _header_only_gguf(path: Path, arch: str) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_embedding_model_as_model_exits_3(tmp_path):
    bert = _header_only_gguf(tmp_path / "encoder.gguf", "bert")
    r = hf2q("serve", "--model", str(bert), "--port", "0")
    assert r.returncode == 3
    line = one_error_line(r.stderr)
    assert "--model" in line and "embedding model" in line, line


def test_chat_model_as_embedding_model_exits_3(smollm2_path):
    r = hf2q("serve", "--model", str(smollm2_path), "--embedding-model", str(smollm2_path), "--port", "0")
    assert r.returncode == 3
    line = one_error_line(r.stderr)
    assert "--embedding-model" in line and "not an embedding model" in line, line
