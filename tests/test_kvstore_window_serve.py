"""A cached prefix of a sliding-window model (the tiny Gemma 4, 16-token window) survives a server restart.

A real ``hf2q serve --kv-persist`` answers a prompt of two full blocks and more cold, and is stopped with
SIGTERM (which drains the writer); its blocks carry the full-attention layers' K/V and, at each block end,
the window layers' last rows (``cache_kind`` ``window``). A second server on the same directory answers the
same request: it restores the two blocks and computes only the tail, and its greedy tokens and their top
log-probabilities are the cold server's.
"""

from __future__ import annotations

import pytest

from tests.test_kvstore_stateful_serve import check_restart_resumes

pytestmark = pytest.mark.slow

#: log-probabilities, restored against cold: the logits differ by the rounding of attention over a shorter
#: kept window buffer (tests/test_kvstore_window_engine.py) and, on the CPU, by the restored run's short tail
#: going through the host decode step's rows where the cold prompt's one chunk ran the MLX graph (3.7e-5 seen)
TOL = 1e-4


def test_restarted_server_resumes_a_windowed_prefix_like_a_cold_prefill(tmp_path):
    from tests.models.gemma4_chat import gemma4_chat_gguf

    check_restart_resumes(gemma4_chat_gguf(), tmp_path / "kv", "window", n_words=200, tol=TOL)
