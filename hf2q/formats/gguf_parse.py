"""The one GGUF header parser (metadata + tensor directory) over one memory map.

``gguf.GGUFReader`` builds numpy views for every element of every metadata array; on a
262k-token vocabulary (Gemma 3) that takes half a minute, which ``hf2q info`` and model
start-up cannot afford. This parser decodes numeric arrays with one ``np.frombuffer``
each and strings with a tight loop (≈0.3 s for 262k tokens), and returns tensor data as
views into the same read-only memory map. Tests check it against ``GGUFReader``.

:func:`parse` reads the whole header (``formats.gguf_file`` validates it);
:func:`read_metadata` stops after the key/values (the text layer needs only the tokenizer
arrays and the chat template) and reports any defect as an ``InputError``.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from hf2q.errors import InputError
from hf2q.formats.gguf_keys import ExtraKeys, Keys

_SCALAR = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
           12: "<f8"}
_STRING, _ARRAY, _BOOL = 8, 9, 7


class ParseError(ValueError):
    pass


class _Cursor:
    def __init__(self, buf: np.ndarray):
        self.buf = buf
        self.mv = memoryview(buf)
        self.pos = 0

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise ParseError(f"header runs past the end of the file at byte {self.pos}")

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        self.need(size)
        v = struct.unpack_from(fmt, self.mv, self.pos)
        self.pos += size
        return v

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        if n > 1 << 30:
            raise ParseError(f"implausible string length {n} at byte {self.pos}")
        self.need(n)
        s = bytes(self.mv[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<IQ")
            if count > 1 << 32:
                raise ParseError(f"implausible array length {count}")
            if etype == _STRING:
                return self._strings(count)
            if etype not in _SCALAR:
                if etype == _ARRAY:
                    return [self.value(_ARRAY) for _ in range(count)]
                raise ParseError(f"unknown array element type {etype}")
            dt = np.dtype(_SCALAR[etype])
            self.need(dt.itemsize * count)
            arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
            self.pos += dt.itemsize * count
            return arr.astype(bool).tolist() if etype == _BOOL else arr.tolist()
        if vtype not in _SCALAR:
            raise ParseError(f"unknown metadata value type {vtype}")
        dt = np.dtype(_SCALAR[vtype])
        self.need(dt.itemsize)
        v = np.frombuffer(self.buf, dtype=dt, count=1, offset=self.pos)[0].item()
        self.pos += dt.itemsize
        return bool(v) if vtype == _BOOL else v

    def _strings(self, count: int) -> list[str]:
        out = []
        mv, pos, end = self.mv, self.pos, len(self.buf)
        unpack = struct.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise ParseError("string array runs past the end of the file")
            (n,) = unpack("<Q", mv, pos)
            pos += 8
            if pos + n > end:
                raise ParseError("string array runs past the end of the file")
            out.append(str(mv[pos:pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out


def _metadata(mm: np.ndarray, spans: list | None = None) -> tuple[_Cursor, dict[str, Any], int, int]:
    """Parse up to the end of the key/values → (cursor, metadata, version, tensor count); with
    ``spans``, append ``(key, value type, start, end)`` for each key/value's bytes to it."""
    cur = _Cursor(mm)
    magic = bytes(mm[:4]) if len(mm) >= 4 else b""
    if magic != b"GGUF":
        raise ParseError(f"bad magic {magic!r}")
    cur.pos = 4
    (version,) = cur.unpack("<I")
    if version not in (2, 3):
        raise ParseError(f"unsupported GGUF version {version} (big-endian files are not supported)")
    n_tensors, n_kv = cur.unpack("<QQ")
    if n_tensors > 1 << 24 or n_kv > 1 << 24:
        raise ParseError(f"implausible counts: {n_tensors} tensors, {n_kv} metadata keys")
    meta: dict[str, Any] = {ExtraKeys.GGUF_VERSION: version, ExtraKeys.GGUF_TENSOR_COUNT: n_tensors,
                            ExtraKeys.GGUF_KV_COUNT: n_kv}
    for _ in range(n_kv):
        start = cur.pos
        key = cur.string()
        (vtype,) = cur.unpack("<I")
        meta[key] = cur.value(vtype)
        if spans is not None:
            spans.append((key, vtype, start, cur.pos))
    return cur, meta, version, n_tensors


def parse(path: Path) -> tuple[dict[str, Any], list[tuple[str, int, tuple[int, ...], int]], int, np.ndarray]:
    """→ (metadata, [(name, ggml_type, dims_ggml_order, absolute_offset)], version, memmap)."""
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    meta, infos, version, _layout = _header(mm)
    return meta, infos, version, mm


@attrs.frozen
class HeaderLayout:
    """Where a GGUF header's parts lie, for rewriting its metadata without touching tensor bytes:
    each key/value's byte span, the tensor directory's span, and where the data section starts."""

    kv_spans: tuple[tuple[str, int, int, int], ...]  # (key, value type, start, end)
    tensor_infos: tuple[int, int]  # (start, end) of the tensor directory
    data_start: int
    alignment: int


def layout(path: Path) -> tuple[dict[str, Any], HeaderLayout, int, np.ndarray]:
    """→ (metadata, layout, version, memmap) of a GGUF that :func:`parse` accepts."""
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    meta, _infos, version, lay = _header(mm)
    return meta, lay, version, mm


def _header(mm: np.ndarray) -> tuple[dict[str, Any], list, int, HeaderLayout]:
    spans: list = []
    cur, meta, version, n_tensors = _metadata(mm, spans)
    infos_start = cur.pos
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        (n_dims,) = cur.unpack("<I")
        if n_dims > 8:
            raise ParseError(f"tensor {name}: {n_dims} dimensions")
        dims = cur.unpack(f"<{n_dims}Q")
        ttype, offset = cur.unpack("<IQ")
        infos.append((name, ttype, tuple(int(d) for d in dims), offset))
    align = meta.get(Keys.General.ALIGNMENT, 32)
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ParseError(f"{Keys.General.ALIGNMENT} must be a positive power of two, found {align!r}")
    for name, _t, _d, offset in infos:
        if offset % align:
            raise ParseError(f"tensor {name} data offset {offset} is not a multiple of the alignment {align}")
    data_start = (cur.pos + align - 1) // align * align
    lay = HeaderLayout(tuple(spans), (infos_start, cur.pos), data_start, align)
    return meta, [(n, t, d, data_start + o) for n, t, d, o in infos], version, lay


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """All metadata key/values of a GGUF file; any defect is an ``InputError`` naming the file."""
    try:
        size = os.stat(path).st_size
        if size < 24:
            raise InputError(f"{path}: not a GGUF file (too small)")
        mm = np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return _metadata(mm)[1]
    except ParseError as exc:
        if str(exc).startswith("bad magic"):
            raise InputError(f"{path}: not a GGUF file ({exc})") from None
        raise InputError(f"{path}: corrupt GGUF metadata ({exc})") from None
    finally:
        del mm


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
