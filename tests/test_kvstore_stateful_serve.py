"""A cached prefix of a hybrid (qwen35) and a DeepSeek-V4 model survives a server restart.

A real ``hf2q serve --kv-persist`` answers a prompt of two full blocks and more cold, and is
stopped with SIGTERM (which drains the writer); a second server on the same directory answers the
same request: it restores the two blocks — K/V or compressed entries, and the recurrent state or
compressor rows at the last block's end — and computes only the tail. Its greedy tokens and their
top log-probabilities are the cold server's (the logits after hydration are a cold prefill's).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest

from hf2q.kvstore import BLOCK_TOKENS
from hf2q.kvstore.blockfile import read_meta

pytestmark = pytest.mark.slow

TOL = 1e-5
BLOCKS = 2


def _ask(model: Path, kv_dir: Path, body: dict, *flags: str) -> tuple[dict, list[dict]]:
    """Start a server on ``kv_dir``, answer ``body``, SIGTERM; → (reply, its JSON log records)."""
    (reply,), records = serve_requests(model, kv_dir, body, 1, *flags)
    return reply, records


def serve_requests(model: Path, kv_dir: Path, body: dict, times: int, *flags: str) -> tuple[list[dict], list[dict]]:
    """A server on ``kv_dir`` (one slot, more ``flags``) answering ``body`` ``times`` times, then SIGTERM;
    → (replies, its JSON log records)."""
    from tests.test_server_command import start_server, wait_ready

    proc, url = start_server("--log-format", "json", "serve", "--model", str(model), "--port", "0", "--slots", "1",
                             "--ctx", "2048", "--kv-persist", str(kv_dir), *flags)
    try:
        wait_ready(url, proc, timeout=120)
        replies = []
        for _ in range(times):
            reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            replies.append(reply.json())
        proc.send_signal(signal.SIGTERM)
        rc, err = proc.wait(60), proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, err[-3000:]
    return replies, [json.loads(ln) for ln in err.splitlines() if ln.startswith("{")]


def _top_logprobs(reply: dict) -> list[dict[str, float]]:
    return [{t["token"]: t["logprob"] for t in step["top_logprobs"]} for step in reply["choices"][0]["logprobs"]["content"]]


def _gguf(family: str) -> Path:
    if family == "qwen35":
        from tests.models.qwen35_chat import qwen35_chat_gguf

        return qwen35_chat_gguf()
    from tests.models.deepseek4_chat import deepseek4_chat_gguf

    return deepseek4_chat_gguf()


@pytest.mark.parametrize("family,cache_kind", [("qwen35", "recurrent"), ("deepseek4", "deepseek4")])
def test_restarted_server_resumes_the_prefix_like_a_cold_prefill(family, cache_kind, tmp_path):
    check_restart_resumes(_gguf(family), tmp_path / "kv", cache_kind, n_words=210, tol=TOL)


def check_restart_resumes(model: Path, kv_dir: Path, cache_kind: str, n_words: int, tol: float,
                          *flags: str) -> None:
    """A cold server (more serve ``flags``) saves a prompt's two full blocks of ``cache_kind`` with their end
    states; a second server on ``kv_dir`` restores them and answers with the cold greedy tokens and top-5
    logprobs."""
    words = " ".join(f"w{(i * 7) % 89}" for i in range(n_words))
    body = {"temperature": 0, "max_tokens": 4, "logprobs": True, "top_logprobs": 5,
            "messages": [{"role": "user", "content": words}]}
    cold, log1 = _ask(model, kv_dir, body, *flags)
    assert not [r for r in log1 if "persistent KV store disabled" in str(r.get("msg"))], log1[-5:]
    n_prompt = cold["usage"]["prompt_tokens"]
    assert (n_prompt - 1) // BLOCK_TOKENS == BLOCKS, n_prompt  # two full blocks, the tail recomputed
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    stopped = [r for r in log1 if r.get("msg") == "kv persist: stopped"]
    assert len(stopped) == 1 and stopped[0]["blocks_written"] == BLOCKS, log1[-5:]
    metas = [read_meta(p) for p in sorted((kv_dir / "blocks").glob("*.safetensors"))]
    assert len(metas) == BLOCKS
    assert all(m.cache_kind == cache_kind and m.has_end_state for m in metas)  # each end's state, saved there

    warm, _ = _ask(model, kv_dir, body, *flags)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCKS * BLOCK_TOKENS
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    for j, (got, want) in enumerate(zip(_top_logprobs(warm), _top_logprobs(cold), strict=True)):
        assert got.keys() == want.keys(), j
        assert max(abs(got[t] - want[t]) for t in want) <= tol, (j, got, want)
