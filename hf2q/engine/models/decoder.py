"""The decoder-only transformer every chat family shares.

Families differ in a handful of switches — q/k norms, norm placement, embedding
scale, RoPE layout and bases, sliding-window layers, MoE feed-forward — collected in
:class:`DecoderConfig`; each ``models/<family>.py`` reads its GGUF metadata into one and
builds the layers. The forward pass takes a :class:`~hf2q.engine.kv_cache.ForwardBatch`
so the same code serves a prefill chunk of one sequence and a batched decode step.
"""

from __future__ import annotations

from typing import Callable

import attrs
import mlx.core as mx

from hf2q.engine.kv_cache import ForwardBatch
from hf2q.engine.layers import (Linear, load_products, norm_rope, qk_rotation, rms_norm, run_products, silu,
                                step_compiling)
from hf2q.formats.gguf_file import GGUFFile
from hf2q.kernels import cpu_ops


@attrs.define
class DecoderConfig:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    n_ctx_train: int
    norm_eps: float
    rope_base: float
    rope_dims: int
    rope_traditional: bool  # GGUF "normal" rope (llama: q/k rows permuted at convert time)
    rope_scale: float = 1.0  # MLX position scale: 1/factor for linear rope scaling
    # custom per-pair RoPE periods (Llama 3 rope_freqs, YaRN); MLX rotates pair i by
    # position·rope_scale/rope_freqs[i] (then base must be None). Both scalings apply to the
    # layers on rope_base only: layers with their own base (gemma3 local) keep plain RoPE.
    rope_freqs: mx.array | None = None
    rope_base_local: float | None = None  # for sliding-window layers (gemma3)
    sliding_window: int | None = None
    is_local: Callable[[int], bool] = lambda i: False
    qk_norm: bool = False
    sandwich_norms: bool = False  # gemma: post-attention and post-ffn norms
    embed_scale: float = 1.0
    attn_scale: float | None = None  # default 1/sqrt(head_dim)
    final_softcap: float | None = None
    act: Callable = silu


class Attention:
    def __init__(self, cfg: DecoderConfig, g: GGUFFile, i: int, dtype):
        p = f"blk.{i}."
        self.cfg = cfg
        #: [q | k | v] as products: adjacent projections of one quantized layout share one, fused as read
        (self.q, self.k, self.v), self.qkv = load_products([g.tensor(p + f"attn_{n}.weight") for n in "qkv"], dtype)
        self.o = Linear(g.tensor(p + "attn_output.weight"), dtype)
        if cfg.qk_norm:
            self.q_norm = _norm(g, p + "attn_q_norm.weight", dtype)
            self.k_norm = _norm(g, p + "attn_k_norm.weight", dtype)
        self.local = cfg.is_local(i)
        self.window = cfg.sliding_window if self.local else None
        self.base = cfg.rope_base_local if (self.local and cfg.rope_base_local) else cfg.rope_base
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5
        self.layer = i
        self._cpu = mx.default_device() == mx.cpu
        # RoPE's arguments, fixed per layer: scaling applies to the layers on rope_base only (llama.cpp: SWA
        # layers keep plain rope)
        scaled = self.base == cfg.rope_base
        freqs = cfg.rope_freqs if scaled else None
        self._rope = dict(traditional=cfg.rope_traditional, base=None if freqs is not None else self.base,
                          scale=cfg.rope_scale if scaled else 1.0, freqs=freqs)
        #: a decode row's norms and RoPE as one traced graph (``layers.qk_rotation``)
        self._rotate = qk_rotation(cfg.rope_dims, self._rope, cfg.norm_eps, cfg.qk_norm) if step_compiling() else None

    def __call__(self, x: mx.array, fb: ForwardBatch) -> mx.array:
        c = self.cfg
        B, L, _ = x.shape
        if len(self.qkv) == 1:  # one product: its heads split as views (no copy at any batch size)
            y = self.qkv[0][0](x).reshape(B, L, -1, c.head_dim)
            h, hk = c.n_heads, c.n_heads + c.n_kv_heads
            q, k, v = y[:, :, :h], y[:, :, h:hk], y[:, :, hk:]
        else:
            q, k, v = run_products(self.qkv, x)
            q = q.reshape(B, L, c.n_heads, c.head_dim)
            k = k.reshape(B, L, c.n_kv_heads, c.head_dim)
            v = v.reshape(B, L, c.n_kv_heads, c.head_dim)
        return self.o(self.attend_projected(q, k, v, fb))

    def attend(self, q: mx.array, x: mx.array, fb: ForwardBatch) -> mx.array:
        """Queries ``q [B, L, heads, head_dim]`` (before norm and RoPE) over the cache plus this
        chunk's keys and values of ``x``; the heads' outputs ``[B, L, heads·head_dim]``."""
        c = self.cfg
        B, L, _ = x.shape
        k = self.k(x).reshape(B, L, c.n_kv_heads, c.head_dim)
        v = self.v(x).reshape(B, L, c.n_kv_heads, c.head_dim)
        return self.attend_projected(q, k, v, fb)

    def attend_projected(self, q: mx.array, k: mx.array, v: mx.array, fb: ForwardBatch) -> mx.array:
        """:meth:`attend` from the projections ``[B, L, heads, head_dim]``: norms, RoPE, the cache."""
        c = self.cfg
        norms = (self.q_norm, self.k_norm) if c.qk_norm else (None, None)
        if self._rotate is not None and fb.n_new == 1:
            q, k = self._rotate(q, k, fb.offset_array, *norms)
            return self.attend_rotated(q, k, v.transpose(0, 2, 1, 3), fb)
        q, k = norm_rope(q, k, fb.offset, *norms, dims=c.rope_dims, rope=self._rope, eps=c.norm_eps)
        return self.attend_rotated(q, k, v.transpose(0, 2, 1, 3), fb)

    def attend_rotated(self, q: mx.array, k: mx.array, v: mx.array, fb: ForwardBatch) -> mx.array:
        """Rotated ``q``/``k`` and ``v`` (``[B, heads, L, d]``) appended to the cache and attended (f16 or 8-bit
        cache, host or MLX kernel); the heads' outputs ``[B, L, heads·head_dim]``."""
        B, L = q.shape[0], q.shape[2]
        keys, values = fb.update(self.layer, k, v)
        if fb.codec is not None:
            out = fb.codec.attention(q, keys, values, self.scale, fb, self.window)  # 8-bit, read as stored
        elif self._cpu and cpu_ops.attention_on_host(q, keys.shape[2]):
            out = cpu_ops.attention(q, keys, values, self.scale, fb.mask_np(self.window))
        elif fb.rows_as_steps and self.window is None:
            out = attend_as_steps(q, keys, values, self.scale)
        else:
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=fb.mask(self.window))
        return out.transpose(0, 2, 1, 3).reshape(B, L, -1)


def attend_as_steps(q: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """A verify's query rows ``q [B, heads, L, d]`` (the last ``L`` of the keys) attended one at a time, each
    over the keys up to its own position: the call a one-token decode step makes. MLX's GPU attention takes a
    one-query kernel for one row and another for several, so a batched call would round differently from the
    plain steps and could flip a near-tie at T=0."""
    L, start = q.shape[2], keys.shape[2] - q.shape[2]
    return mx.concatenate([mx.fast.scaled_dot_product_attention(q[:, :, j:j + 1], keys[:, :, :start + j + 1],
                                                                values[:, :, :start + j + 1], scale=scale)
                           for j in range(L)], axis=2)


def _norm(g: GGUFFile, name: str, dtype) -> mx.array:
    from hf2q.engine.layers import float_array

    return float_array(g.tensor(name), dtype)


class DecoderLayer:
    def __init__(self, cfg: DecoderConfig, g: GGUFFile, i: int, dtype, ffn):
        p = f"blk.{i}."
        self.cfg = cfg
        self.attn_norm = _norm(g, p + "attn_norm.weight", dtype)
        self.attn = Attention(cfg, g, i, dtype)
        self.ffn_norm = _norm(g, p + "ffn_norm.weight", dtype)
        self.ffn = ffn
        if cfg.sandwich_norms:
            self.post_attn_norm = _norm(g, p + "post_attention_norm.weight", dtype)
            self.post_ffn_norm = _norm(g, p + "post_ffw_norm.weight", dtype)

    def __call__(self, x: mx.array, fb: ForwardBatch) -> mx.array:
        eps = self.cfg.norm_eps
        h = self.attn(rms_norm(x, self.attn_norm, eps), fb)
        if self.cfg.sandwich_norms:
            h = rms_norm(h, self.post_attn_norm, eps)
        x = x + h
        h = self.ffn(rms_norm(x, self.ffn_norm, eps))
        if self.cfg.sandwich_norms:
            h = rms_norm(h, self.post_ffn_norm, eps)
        return x + h


class DecoderModel:
    """Embedding → layers → final norm → logits (tied to the embedding when no ``output``)."""

    is_embedding_model = False

    def __init__(self, cfg: DecoderConfig, g: GGUFFile, dtype, make_ffn):
        self.cfg = cfg
        self.dtype = dtype
        self.embed = Linear(g.tensor("token_embd.weight"), dtype)
        self.layers = [DecoderLayer(cfg, g, i, dtype, make_ffn(i)) for i in range(cfg.n_layers)]
        self.norm = _norm(g, "output_norm.weight", dtype)
        self.lm_head = Linear(g.tensors["output.weight"], dtype) if "output.weight" in g.tensors else self.embed

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        return self.cfg.n_layers, self.cfg.n_kv_heads, self.cfg.head_dim

    def weights_nbytes(self) -> int:
        return distinct_nbytes([self.embed, self.lm_head] + [lin for layer in self.layers for lin in _linears(layer)])

    def __call__(self, tokens: mx.array, fb: ForwardBatch, last_only: bool = True) -> mx.array:
        """``tokens [B, T]`` → float32 logits ``[B, vocab]`` of the last position (or all)."""
        x = self.embed.rows(tokens)
        if self.cfg.embed_scale != 1.0:
            x = x * mx.array(self.cfg.embed_scale, dtype=x.dtype)
        for layer in self.layers:
            x = layer(x, fb)
        if last_only:
            x = x[:, -1:, :]
        logits = self.lm_head(rms_norm(x, self.norm, self.cfg.norm_eps)).astype(mx.float32)
        if self.cfg.final_softcap:
            logits = mx.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits[:, -1, :] if last_only else logits


def distinct_nbytes(linears) -> int:
    """Bytes of the weights of ``linears``, each object counted once (a tied output is the embedding)."""
    seen, total = set(), 0
    for obj in linears:
        if id(obj) not in seen:
            seen.add(id(obj))
            total += obj.nbytes
    return total


def _linears(layer: DecoderLayer):
    a = layer.attn
    yield from (a.q, a.k, a.v, a.o)
    f = layer.ffn
    for name in ("gate", "up", "down", "router", "gate_exps", "up_exps", "down_exps"):
        if hasattr(f, name):
            yield getattr(f, name)
