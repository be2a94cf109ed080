"""DeepSeek-V4's compact cache persists at tensor parallel: every rank holds the same whole cache.

The cache's parts (the shared K=V head's windowed rows, the compressed entries, the compressor and indexer
state, the MTP head's window layer and the trunk streams it pairs with) are all computed from all-reduced
streams by replicated weights (``models/deepseek4_tp.py``), so a block is one rank's export and every rank
imports all of it. Two CPU ranks prefill a prompt of two blocks and more with block-end capture on, export the
blocks and import them into a fresh sequence, which continues like a cold sequence that prefilled the same text
in the same two transactions; the blocks are the ones a single process exports.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.test_tp_multihost import ROOT

pytestmark = pytest.mark.slow  # two ranks in a subprocess

TOL = 1e-5
BLOCKS = 2
CTX = 1024
DRIVER = r"""
import sys
import numpy as np
sys.path.insert(0, {root!r})
from hf2q.engine import tp_launch
from tests.test_kvstore_tp_deepseek4 import scenario
path, out, head = sys.argv[1], sys.argv[2], sys.argv[3]
runner = tp_launch.runner_factory(path, 2, {ctx})()
if head != "-":
    runner.enable_mtp(head)
np.savez(out, **scenario(runner))
runner.close()
"""


def scenario(runner) -> dict[str, np.ndarray]:
    """The hybrid models' TP scenario (restored beside cold) over V4's vocabulary, with the draft logits and
    every exported block."""
    from tests.test_kvstore_tp_hybrid import scenario as restored_beside_cold

    return restored_beside_cold(runner, vocab=(3, 49152), draft_logits=True, every_block=True)


def _run_ranks(path, head, tmp_path) -> dict[str, np.ndarray]:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(root=str(ROOT), ctx=CTX))
    out = tmp_path / "tp.npz"
    run = subprocess.run([sys.executable, str(script), str(path), str(out), str(head or "-")], cwd=ROOT,
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


def _close(got, want) -> float:
    if not np.size(want):  # (a layer whose ratio closes no entry inside a block)
        return 0.0
    return float(np.abs(got - want).max()) / max(1.0, float(np.abs(want).max()))


@pytest.mark.parametrize("mtp", [False, True], ids=["deepseek4", "deepseek4-mtp"])
def test_two_ranks_restore_the_whole_cache_like_a_cold_prefill(tmp_path, mtp):
    from hf2q.engine.runner import MlxModelRunner
    from tests.test_deepseek4_mtp import companion_gguf
    from tests.test_engine_deepseek4 import deepseek4_gguf

    path, head = deepseek4_gguf(), companion_gguf() if mtp else None
    tp = _run_ranks(path, head, tmp_path)
    assert bool(tp["persists"]) and str(tp["identity"]).endswith("-mtp-tp2" if mtp else "-tp2")
    assert str(tp["kind"]) == ("deepseek4-mtp" if mtp else "deepseek4")
    assert int(tp["ends_left"]) == 0
    for key in ("restored", "restored_step") + (("restored_draft_logits",) if mtp else ()):
        assert _close(tp[key], tp[key.replace("restored", "cold")]) <= TOL, key
    if mtp:
        np.testing.assert_array_equal(tp["restored_draft"], tp["cold_draft"])
    # the blocks are a single process's: every part once, whole (no rank's copy doubled, none cut)
    one = MlxModelRunner.load(path, ctx=CTX)
    if mtp:
        one.enable_mtp(head)
    want = scenario(one)
    blocks = {k for k in want if k.startswith("block")}
    assert {k for k in tp if k.startswith("block")} == blocks
    for name in blocks:
        assert tp[name].shape == want[name].shape, name
        assert _close(tp[name], want[name]) <= TOL, name


@pytest.mark.parametrize("mtp", [False, True], ids=["deepseek4", "deepseek4-mtp"])
def test_restarted_two_rank_server_resumes_the_prefix(tmp_path, mtp):
    """``serve --tensor-parallel 2 --kv-persist`` (with the head: ``--speculative mtp --model-draft``): a restarted
    group restores the prompt's two blocks and answers with the cold group's greedy tokens and top-5
    log-probabilities."""
    from tests.models.deepseek4_chat import deepseek4_chat_gguf
    from tests.test_deepseek4_mtp import companion_gguf
    from tests.test_kvstore_stateful_serve import check_restart_resumes

    flags = ("--tensor-parallel", "2") + (("--speculative", "mtp", "--model-draft", str(companion_gguf())) if mtp
                                          else ())
    from tests.test_kvstore_stateful_engine import SPLIT_TOL

    # the restored answer's prompt ran as a restored prefix plus a recomputed tail, the cold one in one piece: the
    # split's rounding (1.05e-5 was seen on a fresh machine), as in the one-process restore tests
    check_restart_resumes(deepseek4_chat_gguf(), tmp_path / "kv", "deepseek4-mtp" if mtp else "deepseek4", 210,
                          SPLIT_TOL["deepseek4"], *flags)
