"""A sliding-window model's blocks persist at tensor parallel: every rank's window rows, by KV head.

Two CPU ranks (as tests/test_kvstore_tp_hybrid.py starts them) serve a prompt of two blocks and more
with block-end capture on, persist its blocks through the KV prefix actor and a real store (the window
rows at each block end gathered by head beside the global layers' K/V, a replicated head once) and
restore them into a fresh sequence, which continues like the cold sequence that prefilled the same text
in the same two transactions: within 2e-5 in the logits (the one-process bound,
tests/test_kvstore_window_engine.py) over the prefill and three decode steps; an 8-bit cache's rows are
its codes and scales, gathered by head with them. The rows a rank gets are
its own heads' (gemma4's sliding heads split over the ranks: another rank's rows move the logits). A block
holds the parts one process exports, no more: the E2B-style gemma4's KV-shared layers carry neither K/V nor
window rows, and where every KV head is replicated (gemma3, E2B) the block is one process's, shapes and rows.
A one-process server never finds the group's blocks (the store keys them by the group's size).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hf2q.kvstore import BLOCK_TOKENS as B
from tests.engine_support import random_tokens
from tests.test_tp_multihost import ROOT

pytestmark = pytest.mark.slow  # two ranks in a subprocess, about 560 tokens prefilled per family

#: restored against cold split at the same block end (f32), as on one process
TOL = 2e-5
BLOCKS = 2
#: the arrays of one cached tensor: f16 rows, or an 8-bit cache's codes and their scales
PLANES = {"f16": ("",), "q8": ("", ".scales")}
DRIVER = r"""
import sys
import numpy as np
import trio
sys.path.insert(0, {root!r})
from hf2q.engine import tp_launch
from tests.test_kvstore_tp_window import scenario
path, store_dir, out, kv_type = sys.argv[1:5]
runner = tp_launch.runner_factory(path, 2, 1024, kv_cache_type=kv_type)()
np.savez(out, **trio.run(scenario, runner, path, store_dir))
runner.close()
"""


def _swapped(rows: np.ndarray, heads: int) -> np.ndarray:
    """Gathered window rows rotated by one rank's ``heads`` (rank 0 then gets rank 1's heads where they split;
    replicated heads are stored once, one rank's, and stay as they are)."""
    return np.concatenate([rows[heads:], rows[:heads]])


async def scenario(runner, path, store_dir) -> dict[str, np.ndarray]:
    """A request's blocks persisted and restored through the store into a fresh sequence, beside the
    sequence that served the request (cold: split at the restored block end)."""
    from hf2q.engine.kv_cache import SequenceCache
    from hf2q.kvstore import FORMAT_VERSION, BlockStore, model_fingerprint
    from tests.kvstore_support import persist_then_restore

    prompt = random_tokens(BLOCKS * B + 20, seed=11)
    cold, fresh = runner.new_sequence(), runner.new_sequence()
    cold.keep_block_ends(B)
    runner.prefill(cold, prompt[:BLOCKS * B])
    want = runner.prefill(cold, prompt[BLOCKS * B:])
    rebuilds = []
    put = SequenceCache._put_window
    SequenceCache._put_window = lambda self, *a: (rebuilds.append(a[0]), put(self, *a))[1]  # rank 0's
    fp = model_fingerprint(path, None, None, FORMAT_VERSION, runner.kv_identity)
    with BlockStore.open(store_dir, fp) as store:
        cached = await persist_then_restore(runner, store, cold, prompt, fresh)
        blocks = [store.read(meta) for meta in store.longest_prefix(prompt)]
    SequenceCache._put_window = put
    out = {"cached": np.asarray(cached), "rebuilds": np.asarray(rebuilds), "fp": np.asarray(fp),
           "kind": np.asarray(fresh.persist_kind), "persists": np.asarray(runner.persists_kv),
           "identity": np.asarray(runner.kv_identity), "heads": np.asarray(fresh.local.kv_heads),
           "restored": runner.prefill(fresh, prompt[BLOCKS * B:]), "cold": want}
    for i in range(3):
        step = int(np.argmax(out["cold"] if i == 0 else out[f"cold_step{i - 1}"]))
        out[f"restored_step{i}"] = runner.decode([fresh], [step])[0]
        out[f"cold_step{i}"] = runner.decode([cold], [step])[0]
    other = runner.new_sequence()  # the last block's window rows handed to the other rank
    runner.import_kv(other, {k: v for k, v in blocks[0].items() if not k.startswith("state.")}, B)
    heads = fresh.local.kv_heads
    runner.import_kv(other, {k: _swapped(v, heads) if k.startswith("state.") else v
                             for k, v in blocks[-1].items()}, B)
    out["swapped"] = runner.prefill(other, prompt[BLOCKS * B:])
    for name, a in blocks[-1].items():
        out[f"shape:{name}"] = np.asarray(a.shape)
    for name, a in blocks[0].items():
        out[f"block0:{name}"] = a
    return out


def _run_ranks(path, tmp_path, kv_type: str) -> dict[str, np.ndarray]:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(root=str(ROOT)))
    out = tmp_path / "tp.npz"
    run = subprocess.run([sys.executable, str(script), str(path), str(tmp_path / "kv"), str(out), kv_type],
                         cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


#: whether a family's sliding KV heads split over the two ranks (else replicated: stored once, the one-process
#: shape), and how many of its last layers share an earlier layer's K/V (E2B: no cache layer, no window rows)
SHAPES = {"gemma3": (False, 0), "gemma4": (True, 0), "gemma4_e2b": (False, 2), "gemma4_moe": (True, 0)}


@pytest.mark.parametrize("family, kv_type", [("gemma3", "f16"), ("gemma4", "f16"), ("gemma4", "q8"),
                                             ("gemma4_e2b", "f16"), ("gemma4_e2b", "q8"), ("gemma4_moe", "f16")])
def test_two_ranks_restore_their_window_rows_like_a_cold_prefill(tiny_checkpoint, tmp_path, monkeypatch, family,
                                                                 kv_type):
    from hf2q.engine.runner import MlxModelRunner
    from hf2q.formats.gguf_file import open_gguf
    from hf2q.kvstore import FORMAT_VERSION, BlockStore, model_fingerprint
    from tests.engine_support import convert_f32

    path = convert_f32(tiny_checkpoint(family), tmp_path / "f32.gguf")
    tp = _run_ranks(path, tmp_path, kv_type)
    assert bool(tp["persists"]) and str(tp["identity"]).endswith("-tp2") and str(tp["kind"]) == "window"
    assert int(tp["cached"]) == BLOCKS * B
    assert list(tp["rebuilds"]) == [BLOCKS * B]  # the window buffers are built once, for the last block
    for key in ("restored", *(f"restored_step{i}" for i in range(3))):
        assert float(np.abs(tp[key] - tp[key.replace("restored", "cold")]).max()) <= TOL, key

    monkeypatch.setenv("HF2Q_NO_HOST_DECODE", "1")  # gemma3 on the CPU: the graph, whose window layers keep it
    one = MlxModelRunner.load(path, ctx=1024, kv_cache_type=kv_type)
    seq = one.new_sequence()
    seq.keep_block_ends(B)
    prompt = random_tokens(BLOCKS * B + 20, seed=11)
    one.prefill(seq, prompt[:B + 1])
    whole = one.export_kv(seq, 0, B)  # the first block as one process exports it
    window, layers = one.window_layers
    split, shared = SHAPES[family]
    n_layers = open_gguf(path).hparams.n_layers
    # one process: of the layers that own their K/V (the KV-shared ones come last and carry nothing), the
    # global ones' K/V and the sliding ones' window rows; the group's block has exactly these parts
    owners = n_layers - shared
    assert layers and max(layers) < owners
    assert {k for k in whole if k.startswith(("k.", "v."))} == \
        {f"{kv}.{i}{plane}" for kv in "kv" for i in set(range(owners)) - layers for plane in PLANES[kv_type]}
    assert {k for k in whole if k.startswith("state.")} == \
        {f"state.{kv}.{i}{plane}" for kv in "kv" for i in layers for plane in PLANES[kv_type]}
    shapes = {k[len("shape:"):]: tuple(tp[k]) for k in tp if k.startswith("shape:")}
    assert set(shapes) == set(whole)
    heads = int(tp["heads"])  # a rank's cache heads
    for name, shape in shapes.items():
        assert shape[1:] == whole[name].shape[1:], name
        if split:  # gemma4: its sliding heads split, every rank's cache heads side by side
            assert shape[0] == 2 * heads, name
        else:  # one KV head per layer, replicated on both ranks: stored once, as on one process
            assert shape == whole[name].shape, name
            if kv_type == "f16":  # and the rows are one process's (up to the all-reduces' rounding)
                np.testing.assert_allclose(tp[f"block0:{name}"], whole[name], rtol=0, atol=1e-4, err_msg=name)
    if split:  # the other rank's heads are not this rank's: the restored logits move
        assert float(np.abs(tp["swapped"] - tp["cold"]).max()) > 1e-3
    else:  # replicated heads: the one copy serves either rank
        assert float(np.abs(tp["swapped"] - tp["cold"]).max()) <= TOL
    # the group's blocks are keyed by its size: one process looks them up under another fingerprint
    mine = model_fingerprint(path, None, None, FORMAT_VERSION, one.kv_identity)
    assert mine != str(tp["fp"])
    with BlockStore.open(tmp_path / "kv", mine) as store:
        assert store.longest_prefix(prompt) == []
    with BlockStore.open(tmp_path / "kv", str(tp["fp"])) as store:
        assert len(store.longest_prefix(prompt)) == BLOCKS


def test_restarted_two_rank_server_resumes_an_e2b_windowed_prefix(tmp_path):
    """``serve --tensor-parallel 2 --kv-persist`` on the tiny E2B-style Gemma 4 chat GGUF (F16: per-layer
    embeddings, KV-shared layers, one KV head a layer replicated on both ranks): a restarted group restores the
    prompt's two blocks (global K/V and window rows) and answers with the cold group's greedy tokens and top-5
    log-probabilities (tests/test_kvstore_window_serve.py's bound)."""
    from tests.models.gemma4_chat import gemma4_chat_gguf
    from tests.test_kvstore_stateful_serve import check_restart_resumes

    check_restart_resumes(gemma4_chat_gguf("gemma4_e2b"), tmp_path / "kv", "window", 200, TOL,
                          "--tensor-parallel", "2")
