"""The 8-bit KV cache under tensor parallelism (``serve --tensor-parallel 2 --kv-cache-type q8-rotated``):
each rank's cache holds its own KV heads as codes and scales, and the group gives what one rank on the
same 8-bit cache gives — the same greedy tokens, logits up to the all-reduce's summation order — for
every call the runtime makes (``tests/test_tensor_parallel.py``'s scenario: chunked prefill, batched
decode, trim and re-prefill, KV export and import). Ring backend, ranks on 127.0.0.1, the tiny qwen3
(2 KV heads × 32: the tiny llama's 16-wide heads are below the codec's 32-value groups)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.test_tensor_parallel import CTX, GROUP_TIMEOUT_S, ROOT, assert_same_run, scenario, tiny_gguf  # noqa: F401

DRIVER = r"""
import json, os, sys
import numpy as np
sys.path.insert(0, {root!r})
from tests.test_tensor_parallel import scenario
from hf2q.engine import tp_launch
path, outdir, prompt, kv_type = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
runner = tp_launch.runner_factory(path, 2, {ctx}, kv_cache_type=kv_type)()
np.savez(os.path.join(outdir, "result.npz"), **scenario(runner, prompt))
json.dump({{"kv_bytes_per_token": runner.kv_bytes_per_token, "kv_identity": runner.kv_identity,
           "kv_cache_type": runner.kv_cache_type}}, open(os.path.join(outdir, "info.json"), "w"))
runner.close()
"""


@pytest.mark.slow  # two ranks start on a busy 2-core machine
def test_two_ranks_on_q8_rotated_match_one_rank(tiny_gguf, tmp_path):
    from hf2q.engine.runner import MlxModelRunner

    path = tiny_gguf("qwen3", "f32")
    prompt = [1, 504, 3094, 1210, 282, 253, 3467, 30, 1205, 314]
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(root=str(ROOT), ctx=CTX))
    proc = subprocess.run([sys.executable, str(script), str(path), str(tmp_path), json.dumps(prompt), "q8-rotated"],
                          check=False, cwd=ROOT, capture_output=True, text=True, timeout=GROUP_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads((tmp_path / "info.json").read_text())
    with np.load(tmp_path / "result.npz") as z:
        tp = {k: z[k] for k in z.files}
    one = MlxModelRunner.load(path, ctx=CTX, kv_cache_type="q8-rotated")
    assert_same_run(tp, scenario(one, prompt), rtol=1e-4)
    # each rank holds half the KV heads, at the 8-bit cache's bytes; its blocks are their own kind
    assert info["kv_bytes_per_token"] * 2 == one.kv_bytes_per_token
    assert info["kv_cache_type"] == "q8-rotated" and info["kv_identity"] == one.kv_identity + "-tp2"


def test_serve_accepts_q8_with_tensor_parallel(tiny_gguf):
    """The start-up check no longer refuses the pair (it still refuses a head size the codec cannot hold)."""
    from types import SimpleNamespace

    from hf2q.api.command import check_kv_cache_type
    from hf2q.formats.gguf_file import open_gguf

    header = open_gguf(tiny_gguf("qwen3", "f32"))
    check_kv_cache_type(header, SimpleNamespace(kv_cache_type="q8", tensor_parallel=2))
