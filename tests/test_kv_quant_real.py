"""The 8-bit KV cache on the real SmolLM2-135M: its predictions over shipped text against the same
model's f16 cache, and a real ``hf2q serve --kv-cache-type q8`` answering over HTTP while ``info``
and ``/metrics`` count the smaller bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.serve_support import hf2q_server

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_q8_rotated_cache_keeps_smollm2_predictions(smollm2_gguf):
    """One 384-token window of the calibration text, the second half scored: the rotated 8-bit cache
    puts the same token on top nearly everywhere and moves the distribution by little (KL)."""
    from hf2q.engine.factory import load_runner
    from hf2q.quality.corpus import load_corpus
    from hf2q.quality.kv_scores import kv_type_scores, runners_by_kv_type
    from hf2q.text.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_gguf(smollm2_gguf)
    ids = tok.encode(load_corpus("calibration").text, add_special=False)[:768]
    runners = runners_by_kv_type(load_runner(smollm2_gguf, ctx=384), ["f16", "q8-rotated"])
    got = kv_type_scores(runners, ids, 384, bos_id=tok.bos_id, chunks=1)["q8-rotated"]
    assert got["tokens"] == 191
    assert got["same_top"] >= 0.95, got
    assert got["kld_mean"] < 0.01 and got["kld_max"] < 0.5, got


def _metric(text: str, name: str) -> float:
    return next(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + " "))


@pytest.mark.slow
def test_serve_with_q8_cache_answers_and_counts_the_smaller_bytes(smollm2_gguf, tmp_path):
    from hf2q.engine.device_probe import probe
    from hf2q.engine.memory_plan import token_bytes
    from hf2q.formats.gguf_file import open_gguf

    hp = open_gguf(smollm2_gguf).hparams
    elem = probe().activation_bytes()
    per_token = token_bytes(hp, elem, "q8")
    assert token_bytes(hp, 2, "q8") * 1.9 <= token_bytes(hp, 2, "f16")  # the goal, on a 16-bit (GPU) engine

    info = subprocess.run([sys.executable, "-m", "hf2q", "info", str(smollm2_gguf), "--json", "--kv-cache-type",
                           "q8", "--ctx", "1024"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["kv_bytes_per_token"] == per_token

    args = ["--model", str(smollm2_gguf), "--slots", "2", "--ctx", "1024", "--kv-cache-type", "q8"]
    with hf2q_server(args, tmp_path) as url:
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert "Paris" in body["choices"][0]["message"]["content"]
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert _metric(metrics, "hf2q_kv_budget_bytes") == 2 * 1024 * per_token  # admission's budget
        resident = _metric(metrics, "hf2q_kv_bytes_resident")
        assert resident > 0 and resident % per_token == 0
