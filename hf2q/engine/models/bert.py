"""BERT encoders (all-MiniLM-L6-v2 and kin) for ``/v1/embeddings``.

Post-LayerNorm encoder with biased projections and erf-GELU, bidirectional attention;
the sentence vector is the mean (``pooling_type`` 1) or the CLS token (2) of the last
hidden states, L2-normalised — what sentence-transformers does for these models. A
batch is sorted by length and run in groups of similar lengths, each padded to its
longest input; padding is masked out of attention and of the mean.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import mlx.core as mx
import numpy as np

from hf2q.engine.layers import Linear, float_array, gelu_erf, layer_norm
from hf2q.errors import InputError
from hf2q.formats.gguf_file import GGUFFile


@attrs.define
class BertConfig:
    n_layers: int
    hidden: int
    n_heads: int
    vocab: int
    n_ctx_train: int
    eps: float
    pooling: int


def norm_pair(g: GGUFFile, name: str, dtype) -> tuple[mx.array, mx.array]:
    """A LayerNorm's weight and bias."""
    return float_array(g.tensor(name + ".weight"), dtype), float_array(g.tensor(name + ".bias"), dtype)


class BertLayer:
    def __init__(self, g: GGUFFile, i: int, dtype):
        p = f"blk.{i}."

        def lin(name):
            bias = g.tensors.get(p + name + ".bias")
            return Linear(g.tensor(p + name + ".weight"), dtype, None if bias is None else float_array(bias, dtype))

        self.q, self.k, self.v, self.o = lin("attn_q"), lin("attn_k"), lin("attn_v"), lin("attn_output")
        self.up, self.down = lin("ffn_up"), lin("ffn_down")
        self.ln1, self.ln2 = norm_pair(g, p + "attn_output_norm", dtype), norm_pair(g, p + "layer_output_norm", dtype)

    def __call__(self, x: mx.array, mask: mx.array, cfg: BertConfig) -> mx.array:
        B, L, D = x.shape
        hd = D // cfg.n_heads
        q, k, v = (t(x).reshape(B, L, cfg.n_heads, hd).transpose(0, 2, 1, 3) for t in (self.q, self.k, self.v))
        a = mx.fast.scaled_dot_product_attention(q, k, v, scale=hd ** -0.5, mask=mask)
        x = layer_norm(x + self.o(a.transpose(0, 2, 1, 3).reshape(B, L, D)), *self.ln1, cfg.eps)
        return layer_norm(x + self.down(gelu_erf(self.up(x))), *self.ln2, cfg.eps)


class EncoderModel:
    """What the BERT-style encoders share: token (and type-0) embeddings under a LayerNorm, post-norm
    blocks over a padding mask, pooling. A family gives its blocks and may add to the input rows."""

    is_embedding_model = True

    def __init__(self, cfg, g: GGUFFile, dtype, layers: list):
        self.cfg = cfg
        self.dtype = dtype
        self.tok = float_array(g.tensor("token_embd.weight"), dtype)
        self.types = (float_array(g.tensor("token_types.weight"), dtype).reshape(-1, cfg.hidden)  # one row: 1-D
                      if "token_types.weight" in g.tensors else None)
        self.ln = norm_pair(g, "token_embd_norm", dtype)
        self.layers = layers

    def input_rows(self, ids: np.ndarray) -> mx.array:
        return self.tok[mx.array(ids)]

    def embed(self, batch: Sequence[Sequence[int]]) -> mx.array:
        return embed_by_length(batch, self._forward)

    def _forward(self, batch: Sequence[Sequence[int]]) -> mx.array:
        ids, valid = padded_batch(batch)
        x = self.input_rows(ids)
        if self.types is not None:
            x = x + self.types[0]
        x = layer_norm(x, *self.ln, self.cfg.eps)
        mask = mx.array(valid[:, None, None, :])
        for layer in self.layers:
            x = layer(x, mask, self.cfg)
        return pooled_unit_vectors(x, valid, self.cfg.pooling)


class BertModel(EncoderModel):
    def __init__(self, cfg: BertConfig, g: GGUFFile, dtype):
        super().__init__(cfg, g, dtype, [BertLayer(g, i, dtype) for i in range(cfg.n_layers)])
        self.pos = float_array(g.tensor("position_embd.weight"), dtype)

    def input_rows(self, ids: np.ndarray) -> mx.array:
        return super().input_rows(ids) + self.pos[: ids.shape[1]][None]


def check_pooling(g: GGUFFile) -> int:
    pooling = g.hparams.pooling_type
    if pooling not in (1, 2):
        raise InputError(f"{g.path.name}: pooling type {pooling} is not supported (mean or CLS)")
    return pooling


#: inputs per padded forward pass: a batch is sorted by length and cut into groups of this many, so a
#: short text of a large batch is not padded to the longest one
GROUP_ROWS = 32


def embed_by_length(batch: Sequence[Sequence[int]], forward) -> mx.array:
    """``forward(group)`` over groups of similar-length inputs; the vectors come back in input order."""
    if not batch or any(len(t) == 0 for t in batch):
        raise InputError("every embedding input needs at least one token")
    order = sorted(range(len(batch)), key=lambda i: len(batch[i]))
    parts = [forward([batch[i] for i in order[s: s + GROUP_ROWS]]) for s in range(0, len(order), GROUP_ROWS)]
    inverse = np.empty(len(order), dtype=np.int32)
    inverse[order] = np.arange(len(order), dtype=np.int32)
    out = mx.concatenate(parts)[mx.array(inverse)]
    mx.eval(out)
    return out


def padded_batch(batch: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids right-padded to the longest input, and which positions are real tokens."""
    B, L = len(batch), max(len(t) for t in batch)
    ids = np.zeros((B, L), dtype=np.int32)
    valid = np.zeros((B, L), dtype=bool)
    for i, t in enumerate(batch):
        ids[i, : len(t)] = t
        valid[i, : len(t)] = True
    return ids, valid


def pooled_unit_vectors(x: mx.array, valid: np.ndarray, pooling: int) -> mx.array:
    """The mean of the real tokens' states (pooling 1) or the first token's (2), L2-normalised."""
    x = x.astype(mx.float32)
    if pooling == 2:
        pooled = x[:, 0, :]
    else:
        w = mx.array(valid.astype(np.float32))[..., None]
        pooled = (x * w).sum(axis=1) / w.sum(axis=1)
    out = pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    mx.eval(out)
    return out


def build(g: GGUFFile, dtype) -> BertModel:
    hp = g.hparams
    n_heads, _ = hp.uniform_heads()
    positions = int(g.tensor("position_embd.weight").shape[0])  # no input may go past the learned positions
    cfg = BertConfig(n_layers=hp.n_layers, hidden=hp.hidden, n_heads=n_heads,
                     vocab=int(g.tensor("token_embd.weight").shape[0]),
                     n_ctx_train=min(hp.n_ctx_train, positions), eps=hp.norm_eps, pooling=check_pooling(g))
    return BertModel(cfg, g, dtype)
