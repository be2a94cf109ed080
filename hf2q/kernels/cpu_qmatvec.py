"""Quantized matrix × few-vectors on the CPU, straight from MLX's affine packing.

MLX's CPU ``quantized_matmul`` runs at well under 1 GMAC/s; for single-token decode it
made SmolLM2 spend ~0.3 s per token in matvecs. This module compiles (once, with the
system C compiler, cached under the hf2q cache) a small C kernel over the same packed
``uint32`` words, float32 scales and biases that MLX uses, so no second copy of the
weights is made: ``y[b, r] = Σ_g scale[r,g]·(q[r,g]·x[b,g]) + bias[r,g]·Σx[b,g]``.

Each row is first unpacked to bytes (4-bit nibbles, or any width via 64-bit words),
then the 32-element group dot products run as vectorisable float loops. Rows can be split across ``HF2Q_CPU_THREADS`` Python threads (default 1: on a shared
2-core box the hand-offs cost more than they gain); ctypes releases the GIL for the call. When no compiler is available
:func:`kernel` returns None and callers keep MLX's own path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np

SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* x: [batch, n] float32; xe/xo: scratch [batch, n/2]; xs: [batch, n/32] group sums */
void prep(const float* x, float* xe, float* xo, float* xs, int batch, int n) {
    for (int b = 0; b < batch; b++) {
        const float* xb = x + (int64_t)b * n;
        for (int g = 0; g < n / 32; g++) {
            float s = 0.f;
            for (int i = 0; i < 32; i++) s += xb[g * 32 + i];
            xs[(int64_t)b * (n / 32) + g] = s;
            for (int k = 0; k < 16; k++) {
                xe[(int64_t)b * (n / 2) + g * 16 + k] = xb[g * 32 + 2 * k];
                xo[(int64_t)b * (n / 2) + g * 16 + k] = xb[g * 32 + 2 * k + 1];
            }
        }
    }
}

void qmv4(const uint8_t* w, const float* sc, const float* bi, const float* x, const float* xs,
          float* y, int r0, int r1, int n, int batch, int ystride) {
    const int G = n / 32;
    uint8_t q[n];
    for (int r = r0; r < r1; r++) {
        const uint8_t* wr = w + (int64_t)r * (n / 2);
        for (int k = 0; k < n / 2; k++) {
            q[2 * k] = wr[k] & 15;
            q[2 * k + 1] = wr[k] >> 4;
        }
        for (int b = 0; b < batch; b++) {
            const float* xb = x + (int64_t)b * n;
            const float* s = xs + (int64_t)b * G;
            float acc = 0.f;
            for (int g = 0; g < G; g++) {
                float d = 0.f;
                for (int i = 0; i < 32; i++) d += (float)q[g * 32 + i] * xb[g * 32 + i];
                acc += sc[(int64_t)r * G + g] * d + bi[(int64_t)r * G + g] * s[g];
            }
            y[(int64_t)b * ystride + r] = acc;
        }
    }
}

void qmv8(const uint8_t* w, const float* sc, const float* bi, const float* x, const float* xs,
          float* y, int r0, int r1, int n, int batch, int ystride) {
    const int G = n / 32;
    for (int r = r0; r < r1; r++) {
        const uint8_t* wr = w + (int64_t)r * n;
        for (int b = 0; b < batch; b++) {
            const float* xb = x + (int64_t)b * n;
            const float* s = xs + (int64_t)b * G;
            float acc = 0.f;
            for (int g = 0; g < G; g++) {
                float d = 0.f;
                for (int i = 0; i < 32; i++) d += (float)wr[g * 32 + i] * xb[g * 32 + i];
                acc += sc[(int64_t)r * G + g] * d + bi[(int64_t)r * G + g] * s[g];
            }
            y[(int64_t)b * ystride + r] = acc;
        }
    }
}

/* widths other than 4 and 8: 8 values occupy exactly BITS bytes of the little-endian
   stream; a compile-time width lets the unpack loop unroll and vectorise. */
#define QMV_BITS(BITS)                                                                          \
void qmv##BITS(const uint8_t* w, const float* sc, const float* bi, const float* x, const float* xs, \
               float* y, int r0, int r1, int n, int batch, int ystride) {                       \
    const int G = n / 32;                                                                       \
    const int64_t row_bytes = (int64_t)n * BITS / 8;                                            \
    const uint64_t mask = (1u << BITS) - 1u;                                                    \
    uint8_t q[n];                                                                               \
    for (int r = r0; r < r1; r++) {                                                             \
        const uint8_t* wr = w + (int64_t)r * row_bytes;                                         \
        for (int j = 0; j < n / 8; j++) {                                                       \
            uint64_t word = 0;                                                                  \
            memcpy(&word, wr + (int64_t)j * BITS, BITS);                                        \
            for (int i = 0; i < 8; i++) q[j * 8 + i] = (uint8_t)((word >> (BITS * i)) & mask);  \
        }                                                                                       \
        for (int b = 0; b < batch; b++) {                                                       \
            const float* xb = x + (int64_t)b * n;                                               \
            const float* s = xs + (int64_t)b * G;                                               \
            float acc = 0.f;                                                                    \
            for (int g = 0; g < G; g++) {                                                       \
                float d = 0.f;                                                                  \
                for (int i = 0; i < 32; i++) d += (float)q[g * 32 + i] * xb[g * 32 + i];        \
                acc += sc[(int64_t)r * G + g] * d + bi[(int64_t)r * G + g] * s[g];              \
            }                                                                                   \
            y[(int64_t)b * ystride + r] = acc;                                                  \
        }                                                                                       \
    }                                                                                           \
}
QMV_BITS(2)
QMV_BITS(3)
QMV_BITS(5)
QMV_BITS(6)
"""

_LIB: ctypes.CDLL | None = None
_TRIED = False
_POOL: ThreadPoolExecutor | None = None
_P = ctypes.c_void_p
_I = ctypes.c_int


def _threads() -> int:
    env = os.environ.get("HF2Q_CPU_THREADS")
    if env:
        return max(1, int(env))
    return 1


def _compile() -> ctypes.CDLL | None:
    from hf2q.paths import cache_root

    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if not cc:
        return None
    tag = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    out_dir = cache_root() / "kernels"
    lib = out_dir / f"cpu_qmatvec-{tag}.so"
    if not lib.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        src = out_dir / f"cpu_qmatvec-{tag}.{os.getpid()}.c"
        src.write_text(SOURCE)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        flags = ["-O3", "-fPIC", "-shared", "-ffp-contract=fast", "-fno-math-errno", "-fassociative-math",
                 "-fno-signed-zeros", "-fno-trapping-math"]
        arch = ["-mavx2", "-mfma", "-mf16c"] if _has_avx2() else []
        r = subprocess.run([cc, *flags, *arch, str(src), "-o", str(tmp)], capture_output=True, text=True)
        src.unlink(missing_ok=True)
        if r.returncode != 0:
            return None
        os.replace(tmp, lib)
    l = ctypes.CDLL(str(lib))
    l.prep.argtypes = [_P, _P, _P, _P, _I, _I]
    l.qmv4.argtypes = [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I]
    l.qmv8.argtypes = [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I]
    for bits in (2, 3, 5, 6):
        getattr(l, f"qmv{bits}").argtypes = [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I]
    return l


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        return " avx2 " in flags and " fma " in flags and " f16c " in flags
    except OSError:
        return False


def kernel() -> ctypes.CDLL | None:
    global _LIB, _TRIED, _POOL
    if not _TRIED:
        _TRIED = True
        if os.environ.get("HF2Q_NO_CPU_KERNELS"):
            return None
        try:
            _LIB = _compile()
        except OSError:
            _LIB = None
        if _LIB is not None and _threads() > 1:
            _POOL = ThreadPoolExecutor(_threads(), thread_name_prefix="hf2q-qmv")
    return _LIB


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def qmatvec(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, x: np.ndarray, bits: int) -> np.ndarray:
    """``x [batch, n] float32`` → ``[batch, rows]``; packed is the MLX uint32 layout as bytes ``[rows, n*bits/8]``."""
    lib = kernel()
    assert lib is not None
    x = np.ascontiguousarray(x, dtype=np.float32)
    batch, n = x.shape
    rows = packed.shape[0]
    y = np.empty((batch, rows), dtype=np.float32)
    xs = np.empty((batch, n // 32), dtype=np.float32)
    xe = np.empty((batch, n // 2), dtype=np.float32)
    xo = np.empty((batch, n // 2), dtype=np.float32)
    lib.prep(_ptr(x), _ptr(xe), _ptr(xo), _ptr(xs), batch, n)
    w, s, b = _ptr(packed), _ptr(scales), _ptr(biases)

    def part(r0: int, r1: int) -> None:
        if bits == 4:
            lib.qmv4(w, s, b, _ptr(x), _ptr(xs), _ptr(y), r0, r1, n, batch, rows)
        elif bits == 8:
            lib.qmv8(w, s, b, _ptr(x), _ptr(xs), _ptr(y), r0, r1, n, batch, rows)
        else:
            getattr(lib, f"qmv{bits}")(w, s, b, _ptr(x), _ptr(xs), _ptr(y), r0, r1, n, batch, rows)

    if _POOL is None or rows * n < (1 << 16):
        part(0, rows)
    else:
        k = _threads()
        bounds = [rows * i // k for i in range(k + 1)]
        list(_POOL.map(lambda i: part(bounds[i], bounds[i + 1]), range(k)))
    return y
