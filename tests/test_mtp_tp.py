"""``--speculative mtp`` over two tensor-parallel ranks on the CPU (the tiny Qwen 3.5 checkpoint with its head).

The head is split like the main blocks (its attention heads and FFN, each ending in an all-reduce;
``eh_proj`` and the norms replicated), so each rank's cache holds its share of the head's K/V layer and
the ranks run every draft step together. The reference is one rank on the same file: the same draft
tokens, and T=0 output identical to plain decoding.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.engine_support import random_tokens
from tests.models.mtp_runners import runner_cache
from tests.test_tp_multihost import ROOT

CTX = 256
DRIVER = r"""
import json, sys
sys.path.insert(0, {root!r})
from hf2q.engine import tp_launch
from hf2q.engine.generate import generate_once
from hf2q.sched.contracts import SamplingParams
path, out, prompt = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")]
runner = tp_launch.runner_factory(path, 2, {ctx})()
runner.enable_mtp()
seq = runner.new_sequence()
runner.prefill(seq, prompt)
draft = runner.draft(seq, 7, 3)
res = generate_once(runner, prompt, SamplingParams(max_tokens=12, temperature=0.0), ignore_eos=True, draft_tokens=3)
json.dump({{"draft": draft, "tokens": res["tokens"], "drafted": res["drafted_tokens"],
           "kv_bytes_per_token": runner.kv_bytes_per_token}}, open(out, "w"))
runner.close()
"""

_runner = runner_cache()


@pytest.mark.slow  # two ranks started in a subprocess (~40 s on a loaded 2-core machine)
def test_two_ranks_draft_and_decode_as_one_rank_does(tiny_checkpoint, tmp_path):
    from hf2q.engine.generate import generate_once
    from hf2q.sched.contracts import SamplingParams
    from tests.engine_support import convert_f32

    path = convert_f32(tiny_checkpoint("qwen35_parity_mtp"), tmp_path / "dense.gguf")
    prompt = random_tokens(12, seed=5)
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(root=str(ROOT), ctx=CTX))
    run = subprocess.run([sys.executable, str(script), str(path), str(tmp_path / "tp.json"), ",".join(map(str, prompt))],
                         cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    tp = json.loads((tmp_path / "tp.json").read_text())
    one = _runner(path, True)
    seq = one.new_sequence()
    one.prefill(seq, prompt)
    assert tp["draft"] == one.draft(seq, 7, 3)  # the split head drafts what the whole head drafts
    plain = generate_once(_runner(path, False), prompt, SamplingParams(max_tokens=12, temperature=0.0),
                          ignore_eos=True)
    assert tp["tokens"] == plain["tokens"] and tp["drafted"] > 0
    assert 2 * tp["kv_bytes_per_token"] == one.kv_bytes_per_token  # each rank holds half the KV heads, head's too
