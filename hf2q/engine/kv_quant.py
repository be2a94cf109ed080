"""8-bit K/V in the live cache, and attention that reads it as stored.

``--kv-cache-type q8`` keeps every K/V row as signed 8-bit codes with one scale per group of
``GROUP`` values (``head_dim`` smaller than the group: one group per row): the codes, offset by
128, are packed four to a ``uint32`` exactly as ``mx.quantize(bits=8)`` packs them, so
``mx.quantized_matmul`` multiplies by them directly — ``q·Kᵀ`` and ``p·V`` never see a
dequantized copy of the cache. The group's bias of MLX's affine form is ``−128·scale``: it is not
stored (symmetric codes), only formed per step beside the scores, at one value per group.

``q8-rotated`` first multiplies every K and V row by a fixed orthonormal Hadamard matrix ``H``
(``head_dim`` a power of two): an outlier channel is spread over the whole row, so the group's
scale no longer follows one large value. Queries are rotated the same way, so ``(qH)·(kH) = q·k``;
the output ``p·(VH)`` is rotated back by ``H`` (its own inverse). A head wider than the codec's row
(Gemma 4's global heads, stored as pieces of its narrowest head size) is rotated and grouped piece
by piece: a block-diagonal ``H``, just as orthonormal. docs/ENGINE.md, "8-bit KV cache",
gives the choices and their measured cost; ``kv_quant_ref`` is the numpy twin the tests hold this to.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np

from hf2q.engine.kv_layout import SCALES_SUFFIX, check_kv_type, group_size, row_nbytes
from hf2q.kernels import cpu_ops, cuda_q8_attention, cuda_qmv

BITS = 8
#: codes are stored as ``round(x / scale) + OFFSET`` in ``[1, 255]``
OFFSET = 128
LEVELS = 127
#: queries whose scores are formed at once (``KvCodec.attend``)
QUERY_BLOCK = 512


@attrs.frozen(eq=False)
class KvCodec:
    """How one cache stores a K or V row of ``head_dim`` values, and how attention reads it."""

    kind: str  # "q8" | "q8-rotated"
    head_dim: int
    dtype: object  # the compute dtype: the scales' dtype and the attention's
    rotated: bool = False  # rows are rotated (in float32) before rounding to any 16-bit type

    def rotate(self, x: mx.array) -> mx.array:
        """``x [..., w]`` (``w`` a multiple of ``head_dim``) times the orthonormal Hadamard matrix of
        ``head_dim`` piece by piece (its own inverse), in float32: MLX's fast transform, exact where a
        float32 matmul may run at TF32 precision (CUDA)."""
        x = x.astype(mx.float32)
        n, w = self.head_dim, x.shape[-1]
        if w == n:
            return mx.hadamard_transform(x, scale=n ** -0.5)
        return mx.hadamard_transform(x.reshape(*x.shape[:-1], w // n, n), scale=n ** -0.5).reshape(x.shape)

    @property
    def group(self) -> int:
        return group_size(self.head_dim)

    def row_nbytes(self, width: int | None = None) -> int:
        """Bytes of one stored row of ``width`` values (codes plus scales)."""
        return row_nbytes(self.kind, width or self.head_dim, self.dtype.size)

    def planes(self, width: int) -> list[tuple[int, object]]:
        """``(last dimension, dtype)`` of each stored array of a ``width``-value row: packed codes, scales."""
        return [(width // 4, mx.uint32), (width // group_size(width), self.dtype)]

    def encode(self, x: mx.array, rotate: bool = True) -> tuple[mx.array, mx.array]:
        """Rows ``x [..., d]`` (rotated first unless ``rotate`` is False: values already in the stored
        space) → ``(codes uint32 [..., d/4], scales [..., d/group])``."""
        if rotate and self.rotated:
            x = self.rotate(x)
        d = x.shape[-1]
        g = group_size(d)
        groups = x.astype(mx.float32).reshape(*x.shape[:-1], d // g, g)
        scale = (mx.max(mx.abs(groups), axis=-1, keepdims=True) / LEVELS).astype(self.dtype)
        safe = mx.where(scale == 0, mx.array(1, dtype=self.dtype), scale).astype(mx.float32)
        codes = mx.clip(mx.round(groups / safe), -LEVELS, LEVELS) + OFFSET
        codes = codes.astype(mx.uint8).reshape(*x.shape[:-1], d)
        return mx.view(codes, mx.uint32), scale.squeeze(-1)

    def decode(self, codes: mx.array, scales: mx.array) -> mx.array:
        """The stored rows as float32 ``[..., d]`` (in the stored space: still rotated)."""
        q = mx.view(codes, mx.uint8).astype(mx.float32) - OFFSET
        d = q.shape[-1]
        g = d // scales.shape[-1]
        x = q.reshape(*q.shape[:-1], d // g, g) * scales.astype(mx.float32)[..., None]
        return x.reshape(*q.shape[:-1], d)

    def attend(self, q: mx.array, keys: tuple[mx.array, mx.array], values: tuple[mx.array, mx.array],
               scale: float, mask: mx.array | None) -> mx.array:
        """Attention of ``q [B, heads, L, d]`` over stored ``keys``/``values`` (``[B, kv_heads, T, ·]``
        planes), grouped-query heads sharing a KV head; ``mask`` boolean ``[B, 1, L, T]`` (True =
        attend) or None. Returns ``[B, heads, L, dv]`` in ``q``'s dtype. A plane's group is read off its
        scales (a row may be several codec rows side by side: Gemma 4's pieces).

        Scores, softmax and the weighted sum run in float32, as the fused 16-bit kernels accumulate
        (in bfloat16 they doubled the error against the float64 twin), over blocks of ``QUERY_BLOCK``
        queries so a long prefill chunk never holds all its scores at once."""
        B, n_heads, L, d = q.shape
        kv_heads = keys[0].shape[-3]
        rep = n_heads // kv_heads
        out_dtype = q.dtype
        q = q.astype(mx.float32) * scale
        if self.rotated:
            q = self.rotate(q)
        # the heads sharing a KV head become rows of one product: K/V batch dims match q's exactly
        q = q.reshape(B, kv_heads, rep, L, d)
        T, dv = keys[0].shape[-2], values[0].shape[-1] * 4
        k_group, v_group = d // keys[1].shape[-1], dv // values[1].shape[-1]  # per plane: Gemma 4's pieces
        if cuda_qmv.available():  # MLX's CUDA backend multiplies neither product below
            if cuda_q8_attention.takes(rep * L, d, dv):
                out = cuda_q8_attention.attend(q.reshape(B, kv_heads, rep * L, d), keys, values, mask,
                                               k_group, v_group)
            else:  # a long prefill chunk: one dequantized copy of the rows for the fused kernel
                k, v = self.decode(*keys), self.decode(*values)
                out = mx.fast.scaled_dot_product_attention(q.reshape(B, n_heads, L, d), k, v, scale=1.0,
                                                           mask=mask)
            out = out.reshape(B, n_heads, L, dv)
            if self.rotated:
                out = self.rotate(out)
            return out.astype(out_dtype)
        kc, ks = keys[0], keys[1].astype(mx.float32)
        vc, vs = values[0], values[1].astype(mx.float32)
        kb, vb = ks * -OFFSET, vs * -OFFSET
        parts = []
        for a in range(0, L, QUERY_BLOCK):
            rows = slice(a, min(a + QUERY_BLOCK, L))
            n = rows.stop - rows.start
            scores = mx.quantized_matmul(q[..., rows, :].reshape(B, kv_heads, rep * n, d), kc, ks, kb,
                                         transpose=True, group_size=k_group, bits=BITS)
            if mask is not None:
                scores = mx.where(mask[:, :, None, rows, :], scores.reshape(B, kv_heads, rep, n, T), -mx.inf)
                scores = scores.reshape(B, kv_heads, rep * n, T)
            p = mx.softmax(scores, axis=-1)
            out = mx.quantized_matmul(p, vc, vs, vb, transpose=False, group_size=v_group, bits=BITS)
            parts.append(out.reshape(B, kv_heads, rep, n, dv))
        out = (parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-2)).reshape(B, n_heads, L, dv)
        if self.rotated:
            out = self.rotate(out)
        return out.astype(out_dtype)

    def dense(self, q: mx.array, keys: tuple[mx.array, mx.array], values: tuple[mx.array, mx.array]
              ) -> tuple[mx.array, mx.array, mx.array]:
        """``(q, keys, values)`` as float32 arrays of the stored space (``q`` rotated like the keys), for
        an attention kernel that reads only floats; its output goes back through :meth:`unrotate`.
        A copy of the rows: for the CPU's prefill chunks only, never a decode step (docs/ENGINE.md)."""
        if self.rotated:
            q = self.rotate(q).astype(q.dtype)
        return q, self.decode(*keys), self.decode(*values)

    def to_host(self, name: str, planes: tuple[mx.array, mx.array]) -> dict[str, np.ndarray]:
        """Stored rows as exported (``kv_layout.SCALES_SUFFIX``): ``name`` → uint8 codes ``[..., d]``,
        ``name + SCALES_SUFFIX`` → float32 scales (an exact widening of a 16-bit engine's)."""
        codes, scales = planes
        return {name: np.array(mx.view(codes, mx.uint8)), name + SCALES_SUFFIX: np.array(scales.astype(mx.float32))}

    def from_host(self, arrays, name: str, width: int) -> tuple[mx.array, mx.array]:
        """The planes of exported rows ``arrays[name]``: codes and scales stored as they were, or float
        rows of the stored space (a block an older hf2q wrote for this cache: still rotated) encoded again."""
        rows = np.asarray(arrays[name])
        if rows.dtype != np.uint8:
            return self.encode(mx.array(rows).astype(self.dtype), rotate=False)
        scales = np.asarray(arrays[name + SCALES_SUFFIX])
        if scales.shape != (*rows.shape[:-1], width // group_size(width)):
            raise ValueError(f"{name}: scales of shape {scales.shape} for codes of shape {rows.shape}")
        return mx.view(mx.array(np.ascontiguousarray(rows)), mx.uint32), mx.array(scales).astype(self.dtype)

    def unrotate(self, out: mx.array) -> mx.array:
        return self.rotate(out).astype(out.dtype) if self.rotated else out

    def attention(self, q: mx.array, keys: tuple[mx.array, mx.array], values: tuple[mx.array, mx.array],
                  scale: float, fb, window: int | None) -> mx.array:
        """A layer's attention over the stored planes of forward ``fb`` (masked by ``window``): read as
        stored (:meth:`attend`), except a CPU prefill chunk big enough for the host's tiled float kernel
        (:meth:`dense`, docs/ENGINE.md)."""
        if q.shape[2] > 1 and cpu_ops.attention_on_host(q, keys[0].shape[2]):
            qd, kd, vd = self.dense(q, keys, values)
            return self.unrotate(cpu_ops.attention(qd, kd, vd, scale, fb.mask_np(window)))
        return self.attend(q, keys, values, scale, fb.mask_array(window))


def make_codec(kind: str, head_dim: int, dtype, family: str, *, v_head_dim: int | None = None) -> KvCodec | None:
    """The codec of ``--kv-cache-type kind`` for a cache of ``head_dim`` rows, None for ``f16``;
    ``InputError`` (one line) when the cache cannot hold that type."""
    check_kv_type(kind, (head_dim, v_head_dim or head_dim), family)
    if kind == "f16":
        return None
    return KvCodec(kind, head_dim, dtype, kind == "q8-rotated")
