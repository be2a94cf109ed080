"""Qwen 3.5 dense (``qwen35``): Gated DeltaNet + gated full attention against transformers.

The GGUFs come from llama.cpp's own ``convert_hf_to_gguf.py`` (the sdist's, ``--no-mtp``) run on
a tiny random ``Qwen3_5ForCausalLM`` (4 blocks, linear/full alternating, 2 key / 4 value heads in
the DeltaNet, so the converter's value-head reorder is in play) and its MoE sibling, and q8_0 from
its ``llama-quantize``. Logits of chunked prefills and decode steps must match transformers' forward
pass; batching, chunking and the recurrent state's checkpoint must not change them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import hf2q.engine  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from hf2q.engine.kv_cache import PrefixNotReusable
from hf2q.engine.models.qwen35 import gated_delta_reference
from hf2q.engine.runner import MlxModelRunner
from tests.engine_support import prefill_each, random_tokens

TOL_F32 = 1e-3
TOL_Q8_MAX, TOL_Q8_MEAN = 3.0, 0.3  # q8_0 against transformers: measured max 1.23, mean 0.10 (value heads grouped instead of tiled: mean 1.7)
CHUNK = 32
PROMPT = 80  # > two chunks
DECODE = 10


def _llama_cpp_convert(src: Path, out: Path) -> Path:
    from tests.tools import llama_cpp

    env = llama_cpp.env()
    env["PYTHONPATH"] = str(llama_cpp.gguf_py_dir())
    r = subprocess.run([sys.executable, str(llama_cpp.convert_script()), str(src), "--outtype", "f32", "--no-mtp",
                        "--outfile", str(out)], env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"llama.cpp convert failed: {r.stderr[-2000:]}"
    return out


@pytest.fixture(scope="module")
def qwen35(tiny_checkpoint, tmp_path_factory):
    """(f32 GGUF path, q8_0 GGUF path or None, the test prompt, transformers logits of it)."""
    from tests.tools import llama_cpp

    src = tiny_checkpoint("qwen35")
    d = tmp_path_factory.mktemp("qwen35")
    f32 = _llama_cpp_convert(src, d / "f32.gguf")
    q8 = None
    if llama_cpp.tool("llama-quantize") is not None:
        q8 = d / "q8_0.gguf"
        r = subprocess.run([str(llama_cpp.tool("llama-quantize")), str(f32), str(q8), "q8_0", "2"],
                           env=llama_cpp.env(), capture_output=True, text=True, check=False)
        assert r.returncode == 0, r.stderr[-2000:]
    tokens = random_tokens(PROMPT + DECODE, seed=5)
    return f32, q8, tokens, _reference(src, tokens)


def _reference(src: Path, tokens: list[int]) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


@pytest.fixture(scope="module")
def runner(qwen35):
    return MlxModelRunner.load(qwen35[0])


def _run(runner, tokens, chunk=CHUNK, n_prompt=PROMPT):
    """Per-chunk last logits and per-step decode logits of ``tokens`` (prompt chunked, rest decoded)."""
    seq = runner.new_sequence()
    chunks = [(i, runner.prefill(seq, tokens[i:min(i + chunk, n_prompt)])) for i in range(0, n_prompt, chunk)]
    steps = [runner.decode([seq], [t])[0] for t in tokens[n_prompt:]]
    return seq, chunks, steps


def _max_error(runner, qwen35) -> float:
    _, _, tokens, ref = qwen35
    seq, chunks, steps = _run(runner, tokens)
    errs = [np.abs(out - ref[min(i + CHUNK, PROMPT) - 1]).max() for i, out in chunks]
    errs += [np.abs(out - ref[PROMPT + j]).max() for j, out in enumerate(steps)]
    assert seq.length == len(tokens)
    return float(max(errs))


@pytest.mark.slow  # the module fixture converts, quantizes and runs transformers (~40 s)
def test_f32_logits_match_transformers(runner, qwen35):
    assert runner.arch == "qwen35" and runner.model.n_recurrent == 2 and runner.model.n_attention == 2
    assert float(np.std(qwen35[3])) > 0.5  # the reference is not flat
    assert _max_error(runner, qwen35) < TOL_F32


def _dequantized_runner(path: Path) -> MlxModelRunner:
    """The GGUF at ``path`` with every block-quantized tensor dequantized by gguf-py to F32."""
    import gguf

    from hf2q.engine.models import build_model
    from hf2q.formats.gguf_file import GGUFTensor, open_gguf

    g = open_gguf(path)
    for name, t in list(g.tensors.items()):
        if t.qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            continue
        data = gguf.quants.dequantize(np.asarray(t.data), t.qtype).reshape(t.shape).astype(np.float32)
        g.tensors[name] = GGUFTensor(name, gguf.GGMLQuantizationType.F32, t.shape, data, data.nbytes)
    return MlxModelRunner(g, build_model(g, mx.float32), mx.float32, None)


@pytest.mark.slow
def test_moe_f32_logits_match_transformers(tiny_checkpoint, tmp_path):
    """qwen35moe: the same blocks with softmax top-2-of-4 experts (renormalised) and a gated shared expert."""
    src = tiny_checkpoint("qwen35_moe")
    moe = MlxModelRunner.load(_llama_cpp_convert(src, tmp_path / "moe.gguf"))
    assert moe.arch == "qwen35moe"
    tokens = random_tokens(PROMPT + DECODE, seed=5)
    assert _max_error(moe, (None, None, tokens, _reference(src, tokens))) < TOL_F32


@pytest.mark.slow
def test_q8_0_logits(qwen35):
    """q8_0 as llama-quantize wrote it: equal to the same weights dequantized by gguf-py (so the
    quantized matmuls are exact), and near transformers (this random model amplifies the rounding:
    one q8_0 tensor alone moves logits by up to ~0.7)."""
    if qwen35[1] is None:
        pytest.skip("llama-quantize not built")
    _, q8_path, tokens, ref = qwen35
    q8 = MlxModelRunner.load(q8_path)
    assert q8.model.layers[0].mixer.qkv.quantized and q8.model.layers[1].mixer.q.quantized
    _, chunks, steps = _run(q8, tokens)
    _, chunks_dq, steps_dq = _run(_dequantized_runner(q8_path), tokens)
    np.testing.assert_allclose(np.stack(steps), np.stack(steps_dq), atol=TOL_F32, rtol=0)
    np.testing.assert_allclose(chunks[-1][1], chunks_dq[-1][1], atol=TOL_F32, rtol=0)
    err = np.abs(np.stack(steps) - ref[PROMPT:])
    assert err.max() < TOL_Q8_MAX and err.mean() < TOL_Q8_MEAN


@pytest.mark.slow
def test_chunked_prefill_equals_one_shot(runner, qwen35):
    tokens = qwen35[2]
    _, one_chunk, one_steps = _run(runner, tokens, chunk=PROMPT)
    for chunk in (7, CHUNK):
        _, chunks, steps = _run(runner, tokens, chunk=chunk)
        np.testing.assert_allclose(chunks[-1][1], one_chunk[0][1], atol=1e-4, rtol=0)
        np.testing.assert_allclose(np.stack(steps), np.stack(one_steps), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_batched_decode_equals_single_decodes(runner):
    prompts = [random_tokens(n, seed=n) for n in (5, 37, 12)]
    batch, tok = prefill_each(runner, prompts)
    alone, _ = prefill_each(runner, prompts)
    for _ in range(6):
        got = runner.decode(batch, tok)
        want = np.stack([runner.decode([s], [t])[0] for s, t in zip(alone, tok)])
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        tok = [int(t) for t in np.argmax(got, -1)]
    assert [s.length for s in batch] == [len(p) + 6 for p in prompts]


@pytest.mark.slow
def test_recurrent_state_checkpoint_and_refusals(runner):
    tokens = random_tokens(30, seed=8)
    seq = runner.new_sequence()
    runner.prefill(seq, tokens[:20])
    first = runner.decode([seq], [tokens[20]])[0]
    seq.trim(20)  # back to the last forward's start: the checkpoint (the decode pipeline's rollback)
    np.testing.assert_array_equal(runner.decode([seq], [tokens[20]])[0], first)
    with pytest.raises(PrefixNotReusable, match=r"recurrent state exists only at \(0, 20, 21\) tokens"):
        seq.trim(10)
    with pytest.raises(PrefixNotReusable):
        runner.export_kv(seq, 0, 5)
    with pytest.raises(PrefixNotReusable):
        runner.import_kv(runner.new_sequence(), {}, 5)
    assert seq.length == 21
    seq.trim(0)  # eviction: a fresh state
    assert seq.nbytes == 0
    cold = runner.new_sequence()
    np.testing.assert_array_equal(runner.prefill(seq, tokens), runner.prefill(cold, tokens))


def test_reuse_points_restore_the_state_at_their_length(runner):
    """The state is kept every CHECKPOINT_INTERVAL tokens and at each prefill transaction's end; a
    sequence trimmed back to one of them continues exactly as a cold one (same greedy tokens, logits
    to the rounding of differently sized attention chunks)."""
    from hf2q.engine.kv_cache import CHECKPOINT_INTERVAL as I

    tokens = random_tokens(2 * I + 150, seed=21)
    seq = runner.new_sequence()
    runner.prefill(seq, tokens[:2 * I + 100])
    assert seq.reuse_points() == (0, I, 2 * I, 2 * I + 100)
    for point in (2 * I, I):
        seq.trim(point)
        assert seq.reuse_points() == tuple(p for p in (0, I, 2 * I) if p <= point)
        reused = runner.prefill(seq, tokens[point:])
        cold = runner.prefill(runner.new_sequence(), tokens)
        np.testing.assert_allclose(reused, cold, atol=1e-4, rtol=0)
        assert _greedy_from(runner, seq, reused, 4) == _greedy_from(runner, runner.new_sequence(), None, 4, tokens)
    with pytest.raises(PrefixNotReusable):
        seq.trim(I + 1)


def _greedy_from(runner, seq, logits, n, prompt=None) -> list[int]:
    if logits is None:
        logits = runner.prefill(seq, list(prompt))
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = runner.decode([seq], [out[-1]])[0]
    return out


@pytest.mark.slow
def test_state_bytes_and_kv_accounting(runner):
    hp, cfg = runner.gguf.hparams, runner.model.cfg
    # K/V only for the two full-attention layers; recurrent state per sequence
    assert runner.kv_bytes_per_token == 2 * cfg.n_kv_heads * 2 * cfg.head_dim * 4
    seq = runner.new_sequence()
    runner.prefill(seq, random_tokens(3))
    # the live state and one reuse point (the end of the prefill transaction)
    assert seq.reuse_points() == (0, 3)
    assert seq.nbytes == seq.capacity * runner.kv_bytes_per_token + 2 * hp.recurrent_state_bytes()
    conv = (4 - 1) * (2 * 2 * 32 + 4 * 32)
    assert hp.recurrent_state_bytes() == 2 * (conv + 4 * 32 * 32) * 4


@pytest.mark.parametrize("hk,hv,t", [(2, 4, 9), (4, 4, 1)])
def test_fused_delta_rule_matches_reference(hk, hv, t):
    rng = np.random.default_rng(hk + t)
    B, dk, dv = 2, 32, 16

    def arr(*shape, low=None):
        a = rng.uniform(low, 1.0, shape) if low is not None else rng.standard_normal(shape)
        return mx.array(a.astype(np.float32))

    q, k, v = arr(B, t, hv, dk), arr(B, t, hv, dk), arr(B, t, hv, dv)
    k = k / mx.sqrt((k * k).sum(-1, keepdims=True))
    gamma, beta, state = arr(B, t, hv, low=0.3), arr(B, t, hv, low=0.0), arr(B, hv, dv, dk) * 0.1
    if hk != hv:  # the kernel's own grouping (value head h reads key head h // (hv / hk))
        qg, kg = q[:, :, ::hv // hk], k[:, :, ::hv // hk]
        y, s = mx.fast.gated_delta_update(qg, kg, v, gamma, beta, state)
        q, k = mx.repeat(qg, hv // hk, axis=2), mx.repeat(kg, hv // hk, axis=2)
    else:
        y, s = mx.fast.gated_delta_update(q, k, v, gamma, beta, state)
    y_ref, s_ref = gated_delta_reference(q, k, v, gamma, beta, state)
    np.testing.assert_allclose(np.array(y), np.array(y_ref), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.array(s), np.array(s_ref), atol=1e-5, rtol=0)


def _greedy(runner, prompt, n) -> list[int]:
    seq, out = runner.new_sequence(), []
    logits = runner.prefill(seq, list(prompt))
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = runner.decode([seq], [out[-1]])[0]
    return out


@pytest.mark.slow
def test_pipelined_decode_rolls_back_one_step(runner):
    """The device-sampled decode pipeline queues a step ahead and trims it when the request stops:
    the recurrent state returns to its checkpoint, and greedy generation equals the blocking loop."""
    from hf2q.engine.generate import generate_once
    from hf2q.engine.sampling.device import DeviceSampler
    from hf2q.sched.contracts import SamplingParams

    assert runner.pipelines_decode
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = random_tokens(15, seed=2)
    seq = runner.new_sequence()
    first = int(np.argmax(runner.prefill(seq, prompt)))
    pending = runner.decode_async([seq], [first], [DeviceSampler(params)])
    ahead = runner.decode_async([seq], pending, [DeviceSampler(params)])
    second = int(pending.result()[0][0])
    seq.trim(seq.length - 1)  # drop the queued step
    assert int(np.argmax(runner.decode([seq], [second])[0])) == int(ahead.result()[0][0])

    got: list[int] = []
    generate_once(runner, prompt, params, on_token=got.append)
    assert got == _greedy(runner, prompt, params.max_tokens)


@pytest.mark.slow
def test_runtime_serves_qwen35_slots(qwen35):
    """The serving runtime over the real engine: two slots decoding in one batch, 8-token prefill
    transactions, a turn that extends a slot's history (reused whole) and one that diverges inside it
    (restarted from the last reuse point before the divergence) all give the direct engine's greedy tokens."""
    import trio

    from hf2q.sched.contracts import RuntimeConfig

    from hf2q.actors.runtime import open_runtime
    from hf2q.sched.contracts import Finished, Token
    from tests.test_runtime_real import _run_all as run_all

    n_new = 6
    prompts = [random_tokens(21, seed=11), random_tokens(13, seed=12)]

    async def main():
        async with open_runtime(lambda: MlxModelRunner.load(qwen35[0], ctx=256),
                                RuntimeConfig(slots=2, ctx=256, prefill_chunk=8, gpu_deadline_s=300)) as rt:
            assert await rt.wait_ready(), rt.readiness()
            first = await run_all(rt, prompts, n_new, "a")
            out0 = [e.token_id for e in first[0] if isinstance(e, Token)]
            extended = list(prompts[0]) + out0 + random_tokens(5, seed=13)
            diverged = list(prompts[1][:10]) + random_tokens(6, seed=14)
            second = await run_all(rt, [extended, diverged], n_new, "b")
            return first, second, [extended, diverged]

    first, second, turn2 = trio.run(main)
    first, second = ([d[i] for i in sorted(d)] for d in (first, second))
    r = MlxModelRunner.load(qwen35[0], ctx=256)
    for evs, p in zip(first + second, prompts + turn2):
        assert isinstance(evs[-1], Finished)
        assert [e.token_id for e in evs if isinstance(e, Token)] == _greedy(r, p, n_new)
    assert second[0][0].cached_tokens >= len(prompts[0]) + n_new - 1  # the whole first turn reused
    # diverged inside the slot's history at 10: restarted from the reuse point at its first 8-token transaction
    assert second[1][0].cached_tokens == 8


@pytest.mark.slow
def test_half_precision_graph_runs_on_cpu(runner, qwen35):
    """The GPU's compute dtype (float16) through the same graph, here on the CPU: the recurrent state
    stays float32, the conv window takes the compute dtype, and logits stay near the float32 graph
    (measured 0.07 on this model, which amplifies rounding)."""
    from hf2q.engine.models import build_model

    half = MlxModelRunner(runner.gguf, build_model(runner.gguf, mx.float16), mx.float16, None)
    tokens = qwen35[2][:40]
    seq, want = half.new_sequence(), runner.new_sequence()
    got = [half.prefill(seq, tokens[:32])] + [half.decode([seq], [t])[0] for t in tokens[32:]]
    ref = [runner.prefill(want, tokens[:32])] + [runner.decode([want], [t])[0] for t in tokens[32:]]
    assert seq.recurrent.ssm[0].dtype == mx.float32 and seq.recurrent.conv[0].dtype == mx.float16
    np.testing.assert_allclose(np.stack(got), np.stack(ref), atol=0.3, rtol=0)
