"""DeepSeek-V4 (``deepseek4``) at TP = 2 on CPU ranks: query heads, sinks and output groups split, the
shared K=V head, compressors and indexer replicated, experts split by expert.

The reference is the same GGUF (llama.cpp's f32 conversion of the tiny official-layout checkpoint,
``tests/test_engine_deepseek4.py``) on one rank. The 150-token prompt passes the 128-token window and
closes sparse (ratio 4, more than the indexer's top 16) and heavily compressed (ratio 128) blocks.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from hf2q.engine.memory_plan import rank_need
from hf2q.engine.models.deepseek4_tp import output_group_plan
from hf2q.engine.tensor_parallel import shard_gguf
from hf2q.errors import InputError
from hf2q.formats.gguf_file import open_gguf
from hf2q.formats.gguf_keys import ExtraKeys
from tests.engine_support import random_tokens
from tests.test_tensor_parallel import GROUP_TIMEOUT_S, ROOT, serve_prompts

CTX = 256
PROMPT = 150
DECODE = 8
#: fp32 logits at TP = 2 against one rank, relative to the largest logit (summation order only)
TOL = 1e-5


def v4_file():
    """llama.cpp's f32 conversion of the tiny checkpoint (built once, beside it)."""
    from tests.test_engine_deepseek4 import deepseek4_gguf

    return deepseek4_gguf()


@pytest.fixture(scope="module")
def v4_float_gguf(tmp_path_factory):
    return float_copy(v4_file(), tmp_path_factory.mktemp("v4-tp") / "f32-only.gguf")


def float_copy(src, dst):
    """``src`` with its Q8_0 matrices stored as the F32 values they hold (the same model), minus the
    vocabulary arrays: four ranks cut the shared expert's 64 columns into 16, inside a Q8_0 block."""
    import gguf
    from gguf import quants

    from tests.test_tensor_parallel import TOKENIZER_ARRAYS

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, str(r.get_field("general.architecture").contents()))
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in TOKENIZER_ARRAYS:
            continue
        w.add_key_value(name, f.contents(), f.types[0], f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            w.add_tensor(t.name, quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32))
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


# ---------------------------------------------------------------------------- the cut (no processes)

def test_output_groups_cover_every_head_once():
    """Whole groups per rank, or a share of one group's heads; never heads of two partial groups."""
    for heads, groups, size in [(8, 2, 2), (8, 2, 4), (8, 2, 8), (64, 8, 2), (64, 8, 16), (8, 1, 2), (8, 8, 4)]:
        per_group, q = heads // groups, heads // size
        covered = set()
        for r in range(size):
            p = output_group_plan(heads, groups, 3, r * q, q)
            cols = range(p.col_start // 3, p.col_stop // 3)
            assert len(cols) * p.group_count == q
            for g in range(p.group_start, p.group_start + p.group_count):
                covered |= {g * per_group + c for c in cols}
        assert covered == set(range(heads)), (heads, groups, size)
    with pytest.raises(InputError, match="straddle"):
        output_group_plan(12, 4, 3, 2, 2)  # heads 2, 3 lie in groups 0 and 1


def test_shards_reassemble_the_attention_and_experts():
    from gguf import quants

    g = open_gguf(v4_file())
    views = [shard_gguf(g, r, 2) for r in range(2)]

    def dense(t):
        return quants.dequantize(np.asarray(t.data), t.qtype).reshape(t.shape)

    for i in range(g.hparams.n_layers):
        p = f"blk.{i}."
        whole = {n: dense(g.tensors[p + n]) for n in ("attn_q_b.weight", "attn_sinks.weight", "attn_output_a.weight",
                                                       "attn_output_b.weight", "ffn_gate_exps.weight")}
        parts = {n: [dense(v.tensors[p + n]) for v in views] for n in whole}
        np.testing.assert_array_equal(np.concatenate(parts["attn_q_b.weight"], 0), whole["attn_q_b.weight"])
        np.testing.assert_array_equal(np.concatenate(parts["attn_sinks.weight"], 0), whole["attn_sinks.weight"])
        np.testing.assert_array_equal(np.concatenate(parts["attn_output_a.weight"], 0), whole["attn_output_a.weight"])
        np.testing.assert_array_equal(np.concatenate(parts["attn_output_b.weight"], 1), whole["attn_output_b.weight"])
        np.testing.assert_array_equal(np.concatenate(parts["ffn_gate_exps.weight"], 0), whole["ffn_gate_exps.weight"])
        for n in ("attn_q_a.weight", "attn_kv.weight", "ffn_gate_inp.weight"):  # replicated
            assert all(v.tensors[p + n] is g.tensors[p + n] for v in views), n
    hp = views[0].hparams
    assert (hp.n_heads, hp.stored(ExtraKeys.OUTPUT_GROUP_COUNT)) == (4, 1)
    # the memory plan: a rank holds its share of the weights and the whole (replicated) compact cache
    one, two = (rank_need(g, n, 10**6, float_bytes=4, scale_bytes=2) for n in (1, 2))
    assert one.weights / 2 < two.weights < one.weights and two.kv == one.kv == 10**6


# 3: 8 query heads do not split; 4: the Q8_0 shared expert's 64 down-projection columns would be cut into 16
@pytest.mark.parametrize(("size", "why"), [(3, "8 attention heads do not split over 3 ranks"),
                                           (4, "not aligned to the 32-element Q8_0 blocks")])
def test_unsplittable_shape_is_one_input_error_before_any_rank_starts(size, why):
    """``hf2q serve`` exits 3 with one line, before it starts a follower or loads a weight."""
    run = subprocess.run([sys.executable, "-m", "hf2q", "serve", "--model", str(v4_file()), "--tensor-parallel",
                          str(size), "--ctx", str(CTX), "--port", "1", "--operator-ui", "plain"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 3, (run.stdout, run.stderr[-2000:])
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and why in lines[0], run.stderr[-2000:]


# ---------------------------------------------------------------------------- two ranks against one

DRIVER = r"""
import json, os, sys
import numpy as np
sys.path.insert(0, {root!r})
from tests import test_tp_deepseek4 as t
from hf2q.engine import tp_launch
mode, path, size, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
if mode == "engine":
    runner = tp_launch.runner_factory(path, size, t.CTX)()
    result = t.scenario(runner, t.counting_all_sums())
    runner.close()
    with open(out, "wb") as f:
        np.savez(f, **result)
else:
    os.environ["HF2Q_TP_PIPELINE"] = "1"  # queue decode steps ahead, as over NCCL (GPUs)
    import trio
    tokens = trio.run(t.served_tokens, tp_launch.runner_factory(path, size, t.CTX), json.loads(sys.argv[5]))
    open(out, "w").write(json.dumps(tokens))
"""


def run_group(tmp_path, mode: str, model, size: int, *extra: str) -> None:
    """:data:`DRIVER` in a child process (``mx.distributed.init`` is once per process), which must end with
    every rank gone and exit 0."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(root=str(ROOT)))
    run = subprocess.run([sys.executable, str(script), mode, str(model), str(size), str(tmp_path / "out"), *extra],
                         cwd=ROOT, capture_output=True, text=True, timeout=GROUP_TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]


def counting_all_sums() -> dict:
    """``calls["n"]`` counts this process's ``mx.distributed.all_sum`` calls from now on."""
    import mlx.core as mx

    calls, real = {"n": 0}, mx.distributed.all_sum

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)
    mx.distributed.all_sum = counted
    return calls


def scenario(runner, calls: dict | None = None) -> dict[str, np.ndarray]:
    """A long prompt in two transactions (split mid-block), greedy decode steps, a second sequence decoding
    beside it (a batched step), the first back at a reuse point and continued, then a speculative verify
    partly accepted."""
    prompt = random_tokens(PROMPT, low=3, high=49152, seed=11)
    a = runner.new_sequence()
    runner.prefill(a, prompt[:70])
    out = {"prefill_a": runner.prefill(a, prompt[70:])}
    toks, steps, reduces = [int(out["prefill_a"].argmax())], [], []
    for _ in range(DECODE):
        if calls is not None:
            calls["n"] = 0
        lg = runner.decode([a], [toks[-1]])[0]
        reduces.append(calls["n"] if calls is not None else -1)
        steps.append(lg)
        toks.append(int(lg.argmax()))
    out["decode_a"], out["tokens_a"], out["reduces"] = np.stack(steps), np.asarray(toks), np.asarray(reduces)
    b = runner.new_sequence()
    out["prefill_b"] = runner.prefill(b, prompt[3:40])
    pair, batched = [toks[-1], int(out["prefill_b"].argmax())], []
    for _ in range(3):
        lg = runner.decode([a, b], pair)
        batched.append(lg)
        pair = [int(x) for x in lg.argmax(-1)]
    out["decode_ab"] = np.stack(batched)
    back = a.reuse_points()[-1]
    a.trim(back)
    out["after_trim"] = runner.prefill(a, [7, 8, 9])
    out["verify"] = runner.verify(a, prompt[:5])  # a speculative check: every position's logits
    a.trim(a.length - 2)  # a partial accept: back inside the verify forward
    out["after_verify"] = runner.decode([a], [prompt[3]])[0]
    out["lengths"] = np.asarray([a.length, b.length, back])
    return out


@pytest.mark.slow
# 2 ranks: one output group each (the Q8_0 file); 4 ranks: two ranks share each group, its low-rank sum
# split over them (the float copy: four ranks cannot cut the Q8_0 shared expert)
@pytest.mark.parametrize("size", [2, 4])
def test_ranks_match_one_rank_with_two_all_reduces_per_block(v4_float_gguf, size, tmp_path):
    from hf2q.engine.runner import MlxModelRunner

    model = v4_file() if size == 2 else v4_float_gguf
    run_group(tmp_path, "engine", model, size)
    with np.load(tmp_path / "out") as z:
        tp = {k: z[k] for k in z.files}
    ref = scenario(MlxModelRunner.load(model, ctx=CTX))
    for key in ("tokens_a", "lengths"):
        np.testing.assert_array_equal(tp[key], ref[key], err_msg=key)
    for key in ("prefill_a", "decode_a", "prefill_b", "decode_ab", "after_trim", "verify", "after_verify"):
        scale = float(np.abs(ref[key]).max())
        np.testing.assert_allclose(tp[key], ref[key], rtol=0, atol=TOL * scale, err_msg=key)
    # one all-reduce after each block's attention output, one after its feed-forward (experts + shared)
    assert tp["reduces"].tolist() == [2 * open_gguf(model).hparams.n_layers] * DECODE, tp["reduces"]


# ---------------------------------------------------------------------------- through the serving runtime

def runtime_config():
    from hf2q.sched.contracts import RuntimeConfig

    return RuntimeConfig(slots=2, ctx=CTX, prefill_chunk=48, gpu_deadline_s=120)


async def served_tokens(factory, prompts: list[list[int]]) -> list[list[int]]:
    from hf2q.actors.runtime import open_runtime

    async with open_runtime(factory, runtime_config()) as rt:
        assert await rt.wait_ready(), rt.readiness()
        return await serve_prompts(rt, prompts)


@pytest.mark.slow
def test_runtime_on_two_ranks_serves_what_one_rank_serves(tmp_path):
    """Two concurrent T=0 requests (one long enough to compress) in bounded prefill transactions, batched and
    pipelined decode, then the long one again in its reused slot: the same tokens at TP = 2 as at 1."""
    import trio

    from hf2q.engine.tp_launch import runner_factory

    prompts = [random_tokens(PROMPT, low=3, high=49152, seed=5), random_tokens(30, low=3, high=49152, seed=6)]
    run_group(tmp_path, "runtime", v4_file(), 2, json.dumps(prompts))
    got = json.loads((tmp_path / "out").read_text())
    want = trio.run(served_tokens, runner_factory(v4_file(), 1, CTX), prompts)
    assert got == want and all(len(t) == 8 for t in want), (got, want)
