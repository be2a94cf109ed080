"""A plain GGUF v3 reader for tests: every key and every tensor's bytes, in well under a second.

gguf-py's ``GGUFReader`` builds a numpy view per string and needs ~50 s for Gemma's 262k-token vocabulary;
this parser is independent of hf2q's own (``hf2q.formats.gguf_parse``), so a test of what hf2q writes does not
read it back through hf2q.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf(path: Path) -> tuple[dict, dict]:
    """``({key: value}, {name: (type, ne, bytes)})``; ``ne`` in ggml order (row length first)."""
    import mmap
    import struct

    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    pos = 0

    def take(fmt):
        nonlocal pos
        vals = struct.unpack_from(fmt, m, pos)
        pos += struct.calcsize(fmt)
        return vals[0] if len(vals) == 1 else vals

    def string():
        nonlocal pos
        n = take("<Q")
        b = m[pos:pos + n]
        pos += n
        return b.decode("utf-8", errors="surrogateescape")

    def value(vtype):
        nonlocal pos
        if vtype == 8:
            return string()
        if vtype == 9:
            item, n = take("<I"), take("<Q")
            if item == 8:
                return [string() for _ in range(n)]
            size = struct.calcsize(_SCALARS[item])
            arr = np.frombuffer(m, dtype=np.dtype(_SCALARS[item]), count=n, offset=pos).tolist()
            pos += n * size
            return arr
        return take(_SCALARS[vtype])

    magic, version, n_tensors, n_kv = take("<IIQQ")
    assert magic == 0x46554747 and version == 3, (hex(magic), version)
    kv = {}
    for _ in range(n_kv):
        key = string()
        kv[key] = value(take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        nd = take("<I")
        ne = [take("<Q") for _ in range(nd)]
        qtype, off = take("<IQ")
        infos.append((name, ne, qtype, off))
    align = kv.get("general.alignment", 32)
    data0 = pos + (align - pos % align) % align
    starts = sorted(off for *_, off in infos) + [len(m) - data0]
    tensors = {}
    for name, ne, qtype, off in infos:
        nxt = next(s for s in starts if s > off)
        blk, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        nbytes = int(np.prod(ne)) // blk * size
        assert off + nbytes <= nxt
        tensors[name] = (gguf.GGMLQuantizationType(qtype), ne, m[data0 + off:data0 + off + nbytes])
    return kv, tensors



class Tensor(NamedTuple):
    """One tensor of a file as :func:`read_tensors` gives it: raw bytes and ggml-order ``ne``."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    ne: list[int]
    data: bytes

    @property
    def n_bytes(self) -> int:
        return len(self.data)

    def as_f32(self) -> np.ndarray:
        """float32 in numpy (row-major) shape, through gguf-py's own dequantizers."""
        raw = np.frombuffer(self.data, dtype=np.uint8)
        return gguf.quants.dequantize(raw, self.tensor_type).reshape(list(reversed(self.ne)))


def read_tensors(path: Path) -> tuple[dict, dict[str, Tensor]]:
    """``({key: value}, {name: Tensor})``, the tensors in file order."""
    kv, tensors = read_gguf(path)
    return kv, {name: Tensor(name, *t) for name, t in tensors.items()}
