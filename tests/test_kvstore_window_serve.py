"""A cached prefix of a sliding-window model (the tiny Gemma 4, 16-token window) survives a server restart.

A real ``hf2q serve --kv-persist`` answers a prompt of two full blocks and more cold, and is stopped with
SIGTERM (which drains the writer); its blocks carry the full-attention layers' K/V and, at each block end,
the window layers' last rows. A second server on the same directory answers the same request: it restores
the two blocks and computes only the tail, and its greedy tokens and their top log-probabilities are the
cold server's.
"""

from __future__ import annotations

import pytest

from hf2q.kvstore import BLOCK_TOKENS
from hf2q.kvstore.blockfile import read_meta
from tests.test_kvstore_stateful_serve import _ask, _top_logprobs

pytestmark = pytest.mark.slow

#: log-probabilities, restored against cold: the logits differ by the rounding of attention over a shorter
#: kept window buffer (tests/test_kvstore_window_engine.py)
TOL = 2e-5
BLOCKS = 2


def test_restarted_server_resumes_a_windowed_prefix_like_a_cold_prefill(tmp_path):
    from tests.models.gemma4_chat import gemma4_chat_gguf

    words = " ".join(f"w{(i * 7) % 89}" for i in range(200))
    body = {"temperature": 0, "max_tokens": 4, "logprobs": True, "top_logprobs": 5,
            "messages": [{"role": "user", "content": words}]}
    model = gemma4_chat_gguf()
    cold, log1 = _ask(model, tmp_path / "kv", body)
    assert not [r for r in log1 if "persistent KV store disabled" in r.get("msg", "")]
    n_prompt = cold["usage"]["prompt_tokens"]
    assert (n_prompt - 1) // BLOCK_TOKENS == BLOCKS, n_prompt  # two full blocks, the tail recomputed
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    stopped = [r for r in log1 if r.get("msg") == "kv persist: stopped"]
    assert len(stopped) == 1 and stopped[0]["blocks_written"] == BLOCKS, log1[-5:]
    metas = [read_meta(p) for p in sorted((tmp_path / "kv" / "blocks").glob("*.safetensors"))]
    assert len(metas) == BLOCKS
    assert all(m.cache_kind == "window" and m.has_end_state for m in metas)  # each end's window rows

    warm, _ = _ask(model, tmp_path / "kv", body)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCKS * BLOCK_TOKENS
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    for j, (got, want) in enumerate(zip(_top_logprobs(warm), _top_logprobs(cold), strict=True)):
        assert got.keys() == want.keys(), j
        assert max(abs(got[t] - want[t]) for t in want) <= TOL, (j, got, want)
