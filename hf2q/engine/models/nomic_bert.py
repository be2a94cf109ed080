"""Nomic-BERT encoders (nomic-embed-text v1 / v1.5) for ``/v1/embeddings``.

BERT's post-LayerNorm encoder with three changes: no learned positions but rotary ones (NeoX
halves over the whole head, base ``rope.freq_base``) applied to Q and K, one fused QKV
projection, and a SwiGLU MLP (``down(silu(gate·x) * up·x)``); no biases in the projections.
Attention is bidirectional; the sentence vector is pooled and normalised as in ``bert``.
"""

from __future__ import annotations

import attrs
import mlx.core as mx

from hf2q.engine.layers import GatedMLP, Linear, layer_norm
from hf2q.engine.models.bert import BertConfig, EncoderModel, check_pooling, norm_pair
from hf2q.formats.gguf_file import GGUFFile


@attrs.define
class NomicBertConfig(BertConfig):
    rope_base: float


class NomicBertLayer:
    def __init__(self, g: GGUFFile, i: int, dtype):
        p = f"blk.{i}."

        def lin(name):
            return Linear(g.tensor(p + name + ".weight"), dtype)

        self.qkv, self.o = lin("attn_qkv"), lin("attn_output")
        self.mlp = GatedMLP.load(*(g.tensor(f"{p}ffn_{n}.weight") for n in ("gate", "up", "down")), dtype)
        self.ln1, self.ln2 = norm_pair(g, p + "attn_output_norm", dtype), norm_pair(g, p + "layer_output_norm", dtype)

    def __call__(self, x: mx.array, mask: mx.array, cfg: NomicBertConfig) -> mx.array:
        B, L, D = x.shape
        hd = D // cfg.n_heads
        qkv = self.qkv(x).reshape(B, L, 3, cfg.n_heads, hd).transpose(2, 0, 3, 1, 4)
        q, k = (mx.fast.rope(t, hd, traditional=False, base=cfg.rope_base, scale=1.0, offset=0) for t in qkv[:2])
        a = mx.fast.scaled_dot_product_attention(q, k, qkv[2], scale=hd ** -0.5, mask=mask)
        x = layer_norm(x + self.o(a.transpose(0, 2, 1, 3).reshape(B, L, D)), *self.ln1, cfg.eps)
        return layer_norm(x + self.mlp(x), *self.ln2, cfg.eps)


def build(g: GGUFFile, dtype) -> EncoderModel:
    hp = g.hparams
    n_heads, _ = hp.uniform_heads()
    cfg = NomicBertConfig(n_layers=hp.n_layers, hidden=hp.hidden, n_heads=n_heads,
                          vocab=int(g.tensor("token_embd.weight").shape[0]), n_ctx_train=hp.n_ctx_train,
                          eps=hp.norm_eps, rope_base=hp.rope_base, pooling=check_pooling(g))
    return EncoderModel(cfg, g, dtype, [NomicBertLayer(g, i, dtype) for i in range(cfg.n_layers)])
