"""Numba building blocks for the compiled (JIT) GGML quantizers, bit-exact with llama.cpp's C.

Why numba: llama.cpp's scale searches are short data-dependent loops over 16–32 values;
numpy can only run them as masks over many blocks at once (every candidate evaluated for
every block), while compiled scalar loops do exactly the C's work.

Exactness rules every ``jit_*`` kernel follows (the C reference is compiled without
fast-math and without FMA contraction):

* no ``fastmath``: LLVM then neither reassociates nor fuses ``a*b + c``;
* every operand is float32 — numba promotes ``float32 * int`` to float64, so integers are
  converted with ``np.float32(...)`` first, as C's usual arithmetic conversions would;
* ``error_model="numpy"``: a division by zero gives inf/NaN like C instead of raising;
* comparisons are written out (``if v > m: m = v``) so NaN takes the same branch as in C.

Only imported when the compiled path is used (``codec.jit_active()``).  Every kernel has
explicit signatures: importing a ``jit_*`` module compiles its kernels the first time
(tens of seconds for all of them) and loads them from numba's on-disk cache afterwards.
"""

# ruff: noqa: PLR1730  (explicit comparisons keep C's NaN behaviour, which min()/max() would not)

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

F32 = np.float32
MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: adding it leaves round-half-even(v) in the low mantissa bits
GROUP_MAX_EPS = np.float32(1e-15)
ZERO = np.float32(0.0)
ONE = np.float32(1.0)
TWO_POW_24 = np.float32(16777216.0)


def kernel(*signatures: str):
    """Compile with the one set of options every exact kernel uses (see the module docstring).

    Explicit signatures compile (or load from the cache) once at import, and stop numba from
    compiling a new specialisation for every literal argument a caller passes (``nmax=15``
    and ``nmax=31`` would otherwise be two compilations of the same search).
    """
    def compile_(fn):
        options = {"nogil": True, "error_model": "numpy", "fastmath": False}
        try:
            return njit(list(signatures), cache=True, **options)(fn)
        except RuntimeError:  # no writable cache location at all: compile for this process only
            return njit(list(signatures), **options)(fn)

    return compile_


@intrinsic
def f32_bits(typingctx, value):
    """The IEEE bit pattern of a float32 as int32 (a plain bitcast, like C's union/memcpy)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, bits):
    """The float32 whose bit pattern is the given int32."""
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@kernel("int64(float32)")
def nearest_int(v):
    """llama.cpp's ``nearest_int``: add 1.5·2**23 in float32, read the low 23 bits (wraps when large)."""
    bits = f32_bits(np.float32(v + MAGIC))
    return (np.int64(bits) & 0x007FFFFF) - 0x00400000


@kernel("int64(float32)")
def fp16_bits(value):
    """float32 → IEEE half bits, round to nearest even; NaN → 0x7E00 with the sign kept (ggml's rule)."""
    u = np.int64(f32_bits(np.float32(value))) & 0xFFFFFFFF
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:
        return sign | 0x7E00
    if a >= 0x477FF000:  # ≥ 65520 rounds to infinity
        return sign | 0x7C00
    if a >= 0x38800000:  # ≥ 2**-14: a normal half
        mant = a & 0x7FFFFF
        h = ((((a >> 23) - 112) << 10) | (mant >> 13))
        rest = mant & 0x1FFF
        if rest > 0x1000 or (rest == 0x1000 and (h & 1) == 1):
            h += 1  # a carry into the exponent is the correct next half
        return sign | h
    # subnormal half (or zero): |value|·2**24 is exact in float32; rint is round-half-even
    scaled = np.float32(bits_f32(np.int32(a)) * TWO_POW_24)
    return sign | np.int64(np.rint(scaled))


@kernel("float32(int64)")
def half_f32(h):
    """IEEE half bits → float32 (exact)."""
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    mant = h & 0x3FF
    if exp == 0:
        mag = np.float32(np.float32(mant) / TWO_POW_24)  # subnormal: mant · 2**-24, exact
        return -mag if sign else mag
    if exp == 31:
        bits = sign | 0x7F800000 | (mant << 13)
    else:
        bits = sign | ((exp + 112) << 23) | (mant << 13)
    return bits_f32(np.int32(np.int64(bits) - (np.int64(1) << 32) if bits >= (1 << 31) else bits))


@kernel("float32(uint8[::1], int64, float32)")
def store_half(out, offset, value):
    """Write ``value`` as a little-endian fp16 at ``out[offset:offset+2]``; returns the stored value."""
    h = fp16_bits(value)
    out[offset] = h & 0xFF
    out[offset + 1] = (h >> 8) & 0xFF
    return half_f32(h)


@kernel("UniTuple(float32, 2)(float32[::1])")
def first_absmax(x):
    """(largest |v|, the first v achieving it), 0/0 when all are zero: ``if (|v| > amax) …``."""
    amax = ZERO
    vmax = ZERO
    for i in range(x.shape[0]):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            vmax = x[i]
    return amax, vmax


@kernel("float32(float32[::1])")
def positive_max(x):
    """``m = 0; for v: if (v > m) m = v``."""
    m = ZERO
    for i in range(x.shape[0]):
        if x[i] > m:
            m = x[i]
    return m
