"""A validated, memory-mapped view of one GGUF file.

Everything that reads a GGUF in hf2q goes through :func:`open_gguf`: a fast header
parse (``gguf_parse``; ``gguf.GGUFReader`` needs ~30 s for a 262k-token vocabulary) that
turns any defect into a one-line :class:`~hf2q.errors.InputError` (exit 3) and checks the
invariants the engine relies on: every tensor's bytes lie inside the file, and every
tensor type is one we know. Tensor data stays memory-mapped; nothing is copied here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from hf2q.errors import InputError
from hf2q.formats.gguf_hparams import GGUFHparams
from hf2q.formats.gguf_keys import Keys, arch_key
from hf2q.formats.gguf_parse import ParseError, parse

GGUF_MAGIC = b"GGUF"
_FLOAT_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                 GGMLQuantizationType.BF16: np.uint16, GGMLQuantizationType.F64: np.float64,
                 GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
                 GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}


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
        return str(self.metadata.get(Keys.General.ARCHITECTURE, ""))

    @property
    def hparams(self) -> GGUFHparams:
        """The model's hyper-parameters with hf2q's one table of defaults."""
        return GGUFHparams(self.metadata, self.path.name)

    def _full_key(self, key: str) -> str:
        return self.arch + key if key.startswith(".") else arch_key(key, self.arch)

    def get(self, key: str, default: Any = None) -> Any:
        """Look up ``key``: a ``gguf.Keys`` name (``{arch}`` filled in) or, for short, ``.key``
        for ``{arch}.key``. Hyper-parameters with defaults: :attr:`hparams`."""
        return self.metadata.get(self._full_key(key), default)

    def require(self, key: str) -> Any:
        v = self.get(key)
        if v is None:
            raise InputError(f"{self.path.name}: missing GGUF metadata key {self._full_key(key)!r}")
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


def _tensor_view(mm: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], offset: int,
                 nbytes: int) -> np.ndarray:
    raw = mm[offset:offset + nbytes]
    if qtype in _FLOAT_DTYPES:
        return raw.view(_FLOAT_DTYPES[qtype]).reshape(shape)
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return raw.reshape(rows, -1)


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
        metadata, infos, _version, mm = parse(p)
    except ParseError as e:
        raise InputError(f"{p.name}: corrupt or truncated GGUF ({e})") from None
    except (OSError, ValueError) as e:
        raise InputError(f"{p.name}: unreadable GGUF ({type(e).__name__}: {e})") from None
    tensors: dict[str, GGUFTensor] = {}
    spans: list[tuple[int, int, str]] = []
    for name, ttype, dims, offset in infos:
        if name in tensors:
            raise InputError(f"{p.name}: tensor {name} appears twice in the tensor directory")
        try:
            qtype = GGMLQuantizationType(ttype)
        except ValueError:
            raise InputError(f"{p.name}: tensor {name} has unknown GGML type {ttype}") from None
        shape = tuple(reversed(dims))
        if qtype not in GGML_QUANT_SIZES:
            raise InputError(f"{p.name}: tensor {name} has unsupported GGML type {qtype.name}")
        if not shape or min(shape) <= 0:
            raise InputError(f"{p.name}: tensor {name} has dims {list(dims)} (every dimension must be positive)")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if shape[-1] % block:
            raise InputError(f"{p.name}: tensor {name} row of {shape[-1]} is not a multiple of {qtype.name}'s "
                             f"block of {block}")
        nbytes = math.prod(shape) // block * type_size  # Python ints: crafted dims cannot overflow
        if offset + nbytes > size:
            raise InputError(f"{p.name}: truncated GGUF (tensor {name} ends at byte {offset + nbytes}, file has {size})")
        spans.append((offset, offset + nbytes, name))
        tensors[name] = GGUFTensor(name, qtype, shape, _tensor_view(mm, qtype, shape, offset, nbytes), nbytes)
    spans.sort()
    for (_s0, end0, name0), (start1, _e1, name1) in zip(spans, spans[1:]):
        if start1 < end0:
            raise InputError(f"{p.name}: tensors {name0} and {name1} overlap (bytes {start1}..{end0})")
    return GGUFFile(p, metadata, tensors, size)
