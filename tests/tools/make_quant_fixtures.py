"""Generate byte-exact quantizer fixtures from stock llama.cpp (the oracle for hf2q.ggml).

    python -m tests.tools.make_quant_fixtures        # writes tests/fixtures/quants/*.npz

Loads ``libggml-base.so`` from the llama.cpp build made by ``tests/tools/llama_cpp.py`` with
ctypes and calls ``ggml_quantize_chunk`` (with and without an importance matrix) and the
type's ``to_float`` from ``ggml_get_type_traits``.  Only inputs (float16, or float32 for the
float-format probes) and llama.cpp's outputs are stored; no llama.cpp code is copied.

Layout of each ``<set>.npz``:
  ``x``                 inputs, float16 [rows, n_per_row] (float32 for the ``floats`` set)
  ``imatrix``           positive importance weights, float32 [n_per_row]
  ``q_<TYPE>``          ggml_quantize_chunk(x) bytes, uint8 [rows, row_bytes]
  ``imatrix_sparse``    importance weights with many zeros (whole zero sub-blocks)
  ``qw_<TYPE>``         the same with ``imatrix`` (types whose quantizer reads it)
  ``qz_<TYPE>``         the same with ``imatrix_sparse`` (small sets only)
  ``dq_<TYPE>``         to_float(q_<TYPE>), float32 [rows, n_per_row] (not for the bulk ``wide4096`` set)
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.tools import llama_cpp

OUT_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "quants"

# ggml enum values (ggml.h) — identical to gguf.GGMLQuantizationType values.
GGML_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10,
              "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "BF16": 30}
LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
KQUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
FLOATS = ("F32", "F16", "BF16")
# quantizers whose imatrix path differs from the plain one (Q8_0 ignores quant_weights)
IMATRIX_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1") + KQUANTS
NO_DEQUANT_SETS = ("wide4096",)
SPARSE_IMATRIX_SETS = ("nasty256", "random1024", "legacy96")  # bulk quantizer coverage only; keeps the fixtures small


class _TypeTraits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class Ggml:
    """The few ggml-base entry points we need, bound with ctypes."""

    def __init__(self, bin_dir: Path):
        self.lib = ctypes.CDLL(str(bin_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        self.lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        self.lib.ggml_row_size.restype = ctypes.c_size_t
        self.lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        self.lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
        self.lib.ggml_get_type_traits.argtypes = [ctypes.c_int]

    def quantize(self, x: np.ndarray, type_name: str, imatrix: np.ndarray | None = None) -> np.ndarray:
        t = GGML_TYPES[type_name]
        x = np.ascontiguousarray(x, dtype=np.float32)
        rows, n = x.shape
        rb = self.lib.ggml_row_size(t, n)
        out = np.zeros((rows, rb), dtype=np.uint8)
        qw = None
        if imatrix is not None:
            imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
            qw = imatrix.ctypes.data
        got = self.lib.ggml_quantize_chunk(t, x.ctypes.data, out.ctypes.data, 0, rows, n, qw)
        assert got == rows * rb
        return out

    def dequantize(self, raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> np.ndarray:
        traits = self.lib.ggml_get_type_traits(GGML_TYPES[type_name]).contents
        if not traits.to_float:  # F32 has no converter: its bytes are the values
            return np.ascontiguousarray(raw).view(np.float32).reshape(shape).copy()
        fn = _TO_FLOAT(traits.to_float)
        raw = np.ascontiguousarray(raw)
        out = np.zeros(shape, dtype=np.float32)
        for r in range(shape[0]):  # to_float works on one row's blocks
            fn(raw[r].ctypes.data, out[r].ctypes.data, shape[1])
        return out


def nasty_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """Rows that stress edge cases of the scale searches (zeros, ties, outliers, extremes)."""
    normal = lambda s=1.0: rng.standard_normal(n) * s
    outlier = normal(0.01)
    outlier[n // 3] = 100.0
    half_zero = normal()
    half_zero[: n // 2] = 0
    sparse = np.where(rng.random(n) < 0.05, normal(), 0.0)
    ties = rng.integers(-16, 17, n) * 0.5
    rows = [np.zeros(n), np.full(n, 0.5), np.full(n, -3.0), outlier, normal(1e-8), normal(3e-6),
            rng.uniform(-6e4, 6e4, n), np.full(n, 6e4), -np.abs(normal()), np.abs(normal(2.0)), half_zero, sparse,
            ties, np.tile([1.0, -1.0], n // 2), np.linspace(-1, 1, n), normal(1e-3), normal(30.0),
            rng.integers(0, 4, n) * 1.0 - 1.5]
    return np.stack(rows)


def random_rows(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """Normal rows whose scale varies per row and per 32-block (like real weights)."""
    row_scale = 10.0 ** rng.uniform(-4, 2, (rows, 1))
    block_scale = np.repeat(10.0 ** rng.uniform(-1, 1, (rows, n // 32)), 32, axis=1)
    return rng.standard_normal((rows, n)) * row_scale * block_scale


def float_probes(rng: np.random.Generator) -> np.ndarray:
    """float32 values that are not F16-exact: rounding ties for BF16/F16, subnormals, overflow, NaN/inf."""
    bits = rng.integers(0, 2**32, (3, 256), dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32).copy()
    x[~np.isfinite(x)] = 1.0
    ties = (rng.integers(0, 2**16, 256, dtype=np.uint32) << 16) | 0x8000
    ties[::2] &= ~np.uint32(0x7F800000)  # also some tiny / subnormal ties
    specials = np.array([np.inf, -np.inf, np.nan, -0.0, 0.0, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 1e-40,
                         3.4e38, -3.4e38, 2.0**-24, 2.0**-25], dtype=np.float32)
    last = np.resize(specials, 256)
    return np.concatenate([x, ties.view(np.float32)[None], last[None]])


def build_sets(seed: int = 20260101) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "nasty256": nasty_rows(rng, 256).astype(np.float16),
        "random1024": random_rows(rng, 6, 1024).astype(np.float16),
        "legacy96": random_rows(rng, 5, 96).astype(np.float16),
        "wide4096": random_rows(rng, 16, 4096).astype(np.float16),
        "floats": float_probes(rng),
    }


def main() -> None:
    bin_dir = llama_cpp.bin_dir()
    if not (bin_dir / "libggml-base.so").exists():
        raise SystemExit(f"libggml-base.so not found in {bin_dir}; run python -m tests.tools.llama_cpp first")
    ggml = Ggml(bin_dir)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    for name, x in build_sets().items():
        n = x.shape[1]
        if name == "floats":
            types = FLOATS
        elif name in NO_DEQUANT_SETS:
            types = LEGACY + KQUANTS
        elif n % 256 == 0:
            types = FLOATS + LEGACY + KQUANTS
        else:
            types = FLOATS + LEGACY
        imatrix = (rng.gamma(0.7, 1.0, n) + 1e-3).astype(np.float32)
        sparse = np.where(rng.random(n) < 0.3, 0.0, rng.gamma(0.5, 2.0, n)).astype(np.float32)
        sparse[: min(n, 64)] = 0.0  # whole sub-blocks without importance (unused columns)
        data = {"x": x, "imatrix": imatrix, "imatrix_sparse": sparse}
        xf = x.astype(np.float32)
        for t in types:
            q = ggml.quantize(xf, t)
            data[f"q_{t}"] = q
            if name not in NO_DEQUANT_SETS:
                data[f"dq_{t}"] = ggml.dequantize(q, t, xf.shape)
            if t in IMATRIX_TYPES:
                data[f"qw_{t}"] = ggml.quantize(xf, t, imatrix)
                if name in SPARSE_IMATRIX_SETS:
                    data[f"qz_{t}"] = ggml.quantize(xf, t, sparse)
        path = OUT_DIR / f"{name}.npz"
        np.savez_compressed(path, **data)
        print(f"{path}  {path.stat().st_size / 1024:.0f} KiB  types={','.join(types)}")


if __name__ == "__main__":
    main()
