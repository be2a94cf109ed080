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

from hf2q.kvstore import BLOCK_TOKENS as B
from tests.engine_support import random_tokens
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
    """Blocks exported after a request, restored into a fresh sequence; a cold sequence beside it."""
    from tests.test_kvstore_stateful_engine import serve_and_export

    prompt = random_tokens(BLOCKS * B + 20, low=3, high=49152, seed=11)
    tail = random_tokens(30, low=3, high=49152, seed=12)
    seq, blocks = serve_and_export(runner, prompt, BLOCKS, 2)
    seq.forget_block_ends(())
    restored = runner.new_sequence()
    restored.keep_block_ends(B)
    for block in blocks:
        runner.import_kv(restored, block, B)
    cold = runner.new_sequence()
    runner.prefill(cold, prompt[:BLOCKS * B])
    out = {"restored": runner.prefill(restored, tail), "cold": runner.prefill(cold, tail),
           "ends_left": np.asarray(len(seq.block_ends)), "kind": np.asarray(restored.persist_kind),
           "persists": np.asarray(runner.persists_kv), "identity": np.asarray(runner.kv_identity)}
    pending = int(np.argmax(out["cold"]))
    if runner.drafts:
        out["restored_draft"], out["restored_draft_logits"] = runner.draft_logits(restored, pending, 3)
        out["cold_draft"], out["cold_draft_logits"] = runner.draft_logits(cold, pending, 3)
    out["restored_step"] = runner.decode([restored], [pending])[0]
    out["cold_step"] = runner.decode([cold], [pending])[0]
    for i, block in enumerate(blocks):
        for name, a in block.items():
            out[f"block{i}:{name}"] = a
    return out


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
    from hf2q.kvstore.blockfile import read_meta
    from tests.models.deepseek4_chat import deepseek4_chat_gguf
    from tests.test_deepseek4_mtp import companion_gguf
    from tests.test_kvstore_stateful_serve import _top_logprobs, serve_requests

    model, kv_dir = deepseek4_chat_gguf(), tmp_path / "kv"
    flags = ("--tensor-parallel", "2") + (("--speculative", "mtp", "--model-draft", str(companion_gguf())) if mtp
                                          else ())
    words = " ".join(f"w{(i * 7) % 89}" for i in range(210))
    body = {"temperature": 0, "max_tokens": 4, "logprobs": True, "top_logprobs": 5,
            "messages": [{"role": "user", "content": words}]}
    (cold,), log = serve_requests(model, kv_dir, body, 1, *flags)
    assert not [r for r in log if "persistent KV store disabled" in str(r.get("msg"))], log[-5:]
    metas = [read_meta(p) for p in sorted((kv_dir / "blocks").glob("*.safetensors"))]
    kind = "deepseek4-mtp" if mtp else "deepseek4"
    assert len(metas) == BLOCKS and all(m.cache_kind == kind and m.has_end_state for m in metas)
    (warm,), _ = serve_requests(model, kv_dir, body, 1, *flags)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCKS * B
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    for j, (got, want) in enumerate(zip(_top_logprobs(warm), _top_logprobs(cold), strict=True)):
        assert got.keys() == want.keys(), j
        assert max(abs(got[t] - want[t]) for t in want) <= TOL, (j, got, want)
