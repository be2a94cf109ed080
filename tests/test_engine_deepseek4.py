"""DeepSeek-V4 (``deepseek4``): hyper-connections, compressed sparse / heavily compressed attention and
hash-routed experts against transformers' ``deepseek_v4``.

The GGUF is llama.cpp's own conversion (the sdist's ``convert_hf_to_gguf.py``, ``--outtype f32``) of
the tiny official-layout checkpoint of ``tests/models/deepseek4.py`` (FP8 block matrices, MXFP4
experts, layers of compress ratio 0 / 4 / 128 / 4, two hash-routed layers, YaRN on the compressed
layers). That converter stores the FP8 matrices as Q8_0, so the reference is transformers' forward
with exactly those Q8_0 values put back into its weights. The 150-token prompt passes the 128-token
window and closes 37 sparse windows (more than the indexer's top 16) and one heavily compressed one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import hf2q.engine  # noqa: F401
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf2q.engine.runner import MlxModelRunner
from tests.engine_support import random_tokens

TOL = 1e-3
PROMPT = 150
DECODE = 8
#: transformers' parameter (after ``model.layers.N.``) of each matrix llama.cpp's converter stores as Q8_0
_Q8_NAMES = {"attn_q_a": "self_attn.q_a_proj", "attn_q_b": "self_attn.q_b_proj", "attn_kv": "self_attn.kv_proj",
             "attn_output_a": "self_attn.o_a_proj", "attn_output_b": "self_attn.o_b_proj",
             "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
             "ffn_down_shexp": "mlp.shared_experts.down_proj"}


def _llama_cpp_convert(src: Path, out: Path) -> Path:
    from tests.tools import llama_cpp

    env = llama_cpp.env()
    env["PYTHONPATH"] = str(llama_cpp.gguf_py_dir())
    r = subprocess.run([sys.executable, str(llama_cpp.convert_script()), str(src), "--outtype", "f32",
                        "--outfile", str(out)], env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"llama.cpp convert failed: {r.stderr[-2000:]}"
    return out


def _reference_model(src: Path, gguf_path: Path):
    """transformers' model of ``src`` holding the GGUF's (dequantized) values of its Q8_0 matrices."""
    import torch
    from gguf import GGMLQuantizationType, quants

    from hf2q.formats.gguf_file import open_gguf
    from tests.models.deepseek4 import load_transformers_model

    model = load_transformers_model(src)
    params = dict(model.named_parameters())
    replaced = 0
    for name, t in open_gguf(gguf_path).tensors.items():
        if t.qtype != GGMLQuantizationType.Q8_0:
            continue
        _, layer, base, _ = name.split(".")
        values = quants.dequantize(np.asarray(t.data), t.qtype).reshape(t.shape)
        with torch.no_grad():
            params[f"model.layers.{layer}.{_Q8_NAMES[base]}.weight"].copy_(torch.from_numpy(values))
        replaced += 1
    assert replaced >= 8 * 4  # every layer's FP8 matrices
    return model


def deepseek4_gguf() -> Path:
    """llama.cpp's f32 conversion of the tiny fixture, kept beside the checkpoint (the converter is most
    of this module's time)."""
    from tests.models.cache import build_once
    from tests.models.deepseek4 import deepseek4_checkpoint

    src = deepseek4_checkpoint()
    return build_once(f"{src.name}-llamacpp-f32", lambda out: _llama_cpp_convert(src, out / "f32.gguf")) / "f32.gguf"


@pytest.fixture(scope="module")
def deepseek4():
    """(GGUF path, transformers reference model, prompt + greedy continuation tokens, their logits)."""
    import torch

    from tests.models.deepseek4 import deepseek4_checkpoint

    gguf_path = deepseek4_gguf()
    model = _reference_model(deepseek4_checkpoint(), gguf_path)
    prompt = random_tokens(PROMPT, low=3, high=49152, seed=11)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=DECODE, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        tokens = out[0].tolist()
        logits = model(torch.tensor([tokens])).logits[0].numpy()
    return gguf_path, model, tokens, logits


@pytest.fixture(scope="module")
def runner(deepseek4):
    return MlxModelRunner.load(deepseek4[0])


def _close(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max())


def test_prefill_matches_transformers(deepseek4, runner):
    _, _, tokens, ref = deepseek4
    assert not runner.trims_prefix  # the compact cache returns to its reuse points only
    from hf2q.engine.memory_plan import kv_need

    # the header-only plan (serve's memory check, hf2q info) is what admission reserves
    need = kv_need(runner.gguf.hparams, 4)
    assert (need.per_token, need.window_bytes()) == (runner.kv_bytes_per_token, runner.kv_bytes_per_slot)
    seq = runner.new_sequence()
    ours = runner.verify(seq, tokens[:PROMPT])  # every position's logits
    assert _close(ours, ref[:PROMPT]) < TOL


def test_chunked_prefill_and_decode_match(deepseek4, runner):
    """A prompt split mid-window into two transactions, then greedy decode steps through the cache."""
    _, _, tokens, ref = deepseek4
    seq = runner.new_sequence()
    first = runner.prefill(seq, tokens[:70])  # 70: mid-window for ratio 4 (70 % 4 = 2) and before 128
    second = runner.prefill(seq, tokens[70:PROMPT])
    assert _close(first, ref[69]) < TOL and _close(second, ref[PROMPT - 1]) < TOL
    assert int(np.argmax(second)) == tokens[PROMPT]  # transformers' first greedy token
    for j, t in enumerate(tokens[PROMPT:-1]):
        step = runner.decode([seq], [t])[0]
        assert _close(step, ref[PROMPT + j]) < TOL, f"decode step {j}"
        assert int(np.argmax(step)) == tokens[PROMPT + j + 1]


def test_trim_inside_the_last_forward_and_export_import_stay_exact(deepseek4, runner):
    """Trimming back inside the last forward (across a closed block of the sparse layers) and re-feeding
    gives the same logits; a cache trimmed and continued with other tokens is what a fresh one of that
    text gives; exported and imported blocks continue exactly."""
    _, _, tokens, ref = deepseek4
    a = runner.new_sequence()
    runner.prefill(a, tokens[:PROMPT + 3])
    a.trim(PROMPT - 7)
    again = runner.prefill(a, tokens[PROMPT - 7:PROMPT])
    assert _close(again, ref[PROMPT - 1]) < TOL
    other = random_tokens(30, low=3, high=49152, seed=12)
    d, fresh = runner.new_sequence(), runner.new_sequence()
    runner.prefill(d, tokens[:PROMPT])
    d.trim(101)
    assert _close(runner.prefill(d, other), runner.prefill(fresh, tokens[:101] + other)) < 1e-5
    # the persistent store's restore: trimmed, then another text's blocks imported back to the same length
    text = tokens[:101] + random_tokens(PROMPT - 101, low=3, high=49152, seed=13)
    source, e, same = runner.new_sequence(), runner.new_sequence(), runner.new_sequence()
    runner.prefill(source, text)
    runner.prefill(e, tokens[:PROMPT])
    e.trim(101)
    e.import_(source.export(101, PROMPT), PROMPT - 101)
    runner.prefill(same, text)
    assert _close(runner.decode([e], [7])[0], runner.decode([same], [7])[0]) < 1e-5
    # one forward's state in two blocks (the first ends mid-block), imported into an empty cache
    f, c = runner.new_sequence(), runner.new_sequence()
    runner.prefill(f, tokens[:PROMPT])
    c.import_(f.export(0, 65), 65)
    c.import_(f.export(65, PROMPT), PROMPT - 65)
    assert _close(runner.decode([c], [tokens[PROMPT]])[0], ref[PROMPT]) < TOL


LONG = 700  # past two reuse-point intervals (256) and five heavily compressed blocks (128)


@pytest.fixture(scope="module")
def long_text(runner):
    """A long prompt, its greedy decode steps' logits from one cache, and that cache (decoded on)."""
    text = random_tokens(LONG, low=3, high=49152, seed=21)
    seq = runner.new_sequence()
    for start in range(0, LONG, 256 + 37):  # chunks that end mid-block and mid-interval
        logits = runner.prefill(seq, text[start:start + 256 + 37])
    steps = [logits]
    for _ in range(DECODE):
        text.append(int(np.argmax(logits)))
        logits = runner.decode([seq], [text[-1]])[0]
        steps.append(logits)
    return text, steps, seq


def test_long_prompt_chunks_and_decode_match_one_forward(runner, long_text):
    """700 tokens in three chunks, then 8 decode steps, through the compact cache: every step's logits
    are those one forward over the whole text gives."""
    text, steps, _ = long_text
    whole = runner.verify(runner.new_sequence(), text)
    for j, step in enumerate(steps):
        assert _close(step, whole[LONG - 1 + j]) < 4e-5, f"step {j}"


def test_reuse_points_equal_cold_and_rows_batch_as_alone(deepseek4, runner, long_text):
    """The long cache returns to its reuse points (chunk ends, every 256 tokens) and continues as a cold
    prefill of that prefix does; a length it no longer holds is refused; two rows at different lengths
    (different window starts and entry counts, blocks closing at different steps) decode in one batch
    as each does alone."""
    from hf2q.engine.kv_cache import PrefixNotReusable

    text, _, seq = long_text
    points = seq.reuse_points()
    assert {0, 293, 512, 586, 700, LONG + DECODE} <= set(points)
    with pytest.raises(PrefixNotReusable, match="can return to"):
        seq.trim(400)
    other = random_tokens(20, low=3, high=49152, seed=22)
    cold = {}
    for point in (586, 293):
        seq.trim(point)
        assert max(seq.reuse_points()) == point
        cold[point] = runner.new_sequence()
        assert _close(runner.prefill(seq, other), runner.prefill(cold[point], text[:point] + other)) < 4e-5
    _, _, tokens, _ = deepseek4
    short, short_alone = runner.new_sequence(), runner.new_sequence()
    runner.prefill(short, tokens[:PROMPT - 3])
    runner.prefill(short_alone, tokens[:PROMPT - 3])
    for t in random_tokens(6, low=3, high=49152, seed=23):
        both = runner.decode([seq, short], [t, t])
        assert _close(both[0], runner.decode([cold[293]], [t])[0]) < 4e-5  # (cold: one forward, not chunks)
        assert _close(both[1], runner.decode([short_alone], [t])[0]) < 1e-5


def test_a_prompt_end_outlives_a_long_reply(deepseek4, runner):
    """A reply longer than the kept points (here at an 8-token interval) pushes the prompt's end out of
    them; its copy is kept, and a next turn returning there continues as a cold prefill does."""
    from hf2q.engine.models.deepseek4_cache import Deepseek4Cache
    from hf2q.engine.models.deepseek4_layout import layer_rows

    _, _, tokens, _ = deepseek4
    geo = runner.model.geo
    seq = Deepseek4Cache(layer_rows(geo.head_dim, geo.index_dim, runner.model.cfg.compress_ratios), geo.window,
                         runner.dtype, interval=8)
    runner.prefill(seq, tokens[:PROMPT])
    for t in random_tokens(5 * 8, low=3, high=49152, seed=25):
        runner.decode([seq], [t])
    assert PROMPT not in seq.points and PROMPT in seq.reuse_points()
    seq.trim(PROMPT)
    other = random_tokens(12, low=3, high=49152, seed=26)
    assert _close(runner.prefill(seq, other), runner.prefill(runner.new_sequence(), tokens[:PROMPT] + other)) < 4e-5


def test_slot_bytes_stay_bounded_as_the_context_grows(runner):
    """From 1,000 to 3,000 tokens a slot grows by the compressed entries only (within the plan's
    per-token figure), and stays inside what admission reserves for it."""
    from hf2q.engine.models.deepseek4_layout import compact_need

    text = random_tokens(3001, low=3, high=49152, seed=24)
    seq, held = runner.new_sequence(), {}
    for start in range(0, 3000, 500):
        runner.prefill(seq, text[start:start + 500])
        if start + 500 in (1000, 3000):
            runner.decode([seq], [text[3000]])  # the step after a prompt lets its chunk's rows go
            held[seq.length - 1] = seq.nbytes
            seq.trim(seq.length - 1)
    per_token, per_slot = runner.kv_bytes_per_token, runner.kv_bytes_per_slot
    need = compact_need(runner.gguf.hparams, 4)
    rounding = sum(256 * lay.entry_width * 4 for lay in need.layers)  # entry buffers grow in 256 steps
    # by 3,000 two chunk ends have aged out of the four newest points: each keeps a copy of its rows
    ends = 2 * sum(lay.snapshot_values(need.window) * 4 for lay in need.layers)
    for n, nbytes in held.items():
        assert nbytes <= n * per_token + per_slot
    assert 2000 * per_token <= held[3000] - held[1000] <= 2000 * per_token + rounding + ends
    # every position's raw rows alone would be more (the cache this replaces held 7 times those)
    assert held[3000] < 3000 * len(need.layers) * need.layers[0].head_dim * 4


@pytest.mark.slow
def test_generate_gives_transformers_greedy_text(deepseek4, cli):
    """``hf2q generate`` at T=0 on the GGUF prints the text of transformers' greedy tokens."""
    import torch

    from hf2q.text.tokenizer import GGUFTokenizer

    gguf_path, model, _, _ = deepseek4
    prompt = " ".join(["The compressor pools every four tokens into one key;"] * 14)
    tok = GGUFTokenizer.from_gguf(gguf_path)
    ids = tok.encode(prompt)
    assert len(ids) > 128
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=DECODE, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(ids):].tolist()
    r = cli("generate", "--model", gguf_path, "--prompt", prompt, "--max-tokens", str(DECODE), "--temperature", "0",
            "--raw", "--ignore-eos")
    assert r.code == 0, r.err
    assert r.out.strip() == tok.decode(out, skip_special=True).strip()
    # drafts verified in one forward and the rejected tail trimmed off: the same text
    r = cli("generate", "--model", gguf_path, "--prompt", prompt, "--max-tokens", str(DECODE), "--temperature", "0",
            "--raw", "--ignore-eos", "--speculative", "ngram")
    assert r.code == 0, r.err
    assert r.out.strip() == tok.decode(out, skip_special=True).strip()


def test_bad_metadata_is_refused_in_one_line(deepseek4):
    from hf2q.errors import InputError
    from hf2q.formats.gguf_check import check_servable
    from hf2q.formats.gguf_file import open_gguf
    from hf2q.formats.gguf_keys import ExtraKeys, Keys

    g = open_gguf(deepseek4[0])
    check_servable(g)
    g.metadata[g.hparams.key(ExtraKeys.COMPRESS_RATIOS)] = [0, 4, 64, 4]
    with pytest.raises(InputError, match="one ratio in"):
        check_servable(g)
    g = open_gguf(deepseek4[0])
    g.metadata[g.hparams.key(Keys.LLM.EXPERT_COUNT)] = 1
    with pytest.raises(InputError, match="expert_used_count 2 is more than"):
        check_servable(g)
    g = open_gguf(deepseek4[0])
    del g.tensors["blk.1.indexer.proj.weight"]
    with pytest.raises(InputError, match="missing tensor 'blk.1.indexer.proj.weight'"):
        check_servable(g)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(1, PROMPT - 1), min_size=1, max_size=3, unique=True))
def test_any_split_into_transactions_gives_one_forwards_logits(deepseek4, runner, cuts):
    """The compressor and indexer state crosses transaction boundaries anywhere (inside a window, across
    the 128-token window edge): each chunk's last logits are the one-shot forward's at that position."""
    _, _, tokens, ref = deepseek4
    seq, start = runner.new_sequence(), 0
    for end in (*sorted(cuts), PROMPT):
        last = runner.prefill(seq, tokens[start:end])
        assert _close(last, ref[end - 1]) < TOL, f"chunk {start}..{end}"
        start = end
