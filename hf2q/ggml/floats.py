"""F32 / F16 / BF16 "codecs": plain element conversions with ggml's rounding rules.

F16 is round-to-nearest-even (NaN → quiet 0x7E00); BF16 rounds the float32 bit pattern to
nearest even and forces NaNs quiet (``ggml_compute_fp32_to_bf16``), which differs from
truncation and from torch's handling of NaN payloads.
"""

from __future__ import annotations

import numpy as np

from .common import F32, bf16_bits, fp16_bits

BYTES_PER_VALUE = {"F32": 4, "F16": 2, "BF16": 2}


def quantize(x: np.ndarray, name: str) -> np.ndarray:
    """float32 [rows, n] → uint8 [rows, n * bytes_per_value] (little-endian)."""
    rows = x.shape[0]
    if name == "F32":
        out = np.array(x, dtype="<f4", order="C", copy=True)  # never a view of the caller's array
    elif name == "F16":
        out = fp16_bits(x).astype("<u2")
    elif name == "BF16":
        out = bf16_bits(x).astype("<u2")
    else:
        raise KeyError(name)
    return out.view(np.uint8).reshape(rows, -1)


def dequantize(raw: np.ndarray, name: str) -> np.ndarray:
    """uint8 bytes (C-contiguous) → flat float32 values."""
    raw = np.ascontiguousarray(raw).reshape(-1)
    if name == "F32":
        return raw.view("<f4").astype(F32)
    if name == "F16":
        return raw.view("<f2").astype(F32)
    if name == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(F32)
    raise KeyError(name)
