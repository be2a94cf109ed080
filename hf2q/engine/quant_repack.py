"""Re-express GGUF quantized blocks as MLX affine groups, without going through floats.

MLX's quantized weights are ``w = scale * q + bias`` per group of 32/64/128 consecutive
elements of a row, with ``q`` an unsigned ``bits``-wide integer packed as a
little-endian bit stream into ``uint32`` words. Every GGUF type whose groups have 32
elements and one (scale, offset) pair per group maps onto that *exactly*:

============  =====  ======================================
GGUF type     bits   scale, bias per 32 elements
============  =====  ======================================
Q8_0          8      d, -128·d     (int8 → q + 128)
Q4_0 / Q5_0   4 / 5  d, -8·d / -16·d
Q4_1 / Q5_1   4 / 5  d, m
Q4_K / Q5_K   4 / 5  d·sc_j, -dmin·m_j   (6-bit sub-scales)
============  =====  ======================================

Scales and biases are kept in float32: ``d·sc_j`` (an f16 times a 6-bit integer) is
not always representable in float16, so a float16 scale would silently change the
weights. Q2_K, Q3_K and Q6_K have 16-element sub-blocks, which MLX cannot express
(smallest group is 32); they are dequantized and re-quantized to 8-bit groups of 32
(see docs/ENGINE.md for the measured error). Returned arrays are numpy; the loader
moves them into MLX.
"""

from __future__ import annotations

import attrs
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from hf2q.errors import InputError

GROUP = 32
#: types whose 16-element sub-blocks MLX cannot hold: dequantized and re-quantized to 8-bit groups of 32
REQUANTIZED = frozenset({T.Q2_K, T.Q3_K, T.Q6_K})


@attrs.frozen
class AffineWeight:
    """Packed MLX affine weight: ``packed`` uint32 [rows, n*bits/32], scales/biases f32 [rows, n/32]."""

    packed: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int
    exact: bool  # False when re-quantized (16-element sub-block types)

    @property
    def group_size(self) -> int:
        return GROUP


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ``q`` (uint8 [rows, n], values < 2**bits) into MLX's uint32 bit stream."""
    rows, n = q.shape
    if bits == 8:
        return np.ascontiguousarray(q, dtype=np.uint8).view(np.uint32)
    if bits == 4:
        pairs = q.reshape(rows, n // 2, 2)
        return np.ascontiguousarray(pairs[..., 0] | (pairs[..., 1] << 4), dtype=np.uint8).view(np.uint32)
    # general widths: 8 values form ``bits`` bytes of the little-endian stream
    g = q.reshape(rows, n // 8, 8).astype(np.uint64)
    word = np.zeros(g.shape[:2], dtype=np.uint64)
    for i in range(8):
        word |= g[..., i] << np.uint64(bits * i)
    as_bytes = word.view(np.uint8).reshape(rows, n // 8, 8)[..., :bits]
    return np.ascontiguousarray(as_bytes).reshape(rows, n * bits // 8).view(np.uint32)


def unpack_bits(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: uint8 ``[..., n]`` (8 values span exactly ``bits`` bytes)."""
    raw = np.ascontiguousarray(packed).view(np.uint8)
    lead = raw.shape[:-1]
    chunks = raw.reshape(*lead, n // 8, bits).astype(np.uint64)
    word = np.zeros(chunks.shape[:-1], dtype=np.uint64)
    for i in range(bits):
        word |= chunks[..., i] << np.uint64(8 * i)
    mask = np.uint64((1 << bits) - 1)
    out = np.empty((*lead, n // 8, 8), dtype=np.uint8)
    for i in range(8):
        out[..., i] = (word >> np.uint64(bits * i)) & mask
    return out.reshape(*lead, n)


def _blocks(raw: np.ndarray, rows: int, type_size: int) -> np.ndarray:
    return np.ascontiguousarray(raw).reshape(rows, -1, type_size)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(b[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """16 bytes per block → 32 values: low nibbles first, then high nibbles (legacy layout)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12-byte 6-bit scale/min packing of Q4_K/Q5_K → (sc, m) each [..., 8]."""
    sc = sc.astype(np.uint8)
    lo_s = sc[..., 0:4] & 63
    lo_m = sc[..., 4:8] & 63
    hi_s = (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)
    hi_m = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return (np.concatenate([lo_s, hi_s], -1).astype(np.float32),
            np.concatenate([lo_m, hi_m], -1).astype(np.float32))


def _legacy(raw, rows, qtype):
    size = {T.Q4_0: 18, T.Q4_1: 20, T.Q5_0: 22, T.Q5_1: 24, T.Q8_0: 34}[qtype]
    b = _blocks(raw, rows, size)
    d = _f16(b, 0)
    if qtype == T.Q8_0:
        q = (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q, d, -128.0 * d, 8
    has_min = qtype in (T.Q4_1, T.Q5_1)
    off = 4 if has_min else 2
    m = _f16(b, 2) if has_min else None
    if qtype in (T.Q4_0, T.Q4_1):
        q = _nibbles_32(b[..., off:off + 16])
        return q, d, (m if has_min else -8.0 * d), 4
    qh = np.ascontiguousarray(b[..., off:off + 4]).view(np.uint32)  # [rows, nb, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    q = _nibbles_32(b[..., off + 4:off + 20]) | (high << 4)
    return q, d, (m if has_min else -16.0 * d), 5


def _k_quant(raw, rows, qtype):
    size = {T.Q4_K: 144, T.Q5_K: 176}[qtype]
    b = _blocks(raw, rows, size)
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = _k_scales(b[..., 4:16])
    if qtype == T.Q4_K:
        qs = b[..., 16:144].reshape(rows, -1, 4, 32)
        q = np.stack([qs & 15, qs >> 4], axis=3).reshape(rows, -1, 256)
        bits = 4
    else:
        qh = b[..., 16:48]  # [rows, nb, 32]
        qs = b[..., 48:176].reshape(rows, -1, 4, 32)
        low = np.stack([qs & 15, qs >> 4], axis=3).reshape(rows, -1, 8, 32)
        high = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
        q = (low | (high << 4)).reshape(rows, -1, 256)
        bits = 5
    scale = d[..., None] * sc
    bias = -(dmin[..., None] * m)
    return q.reshape(rows, -1, 32), scale.reshape(rows, -1), bias.reshape(rows, -1), bits


def requantize_8bit(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float rows → 8-bit affine groups of 32 (min/max), as (q uint8, scale, bias)."""
    rows, n = w.shape
    g = w.reshape(rows, n // GROUP, GROUP).astype(np.float32)
    lo, hi = g.min(-1), g.max(-1)
    scale = (hi - lo) / 255.0
    safe = np.where(scale > 0, scale, 1.0)
    q = np.clip(np.rint((g - lo[..., None]) / safe[..., None]), 0, 255).astype(np.uint8)
    return q.reshape(rows, n), scale.astype(np.float32), lo.astype(np.float32)


def to_affine(raw: np.ndarray, qtype: T, shape: tuple[int, ...], wide: bool = False) -> AffineWeight:
    """GGUF block bytes of a 2-D (or stacked 3-D) tensor → :class:`AffineWeight` (5-bit codes one a byte when
    ``wide``, as a CPU load stores them).

    ``shape`` is numpy order; leading dims are flattened into rows and restored by the caller."""
    n = shape[-1]
    rows = int(np.prod(shape[:-1]))
    out: list[np.ndarray] = []

    def allocate(like: AffineWeight) -> list[np.ndarray]:
        out.extend(np.empty((rows, x.shape[1]), x.dtype) for x in (like.packed, like.scales, like.biases))
        return out

    bits, exact = repack_rows([(raw, qtype, rows)], n, allocate, wide)
    return AffineWeight(*out, bits, exact)


def repack_rows(parts, n: int, allocate, wide: bool = False) -> tuple[int, bool]:
    """The rows of ``parts`` (``(GGUF block bytes, type, rows)`` each, of width ``n``) repacked, stacked in order, into
    the three arrays ``allocate(an AffineWeight of the first row)`` returns (packed, scales, biases: one row per row
    of all parts, that row's widths and dtypes); ``(bits, exact)``.

    The one banding of a repack: each part is cut into row bands (:func:`_bands`) repacked on the shared CPU pool
    (numpy's element-wise work releases the GIL, so loading a many-gigabyte model uses every core) and written
    straight into the destination, so a load holds one band per worker beside it, never a second whole copy.
    A row's blocks depend on that row alone: the bands join to the bytes of the tensor repacked in one piece.
    A band goes through the C pass of :mod:`hf2q.kernels.cpu_repack` where it takes the type (the same bytes as
    :func:`_to_affine_rows`, the reference, which does the rest). ``wide`` stores 5-bit codes one a byte (8-bit
    groups of the same values: the CPU's kernels unpack 5-bit fields several times slower than they stream bytes)."""
    from hf2q.kernels import cpu_repack
    from hf2q.kernels.cpu_blas import pool

    jobs, at = [], 0
    for raw, qtype, rows in parts:
        flat = np.ascontiguousarray(raw).reshape(rows, -1)
        jobs += [(flat[a:b], qtype, at + a) for a, b in _bands(rows, n)]
        at += rows

    def one(job) -> bool:  # the band's exactness only: its arrays go once written, so bands never pile up
        raw, qtype, start = job
        rows = raw.shape[0]
        if cpu_repack.repack_band(raw, qtype, n, *(dst[start:start + rows] for dst in dest), wide=wide):
            return qtype not in REQUANTIZED
        aff = _to_affine_rows(raw, qtype, rows, n, wide)
        for dst, src in zip(dest, (aff.packed, aff.scales, aff.biases)):
            dst[start:start + rows] = src
        return aff.exact

    raw0, qtype0, _ = jobs[0]
    probe = _to_affine_rows(raw0[:1], qtype0, 1, n, wide)  # one row gives the widths and dtypes: every band goes to the pool
    dest = allocate(probe)
    workers = pool()
    exact = list(map(one, jobs) if workers is None else workers.map(one, jobs))
    return probe.bits, all(exact)


#: a tensor is repacked in one band below this many weights (when the pool has more than one thread)
PARALLEL_MIN_ELEMENTS = 1 << 22
#: weights one band holds at most (bounds a load's transient host memory: one band per worker)
REPACK_CHUNK = 1 << 24


def _bands(rows: int, n: int) -> list[tuple[int, int]]:
    """Row bands of a ``rows × n`` repack: a few per worker of the shared CPU pool (``hf2q.kernels.cpu_blas.pool``;
    one band when it has one thread or the tensor is small), and never more than ``REPACK_CHUNK`` weights each."""
    from hf2q.kernels.cpu_blas import threads

    workers = threads()
    k = 1 if workers < 2 or rows * n < PARALLEL_MIN_ELEMENTS or rows < 2 * workers else 4 * workers
    k = min(rows, max(k, -(-rows * n // REPACK_CHUNK)))
    edges = np.linspace(0, rows, k + 1).astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def _to_affine_rows(raw: np.ndarray, qtype: T, rows: int, n: int, wide: bool = False) -> AffineWeight:
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        q, s, bias, bits = _legacy(raw, rows, qtype)
        exact = True
    elif qtype in (T.Q4_K, T.Q5_K):
        q, s, bias, bits = _k_quant(raw, rows, qtype)
        exact = True
    elif qtype in REQUANTIZED:
        w = gguf_quants.dequantize(np.ascontiguousarray(raw).reshape(rows, -1), qtype).reshape(rows, n)
        q, s, bias = requantize_8bit(w)
        return AffineWeight(pack_bits(q, 8), s, bias, 8, exact=False)
    else:
        raise InputError(f"unsupported GGUF tensor type {qtype.name}")
    q = q.reshape(rows, n)
    if wide and bits == 5:
        bits = 8
    return AffineWeight(pack_bits(q, bits), np.ascontiguousarray(s.reshape(rows, -1), dtype=np.float32),
                        np.ascontiguousarray(bias.reshape(rows, -1), dtype=np.float32), bits, exact)


def affine_dequantize(w: AffineWeight, n: int) -> np.ndarray:
    """Numpy reference of MLX's dequantize (for tests)."""
    q = unpack_bits(w.packed, w.bits, n).astype(np.float32)
    rows = q.shape[0]
    g = q.reshape(rows, -1, GROUP)
    return (g * w.scales[..., None] + w.biases[..., None]).reshape(rows, n)


QUANTIZED_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q2_K, T.Q3_K, T.Q6_K)
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
