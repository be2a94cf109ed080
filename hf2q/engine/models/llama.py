"""Llama family (SmolLM2, Llama 2/3 shapes): SwiGLU, RMSNorm, GGUF "normal" RoPE.

llama.cpp's converter permutes the q/k rows of Llama checkpoints so that rotary pairs
are adjacent; on GGUF weights that is MLX's ``traditional=True`` RoPE.
"""

from __future__ import annotations

from hf2q.engine.layers import GatedMLP, Linear
from hf2q.engine.models.decoder import DecoderConfig, DecoderModel
from hf2q.errors import InputError
from hf2q.formats.gguf_file import GGUFFile


def common_config(g: GGUFFile, *, traditional: bool) -> DecoderConfig:
    hidden = int(g.require(".embedding_length"))
    n_heads = int(g.require(".attention.head_count"))
    n_kv = g.get(".attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        raise InputError(f"{g.path.name}: per-layer head counts are not supported")
    head_dim = int(g.get(".attention.key_length", hidden // n_heads))
    scaling = g.get(".rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise InputError(f"{g.path.name}: rope scaling {scaling!r} is not supported yet")
    factor = float(g.get(".rope.scaling.factor", 1.0) or 1.0)
    embd = g.tensor("token_embd.weight")
    return DecoderConfig(
        n_layers=int(g.require(".block_count")), hidden=hidden, n_heads=n_heads, n_kv_heads=int(n_kv),
        head_dim=head_dim, vocab=int(embd.shape[0]), n_ctx_train=int(g.get(".context_length", 4096)),
        norm_eps=float(g.get(".attention.layer_norm_rms_epsilon", 1e-6)),
        rope_base=float(g.get(".rope.freq_base", 10000.0)), rope_dims=int(g.get(".rope.dimension_count", head_dim)),
        rope_traditional=traditional, rope_scale=1.0 / factor if scaling == "linear" else 1.0,
    )


def gated_mlp(g: GGUFFile, i: int, dtype, act=None) -> GatedMLP:
    p = f"blk.{i}."
    kw = {"act": act} if act else {}
    return GatedMLP(Linear(g.tensor(p + "ffn_gate.weight"), dtype), Linear(g.tensor(p + "ffn_up.weight"), dtype),
                    Linear(g.tensor(p + "ffn_down.weight"), dtype), **kw)


def build(g: GGUFFile, dtype) -> DecoderModel:
    if "rope_freqs.weight" in g.tensors:
        raise InputError(f"{g.path.name}: Llama 3 rope_freqs scaling is not supported yet")
    cfg = common_config(g, traditional=True)
    return DecoderModel(cfg, g, dtype, lambda i: gated_mlp(g, i, dtype))
