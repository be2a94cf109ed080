"""A hybrid (qwen35) model's blocks persist at tensor parallel: each rank's share of the DeltaNet state.

Two CPU ranks (as tests/test_tp_hybrid.py starts them) prefill a prompt of two blocks and more with
block-end capture on, export the two blocks (K/V gathered by head, every rank's conv and delta-rule share
side by side) and import them into a fresh sequence, which continues exactly like a cold sequence that
prefilled the same text in the same two transactions, at T=0 and within 1e-5 in the logits. With the MTP
head on, the blocks also carry the head's K/V layer and input row, and the restored sequence drafts as the
cold one does.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hf2q.engine.kv_layout import HIDDEN_STATE
from hf2q.kvstore import BLOCK_TOKENS as B
from tests.engine_support import random_tokens
from tests.test_tp_multihost import ROOT

pytestmark = pytest.mark.slow  # two ranks in a subprocess, about 1,100 tokens prefilled (~40 s loaded)

TOL = 1e-5
BLOCKS = 2
DRIVER = r"""
import sys
import numpy as np
sys.path.insert(0, {root!r})
from hf2q.engine import tp_launch
from tests.test_kvstore_tp_hybrid import scenario
path, out, mtp = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
runner = tp_launch.runner_factory(path, 2, 1024)()
if mtp:
    runner.enable_mtp()
np.savez(out, **scenario(runner))
runner.close()
"""


def scenario(runner, vocab: tuple[int, int] = (5, 1000), draft_logits: bool = False,
             every_block: bool = False) -> dict[str, np.ndarray]:
    """Blocks exported after a request, restored into a fresh sequence; a cold sequence beside it. ``vocab``:
    the token ids' range; ``draft_logits``: the head's logits beside its drafts; ``every_block``: the exported
    blocks' arrays too (DeepSeek-V4's TP test reuses this scenario)."""
    from tests.test_kvstore_stateful_engine import serve_and_export

    low, high = vocab
    prompt = random_tokens(BLOCKS * B + 20, low=low, high=high, seed=11)
    tail = random_tokens(30, low=low, high=high, seed=12)
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
    if runner.drafts and draft_logits:
        out["restored_draft"], out["restored_draft_logits"] = runner.draft_logits(restored, pending, 3)
        out["cold_draft"], out["cold_draft_logits"] = runner.draft_logits(cold, pending, 3)
    elif runner.drafts:
        out["restored_draft"] = np.asarray(runner.draft(restored, pending, 3))
        out["cold_draft"] = np.asarray(runner.draft(cold, pending, 3))
    out["restored_step"] = runner.decode([restored], [pending])[0]
    out["cold_step"] = runner.decode([cold], [pending])[0]
    for name, a in blocks[-1].items():
        out[f"shape:{name}"] = np.asarray(a.shape)
    if every_block:
        for i, block in enumerate(blocks):
            for name, a in block.items():
                out[f"block{i}:{name}"] = a
    return out


def _run_ranks(path, tmp_path, mtp: bool) -> dict[str, np.ndarray]:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(root=str(ROOT)))
    out = tmp_path / f"tp-{int(mtp)}.npz"
    run = subprocess.run([sys.executable, str(script), str(path), str(out), str(int(mtp))], cwd=ROOT,
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("mtp", [False, True], ids=["hybrid", "hybrid-mtp"])
def test_two_ranks_restore_their_state_shares_like_a_cold_prefill(tiny_checkpoint, tmp_path, mtp):
    from hf2q.engine.factory import load_runner
    from tests.engine_support import convert_f32

    path = convert_f32(tiny_checkpoint("qwen35_parity_mtp"), tmp_path / "dense.gguf")
    tp = _run_ranks(path, tmp_path, mtp)
    assert bool(tp["persists"]) and str(tp["identity"]).endswith("-mtp-tp2" if mtp else "-tp2")
    assert str(tp["kind"]) == ("recurrent-mtp" if mtp else "recurrent")
    assert int(tp["ends_left"]) == 0
    for key in ("restored", "restored_step"):
        assert float(np.abs(tp[key] - tp[key.replace("restored", "cold")]).max()) <= TOL, key
    if mtp:
        np.testing.assert_array_equal(tp["restored_draft"], tp["cold_draft"])
    # the gathered state is the whole model's: every value head's delta-rule state, every conv channel
    one = load_runner(path, ctx=1024)
    seq = one.new_sequence()
    seq.keep_block_ends(B)
    one.prefill(seq, random_tokens(B + 1, seed=13))
    whole = one.export_kv(seq, 0, B)
    head = one.model.kv_shape[0]  # the MTP head's cache layer comes after the main model's
    extra = {f"k.{head}", f"v.{head}", HIDDEN_STATE} if mtp else set()
    assert {k[len("shape:"):] for k in tp if k.startswith("shape:")} == set(whole) | extra
    for name in whole:
        assert tuple(tp[f"shape:{name}"]) == whole[name].shape, name


def test_restarted_two_rank_server_resumes_a_hybrid_prefix(tmp_path):
    """``serve --tensor-parallel 2 --kv-persist`` on the tiny Qwen 3.5 chat GGUF: a restarted group restores the
    prompt's two blocks (each rank's state share) and answers with the cold group's greedy tokens and top-5
    log-probabilities."""
    from tests.models.qwen35_chat import qwen35_chat_gguf
    from tests.test_kvstore_stateful_serve import check_restart_resumes

    check_restart_resumes(qwen35_chat_gguf(), tmp_path / "kv", "recurrent", 210, TOL, "--tensor-parallel", "2")
