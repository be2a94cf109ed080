"""Nomic-BERT MoE encoders (nomic-embed-text v2) for ``/v1/embeddings``.

llama.cpp's graph for ``nomic-bert-moe``: the nomic-bert post-norm encoder (NeoX rotary Q/K, one fused
QKV) with biased projections, and two kinds of MLP. Blocks ``i % moe_every_n_layers == 1`` route each
token to ``expert_used_count`` experts by a softmax over the router logits, weighted by those
probabilities as they are (not renormalised), each expert ``down(gelu(up·x))`` without biases; the
other blocks run a biased ``down(gelu(up·x + b)) + b``. GELU is the tanh form llama.cpp's
``ggml_gelu`` computes.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np

from hf2q.engine import layers
from hf2q.engine.expert_route import HostSort
from hf2q.engine.layers import Linear, float_array, gelu_tanh, host_rows, on_cpu
from hf2q.engine.models.bert import EncoderModel, check_pooling, norm_pair
from hf2q.engine.models.nomic_bert import NomicBertConfig, NomicBertLayer
from hf2q.formats.gguf_file import GGUFFile
from hf2q.kernels import cpu_blas
from hf2q.formats.gguf_hparams import moe_block
from hf2q.formats.gguf_keys import Keys


@attrs.define
class NomicMoeConfig(NomicBertConfig):
    top_k: int
    moe_every: int


class ExpertMLP:
    """Softmax router → top-k experts, each ``down(gelu(up·x))``, summed by their router probabilities.

    On the CPU a batch of many tokens runs expert by expert: the (token, expert) pairs sorted by expert, one
    host BLAS product per expert over its tokens. MLX's gather-matmul there is a matrix-vector product per pair,
    which reads a whole expert matrix for every token it routes; grouped, each expert is read once per block.
    Padding positions (:class:`LiveRows` of the block's mask) are left out there: they are never a key
    of attention nor part of the pooled mean, so their expert output is never read.
    """

    def __init__(self, g: GGUFFile, p: str, dtype, top_k: int, live: "LiveRows"):
        self.router = Linear(g.tensor(p + "ffn_gate_inp.weight"), dtype)
        self.up = Linear(g.tensor(p + "ffn_up_exps.weight"), dtype)
        self.down = Linear(g.tensor(p + "ffn_down_exps.weight"), dtype)
        self.top_k = top_k
        self.n_experts = int(self.up.shape[0])
        self.live = live
        #: the padding mask of the forward the next call is part of (None: every position is live)
        self.mask: mx.array | None = None

    def __call__(self, x: mx.array) -> mx.array:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = mx.softmax(self.router(flat).astype(mx.float32), axis=-1, precise=True)
        idx = mx.argpartition(-probs, kth=self.top_k - 1, axis=-1)[:, :self.top_k]
        weights = mx.take_along_axis(probs, idx, axis=-1)
        if on_cpu() and layers._observer is None and flat.shape[0] > 1:
            out = self._by_expert(flat, idx)
        else:  # one fused gather-matmul (and the imatrix observer's per-expert hook)
            h = gelu_tanh(self.up.gather(flat[:, None, None, :], idx))  # [N, k, 1, ff]
            out = self.down.gather(h, idx)[:, :, 0, :]  # [N, k, hidden]
        return (out * weights[..., None].astype(out.dtype)).sum(axis=1).reshape(shape)

    def _by_expert(self, flat: mx.array, idx: mx.array) -> mx.array:
        """``[N, k, hidden]``: every live (token, slot) pair through its expert, the pairs grouped by expert;
        zeros for padding."""
        n, k = idx.shape
        live = np.arange(n) if self.mask is None else self.live.of(self.mask)
        kept = (live[:, None] * k + np.arange(k)).reshape(-1)  # pair numbers, token-major
        sort = HostSort.of(np.array(idx).reshape(-1)[kept], self.n_experts)
        order = kept[sort.order]
        out = np.zeros((n * k, self.down.shape[1]), dtype=np.float32)
        for e, start, c in zip(sort.experts, sort.starts, sort.counts):
            pairs = order[start:start + c]
            seg = flat[mx.array((pairs // k).astype(np.int32))]
            out[pairs] = np.asarray(_expert_product(self.down, gelu_tanh(_expert_product(self.up, seg, e)), e))
        return mx.array(out).astype(flat.dtype).reshape(n, k, -1)


def _expert_product(lin: Linear, x: mx.array, e: int) -> mx.array:
    """``x @ W[e].T`` for one expert of an expert-stacked weight ``[E, out, in]``: through the host BLAS
    where there is one (MLX's own CPU products are many times slower), a quantized expert dequantized for
    the call (the float32 copies of every expert would not fit the dense-weight cache)."""
    if lin.dtype == mx.float32 and cpu_blas.has_matmul():
        if lin.quantized:
            w = mx.dequantize(lin.weight[e], lin.scales[e], lin.biases[e], group_size=lin.group_size,
                              bits=lin.bits).astype(mx.float32)
            mx.eval(w)
            dense = np.asarray(memoryview(w))
        else:
            dense = np.asarray(memoryview(lin.weight))[e]
        return mx.array(cpu_blas.matmul_t(host_rows(x), dense))
    if lin.quantized:
        return mx.quantized_matmul(x, lin.weight[e], lin.scales[e], lin.biases[e], transpose=True,
                                   group_size=lin.group_size, bits=lin.bits)
    return x @ lin.weight[e].T


class LiveRows:
    """The flattened non-padding positions of a forward's mask, read back from the device once per forward
    (every MoE block of the forward is handed the same mask) and only by a block that groups by expert."""

    def __init__(self):
        self._mask: mx.array | None = None
        self._rows: np.ndarray | None = None

    def of(self, mask: mx.array) -> np.ndarray:
        if mask is not self._mask:
            self._mask, self._rows = mask, np.flatnonzero(np.array(mask).reshape(-1))
        return self._rows


class DenseMLP:
    def __init__(self, lin):
        self.up, self.down = lin("ffn_up"), lin("ffn_down")

    def __call__(self, x: mx.array) -> mx.array:
        return self.down(gelu_tanh(self.up(x)))


class NomicMoeLayer(NomicBertLayer):
    """The nomic-bert block (its forward) over biased projections and this block's kind of MLP."""

    def __init__(self, g: GGUFFile, i: int, dtype, cfg: NomicMoeConfig, live: LiveRows):
        p = f"blk.{i}."

        def lin(name):
            bias = g.tensors.get(p + name + ".bias")
            return Linear(g.tensor(p + name + ".weight"), dtype, None if bias is None else float_array(bias, dtype))

        self.qkv, self.o = lin("attn_qkv"), lin("attn_output")
        self.mlp = ExpertMLP(g, p, dtype, cfg.top_k, live) if moe_block(i, cfg.moe_every) else DenseMLP(lin)
        self.ln1, self.ln2 = norm_pair(g, p + "attn_output_norm", dtype), norm_pair(g, p + "layer_output_norm", dtype)

    def __call__(self, x: mx.array, mask: mx.array, cfg: NomicMoeConfig) -> mx.array:
        if isinstance(self.mlp, ExpertMLP):  # the padding mask [B, 1, 1, L]: which positions are worth routing
            self.mlp.mask = mask
        return super().__call__(x, mask, cfg)


def build(g: GGUFFile, dtype) -> EncoderModel:
    hp = g.hparams
    n_heads, _ = hp.uniform_heads()
    every = int(hp.stored(Keys.LLM.MOE_EVERY_N_LAYERS) or 0)
    cfg = NomicMoeConfig(n_layers=hp.n_layers, hidden=hp.hidden, n_heads=n_heads,
                         vocab=int(g.tensor("token_embd.weight").shape[0]), n_ctx_train=hp.n_ctx_train,
                         eps=hp.norm_eps, rope_base=hp.rope_base, pooling=check_pooling(g),
                         top_k=hp.expert_used_count, moe_every=every)
    live = LiveRows()  # shared by the blocks: one read of the mask per forward
    return EncoderModel(cfg, g, dtype, [NomicMoeLayer(g, i, dtype, cfg, live) for i in range(cfg.n_layers)])
