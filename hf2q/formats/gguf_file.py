"""A validated, memory-mapped view of one GGUF file.

``gguf.GGUFReader`` parses the container but fails on bad input with whatever
exception the parser hit (``ValueError``, ``IndexError``, numpy errors…). Everything
that reads a GGUF in hf2q goes through :func:`open_gguf`, which turns any such failure
into a one-line :class:`~hf2q.errors.InputError` (exit 3) and checks the invariants the
engine relies on: every tensor's bytes lie inside the file, and every tensor type is
one we know. Tensor data stays memory-mapped; nothing is copied here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES

from hf2q.errors import InputError

GGUF_MAGIC = b"GGUF"


@attrs.frozen
class GGUFTensor:
    """One tensor: ``shape`` in numpy (row-major) order, ``data`` the raw memmapped bytes."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray  # uint8 [rows, row_bytes] for block types; typed array for F32/F16/…
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


@attrs.define
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    file_bytes: int

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        """Look up ``key``; a leading ``.`` means ``{arch}.key`` (e.g. ``.block_count``)."""
        if key.startswith("."):
            key = self.arch + key
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        v = self.get(key)
        if v is None:
            full = self.arch + key if key.startswith(".") else key
            raise InputError(f"{self.path.name}: missing GGUF metadata key {full!r}")
        return v

    def tensor(self, name: str) -> GGUFTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise InputError(f"{self.path.name}: missing tensor {name!r}") from None

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def type_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.qtype.name] = out.get(t.qtype.name, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _field_value(field) -> Any:
    """Decode a reader field to plain Python (str, int, float, bool, list)."""
    types = list(field.types)
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        inner = types[1] if len(types) > 1 else None
        if inner == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        vals = [field.parts[i][0] for i in field.data] if field.data else []
        return np.asarray(vals).tolist() if vals else []
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    v = field.parts[field.data[0]][0]
    return bool(v) if types[0] == GGUFValueType.BOOL else v.item()


def open_gguf(path: str | Path) -> GGUFFile:
    """Open and validate ``path``; any defect is an ``InputError`` naming the file."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"no such model file: {p}")
    size = p.stat().st_size
    with open(p, "rb") as fh:
        head = fh.read(4)
    if head != GGUF_MAGIC:
        raise InputError(f"{p.name}: not a GGUF file (bad magic {head!r})")
    try:
        reader = GGUFReader(p, "r")
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 — the reader's failure modes are not typed
        raise InputError(f"{p.name}: corrupt or truncated GGUF ({type(e).__name__}: {e})") from None
    try:
        metadata = {k: _field_value(f) for k, f in reader.fields.items()}
    except Exception as e:  # noqa: BLE001
        raise InputError(f"{p.name}: unreadable GGUF metadata ({type(e).__name__}: {e})") from None
    tensors: dict[str, GGUFTensor] = {}
    for t in reader.tensors:
        try:
            qtype = GGMLQuantizationType(int(t.tensor_type))
        except ValueError:
            raise InputError(f"{p.name}: tensor {t.name} has unknown GGML type {int(t.tensor_type)}") from None
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        block, type_size = GGML_QUANT_SIZES[qtype]
        if shape[-1] % block:
            raise InputError(f"{p.name}: tensor {t.name} row of {shape[-1]} is not a multiple of {block}")
        nbytes = int(np.prod(shape)) // block * type_size
        end = int(t.data_offset) + nbytes
        if end > size or int(t.n_bytes) != nbytes:
            raise InputError(f"{p.name}: truncated GGUF (tensor {t.name} ends at byte {end}, file has {size})")
        tensors[t.name] = GGUFTensor(t.name, qtype, shape, t.data, nbytes)
    return GGUFFile(p, metadata, tensors, size)
