"""How a block's KV arrays are laid out on disk, and back.

``kv`` (default, lossless): arrays keep their values bit for bit, but float32 arrays whose
every value is exactly representable in float16 (or bfloat16) are *stored* narrow — the
engine exports float32 host copies of an f16/bf16 cache, so this halves the bytes without
changing a bit of what ``import_kv`` receives. bfloat16 is stored as its 16 raw bits under
the safetensors tag ``BF16``. ``kv-f16`` (opt-in, lossy): float32 arrays that do not narrow
losslessly are rounded to float16 (when every value is within its range) — the CPU engine's
float32 KV at half the bytes, at the cost of bit-exact restores. ``kv-q8`` (opt-in, lossy):
floating-point arrays become int8 rows plus float16 scales (``q8.py``). ``kv-codes`` (chosen by the
block, not the store): an 8-bit cache's export — uint8 codes and their scales
(``engine/kv_layout.SCALES_SUFFIX``) — kept as it is, the scales narrowed only losslessly, so a
restore gives back the very codes, whatever ``--kv-persist-payload`` says. In every case
``payload_dtypes`` in the header records the dtype each narrowed tensor is restored to, so
readers get back exactly the exported dtype. A block's end state (``state.*``: a recurrent state,
DeepSeek-V4's open compressor rows, or a sliding-window layer's last rows) is always stored losslessly:
a rounded recurrent state would carry its error into every later token, where rounded K/V rows only
touch attention over them.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from hf2q.engine.kv_layout import END_STATE_PREFIX, SCALES_SUFFIX
from hf2q.kvstore.blockfile import (PAYLOAD_KV, PAYLOAD_KV_CODES, PAYLOAD_KV_F16, PAYLOAD_KV_Q8,
                                    BlockMeta)
from hf2q.kvstore.q8 import SCALE_SUFFIX, dequantize_rows, quantize_rows


_F16_MAX = float(np.finfo(np.float16).max)


def _narrow_lossless(arr: np.ndarray) -> tuple[np.ndarray, str | None] | None:
    """(stored array, safetensors tag override) when ``arr`` (float32) fits 16 bits exactly."""
    with np.errstate(over="ignore"):  # out of float16's range: inf, which the comparison rejects
        half = arr.astype(np.float16)
    if np.array_equal(half.astype(np.float32), arr):
        return half, None
    bits = np.ascontiguousarray(arr).view(np.uint32)
    if not np.any(bits & 0xFFFF):
        return (bits >> 16).astype(np.uint16), "BF16"
    return None


def block_kind(arrays: Mapping[str, np.ndarray], kind: str) -> str:
    """The payload kind a block of ``arrays`` is stored as in a store of ``kind``: ``kv-codes`` for an
    8-bit cache's export (re-quantizing or rounding its codes and scales would only lose)."""
    return PAYLOAD_KV_CODES if any(name.endswith(SCALES_SUFFIX) for name in arrays) else kind


def encode_payload(arrays: Mapping[str, np.ndarray], kind: str
                   ) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, str]]:
    """→ (arrays to store, safetensors dtype tag overrides, restored dtype by name)."""
    stored: dict[str, np.ndarray] = {}
    tags: dict[str, str] = {}
    dtypes: dict[str, str] = {}
    for name, arr in arrays.items():
        arr = np.asarray(arr)
        if name.endswith(SCALE_SUFFIX):
            raise ValueError(f"tensor name {name!r} is reserved")
        lossy = not name.startswith(END_STATE_PREFIX)
        if lossy and kind == PAYLOAD_KV_Q8 and arr.dtype.kind == "f" and arr.ndim >= 1 and arr.shape[-1] > 0:
            stored[name], stored[name + SCALE_SUFFIX] = quantize_rows(arr)
            dtypes[name] = arr.dtype.name
            continue
        if arr.dtype == np.float32:
            narrow = _narrow_lossless(arr)
            if narrow is None and lossy and kind == PAYLOAD_KV_F16 and np.all(np.abs(arr) <= _F16_MAX):
                narrow = arr.astype(np.float16), None
            if narrow is not None:
                stored[name], tag = narrow
                if tag:
                    tags[name] = tag
                dtypes[name] = "float32"
                continue
        stored[name] = arr
    return stored, tags, dtypes


def decode_payload(stored: Mapping[str, np.ndarray], meta: BlockMeta) -> dict[str, np.ndarray]:
    """The arrays as exported: q8 rows dequantized, narrowed tensors widened back."""
    if not meta.payload_dtypes:
        return dict(stored)
    out = {}
    for name, arr in stored.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        want = meta.payload_dtypes.get(name)
        if want is None:
            out[name] = arr
        elif meta.payload_kind == PAYLOAD_KV_Q8 and name + SCALE_SUFFIX in stored:  # (an end state is not q8)
            out[name] = dequantize_rows(arr, stored[name + SCALE_SUFFIX], np.dtype(want))
        elif meta.tensors[name].dtype == "BF16":
            out[name] = (arr.astype(np.uint32) << 16).view(np.float32).astype(np.dtype(want), copy=False)
        else:
            out[name] = arr.astype(np.dtype(want))
    return out


__all__ = ["PAYLOAD_KV", "PAYLOAD_KV_CODES", "PAYLOAD_KV_F16", "PAYLOAD_KV_Q8", "block_kind", "decode_payload",
           "encode_payload"]
