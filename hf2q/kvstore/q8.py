"""Optional 8-bit KV payloads (``payload_kind = "kv-q8"``): half the disk, small error.

Each row along the last axis (one head's key or value for one token, ``head_dim`` values) is
stored as int8 with its own float16 scale ``max|x| / 127`` — symmetric, round-to-nearest,
like GGML's Q8_0 but with the block being one head row. A stored tensor ``NAME`` becomes
``NAME`` (int8, same shape) plus ``NAME.q8_scale`` (float16, shape ``[..., 1]``); reading
multiplies back into the engine's dtype. The error this causes is measured in
docs/KVSTORE.md; outputs are then no longer bit-identical to a cold prefill, which is why
the default payload keeps the engine's own dtype.
"""

from __future__ import annotations


import numpy as np

PAYLOAD_KV_Q8 = "kv-q8"
SCALE_SUFFIX = ".q8_scale"


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x[..., D]`` → (int8 ``[..., D]``, float16 scales ``[..., 1]``)."""
    xf = np.asarray(x, dtype=np.float32)
    amax = np.max(np.abs(xf), axis=-1, keepdims=True)
    scale = (amax / 127.0).astype(np.float16)
    s32 = scale.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s32 > 0, np.rint(xf / np.where(s32 > 0, s32, 1.0)), 0.0)
    return np.clip(q, -127, 127).astype(np.int8), scale


def dequantize_rows(q: np.ndarray, scale: np.ndarray, dtype) -> np.ndarray:
    return (q.astype(np.float32) * scale.astype(np.float32)).astype(dtype)
