"""Qwen3-VL's language model (``qwen3vl``; the MoE ``qwen3vlmoe`` in ``qwen3vl_moe.py``).

Qwen3 (per-head q/k RMSNorm, NeoX rotary halves) with interleaved multimodal RoPE: every token
has three position ids — time, height, width — and rotary pair ``j`` turns by one of them,
picked by ``j mod 3`` among the first ``3 · sections[axis]`` pairs (height: ``j ≡ 1``, width:
``j ≡ 2``; every other pair, including those past the sections, by time). Text tokens carry the
same id on all three axes, which makes this ordinary RoPE at that position, so a text-only
batch takes ``mx.fast.rope`` with the cache offset like Qwen3. Image tokens get their grid
``(t, h, w)`` ids; a forward with explicit ``positions [3, B, L]`` rotates by them
(:func:`rotate_mrope`), and the text after an image continues from the largest id, no longer
from the token index.

Deepstack: the vision encoder also hands over features of some of its blocks; the k-th is added
to the residual stream at the image tokens after decoder layer k (``deepstack``, with
``visual_mask`` saying which tokens are image tokens), as transformers' ``_deepstack_process``.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from hf2q.engine.kv_cache import ForwardBatch
from hf2q.engine.layers import Linear, rms_norm
from hf2q.engine.models.decoder import Attention, DecoderConfig, DecoderLayer, DecoderModel, _norm
from hf2q.engine.models.llama import common_config, gated_mlp
from hf2q.errors import InputError
from hf2q.formats.gguf_file import GGUFFile
from hf2q.formats.gguf_keys import Keys

#: the three position axes of M-RoPE
TIME, HEIGHT, WIDTH = 0, 1, 2


def pair_axes(sections: Sequence[int], n_pairs: int) -> np.ndarray:
    """Which position axis each rotary pair turns by (interleaved, llama.cpp's IMROPE / transformers')."""
    axes = np.full(n_pairs, TIME, dtype=np.int32)
    for axis in (HEIGHT, WIDTH):
        j = np.arange(axis, min(n_pairs, 3 * int(sections[axis])), 3)
        axes[j] = axis
    return axes


def text_positions(offset: int, n: int, batch: int = 1) -> mx.array:
    """``[3, batch, n]``: a text run from ``offset``, the same id on every axis."""
    p = mx.arange(offset, offset + n, dtype=mx.int32)
    return mx.broadcast_to(p[None, None, :], (3, batch, n))


def rotate_mrope(x: mx.array, positions: mx.array, inv_freq: mx.array, axes: mx.array) -> mx.array:
    """NeoX rotation of the first ``2 · len(inv_freq)`` dims of ``x [B, H, L, D]`` by per-pair
    angles ``positions[axes[j], b, l] · inv_freq[j]`` (``positions [3, B, L]``)."""
    n_pairs = inv_freq.shape[0]
    pos = positions.astype(mx.float32)  # [3, B, L]
    chosen = mx.take(pos, axes, axis=0)  # [pairs, B, L]
    angles = chosen.transpose(1, 2, 0) * inv_freq  # [B, L, pairs]
    cos, sin = mx.cos(angles)[:, None], mx.sin(angles)[:, None]  # [B, 1, L, pairs]
    xf = x.astype(mx.float32)
    a, b = xf[..., :n_pairs], xf[..., n_pairs:2 * n_pairs]
    turned = [a * cos - b * sin, b * cos + a * sin]
    if x.shape[-1] > 2 * n_pairs:
        turned.append(xf[..., 2 * n_pairs:])
    return mx.concatenate(turned, axis=-1).astype(x.dtype)


class MRopeAttention(Attention):
    """Qwen3 attention whose rotation can follow explicit M-RoPE positions."""

    def __init__(self, cfg: DecoderConfig, g: GGUFFile, i: int, dtype, inv_freq: mx.array, axes: mx.array):
        super().__init__(cfg, g, i, dtype)
        self.inv_freq, self.axes = inv_freq, axes

    def __call__(self, x: mx.array, fb: ForwardBatch, positions: mx.array | None = None) -> mx.array:
        c = self.cfg
        B, L, _ = x.shape
        q = self.q(x).reshape(B, L, c.n_heads, c.head_dim)
        if positions is None:
            return self.o(self.attend(q, x, fb))
        k = self.k(x).reshape(B, L, c.n_kv_heads, c.head_dim)
        v = self.v(x).reshape(B, L, c.n_kv_heads, c.head_dim)
        q = rms_norm(q, self.q_norm, c.norm_eps)
        k = rms_norm(k, self.k_norm, c.norm_eps)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        q = rotate_mrope(q, positions, self.inv_freq, self.axes)
        k = rotate_mrope(k, positions, self.inv_freq, self.axes)
        return self.o(self.attend_rotated(q, k, v, fb))


class MRopeLayer(DecoderLayer):
    def __init__(self, cfg: DecoderConfig, g: GGUFFile, i: int, dtype, ffn, inv_freq, axes):
        p = f"blk.{i}."
        self.cfg = cfg
        self.attn_norm = _norm(g, p + "attn_norm.weight", dtype)
        self.attn = MRopeAttention(cfg, g, i, dtype, inv_freq, axes)
        self.ffn_norm = _norm(g, p + "ffn_norm.weight", dtype)
        self.ffn = ffn

    def __call__(self, x: mx.array, fb: ForwardBatch, positions: mx.array | None = None) -> mx.array:
        eps = self.cfg.norm_eps
        x = x + self.attn(rms_norm(x, self.attn_norm, eps), fb, positions)
        return x + self.ffn(rms_norm(x, self.ffn_norm, eps))


def mrope_sections(g: GGUFFile, rope_dims: int) -> list[int]:
    key = Keys.Rope.DIMENSION_SECTIONS.format(arch=g.arch)
    raw = g.metadata.get(key)
    if not isinstance(raw, list) or len(raw) < 3 or not all(isinstance(s, int) and s >= 0 for s in raw):
        raise InputError(f"{g.path.name}: {key} must list at least three non-negative pair counts")
    if 2 * sum(raw[:3]) > rope_dims:
        raise InputError(f"{g.path.name}: {key} {raw} covers more than the {rope_dims} rotary dims")
    return [int(s) for s in raw]


class Qwen3VLModel(DecoderModel):
    """The Qwen3-VL decoder: text forward as Qwen3, plus M-RoPE positions and deepstack inputs."""

    def __init__(self, cfg: DecoderConfig, g: GGUFFile, dtype, make_ffn):
        self.sections = mrope_sections(g, cfg.rope_dims)
        n_pairs = cfg.rope_dims // 2
        inv_freq = mx.array((cfg.rope_base ** (-np.arange(n_pairs, dtype=np.float64) * 2 / cfg.rope_dims))
                            .astype(np.float32))
        axes = mx.array(pair_axes(self.sections, n_pairs))
        # DecoderModel's fields, with M-RoPE layers in place of its plain ones
        self.cfg, self.dtype = cfg, dtype
        self.embed = Linear(g.tensor("token_embd.weight"), dtype)
        self.layers = [MRopeLayer(cfg, g, i, dtype, make_ffn(i), inv_freq, axes) for i in range(cfg.n_layers)]
        self.norm = _norm(g, "output_norm.weight", dtype)
        self.lm_head = Linear(g.tensors["output.weight"], dtype) if "output.weight" in g.tensors else self.embed
        self.n_deepstack = int(g.metadata.get(Keys.LLM.NUM_DEEPSTACK_LAYERS.format(arch=g.arch)) or 0)

    def __call__(self, tokens: mx.array, fb: ForwardBatch, last_only: bool = True, *,
                 positions: mx.array | None = None, embeddings: mx.array | None = None,
                 visual_mask: mx.array | None = None, deepstack: Sequence[mx.array] = ()) -> mx.array:
        """``tokens [B, T]`` → float32 logits of the last position (or all).

        ``positions [3, B, T]``: M-RoPE ids (default: the text run from the cache offset);
        ``embeddings [B, T, d]``: inputs instead of the token rows (image features spliced in);
        ``deepstack``: per early layer, features ``[n_visual, d]`` added at ``visual_mask [B, T]``."""
        if len(deepstack) > len(self.layers):
            raise InputError(f"{len(deepstack)} deepstack feature sets for {len(self.layers)} layers")
        x = self.embed.rows(tokens) if embeddings is None else embeddings.astype(self.dtype)
        index = None
        if deepstack:
            if visual_mask is None:
                raise InputError("deepstack features need visual_mask")
            rows = np.flatnonzero(np.asarray(visual_mask).reshape(-1)).astype(np.int32)
            if any(d.shape[0] != rows.size for d in deepstack):
                raise InputError(f"deepstack features for {[d.shape[0] for d in deepstack]} tokens, "
                                 f"visual_mask marks {rows.size}")
            index = mx.array(rows) if rows.size else None  # a chunk without image tokens adds nothing
        for i, layer in enumerate(self.layers):
            x = layer(x, fb, positions)
            if index is not None and i < len(deepstack):
                shape = x.shape
                flat = x.reshape(-1, shape[-1])
                flat = flat.at[index].add(deepstack[i].astype(flat.dtype))
                x = flat.reshape(shape)
        if last_only:
            x = x[:, -1:, :]
        logits = self.lm_head(rms_norm(x, self.norm, self.cfg.norm_eps)).astype(mx.float32)
        return logits[:, -1, :] if last_only else logits


def build(g: GGUFFile, dtype) -> Qwen3VLModel:
    cfg = common_config(g, traditional=False)
    cfg.qk_norm = True
    return Qwen3VLModel(cfg, g, dtype, lambda i: gated_mlp(g, i, dtype))
