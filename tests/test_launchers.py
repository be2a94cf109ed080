"""``launchers/serve_agent.py``: refuses what cannot work, then starts a server an agent can use.

Fast: a missing model (exit 3) and a busy port (exit 1) are refused with one clear line
before anything starts. Slow: the launcher starts a real ``hf2q serve`` on the default
model, prints OpenCode's provider JSON, and that JSON alone (base URL + key + model id)
is enough for the official ``openai`` client to chat; SIGTERM stops both.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launchers" / "serve_agent.py"


def launch(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LAUNCHER), *args], check=False, capture_output=True, text=True, timeout=60, **kw)


def test_missing_model_is_refused(tmp_path):
    r = launch("--model", str(tmp_path / "absent.gguf"), "--port", "0")
    assert r.returncode == 3
    assert r.stdout == ""
    assert r.stderr.strip() == f"serve_agent: error: model not found: {tmp_path / 'absent.gguf'}"


def test_busy_port_is_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = launch("--port", str(port))
    assert r.returncode == 1 and r.stdout == ""
    assert f"port {port} on 127.0.0.1 is busy" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_opencode_config_shape():
    sys.path.insert(0, str(LAUNCHER.parent))
    try:
        from serve_agent import opencode_config
    finally:
        sys.path.pop(0)
    cfg = opencode_config("http://127.0.0.1:9000/v1", "k", "m1", 8192)
    prov = cfg["provider"]["hf2q"]
    assert prov["npm"] == "@ai-sdk/openai-compatible"
    assert prov["options"] == {"baseURL": "http://127.0.0.1:9000/v1", "apiKey": "k"}
    assert prov["models"]["m1"]["limit"]["context"] == 8192
    assert cfg["model"] == "hf2q/m1"
    json.dumps(cfg)  # serialisable as the config file


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def launched(args: list[str], **kw):
    """A launcher process; SIGTERM at the end must stop it (and its server) cleanly."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    try:
        yield proc
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        assert code == 0, f"exit {code}; stderr tail: {proc.stderr.read()[-3000:]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def printed_config(proc: subprocess.Popen) -> dict:
    """The config a launcher prints: its whole stdout, once the server is ready."""
    text = ""
    while True:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        text += line
        if line.rstrip() == "}":
            return json.loads(text)


@pytest.mark.slow
def test_launcher_starts_server_and_config_works(tmp_path):
    import openai

    port = _free_port()
    out_file = tmp_path / "opencode.json"
    with launched([sys.executable, str(LAUNCHER), "--port", str(port), "--slots", "2", "--ctx", "2048",
                   "--config-out", str(out_file)]) as proc:
        cfg = printed_config(proc)
        assert json.loads(out_file.read_text()) == cfg
        assert oct(out_file.stat().st_mode & 0o777) == "0o600"
        prov = cfg["provider"]["hf2q"]
        model_id = cfg["model"].split("/", 1)[1]
        assert prov["models"][model_id]["limit"]["context"] == 2048
        client = openai.OpenAI(base_url=prov["options"]["baseURL"], api_key=prov["options"]["apiKey"],
                               max_retries=0)
        r = client.chat.completions.create(model=model_id, max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "Say hi"}])
        assert r.choices[0].finish_reason in ("stop", "length")
        bad = openai.OpenAI(base_url=prov["options"]["baseURL"], api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


# ---- the per-family launchers: qwen36-opencode.sh, gemma4-opencode.sh, deepseek4-opencode.sh ------------


def _qwen35_gguf():
    from tests.models.qwen35_chat import qwen35_chat_gguf

    return qwen35_chat_gguf()


def _gemma4_gguf():
    from tests.models.gemma4_chat import gemma4_chat_gguf

    return gemma4_chat_gguf()


def _deepseek4_gguf():
    from tests.models.deepseek4_chat import deepseek4_chat_gguf

    return deepseek4_chat_gguf()


@attrs.frozen
class Family:
    script: str
    port: int
    arches: str  # the --model line's words
    named: str  # how the refusal names the family
    gguf: object  # () -> Path of a tiny GGUF of the family
    other: object  # () -> Path of another family's GGUF (also refused)
    context_env: bool = False  # the per-slot context comes from CONTEXT_LEN


FAMILIES = {
    "qwen36": Family("qwen36-opencode", 8081, "a qwen35 or qwen35moe GGUF", "Qwen 3.5 / 3.6 (qwen35, qwen35moe)",
                     _qwen35_gguf, _gemma4_gguf),
    "gemma4": Family("gemma4-opencode", 8082, "a gemma4 GGUF", "Gemma 4 (gemma4)", _gemma4_gguf, _qwen35_gguf),
    "deepseek4": Family("deepseek4-opencode", 8080, "a deepseek4 GGUF", "DeepSeek-V4 (deepseek4)", _deepseek4_gguf,
                        _gemma4_gguf, context_env=True),
}


def family_launcher(f: Family, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF2Q_PYTHON": sys.executable}
    return subprocess.run(["bash", str(ROOT / "launchers" / f"{f.script}.sh"), *args], check=False,
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("name", FAMILIES)
def test_family_launcher_needs_a_model_of_its_family(name, smollm2_gguf, tmp_path):
    f = FAMILIES[name]
    r = family_launcher(f)
    assert (r.returncode, r.stdout) == (2, "") and f"--model PATH.gguf is required ({f.arches})" in r.stderr
    r = family_launcher(f, "--model", str(smollm2_gguf))
    assert (r.returncode, r.stdout) == (3, "")
    assert r.stderr.strip() == f"{f.script}: error: {smollm2_gguf} is a 'llama' GGUF, not {f.named}"
    assert family_launcher(f, "--model", str(f.other())).returncode == 3  # another family's launcher file
    r = family_launcher(f, "--model", str(tmp_path / "absent.gguf"))
    assert r.returncode == 3 and r.stderr.strip() == f"serve_agent: error: model not found: {tmp_path / 'absent.gguf'}"


@pytest.mark.parametrize("name", FAMILIES)
def test_family_launcher_defaults_to_its_port(name):
    f = FAMILIES[name]
    with socket.socket() as s:  # the port busy, by us or by someone else: the launcher must say so
        try:
            s.bind(("127.0.0.1", f.port))
            s.listen()
        except OSError:
            pass
        r = family_launcher(f, "--model", str(f.gguf()))
    assert r.returncode == 1 and r.stdout == ""
    assert f"port {f.port} on 127.0.0.1 is busy" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_family_launcher_serves_four_slots_and_forced_tool_calls(name):
    import openai

    f = FAMILIES[name]
    port = _free_port()
    ctx = ([], {"CONTEXT_LEN": "2048"}) if f.context_env else (["--ctx", "2048"], {})
    with launched(["bash", str(ROOT / "launchers" / f"{f.script}.sh"), "--model", str(f.gguf()), "--port", str(port),
                   *ctx[0]], env={**os.environ, "HF2Q_PYTHON": sys.executable, **ctx[1]}) as proc:
        cfg = printed_config(proc)
        prov = cfg["provider"]["hf2q"]
        assert prov["npm"] == "@ai-sdk/openai-compatible"
        assert prov["options"]["baseURL"] == f"http://127.0.0.1:{port}/v1"
        model_id = cfg["model"].split("/", 1)[1]
        assert prov["models"][model_id]["tool_call"] is True
        assert prov["models"][model_id]["limit"]["context"] == 2048
        client = openai.OpenAI(base_url=prov["options"]["baseURL"], api_key=prov["options"]["apiKey"], max_retries=0)
        tools = [{"type": "function", "function": {"name": "read_file", "parameters": {
            "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
        # one call: random weights would go on writing parallel calls until max_tokens
        r = client.chat.completions.create(model=model_id, max_tokens=128, temperature=0, tools=tools,
                                           tool_choice="required", parallel_tool_calls=False,
                                           messages=[{"role": "user", "content": "Open a.py"}])
        assert r.choices[0].finish_reason == "tool_calls"
        assert isinstance(json.loads(r.choices[0].message.tool_calls[0].function.arguments)["path"], str)
        import urllib.request
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Authorization": f"Bearer {prov['options']['apiKey']}"})
        assert "hf2q_slots_total 4.0" in urllib.request.urlopen(req, timeout=10).read().decode()
