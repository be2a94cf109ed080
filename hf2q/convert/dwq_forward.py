"""A differentiable MLX forward pass for the decoder families DWQ can fit: llama (SmolLM2) and qwen3.

DWQ needs gradients of the next-token distribution with respect to the per-group scales and
biases of an mlx-lm affine quantization, so the forward has to run on the very arrays that end up
in the output directory (names after mlx-lm's sanitize, packed codes, scales, biases) rather than
on a module tree. Every function here is pure: weights come in as one flat ``name → array`` mapping
(float weights as ``X.weight``; a quantized module as ``X.weight`` codes plus ``X.scales`` and
``X.biases``), so ``mx.value_and_grad`` can differentiate with respect to any subset of it. The
same code runs the teacher (float weights) and the student (quantized weights).

Qwen3 differs from llama only by its per-head RMSNorm on queries and keys before RoPE.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hf2q.errors import InputError

FAMILIES = ("llama", "qwen3")


@attrs.frozen
class Decoder:
    """The shape facts the forward needs, read once from config.json."""

    family: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    eps: float
    tied: bool

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"


@attrs.frozen
class QuantLayout:
    """How each quantized module is packed: mlx-lm's ``quantization`` block (defaults + overrides)."""

    bits: int
    group_size: int
    overrides: Mapping[str, tuple[int, int]] = attrs.field(factory=dict)

    def of(self, module: str) -> tuple[int, int]:
        return self.overrides.get(module, (self.bits, self.group_size))

    @classmethod
    def from_config(cls, q: Mapping[str, Any]) -> QuantLayout:
        over = {k: (int(v["bits"]), int(v["group_size"])) for k, v in q.items() if isinstance(v, dict)}
        return cls(int(q["bits"]), int(q["group_size"]), over)


def _rope_theta(cfg: Mapping[str, Any]) -> float:
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict):
        kind = rp.get("rope_type", "default")
        if kind != "default":
            raise InputError(f"DWQ's forward supports plain RoPE only; this model uses rope_type {kind!r}")
        if "rope_theta" in rp:
            return float(rp["rope_theta"])
    rs = cfg.get("rope_scaling")
    if isinstance(rs, dict) and rs.get("rope_type", rs.get("type", "default")) != "default":
        raise InputError("DWQ's forward supports plain RoPE only; this model sets rope_scaling")
    return float(cfg.get("rope_theta", 10000.0))


def decoder(cfg: Mapping[str, Any]) -> Decoder:
    """The Decoder of an HF config; InputError for a family or feature the forward does not implement."""
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise InputError(f"DWQ supports model types {', '.join(FAMILIES)}; this model is {family!r} "
                         "(use a plain --quant mlx-N instead)")
    n_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return Decoder(
        family=family, n_layers=int(cfg["num_hidden_layers"]), n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or hidden // n_heads), rope_theta=_rope_theta(cfg),
        eps=float(cfg.get("rms_norm_eps", 1e-6)), tied=bool(cfg.get("tie_word_embeddings", False)))


def _linear(w: Mapping[str, Any], module: str, x, linear):
    y = linear(w, module, x)
    bias = w.get(f"{module}.bias")
    return y if bias is None else y + bias


def _embed(mx, w: Mapping[str, Any], tokens, layout: QuantLayout | None):
    module = "model.embed_tokens"
    if f"{module}.scales" not in w:
        return w[f"{module}.weight"][tokens]
    bits, gs = layout.of(module)  # type: ignore[union-attr]
    return mx.dequantize(w[f"{module}.weight"][tokens], w[f"{module}.scales"][tokens],
                         w[f"{module}.biases"][tokens], group_size=gs, bits=bits)


def _attention(mx, dec: Decoder, w, p: str, x, linear):
    b, n, _ = x.shape
    q = _linear(w, f"{p}.q_proj", x, linear).reshape(b, n, dec.n_heads, dec.head_dim)
    k = _linear(w, f"{p}.k_proj", x, linear).reshape(b, n, dec.n_kv_heads, dec.head_dim)
    v = _linear(w, f"{p}.v_proj", x, linear).reshape(b, n, dec.n_kv_heads, dec.head_dim)
    if dec.qk_norm:
        q = mx.fast.rms_norm(q, w[f"{p}.q_norm.weight"], dec.eps)
        k = mx.fast.rms_norm(k, w[f"{p}.k_norm.weight"], dec.eps)
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
    q = mx.fast.rope(q, dec.head_dim, traditional=False, base=dec.rope_theta, scale=1.0, offset=0)
    k = mx.fast.rope(k, dec.head_dim, traditional=False, base=dec.rope_theta, scale=1.0, offset=0)
    o = mx.fast.scaled_dot_product_attention(q, k, v, scale=dec.head_dim ** -0.5, mask="causal")
    return _linear(w, f"{p}.o_proj", o.transpose(0, 2, 1, 3).reshape(b, n, -1), linear)


def _mlp(mx, w, p: str, x, linear):
    gate = _linear(w, f"{p}.gate_proj", x, linear)
    up = _linear(w, f"{p}.up_proj", x, linear)
    return _linear(w, f"{p}.down_proj", gate * mx.sigmoid(gate) * up, linear)


def logits(dec: Decoder, w: Mapping[str, Any], tokens, linear, layout: QuantLayout | None = None):
    """Next-token logits (float32, shape ``tokens.shape + (vocab,)``) for a batch of token rows.

    ``linear(w, module, x)`` computes ``x · Wᵀ`` for a module (``hf2q.convert.dwq_matmul``); ``layout``
    says how a quantized embedding is packed.
    """
    import mlx.core as mx

    h = _embed(mx, w, tokens, layout).astype(mx.float32)
    for i in range(dec.n_layers):
        p = f"model.layers.{i}"
        x = mx.fast.rms_norm(h, w[f"{p}.input_layernorm.weight"], dec.eps)
        h = h + _attention(mx, dec, w, f"{p}.self_attn", x, linear)
        x = mx.fast.rms_norm(h, w[f"{p}.post_attention_layernorm.weight"], dec.eps)
        h = h + _mlp(mx, w, f"{p}.mlp", x, linear)
    h = mx.fast.rms_norm(h, w["model.norm.weight"], dec.eps)
    head = "model.embed_tokens" if dec.tied else "lm_head"
    return _linear(w, head, h, linear).astype(mx.float32)
