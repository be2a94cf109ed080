"""Qwen3-VL's vision encoder over its mmproj GGUF (``clip``, projector ``qwen3vl_merger``).

An image (or a video clip) arrives as patches the way Qwen3-VL's processor cuts them: each row is
one ``patch × patch`` square over two frames and the channels, flattened as ``[channels, time,
patch, patch]``, the rows ordered by 2×2 merge block (block row, block column, row in block,
column in block), one frame pair after another. ``prepare`` resizes an image to the processor's
size and :func:`patchify` makes the cut. Then:

1. **Patch embedding**: the Conv3D kernel (stored as two Conv2D time slices) is one matrix over a
   row, plus its bias.
2. **Position embedding**: the learned square table resampled to the image's patch grid by
   bilinear interpolation with aligned corners, in the same merge-block order.
3. **Blocks**: pre-LayerNorm ViT blocks (fused qkv with bias, full attention within a frame-pair,
   GELU-tanh MLP); q and k turn by a 2-D rotary embedding whose first half of frequencies follows
   the patch row and the second half its column (NeoX halves over the whole head).
4. **Deepstack**: after each block flagged in ``is_deepstack_layers`` a merger (2×2 patches
   concatenated, LayerNorm, two linears around an exact GELU) gives the features the language
   model adds after its first layers.
5. **Merger**: LayerNorm per patch, 2×2 patches concatenated, the same two linears: one feature per
   merged token, in the text model's width.
"""

from __future__ import annotations

import attrs
import gguf
import mlx.core as mx
import numpy as np

from hf2q.engine.layers import Linear, float_array, gelu_erf, gelu_tanh, layer_norm
from hf2q.engine.vision.patches import (  # noqa: F401  (the cut lives without MLX, for the request side)
    MAX_PIXELS,
    MIN_PIXELS,
    TEMPORAL_PATCH,
    merge_order,
    normalise,
    patchify,
    prepare_image,
    smart_resize,
)
from hf2q.errors import InputError
from hf2q.formats.gguf_file import GGUFFile
from hf2q.formats.gguf_keys import Keys

MMPROJ_ARCH = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ]
PROJECTOR = gguf.VisionProjectorType.QWEN3VL
#: the 2-D rotary base (llama.cpp's and transformers' default; the mmproj does not store it)
ROPE_THETA = 10000.0


@attrs.frozen
class VisionFeatures:
    """The encoder's output for one image: ``merged [tokens, d_text]`` and one ``[tokens, d_text]``
    per deepstack layer, in the order the language model takes them."""

    merged: mx.array
    deepstack: tuple[mx.array, ...]
    grid: tuple[int, int, int]  # (frame pairs, patch rows, patch columns)

    @property
    def nbytes(self) -> int:
        return int(self.merged.nbytes + sum(d.nbytes for d in self.deepstack))


@attrs.define(eq=False)
class EncodeState:
    """An image part-way through the encoder: the hidden rows after ``done`` blocks."""

    x: mx.array
    cos: mx.array
    sin: mx.array
    grid: tuple[int, int, int]
    done: int = 0
    deepstack: list = attrs.Factory(list)


def bilinear_taps(h: int, w: int, side: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``[h·w, 4]`` into the flattened ``side × side`` table and their weights, per patch in
    merge-block order (align-corners bilinear resampling to ``h × w``)."""
    rows, cols = merge_order(h, w, merge)

    def axis(index: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        src = index * (side - 1) / max(size - 1, 1)
        lo = np.floor(src)
        taps = np.clip(lo[:, None].astype(np.int64) + np.arange(2), 0, side - 1)
        weights = np.clip(1 - np.abs(src[:, None] - lo[:, None] - np.arange(2)), 0, None)
        return taps, weights

    ht, hw = axis(rows.astype(np.float64), h)
    wt, ww = axis(cols.astype(np.float64), w)
    idx = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)
    wts = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)
    return idx.astype(np.int32), wts.astype(np.float32)


def rotary_angles(h: int, w: int, merge: int, head_dim: int) -> np.ndarray:
    """Per patch (merge-block order), the ``head_dim / 2`` angles: row · f then column · f."""
    quarter = head_dim // 4
    inv_freq = 1.0 / ROPE_THETA ** (np.arange(0, head_dim // 2, 2, dtype=np.float64) / (head_dim // 2))
    rows, cols = merge_order(h, w, merge)
    if inv_freq.size != quarter:
        raise InputError(f"vision head size {head_dim} is not a multiple of 4")
    return np.concatenate([rows[:, None] * inv_freq, cols[:, None] * inv_freq], axis=1).astype(np.float32)


def _rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """NeoX rotation over the whole head: ``x [heads, N, hd]`` by ``cos/sin [N, hd/2]``."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return mx.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


class _Block:
    def __init__(self, g: GGUFFile, i: int, dtype):
        p = f"v.blk.{i}."
        f = lambda name: float_array(g.tensor(p + name), dtype)  # noqa: E731
        self.ln1, self.ln1_b, self.ln2, self.ln2_b = f("ln1.weight"), f("ln1.bias"), f("ln2.weight"), f("ln2.bias")
        self.qkv = Linear(g.tensor(p + "attn_qkv.weight"), dtype, f("attn_qkv.bias"))
        self.out = Linear(g.tensor(p + "attn_out.weight"), dtype, f("attn_out.bias"))
        self.up = Linear(g.tensor(p + "ffn_up.weight"), dtype, f("ffn_up.bias"))
        self.down = Linear(g.tensor(p + "ffn_down.weight"), dtype, f("ffn_down.bias"))


class _Merger:
    """2×2 patches → one feature: LayerNorm (before or after the concatenation), fc1, GELU, fc2."""

    def __init__(self, g: GGUFFile, norm: str, fc1: str, fc2: str, dtype, after_concat: bool):
        f = lambda name: float_array(g.tensor(name), dtype)  # noqa: E731
        self.norm, self.norm_b = f(norm + ".weight"), f(norm + ".bias")
        self.fc1 = Linear(g.tensor(fc1 + ".weight"), dtype, f(fc1 + ".bias"))
        self.fc2 = Linear(g.tensor(fc2 + ".weight"), dtype, f(fc2 + ".bias"))
        self.after_concat = after_concat

    def __call__(self, x: mx.array, unit: int, eps: float) -> mx.array:
        n, d = x.shape
        if self.after_concat:
            x = layer_norm(x.reshape(n // unit, d * unit), self.norm, self.norm_b, eps)
        else:
            x = layer_norm(x, self.norm, self.norm_b, eps).reshape(n // unit, d * unit)
        return self.fc2(gelu_erf(self.fc1(x)))


class Qwen3VLVisionEncoder:
    """Patches → merged features and deepstack features, from a ``qwen3vl_merger`` mmproj."""

    def __init__(self, g: GGUFFile, dtype=mx.float32):
        md = g.metadata
        if md.get(Keys.General.ARCHITECTURE) != MMPROJ_ARCH or md.get(Keys.Clip.PROJECTOR_TYPE) != PROJECTOR:
            raise InputError(f"{g.path.name}: not a Qwen3-VL mmproj (clip with projector qwen3vl_merger)")
        self.dtype = dtype
        self.width = int(md[Keys.ClipVision.EMBEDDING_LENGTH])
        self.n_heads = int(md[Keys.ClipVision.Attention.HEAD_COUNT])
        self.patch = int(md[Keys.ClipVision.PATCH_SIZE])
        self.merge = int(md.get(Keys.ClipVision.SPATIAL_MERGE_SIZE) or 2)
        self.eps = float(md.get(Keys.ClipVision.Attention.LAYERNORM_EPS) or 1e-6)
        self.image_mean = list(md.get(Keys.ClipVision.IMAGE_MEAN) or [0.5] * 3)
        self.image_std = list(md.get(Keys.ClipVision.IMAGE_STD) or [0.5] * 3)
        if self.width % self.n_heads:
            raise InputError(f"{g.path.name}: vision width {self.width} is not a multiple of {self.n_heads} heads")
        self.head_dim = self.width // self.n_heads
        depth = int(md[Keys.ClipVision.BLOCK_COUNT])
        flags = list(md.get(Keys.ClipVision.IS_DEEPSTACK_LAYERS) or [False] * depth)
        kernels = [float_array(g.tensor(name), mx.float32) for name in ("v.patch_embd.weight", "v.patch_embd.weight.1")]
        conv = mx.stack(kernels, axis=2)  # [d, C, time, p, p]: the Conv3D kernel again
        self.patch_w = conv.reshape(conv.shape[0], -1).astype(dtype)
        self.patch_b = float_array(g.tensor("v.patch_embd.bias"), dtype)
        self.pos_table = float_array(g.tensor("v.position_embd.weight"), dtype)
        self.side = int(round(self.pos_table.shape[0] ** 0.5))
        if self.side * self.side != self.pos_table.shape[0]:
            raise InputError(f"{g.path.name}: position table of {self.pos_table.shape[0]} rows is not a square grid")
        self.blocks = [_Block(g, i, dtype) for i in range(depth)]
        self.deepstack = {i: _Merger(g, f"v.deepstack.{i}.norm", f"v.deepstack.{i}.fc1", f"v.deepstack.{i}.fc2", dtype,
                                     after_concat=True) for i, on in enumerate(flags) if on}
        self.merger = _Merger(g, "v.post_ln", "mm.0", "mm.2", dtype, after_concat=False)

    @property
    def n_deepstack(self) -> int:
        return len(self.deepstack)

    def normalise(self, image: np.ndarray) -> np.ndarray:
        """``image [H, W, C]`` in 0..255 → ``[C, H, W]`` float32 scaled and normalised as the processor."""
        return normalise(image, self.image_mean, self.image_std)

    def prepare(self, image: np.ndarray, min_pixels: int = MIN_PIXELS,
                max_pixels: int = MAX_PIXELS) -> tuple[np.ndarray, tuple[int, int, int]]:
        """An RGB image ``[H, W, 3]`` (uint8) → patch rows and grid, as Qwen3-VL's processor makes them."""
        return prepare_image(image, self.patch, self.merge, self.image_mean, self.image_std, min_pixels, max_pixels)

    def __call__(self, patches: np.ndarray, grid: tuple[int, int, int]) -> VisionFeatures:
        state = self.begin(patches, grid)
        while not self.advance(state, len(self.blocks)):
            pass
        return self.finish(state)

    def begin(self, patches: np.ndarray, grid: tuple[int, int, int]) -> "EncodeState":
        """The patch and position embedding of one image: the state ``advance`` takes through the blocks."""
        t, h, w = (int(v) for v in grid)
        if patches.shape != (t * h * w, self.patch_w.shape[1]):
            raise InputError(f"patches of shape {patches.shape} for grid {grid}: expected "
                             f"{(t * h * w, self.patch_w.shape[1])}")
        if h % self.merge or w % self.merge:
            raise InputError(f"patch grid {h}×{w} is not a multiple of the {self.merge}×{self.merge} merge")
        x = mx.array(patches.astype(np.float32)).astype(self.dtype) @ self.patch_w.T + self.patch_b
        idx, wts = bilinear_taps(h, w, self.side, self.merge)
        pos = (self.pos_table[mx.array(idx)] * mx.array(wts)[..., None].astype(self.dtype)).sum(axis=1)
        x = x + mx.tile(pos, (t, 1))
        angles = mx.array(np.tile(rotary_angles(h, w, self.merge, self.head_dim), (t, 1)))
        return EncodeState(x, mx.cos(angles), mx.sin(angles), (t, h, w))

    def advance(self, state: "EncodeState", blocks: int) -> bool:
        """Run up to ``blocks`` more blocks (and their deepstack mergers), evaluated; True once the last ran.

        Each call is a bounded piece of vision work: a server runs one per GPU job, so decode steps of
        other requests go between the pieces of a large image."""
        unit = self.merge * self.merge
        stop = min(state.done + max(blocks, 1), len(self.blocks))
        for i in range(state.done, stop):
            state.x = self._block(self.blocks[i], state.x, state.cos, state.sin, state.grid[0])
            if i in self.deepstack:
                state.deepstack.append(self.deepstack[i](state.x, unit, self.eps))
        state.done = stop
        mx.eval(state.x, *state.deepstack)
        return state.done == len(self.blocks)

    def finish(self, state: "EncodeState") -> VisionFeatures:
        """The merger over the last block's output: the features the language model takes."""
        merged = self.merger(state.x, self.merge * self.merge, self.eps)
        mx.eval(merged)
        return VisionFeatures(merged, tuple(state.deepstack), state.grid)

    def _block(self, blk: _Block, x: mx.array, cos: mx.array, sin: mx.array, frames: int) -> mx.array:
        n = x.shape[0]
        hd, heads = self.head_dim, self.n_heads
        qkv = blk.qkv(layer_norm(x, blk.ln1, blk.ln1_b, self.eps)).reshape(n, 3, heads, hd).transpose(1, 2, 0, 3)
        q, k, v = qkv[0], qkv[1], qkv[2]  # [heads, n, hd]
        q = _rotate(q.astype(mx.float32), cos, sin).astype(self.dtype)
        k = _rotate(k.astype(mx.float32), cos, sin).astype(self.dtype)
        per = n // frames  # attention stays within each frame pair
        q, k, v = (a.reshape(heads, frames, per, hd).transpose(1, 0, 2, 3) for a in (q, k, v))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=hd ** -0.5)  # [frames, heads, per, hd]
        out = out.transpose(0, 2, 1, 3).reshape(n, heads * hd)
        x = x + blk.out(out)
        return x + blk.down(gelu_tanh(blk.up(layer_norm(x, blk.ln2, blk.ln2_b, self.eps))))
