"""Qwen 3.5's hybrid blocks (Gated DeltaNet linear attention + gated attention) and Gemma 4's two layer
shapes at TP = 2, on CPU.

The linear-attention layers are split by value head (each rank holds its heads' conv and delta-rule
state); Gemma 4's layers each by their own head counts and sizes. The reference is the same GGUF on one rank: served through a real HTTP client (T = 0 answers),
and on the engine (logits, and the all-reduces a decode step costs).
"""

from __future__ import annotations

import signal
import subprocess
import sys

import numpy as np
import pytest

from hf2q.engine.tensor_parallel import deltanet_plan
from hf2q.errors import InputError
from hf2q.engine.tp_launch import free_ports
from tests.test_tp_multihost import PY, ROOT, concurrent_answers, models, stop, wait_ready  # noqa: F401 — fixture

CTX = 256


def test_deltanet_heads_split_so_each_value_head_keeps_its_key_head():
    """Value head j reads key head j mod k: a rank's local tiling must keep that pairing."""
    for k, v, size in [(2, 4, 2), (16, 32, 2), (16, 32, 4), (2, 2, 2), (1, 4, 2), (2, 8, 4)]:
        seen = []
        for r in range(size):
            p = deltanet_plan(k, v, size, r)
            kl = len(p.key_heads)
            assert len(p.value_heads) == v // size
            for jl, j in enumerate(p.value_heads):  # locally: value head jl reads key head jl mod kl
                assert j % k == p.key_heads[jl % kl], (k, v, size, r)
            seen += p.value_heads
        assert sorted(seen) == list(range(v)), (k, v, size)
    assert deltanet_plan(2, 4, 2, 1).value_heads == (1, 3)
    for k, v, size in [(2, 6, 4), (4, 8, 3)]:
        with pytest.raises(InputError, match="do not split"):
            deltanet_plan(k, v, size, 0)


DRIVER = r"""
import json, sys
import numpy as np
sys.path.insert(0, {root!r})
from hf2q.engine import tp_launch
path, out = sys.argv[1], sys.argv[2]
runner = tp_launch.runner_factory(path, 2, {ctx})()
import mlx.core as mx
from tests.test_tp_hybrid import scenario
calls = {{"n": 0}}
real = mx.distributed.all_sum
def all_sum(*a, **k):
    calls["n"] += 1
    return real(*a, **k)
mx.distributed.all_sum = all_sum
result = scenario(runner, calls)
np.savez(out, **result)
runner.close()
"""


def scenario(runner, calls: dict | None = None) -> dict[str, np.ndarray]:
    """Two sequences prefilled, then decoding together (a batched step), one trimmed back to a reuse point."""
    a, b = runner.new_sequence(), runner.new_sequence()
    out = {"prefill_a": runner.prefill(a, [1, 504, 3094, 1210, 282, 253, 3467]),
           "prefill_b": runner.prefill(b, [1, 77])}
    toks = [int(out["prefill_a"].argmax()), int(out["prefill_b"].argmax())]
    steps, reduces = [], []
    for _ in range(4):
        if calls is not None:
            calls["n"] = 0
        lg = runner.decode([a, b], toks)
        reduces.append(calls["n"] if calls is not None else -1)
        steps.append(lg)
        toks = [int(x) for x in lg.argmax(-1)]
    out["decode"], out["reduces"] = np.stack(steps), np.asarray(reduces)
    back = a.reuse_points()[-1]
    a.trim(back)
    out["after_trim"] = runner.prefill(a, [7, 8, 9])
    out["lengths"] = np.asarray([a.length, b.length])
    return out


@pytest.mark.slow
# qwen35_moe: routed experts + a shared expert; gemma4: sliding layers of 2 KV heads × 32 and a global layer of
# one KV head × 64 whose K is its V (replicated on both ranks); gemma4_e2b: per-layer embeddings, KV-shared layers;
# gemma4_moe: 4 experts split 2+2 beside the dense MLP, both partial sums in the block's second all-reduce
@pytest.mark.parametrize("family", ["qwen35", "qwen35_moe", "gemma4", "gemma4_e2b", "gemma4_moe"])
def test_two_ranks_match_one_rank_with_two_all_reduces_per_block(models, family, tmp_path, monkeypatch):
    from hf2q.engine.runner import MlxModelRunner
    from hf2q.formats.gguf_file import open_gguf

    model = models(family, "f32")
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(root=str(ROOT), ctx=CTX))
    run = subprocess.run([sys.executable, str(script), str(model), str(tmp_path / "tp.npz")], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    with np.load(tmp_path / "tp.npz") as z:
        tp = {k: z[k] for k in z.files}
    monkeypatch.setenv("HF2Q_NO_HOST_DECODE", "1")
    ref = scenario(MlxModelRunner.load(model, ctx=CTX))
    np.testing.assert_array_equal(tp["lengths"], ref["lengths"])
    for key in ("prefill_a", "prefill_b", "decode", "after_trim"):
        scale = float(np.abs(ref[key]).max())
        np.testing.assert_allclose(tp[key], ref[key], rtol=0, atol=1e-4 * scale, err_msg=key)
        np.testing.assert_array_equal(tp[key].argmax(-1), ref[key].argmax(-1), err_msg=key)
    n_layers = open_gguf(model).hparams.n_main_layers
    # Megatron's minimum: one all-reduce after each mixer (DeltaNet or attention) and one after each
    # feed-forward (the MoE's experts and its shared expert reduced together)
    assert tp["reduces"].tolist() == [2 * n_layers] * 4, tp["reduces"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen35", "gemma4"])
def test_served_at_two_ranks_answers_what_one_rank_answers(models, family, tmp_path):
    """Three concurrent T=0 chat requests through a real HTTP client: the same answers at TP = 2 as at 1."""
    model = models(family, "f32")
    args = ["--model", str(model), "--model-name", "m", "--slots", "3", "--ctx", str(CTX), "--operator-ui", "plain"]
    ports = free_ports(2)
    logs = [tmp_path / f"serve-{n}.log" for n in (1, 2)]
    procs = [subprocess.Popen([*PY, "serve", *args, "--port", str(port), "--tensor-parallel", str(n)], cwd=ROOT,
                              stdout=log.open("wb"), stderr=subprocess.STDOUT)
             for n, port, log in zip((1, 2), ports, logs)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for url, proc, log in zip(urls, procs, logs):
            wait_ready(url, proc, log)
        want = concurrent_answers(urls[0])
        got = concurrent_answers(urls[1])
        assert got == want and all(want), (got, want)
        assert [stop(p) for p in procs] == [0, 0], [log.read_text()[-2000:] for log in logs]
    finally:
        for p in procs:
            stop(p, signal.SIGKILL, 10)
