"""Read only the key/value metadata of a GGUF file.

The text layer needs the tokenizer arrays and the chat template, nothing else. The
``gguf`` package's reader parses every tensor record too (tens of seconds for a large
model on a busy machine); this reader stops after the metadata section and keeps big
numeric arrays as numpy views of the memory map, so it costs well under a second even
for a 262k-entry vocabulary.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any

import numpy as np

from hf2q.errors import InputError

GGUF_MAGIC = b"GGUF"

# GGUF value type codes (see gguf.GGUFValueType)
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)

_SCALAR_DTYPES = {
    _UINT8: np.dtype("<u1"),
    _INT8: np.dtype("<i1"),
    _UINT16: np.dtype("<u2"),
    _INT16: np.dtype("<i2"),
    _UINT32: np.dtype("<u4"),
    _INT32: np.dtype("<i4"),
    _FLOAT32: np.dtype("<f4"),
    _BOOL: np.dtype("<u1"),
    _UINT64: np.dtype("<u8"),
    _INT64: np.dtype("<i8"),
    _FLOAT64: np.dtype("<f8"),
}


class _Cursor:
    def __init__(self, buf, offset: int):
        self.buf = buf
        self.pos = offset

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise InputError("GGUF metadata is truncated")
        view = memoryview(self.buf)[self.pos : self.pos + n]
        self.pos += n
        return view

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self) -> bytes:
        return bytes(self.take(self.u64()))


def _read_value(cur: _Cursor, vtype: int) -> Any:
    if vtype == _STRING:
        return cur.string().decode("utf-8", errors="replace")
    if vtype in _SCALAR_DTYPES:
        dt = _SCALAR_DTYPES[vtype]
        value = np.frombuffer(cur.take(dt.itemsize), dtype=dt)[0].item()
        return bool(value) if vtype == _BOOL else value
    if vtype == _ARRAY:
        item_type = cur.u32()
        count = cur.u64()
        if item_type == _STRING:
            # token texts stay bytes: a few vocabularies hold invalid UTF-8 pieces
            out = []
            take, u64 = cur.take, cur.u64
            for _ in range(count):
                out.append(bytes(take(u64())))
            return out
        if item_type in _SCALAR_DTYPES:
            dt = _SCALAR_DTYPES[item_type]
            arr = np.frombuffer(cur.take(dt.itemsize * count), dtype=dt).copy()
            return arr.astype(bool) if item_type == _BOOL else arr
        return [_read_value(cur, item_type) for _ in range(count)]
    raise InputError(f"GGUF metadata holds an unknown value type {vtype}")


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """All metadata key/values of a GGUF file (string arrays as lists of bytes)."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 24:
                raise InputError(f"{path}: not a GGUF file (too small)")
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        if buf[:4] != GGUF_MAGIC:
            raise InputError(f"{path}: not a GGUF file (bad magic)")
        cur = _Cursor(buf, 4)
        version = cur.u32()
        if version not in (2, 3):
            raise InputError(f"{path}: unsupported GGUF version {version}")
        cur.u64()  # tensor count
        n_kv = cur.u64()
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string().decode("utf-8", errors="replace")
            meta[key] = _read_value(cur, cur.u32())
        return meta
    except (struct.error, ValueError) as exc:
        raise InputError(f"{path}: corrupt GGUF metadata ({exc})") from None
    finally:
        buf.close()


def metadata_from(source: Any) -> dict[str, Any]:
    """Metadata from a path, a ready dict, or a ``gguf.GGUFReader``."""
    if isinstance(source, dict):
        return source
    if hasattr(source, "fields"):  # gguf.GGUFReader
        meta: dict[str, Any] = {}
        for key, field in source.fields.items():
            if not field.types:
                continue
            if field.types[0] == 9 and len(field.types) > 1 and field.types[1] == 8:
                meta[key] = [bytes(field.parts[i]) for i in field.data]
            elif field.types[0] == 9 and len(field.types) > 1:
                meta[key] = np.concatenate([np.asarray(field.parts[i]) for i in field.data]) if field.data else np.array([])
            else:
                meta[key] = field.contents()
        return meta
    return read_metadata(source)
