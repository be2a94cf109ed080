"""Streaming GGUF v3 writer: header, metadata and tensor infos first, then tensor data as it is produced.

The ``gguf`` package's ``GGUFWriter`` keeps every tensor in memory until ``close()``; for a
converter whose peak memory should be one tensor (slab) plus scratch, we write the container
ourselves. The layout is fixed up front from the planned tensor types and shapes, so each
tensor's offset is known before any data exists and data can be appended in order.

Layout (little-endian): ``GGUF`` · u32 version · u64 n_tensors · u64 n_kv · KV pairs ·
tensor infos (name, n_dims, ne[], u32 type, u64 offset) · pad to ``ALIGNMENT`` · data, each
tensor padded to ``ALIGNMENT``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import BinaryIO

import attrs
import gguf
import numpy as np

V = gguf.GGUFValueType
ALIGNMENT = gguf.GGUF_DEFAULT_ALIGNMENT  # 32; llama.cpp assumes it unless general.alignment says otherwise

_SCALAR = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
           V.FLOAT32: "<f", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d", V.BOOL: "<?"}


@attrs.frozen
class TensorLayout:
    name: str
    ne: tuple[int, ...]  # ggml order
    qtype: gguf.GGMLQuantizationType
    nbytes: int
    offset: int  # relative to the start of the data section


def tensor_nbytes(ne: Sequence[int], qtype: gguf.GGMLQuantizationType) -> int:
    blk, size = gguf.GGML_QUANT_SIZES[qtype]
    n = 1
    for d in ne:
        n *= int(d)
    if ne[0] % blk:
        raise ValueError(f"row length {ne[0]} is not a multiple of {qtype.name}'s block size {blk}")
    return n // blk * size


def _pad(n: int) -> int:
    return (ALIGNMENT - n % ALIGNMENT) % ALIGNMENT


def _string(s: str | bytes) -> bytes:
    b = s if isinstance(s, bytes) else s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(v, vtype: gguf.GGUFValueType, item: gguf.GGUFValueType | None) -> bytes:
    if vtype == V.STRING:
        return _string(v)
    if vtype == V.ARRAY:
        assert item is not None
        head = struct.pack("<IQ", int(item), len(v))
        if item == V.STRING:
            return head + b"".join(_string(x) for x in v)
        np_type = {V.INT32: "<i4", V.FLOAT32: "<f4", V.UINT32: "<u4", V.INT64: "<i8", V.UINT8: "u1",
                   V.BOOL: "?", V.FLOAT64: "<f8", V.UINT64: "<u8", V.INT8: "i1", V.INT16: "<i2",
                   V.UINT16: "<u2"}[item]
        return head + np.asarray(v, dtype=np_type).tobytes()
    return struct.pack(_SCALAR[vtype], v)


def layout(tensors: Sequence[tuple[str, Sequence[int], gguf.GGMLQuantizationType]]) -> list[TensorLayout]:
    out, off = [], 0
    for name, ne, qtype in tensors:
        nb = tensor_nbytes(ne, qtype)
        out.append(TensorLayout(name, tuple(int(d) for d in ne), qtype, nb, off))
        off += nb + _pad(nb)
    return out


def header_bytes(metadata: dict, tensors: Sequence[TensorLayout]) -> bytes:
    """Everything before the data section, padded to ``ALIGNMENT``."""
    parts = [struct.pack("<IIQQ", gguf.GGUF_MAGIC, 3, len(tensors), len(metadata))]
    for key, (value, vtype, item) in metadata.items():
        parts.append(_string(key) + struct.pack("<I", int(vtype)) + _value(value, vtype, item))
    for t in tensors:
        parts.append(_string(t.name) + struct.pack("<I", len(t.ne)) + struct.pack(f"<{len(t.ne)}Q", *t.ne)
                     + struct.pack("<IQ", int(t.qtype), t.offset))
    head = b"".join(parts)
    return head + b"\0" * _pad(len(head))


class GGUFStream:
    """Appends tensor data in layout order to an open binary file, checking sizes as it goes."""

    def __init__(self, f: BinaryIO, metadata: dict, tensors: Sequence[TensorLayout]):
        self.f, self.tensors = f, list(tensors)
        self._i = 0
        self._written = 0  # bytes of the current tensor written so far
        f.write(header_bytes(metadata, self.tensors))

    @property
    def current(self) -> TensorLayout:
        return self.tensors[self._i]

    def write(self, data: bytes | memoryview | np.ndarray) -> None:
        """Write the next chunk of the current tensor (chunks must add up to its ``nbytes``)."""
        buf = memoryview(np.ascontiguousarray(data)).cast("B") if isinstance(data, np.ndarray) else memoryview(data)
        t = self.current
        if self._written + buf.nbytes > t.nbytes:
            raise ValueError(f"{t.name}: more data than its layout ({t.nbytes} bytes)")
        self.f.write(buf)
        self._written += buf.nbytes
        if self._written == t.nbytes:
            self.f.write(b"\0" * _pad(t.nbytes))
            self._i += 1
            self._written = 0

    def finished(self) -> bool:
        return self._i == len(self.tensors)
