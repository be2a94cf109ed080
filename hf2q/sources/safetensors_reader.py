"""Streaming, validating reader for HF safetensors checkpoints (single file or sharded).

Why our own reader instead of ``safetensors.safe_open``: we want (1) every header checked
up front so a truncated or inconsistent file fails *before* any output is written, with one
clear ``InputError`` line, (2) row-range reads straight from a memory map so a converter can
work on a slab of a huge tensor without materialising the whole thing, and (3) the ability to
drop pages we have finished with (``release``) so peak RSS stays near one slab, not the model.

File format: 8-byte little-endian header length N, N bytes of JSON
``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}``, then the data
buffer; offsets are relative to the start of the data buffer.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import attrs
import numpy as np

from hf2q.errors import InputError
from hf2q.sources import fp8

# safetensors dtype → (numpy dtype used to view the bytes, bytes per element)
_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("<f8", 8), "F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2),
    "I64": ("<i8", 8), "I32": ("<i4", 4), "I16": ("<i2", 2), "I8": ("i1", 1), "U8": ("u1", 1),
    "BOOL": ("?", 1),
    # 8-bit floats (DeepSeek's FP8 weights and their E8M0 block exponents): raw bytes, decoded by ``fp8``
    "F8_E4M3": ("u1", 1), "F8_E5M2": ("u1", 1), "F8_E8M0": ("u1", 1),
}
# dtypes whose values are the weights themselves; 8-bit floats are not among them, since their meaning depends
# on a scale only the family knows how to apply (``to_f32`` still decodes them for it)
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
_MAX_HEADER = 100 << 20  # the spec caps headers at 100 MB


@attrs.frozen
class TensorEntry:
    """Where one tensor lives: file, dtype, shape and byte range inside that file."""

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _parse_header(path: Path) -> dict[str, TensorEntry]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise InputError(f"{path.name}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > _MAX_HEADER or 8 + n > size:
                raise InputError(f"{path.name}: corrupt or truncated safetensors header (header length {n}, "
                                 f"file size {size})")
            raw = f.read(n)
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path.name}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path.name}: safetensors header is not a JSON object")
    data_start = 8 + n
    out: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        out[name] = _entry(path, name, info, data_start, size)
    _check_disjoint(path, out.values())
    return out


def _entry(path: Path, name: str, info, data_start: int, size: int) -> TensorEntry:
    """One header entry, checked: known dtype, whole non-negative dims, a byte range inside the file
    whose length is exactly dtype × shape."""
    try:
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    except (KeyError, TypeError):
        raise InputError(f"{path.name}: malformed header entry for tensor {name!r} "
                         "(needs dtype, shape and data_offsets)") from None
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise InputError(f"{path.name}: tensor {name!r} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_whole(d) for d in shape):
        raise InputError(f"{path.name}: tensor {name!r} has shape {shape!r}; expected non-negative whole numbers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_whole(o) for o in offsets) \
            or offsets[0] > offsets[1]:
        raise InputError(f"{path.name}: tensor {name!r} has data_offsets {offsets!r}; expected [begin, end] "
                         "with 0 ≤ begin ≤ end")
    b, e = offsets
    count = 1
    for d in shape:
        count *= d
    if e - b != count * _DTYPES[dtype][1]:
        raise InputError(f"{path.name}: tensor {name!r} is {e - b} bytes but dtype {dtype} × shape "
                         f"{list(shape)} needs {count * _DTYPES[dtype][1]} (dtype/shape mismatch)")
    if data_start + e > size:
        raise InputError(f"{path.name}: truncated — tensor {name!r} ends at byte {data_start + e} "
                         f"but the file has {size}")
    return TensorEntry(name, path, dtype, tuple(shape), data_start + b, data_start + e)


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_disjoint(path: Path, entries) -> None:
    """No two tensors may share bytes (a forged header could alias one tensor's data as another's)."""
    prev = None
    for e in sorted((e for e in entries if e.nbytes), key=lambda e: e.begin):
        if prev is not None and e.begin < prev.end:
            raise InputError(f"{path.name}: tensors {prev.name!r} and {e.name!r} overlap in the data buffer "
                             "(data_offsets)")
        prev = e


def index_weight_map(src: Path) -> dict[str, str]:
    """``weight_map`` of ``model.safetensors.index.json``: tensor name → shard file name in ``src``."""
    index = src / "model.safetensors.index.json"
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{index}: invalid safetensors index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise InputError(f"{index.name}: weight_map must map tensor names to shard file names")
    for shard in set(weight_map.values()):
        if Path(shard).name != shard or shard in ("", ".", ".."):
            raise InputError(f"{index.name} names shard {shard!r} outside the model directory")
    return weight_map


def checkpoint_files(src: Path) -> list[Path]:
    """The safetensors files of an HF directory, in shard order (index.json wins when present)."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(index_weight_map(src).values()))
        missing = [n for n in names if not (src / n).is_file()]
        if missing:
            raise InputError(f"{index.name} names shard(s) that do not exist: {', '.join(missing[:3])}")
        return [src / n for n in names]
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise InputError(f"{src}: no *.safetensors files found (only safetensors checkpoints are supported)")
    return files


class SafetensorsCheckpoint:
    """All tensors of a (possibly sharded) checkpoint, read lazily through memory maps."""

    def __init__(self, src: Path):
        self.src = Path(src)
        self.files = checkpoint_files(self.src)
        self.entries: dict[str, TensorEntry] = {}
        for f in self.files:
            for name, entry in _parse_header(f).items():
                if name in self.entries:
                    raise InputError(f"tensor {name!r} appears in both {self.entries[name].path.name} and {f.name}")
                self.entries[name] = entry
        if (self.src / "model.safetensors.index.json").is_file():
            self._check_index(index_weight_map(self.src))
        self._maps: dict[Path, mmap.mmap] = {}

    def _check_index(self, weight_map: dict[str, str]) -> None:
        """Every tensor the index names is in the shard it names (the index is what loaders trust)."""
        for name, shard in weight_map.items():
            e = self.entries.get(name)
            if e is None:
                raise InputError(f"model.safetensors.index.json names tensor {name!r} in {shard}, "
                                 "but that shard does not have it")
            if e.path.name != shard:
                raise InputError(f"model.safetensors.index.json puts tensor {name!r} in {shard}, "
                                 f"but it is in {e.path.name}")

    # -- lookup -----------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise InputError(f"checkpoint has no tensor {name!r}") from None

    # -- data -------------------------------------------------------------------
    def _map(self, path: Path) -> mmap.mmap:
        m = self._maps.get(path)
        if m is None:
            with open(path, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[path] = m
        return m

    def raw(self, name: str) -> np.ndarray:
        """A read-only numpy view (no copy) of the tensor in its stored dtype (bf16 as uint16)."""
        e = self.entry(name)
        dt = np.dtype(_DTYPES[e.dtype][0])
        arr = np.frombuffer(self._map(e.path), dtype=dt, count=e.n_elements, offset=e.begin)
        return arr.reshape(e.shape)

    def rows_f32(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows ``[start, stop)`` along the first axis, converted to a fresh float32 array."""
        e = self.entry(name)
        if e.dtype not in FLOAT_DTYPES:
            raise InputError(f"tensor {name!r} has dtype {e.dtype}, expected a floating type")
        a = self.raw(name)
        if a.ndim:
            a = a[start:stop]
        return to_f32(a, e.dtype)

    def f32(self, name: str) -> np.ndarray:
        return self.rows_f32(name)

    def release(self, name: str, first_row: int | None = None, stop_row: int | None = None) -> None:
        """Tell the kernel we are done with this tensor's pages (or rows ``[first_row, stop_row)`` of it).

        Pages of a read-only file mapping count towards RSS once touched; dropping them after
        each slab keeps peak RSS near one slab instead of the largest tensor.
        """
        e = self.entry(name)
        m = self._maps.get(e.path)
        if m is None or not hasattr(m, "madvise"):
            return
        begin, end = e.begin, e.end
        if first_row is not None and len(e.shape) > 1:
            row = e.nbytes // e.shape[0]
            begin, end = e.begin + first_row * row, min(e.end, e.begin + (stop_row or e.shape[0]) * row)
        page = mmap.PAGESIZE
        start = begin - begin % page
        length = end - start
        if length <= 0:
            return
        try:
            m.madvise(mmap.MADV_DONTNEED, start, length)
        except (OSError, ValueError, AttributeError):
            pass

    def close(self) -> None:
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a view is still alive; the map closes when it is collected
                pass
        self._maps.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def total_bytes(self) -> int:
        return sum(os.path.getsize(f) for f in self.files)

    def __iter__(self) -> Iterator[TensorEntry]:
        return iter(self.entries.values())


def to_f32(a: np.ndarray, dtype: str) -> np.ndarray:
    """Stored safetensors values → float32 (bf16 widened exactly by a 16-bit shift, 8-bit floats by table)."""
    if dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    if dtype in fp8.TABLES:
        return fp8.TABLES[dtype]()[a]
    return np.asarray(a, dtype=np.float32).copy() if a.dtype == np.float32 else a.astype(np.float32)
