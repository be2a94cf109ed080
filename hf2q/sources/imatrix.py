"""Read llama.cpp importance matrices (``llama-imatrix`` output) as llama-quantize uses them.

Two file formats exist (llama.cpp ``tools/imatrix/imatrix.cpp``, ``common/imatrix-loader.cpp``):

* **GGUF** (current default): per tensor ``<name>.in_sum2`` (F32, ne = [n_per_row, n_mat]:
  Σ activation² per column, one row per expert) and ``<name>.counts`` (F32, ne = [1, n_mat]:
  activations seen per expert); metadata ``imatrix.datasets`` / ``imatrix.chunk_count`` /
  ``imatrix.chunk_size`` must be present.  llama-quantize's weight for column i of expert e is
  ``in_sum2[e, i] / round(counts[e])``, or 1 for an expert that never ran.
* **legacy** binary ``.imatrix`` / ``.dat`` (little-endian): int32 entry count, then per
  entry int32 name length, the name, int32 ``ncall``, int32 ``nval``, ``nval`` float32
  values (already ``mean · ncall``); optionally int32 chunk count, int32 length and the
  dataset name.  The weight is ``value / ncall`` (the raw value when ``ncall`` ≤ 0).

``write_imatrix(path, entries, ...)`` writes the GGUF format as ``llama-imatrix`` does (entries
sorted by name, ``general.type = imatrix``), atomically; ``read_imatrix`` reads it back.

``load_imatrix(path)`` returns ``{tensor name: float32 weights}`` — ``[n_per_row]`` for a plain
matrix, ``[n_expert, n_per_row]`` for an expert tensor in the GGUF format (the legacy format
stores experts concatenated in one flat vector).  ``weights_for_tensor`` turns an entry
into the per-expert rows the quantizer needs, with llama-quantize's size check.

Wiring into the GGUF converter (one imatrix per tensor, per expert for 3-D tensors)::

    imatrix = load_imatrix(args.imatrix)                         # once, before the tensor loop
    w = weights_for_tensor(imatrix, gguf_name, ne)               # None → quantize without
    for e in range(n_expert):                                    # 2-D tensors: n_expert == 1
        codec.quantize(rows_of_expert_e, qtype, threads, imatrix=None if w is None else w[e])
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..formats.gguf_keys import Keys

GGUF_MAGIC = b"GGUF"
KEY_DATASETS = Keys.IMatrix.DATASETS
KEY_CHUNK_COUNT = Keys.IMatrix.CHUNK_COUNT
KEY_CHUNK_SIZE = Keys.IMatrix.CHUNK_SIZE
SUM_SUFFIX = ".in_sum2"
COUNT_SUFFIX = ".counts"
MAX_NAME = 1 << 16  # tensor names are short; a larger length means a corrupt file


@dataclass(frozen=True)
class ImatrixFile:
    """An importance matrix as llama-quantize sees it, plus the file's provenance metadata."""

    weights: dict[str, np.ndarray]
    legacy: bool
    datasets: tuple[str, ...] = ()
    chunk_count: int = 0
    chunk_size: int = 0
    path: Path = field(default=Path())


def load_imatrix(path) -> dict[str, np.ndarray]:
    """``{tensor name: float32 per-column weights}`` from either file format (see the module doc)."""
    return read_imatrix(path).weights


def read_imatrix(path) -> ImatrixFile:
    path = Path(path)
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise InputError(f"cannot read imatrix {path}: {e.strerror or e}") from None
    parsed = _read_gguf(path) if magic == GGUF_MAGIC else _read_legacy(path)
    for name, w in parsed.weights.items():
        if not np.all(np.isfinite(w)):
            raise InputError(f"imatrix {path}: entry {name} contains non-finite values")
        if np.any(w < 0):
            raise InputError(f"imatrix {path}: entry {name} contains negative values")
    return parsed


def weights_for_tensor(imatrix: dict[str, np.ndarray], name: str, ne) -> np.ndarray | None:
    """The imatrix rows for GGUF tensor ``name`` of GGUF shape ``ne`` (ne[0] = values per row,
    ne[2] = experts): float32 ``[n_expert, ne[0]]``, or None when the file has no entry.

    A size mismatch is an error except for ``token_embd`` (llama-quantize quantizes that
    one without an imatrix: its activations are never multiplied)."""
    w = imatrix.get(name)
    if w is None:
        return None
    n_per_row = int(ne[0])
    n_expert = int(ne[2]) if len(ne) > 2 else 1
    if w.size != n_per_row * n_expert:
        if name.startswith("token_embd."):
            return None
        raise InputError(f"imatrix entry {name} has {w.size} values, the tensor needs "
                         f"{n_per_row * n_expert} ({n_expert} × {n_per_row})")
    return np.ascontiguousarray(w, dtype=np.float32).reshape(n_expert, n_per_row)


# ------------------------------------------------------------------------- legacy binary


class _Cursor:
    """Little-endian reads from a byte string that fail with the imatrix's name, not a struct error."""

    def __init__(self, data: bytes, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise InputError(f"imatrix {self.path} is truncated or corrupt (reading {what})")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def int32(self, what: str) -> int:
        return struct.unpack("<i", self.take(4, what))[0]

    @property
    def left(self) -> int:
        return len(self.data) - self.pos


def _read_legacy(path: Path) -> ImatrixFile:
    cur = _Cursor(path.read_bytes(), path)
    if cur.left < 4:
        raise InputError(f"{path} is not an imatrix file (neither GGUF nor llama.cpp's legacy format)")
    n_entries = cur.int32("entry count")
    if n_entries < 1:
        raise InputError(f"imatrix {path} has no entries (or is not an imatrix file)")
    weights: dict[str, np.ndarray] = {}
    for i in range(n_entries):
        length = cur.int32(f"name length of entry {i + 1}")
        if not 0 < length <= MAX_NAME:
            raise InputError(f"imatrix {path} is corrupt: entry {i + 1} has a name of {length} bytes")
        name = cur.take(length, f"name of entry {i + 1}").split(b"\0", 1)[0].decode("utf-8", "replace")
        ncall = cur.int32(f"ncall of {name}")
        nval = cur.int32(f"value count of {name}")
        if nval < 1:
            raise InputError(f"imatrix {path} is corrupt: entry {name} has {nval} values")
        values = np.frombuffer(cur.take(4 * nval, f"values of {name}"), dtype="<f4").astype(np.float32)
        # llama-quantize: sums hold mean·ncall; the weight is sums / (float)ncall in float32
        weights[name] = values / np.float32(ncall) if ncall > 0 else values.copy()
    chunk_count, datasets = 0, ()
    if cur.left >= 4:  # optional trailer: chunk count, then the dataset file name
        chunk_count = cur.int32("chunk count")
        if cur.left >= 4:
            length = cur.int32("dataset name length")
            if 0 < length <= cur.left:
                datasets = (cur.take(length, "dataset name").split(b"\0", 1)[0].decode("utf-8", "replace"),)
    return ImatrixFile(weights, legacy=True, datasets=datasets, chunk_count=chunk_count, path=path)


# ------------------------------------------------------------------------- GGUF


def _lround(v: np.ndarray) -> np.ndarray:
    """C ``lround``: nearest integer, halves away from zero."""
    return np.sign(v) * np.floor(np.abs(v.astype(np.float64)) + 0.5)


def _scalar(field_) -> int | None:
    if field_ is None or not field_.data:
        return None
    value = field_.parts[field_.data[0]]
    return int(value[0]) if len(value) else None


def _read_gguf(path: Path) -> ImatrixFile:
    import gguf  # the package's reader parses the container; the semantics are ours

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, struct.error, IndexError) as e:
        raise InputError(f"imatrix {path} is not a readable GGUF file: {e}") from None
    fields = reader.fields
    if not all(k in fields for k in (KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE)):
        raise InputError(f"imatrix {path} lacks the imatrix metadata ({KEY_DATASETS}, {KEY_CHUNK_COUNT}, "
                         f"{KEY_CHUNK_SIZE}); is it a model file rather than an imatrix?")
    datasets: tuple[str, ...] = ()
    ds = fields[KEY_DATASETS]
    if ds.types and ds.types[0] == gguf.GGUFValueType.ARRAY and ds.types[-1] == gguf.GGUFValueType.STRING:
        datasets = tuple(bytes(ds.parts[i]).decode("utf-8", "replace") for i in ds.data)
    if not reader.tensors:
        raise InputError(f"imatrix {path} has no entries")
    pairs: dict[str, dict[str, object]] = {}
    for t in reader.tensors:
        for suffix, slot in ((SUM_SUFFIX, "sums"), (COUNT_SUFFIX, "counts")):
            if t.name.endswith(suffix):
                pairs.setdefault(t.name[:-len(suffix)], {})[slot] = t
    weights: dict[str, np.ndarray] = {}
    for name, pair in sorted(pairs.items()):
        sums, counts = pair.get("sums"), pair.get("counts")
        if sums is None or counts is None:
            raise InputError(f"imatrix {path}: entry {name} has {'no counts' if counts is None else 'no sums'}")
        if sums.tensor_type != gguf.GGMLQuantizationType.F32 or counts.tensor_type != gguf.GGMLQuantizationType.F32:
            raise InputError(f"imatrix {path}: sums and counts of {name} must be F32")
        s = np.asarray(sums.data, dtype=np.float32).reshape(-1)
        c = np.asarray(counts.data, dtype=np.float32).reshape(-1)
        if c.size == 0 or s.size % c.size:
            raise InputError(f"imatrix {path}: {name} has {s.size} sums for {c.size} counts")
        per_expert = s.reshape(c.size, s.size // c.size)
        count = _lround(c).astype(np.float32)[:, None]  # int64 counts → float, as llama-quantize
        with np.errstate(divide="ignore", invalid="ignore"):
            w = np.where(count > 0, per_expert / count, np.float32(1.0)).astype(np.float32)
        weights[name] = w[0] if c.size == 1 else w
    return ImatrixFile(weights, legacy=False, datasets=datasets,
                       chunk_count=_scalar(fields.get(KEY_CHUNK_COUNT)) or 0,
                       chunk_size=_scalar(fields.get(KEY_CHUNK_SIZE)) or 0, path=path)


# ------------------------------------------------------------------------- writing


def _ggml_ne(shape: tuple[int, ...]) -> tuple[int, ...]:
    """ggml's dims of a numpy shape, trailing 1s dropped as ggml's GGUF writer does (``ggml_n_dims``):
    a single matrix's ``[1, n]`` sums are stored 1-D, as llama-imatrix's are."""
    ne = list(shape[::-1])
    while len(ne) > 1 and ne[-1] == 1:
        ne.pop()
    return tuple(ne)


def write_imatrix(path, entries: dict[str, tuple[np.ndarray, np.ndarray]], *, datasets: tuple[str, ...],
                  chunk_count: int, chunk_size: int) -> Path:
    """Write ``{name: (in_sum2 [n_mat, n_per_row], counts [n_mat])}`` as llama.cpp's GGUF imatrix
    (temp file, fsync, rename): per entry ``<name>.in_sum2`` F32 ne = [n_per_row, n_mat] and
    ``<name>.counts`` F32 ne = [1, n_mat] (trailing 1s dropped), in name order, plus the provenance keys."""
    import gguf

    from ..atomic import atomic_output
    from ..convert.gguf_writer import GGUFStream, layout

    V, F32 = gguf.GGUFValueType, gguf.GGMLQuantizationType.F32
    metadata = {
        Keys.General.TYPE: (gguf.GGUFType.IMATRIX, V.STRING, None),
        KEY_DATASETS: (list(datasets), V.ARRAY, V.STRING),
        KEY_CHUNK_COUNT: (int(chunk_count), V.UINT32, None),
        KEY_CHUNK_SIZE: (int(chunk_size), V.UINT32, None),
    }
    arrays = []
    for name in sorted(entries):
        sums, counts = entries[name]
        counts = np.ascontiguousarray(counts, dtype=np.float32).reshape(-1)
        sums = np.ascontiguousarray(sums, dtype=np.float32).reshape(counts.size, -1)
        arrays += [(name + SUM_SUFFIX, sums), (name + COUNT_SUFFIX, counts.reshape(-1, 1))]
    tensors = layout([(n, _ggml_ne(a.shape), F32) for n, a in arrays])
    path = Path(path)
    with atomic_output(path) as f:
        stream = GGUFStream(f, metadata, tensors)
        for _, a in arrays:
            stream.write(a)
    return path


__all__ = ["ImatrixFile", "load_imatrix", "read_imatrix", "weights_for_tensor", "write_imatrix"]
