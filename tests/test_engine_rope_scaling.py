"""RoPE frequency scaling (Llama 3 ``rope_freqs``, linear, YaRN) against transformers and llama.cpp.

Tiny random-weight Llama checkpoints whose original context is 64 tokens (and a Gemma 3 one with
linear scaling on its global layer only), so the scaling
changes the rotation of most pairs well inside a 200-token prompt, are converted with
``hf2q convert -q f32``; our logits (a 100-token prefill, an 80-token chunk on top, then 20
single-token decode steps, i.e. positions 99…199) must equal transformers' within 1e-4 on the
MLX graph and on the host (numpy) decode step. The converter's ``rope_freqs.weight`` and
rope metadata must equal what llama.cpp's ``convert_hf_to_gguf.py`` writes for the same folder.
"""

from __future__ import annotations

import math

import hf2q.engine  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from hf2q.errors import InputError
from tests.engine_support import convert_f32, load_runner, random_tokens

TOL = 1e-4
# Gemma 3 (4B and up): linear scaling on the global layers only, the sliding layers keep their plain rope
VARIANTS = ("llama_rope_llama3", "llama_rope_linear", "llama_rope_yarn", "gemma3_rope_linear")
N_TOKENS = 200


@pytest.fixture(scope="module")
def scaled(tiny_checkpoint, tmp_path_factory):
    """variant → (GGUF path, HF folder, transformers logits [200, vocab] of the shared prompt)."""
    made = {}

    def get(variant: str):
        if variant not in made:
            import torch
            import transformers

            src = tiny_checkpoint(variant)
            gguf = convert_f32(src, tmp_path_factory.mktemp(variant) / f"{variant}.gguf")
            model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
            with torch.no_grad():
                ref = model(torch.tensor([random_tokens(N_TOKENS)])).logits[0].numpy()
            made[variant] = (gguf, src, ref)
        return made[variant]

    return get


@pytest.mark.parametrize("path", ["mlx", "host"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers_beyond_original_context(variant, path, scaled):
    gguf, src, ref = scaled(variant)
    tokens = random_tokens(N_TOKENS)
    runner = load_runner(gguf, src)
    if path == "mlx":
        runner.host_decoder = None
    else:
        assert runner.host_decoder is not None, "host decode step not used for a rope-scaled llama on CPU"
    seq = runner.new_sequence()
    got = runner.prefill(seq, tokens[:100])
    assert np.abs(got - ref[99]).max() < TOL
    got = runner.prefill(seq, tokens[100:180])
    assert np.abs(got - ref[179]).max() < TOL
    for i, t in enumerate(tokens[180:]):
        got = runner.decode([seq], [t])[0]
        assert np.abs(got - ref[180 + i]).max() < TOL, f"decode step at position {180 + i}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_scaling_changes_the_logits(variant, scaled, tiny_checkpoint):
    """The same weights with plain RoPE give clearly different logits: the test above can fail."""
    import torch
    import transformers

    _, src, ref = scaled(variant)
    config = transformers.AutoConfig.from_pretrained(src)
    rope = dict(config.rope_parameters)
    if "full_attention" in rope:
        rope["full_attention"] = {"rope_type": "default", "rope_theta": rope["full_attention"]["rope_theta"]}
    else:
        rope = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    config.rope_parameters = rope
    plain = transformers.AutoModelForCausalLM.from_pretrained(src, config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        other = plain(torch.tensor([random_tokens(N_TOKENS)])).logits[0].numpy()
    assert np.abs(other[100:] - ref[100:]).max() > 0.1


# ---- the rules themselves, against transformers' rope initialisers, on real model shapes

LLAMA31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("rope, head_dim", [
    (LLAMA31, 128),  # Llama 3.1 8B
    ({**LLAMA31, "factor": 32.0}, 64),  # Llama 3.2 1B
    ({**LLAMA31, "rope_theta": 10000.0, "original_max_position_embeddings": 64}, 16),  # the tiny checkpoint
])
def test_llama3_divisors_match_transformers(rope, head_dim):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from hf2q.arch.llama import llama3_rope_divisors

    config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, rope_parameters=rope)
    inv_scaled, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    divisors = llama3_rope_divisors(rope, head_dim)
    assert divisors.dtype == np.float32 and divisors.shape == (head_dim // 2,)
    np.testing.assert_allclose(plain / divisors, inv_scaled.double().numpy(), rtol=2e-6)
    assert attention_factor == 1.0
    assert divisors.min() == 1.0 and divisors.max() == rope["factor"]  # both ends of the rule are reached


def _gguf_with(metadata: dict, tensors: dict | None = None):
    """An in-memory GGUFFile holding just what ``common_config`` reads (no weights)."""
    from pathlib import Path

    from gguf import GGMLQuantizationType as T

    from hf2q.formats.gguf_file import GGUFFile, GGUFTensor

    embd = np.zeros((8, 4), dtype=np.float32)
    all_tensors = {"token_embd.weight": GGUFTensor("token_embd.weight", T.F32, embd.shape, embd, embd.nbytes)}
    all_tensors.update(tensors or {})
    md = {"general.architecture": "llama", "llama.block_count": 1, **metadata}
    return GGUFFile(Path("test.gguf"), md, all_tensors, 0)


def test_yarn_periods_and_temperature_match_transformers():
    """Qwen3's documented YaRN setting (factor 4 over 32k, base 1e6, head_dim 128)."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from hf2q.engine.models.llama import common_config

    head_dim, base, factor, orig = 128, 1_000_000.0, 4.0, 32768
    g = _gguf_with({"llama.embedding_length": head_dim * 4, "llama.attention.head_count": 4,
                    "llama.rope.freq_base": base, "llama.rope.scaling.type": "yarn",
                    "llama.rope.scaling.factor": factor, "llama.rope.scaling.original_context_length": orig})
    cfg = common_config(g, traditional=False)
    config = transformers.LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=int(orig * factor),
        rope_parameters={"rope_type": "yarn", "rope_theta": base, "factor": factor,
                         "original_max_position_embeddings": orig})
    inv, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    np.testing.assert_allclose(1.0 / np.array(cfg.rope_freqs, dtype=np.float64), inv.double().numpy(), rtol=2e-6)
    assert math.isclose(cfg.attn_scale, head_dim ** -0.5 * attention_factor ** 2, rel_tol=1e-6)
    assert cfg.rope_scale == 1.0  # the interpolation is inside the periods, not a position scale


# ---- what is refused, with one line

@pytest.mark.parametrize("extra, message", [
    ({"llama.rope.scaling.type": "longrope"}, "rope scaling 'longrope' is not supported"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
      "llama.rope.scaling.original_context_length": 64, "llama.rope.scaling.yarn_ext_factor": 0.5},
     "yarn_ext_factor"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
      "llama.rope.scaling.original_context_length": 64, "llama.rope.scaling.yarn_log_multiplier": 0.1},
     "yarn_log_multiplier"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, "original_context_length"),
])
def test_unsupported_rope_scaling_is_an_input_error(extra, message):
    from hf2q.engine.models.llama import common_config

    g = _gguf_with({"llama.embedding_length": 64, "llama.attention.head_count": 4, **extra})
    with pytest.raises(InputError, match=message) as info:
        common_config(g, traditional=True)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("values", [np.ones(3, dtype=np.float32), np.array([1, 0, 8, 8], dtype=np.float32)])
def test_bad_rope_freqs_tensor_is_an_input_error(values):
    from gguf import GGMLQuantizationType as T

    from hf2q.engine.models.llama import common_config
    from hf2q.formats.gguf_file import GGUFTensor

    t = GGUFTensor("rope_freqs.weight", T.F32, values.shape, values, values.nbytes)
    g = _gguf_with({"llama.embedding_length": 32, "llama.attention.head_count": 4}, {"rope_freqs.weight": t})
    with pytest.raises(InputError, match="rope_freqs"):
        common_config(g, traditional=True)


def test_rope_freqs_become_mlx_periods():
    """``rope_freqs`` divides each pair's angle (llama.cpp); MLX's ``freqs`` are periods: base^(2i/d)·divisor."""
    from gguf import GGMLQuantizationType as T

    from hf2q.engine.models.llama import common_config
    from hf2q.formats.gguf_file import GGUFTensor

    values = np.array([1.0, 2.0, 4.0, 8.0], dtype=np.float32)
    t = GGUFTensor("rope_freqs.weight", T.F32, values.shape, values, values.nbytes)
    g = _gguf_with({"llama.embedding_length": 32, "llama.attention.head_count": 4, "llama.rope.freq_base": 100.0},
                   {"rope_freqs.weight": t})
    cfg = common_config(g, traditional=True)
    expected = 100.0 ** (np.arange(4) * 2.0 / 8) * values
    np.testing.assert_allclose(np.array(cfg.rope_freqs), expected, rtol=1e-6)
    # MLX's rope with these periods equals rotating by hand with angle p / period
    x = mx.random.normal((1, 1, 3, 8), key=mx.random.key(0))
    got = np.array(mx.fast.rope(x, 8, traditional=True, base=None, scale=1.0, offset=5, freqs=cfg.rope_freqs))
    xn = np.array(x)[0, 0]
    ang = (5 + np.arange(3))[:, None] / expected[None, :]
    want = np.empty_like(xn)
    want[:, 0::2] = xn[:, 0::2] * np.cos(ang) - xn[:, 1::2] * np.sin(ang)
    want[:, 1::2] = xn[:, 0::2] * np.sin(ang) + xn[:, 1::2] * np.cos(ang)
    assert np.abs(got[0, 0] - want).max() < 1e-5


# ---- the converter against llama.cpp's

@pytest.mark.slow
@pytest.mark.llamacpp
@pytest.mark.parametrize("variant", VARIANTS)
def test_rope_tensors_and_metadata_equal_llama_cpp_converter(variant, scaled):
    from tests.test_llamacpp_parity import llamacpp_reference, read_gguf

    gguf, src, _ = scaled(variant)
    ref_kv, ref_tensors = read_gguf(llamacpp_reference(src, "f32"))
    our_kv, our_tensors = read_gguf(gguf)
    assert set(our_tensors) == set(ref_tensors)
    assert ("rope_freqs.weight" in our_tensors) == (variant == "llama_rope_llama3")
    if "rope_freqs.weight" in ref_tensors:
        assert our_tensors["rope_freqs.weight"] == ref_tensors["rope_freqs.weight"]  # type, shape, bytes
    rope_keys = {k for k in set(ref_kv) | set(our_kv) if ".rope." in k}
    assert rope_keys and {k: our_kv.get(k) for k in rope_keys} == {k: ref_kv.get(k) for k in rope_keys}


# ---- the command line: a Llama 3 GGUF generates; an unknown scaling is one line, exit 3

def test_generate_runs_a_llama3_rope_freqs_gguf(scaled, cli):
    gguf, _, _ = scaled("llama_rope_llama3")
    res = cli("generate", "--model", gguf, "--prompt", "one two three " * 30, "--raw", "--max-tokens", "8",
              "--temperature", "0")
    assert res.code == 0, res.err
    assert res.out.strip()


def _copy_with(src, dst, changes: dict):
    """Rewrite an F32 GGUF with some metadata keys changed (value types inferred from Python types)."""
    from gguf import GGUFValueType as V
    from gguf import GGUFWriter

    from hf2q.formats.gguf_file import open_gguf

    g = open_gguf(src)
    w = GGUFWriter(str(dst), g.arch)
    scalar = {bool: V.BOOL, int: V.UINT32, float: V.FLOAT32, str: V.STRING}
    for key, value in {**g.metadata, **changes}.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if isinstance(value, list):
            w.add_key_value(key, value, V.ARRAY, V.STRING if isinstance(value[0], str) else V.INT32)
        else:
            w.add_key_value(key, value, scalar[type(value)])
    for name, t in g.tensors.items():
        w.add_tensor(name, np.asarray(t.data).reshape(t.shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("changes, message", [
    ({"llama.rope.scaling.type": "longrope"}, "rope scaling 'longrope' is not supported"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.original_context_length": 64,
      "llama.rope.scaling.yarn_ext_factor": 0.5}, "yarn_ext_factor 0.5 is not supported"),
])
def test_generate_refuses_unsupported_rope_scaling(changes, message, scaled, tmp_path, cli):
    from tests.test_engine_errors import _assert_one_line

    gguf, _, _ = scaled("llama_rope_linear")
    path = _copy_with(gguf, tmp_path / "scaled.gguf", changes)
    res = cli("generate", "--model", path, "--prompt", "hi", "--raw", "--max-tokens", "2")
    _assert_one_line(res)
    assert message in res.err
    info = cli("info", path)  # the static preflight reaches the same verdict
    assert info.out.strip().splitlines()[-1].startswith("Serve support: rejected") and message in info.out
