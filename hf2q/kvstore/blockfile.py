"""The on-disk form of one KV block: a safetensors file with a checksummed body.

Layout (safetensors-compatible, so ``safetensors.numpy.load_file`` reads a block):
``u64 little-endian header length`` ‖ ``JSON header`` (space-padded to 8-byte alignment)
‖ ``body`` (every tensor's C-order little-endian bytes, back to back in name order).
The header maps each tensor name to ``{dtype, shape, data_offsets}`` and keeps our own
fields in ``__metadata__`` (string → string, as safetensors requires): format name and
version, model fingerprint, block hash, parent hash, payload kind, token count and ids,
the tensors' dtype/shape summary and the body's sha256.

Versions: a block is written at ``FORMAT_VERSION`` (1), except one holding an 8-bit cache's own codes
and scales (payload ``kv-codes``), written at ``CODES_FORMAT_VERSION`` (2) — a reader that predates
those blocks refuses them as ``wrong-version`` rather than misreading the codes as K/V values, while
every version-1 store stays readable. A version goes with its payload kinds only. A block of a cache
that is not plain per-position K/V (``cache_kind``: ``recurrent`` for a hybrid model's DeltaNet state,
``deepseek4`` for DeepSeek-V4's compact cache, ``window`` for a sliding-window model's) is written at
``STATE_FORMAT_VERSION`` (3), with ``cache_kind`` in its header and, when its end is a reuse point, the
state that point needs as the tensors named ``state.*`` (``END_STATE_PREFIX``); a reader that predates
them refuses them as ``wrong-version`` instead of importing K/V without the state it belongs to
(docs/KVSTORE.md). A hybrid sequence that feeds an MTP draft head (``recurrent-mtp``: the head's K/V
layer, and the hidden row the head reads next as ``state.hidden``) and DeepSeek-V4's compact cache with its MTP
head's window layer (``deepseek4-mtp``: the trunk streams the head pairs with next as ``state.hidden``) are
version-3 cache kinds like the others: a reader that predates a cache kind refuses it at version 3 already
(``unknown-payload``), and the engine identity's ``-mtp`` keeps their blocks under a fingerprint of their own.
``recurrent-mtp`` blocks written at ``HEAD_FORMAT_VERSION`` (4) stay readable; nothing writes that version any
more. Each version holds its own cache kinds only.

Everything here is pure byte work with no locking or directory policy, so recovery,
the store, the CLI and tests share one parser. Any defect raises ``BlockFileError`` with a
short ``reason`` (``truncated``, ``bad-header``, ``wrong-version``, ``bad-checksum`` …)
that becomes the quarantine file's suffix.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Mapping, Sequence

import attrs
import numpy as np

from hf2q.engine.kv_layout import has_end_state
from hf2q.kvstore.fingerprint import chain_hash

FORMAT_NAME = "hf2q-kv-block"
FORMAT_VERSION = 1
CODES_FORMAT_VERSION = 2
STATE_FORMAT_VERSION = 3
HEAD_FORMAT_VERSION = 4
BLOCK_SUFFIX = ".safetensors"
PAYLOAD_KV = "kv"  # tensors at the engine's own KV dtype
PAYLOAD_KV_Q8 = "kv-q8"  # int8 rows + float16 scales (hf2q/kvstore/q8.py)
PAYLOAD_KV_F16 = "kv-f16"  # float32 KV rounded to float16 (half the bytes of a CPU block; not bit-exact)
PAYLOAD_KINDS = (PAYLOAD_KV, PAYLOAD_KV_Q8, PAYLOAD_KV_F16)  # what ``--kv-persist-payload`` chooses
#: an 8-bit cache's codes and scales as the engine holds them (whatever the store's chosen kind)
PAYLOAD_KV_CODES = "kv-codes"
#: the payload kinds each readable format version holds
VERSION_PAYLOADS = {FORMAT_VERSION: PAYLOAD_KINDS, CODES_FORMAT_VERSION: (PAYLOAD_KV_CODES,),
                    STATE_FORMAT_VERSION: (*PAYLOAD_KINDS, PAYLOAD_KV_CODES),
                    HEAD_FORMAT_VERSION: (*PAYLOAD_KINDS, PAYLOAD_KV_CODES)}
#: the cache kinds each format version holds ("" plain K/V): what the sequences' ``export`` produces
VERSION_CACHE_KINDS = {FORMAT_VERSION: ("",), CODES_FORMAT_VERSION: ("",),
                       STATE_FORMAT_VERSION: ("recurrent", "recurrent-mtp", "deepseek4", "deepseek4-mtp",
                                              "window"),
                       HEAD_FORMAT_VERSION: ("recurrent-mtp",)}  # read only: recurrent-mtp blocks once written at 4
#: the caches whose blocks carry a cache kind (written at version 3)
CACHE_KINDS = VERSION_CACHE_KINDS[STATE_FORMAT_VERSION]

_MAX_HEADER = 1 << 20

# numpy dtype → safetensors dtype tag (bfloat16 only when numpy knows it, e.g. via ml_dtypes)
_NP_TO_ST = {
    "float16": "F16", "float32": "F32", "float64": "F64", "bfloat16": "BF16",
    "int8": "I8", "uint8": "U8", "int16": "I16", "uint16": "U16",
    "int32": "I32", "uint32": "U32", "int64": "I64", "uint64": "U64", "bool": "BOOL",
}
_ST_TO_NP = {v: k for k, v in _NP_TO_ST.items()}
_ST_TO_NP["BF16"] = "uint16"  # read as raw bits: numpy has no bfloat16 (payload.py widens them)


class BlockFileError(Exception):
    """A block file that must not be loaded; ``reason`` names the defect."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@attrs.frozen
class TensorInfo:
    dtype: str  # safetensors tag, e.g. "F16"
    shape: tuple[int, ...]
    begin: int
    end: int


@attrs.frozen
class BlockMeta:
    """What the index knows about one stored block (parsed from its header, body unread)."""

    block_hash: str
    parent_hash: str
    fingerprint: str
    payload_kind: str
    token_ids: tuple[int, ...]
    body_sha256: str
    tensors: Mapping[str, TensorInfo] = attrs.field(repr=False)
    body_offset: int  # 8 + header length
    file_bytes: int
    path: Path = attrs.field(eq=False)
    payload_dtypes: Mapping[str, str] = attrs.field(factory=dict, repr=False)  # kv-q8: original dtypes
    cache_kind: str = ""  # "" for plain K/V (versions 1 and 2), else one of CACHE_KINDS (version 3; 4 read)

    @property
    def token_count(self) -> int:
        return len(self.token_ids)

    @property
    def has_end_state(self) -> bool:
        """Whether a restore may stop at this block's end: plain K/V always, a stateful cache's block
        only when it carries the state there."""
        return not self.cache_kind or has_end_state(self.tensors)


def block_file_name(block_hash: str) -> str:
    return block_hash + BLOCK_SUFFIX


def _st_dtype(arr: np.ndarray) -> str:
    tag = _NP_TO_ST.get(arr.dtype.name)
    if tag is None:
        raise ValueError(f"KV payload dtype {arr.dtype} cannot be stored")
    return tag


def encode_block(*, block_hash: str, parent_hash: str, fingerprint: str, token_ids: Sequence[int],
                 arrays: Mapping[str, np.ndarray], payload_kind: str = PAYLOAD_KV,
                 payload_dtypes: Mapping[str, str] | None = None,
                 dtype_tags: Mapping[str, str] | None = None, cache_kind: str = "") -> tuple[bytes, list[memoryview]]:
    """Return ``(prefix, body_parts)``: the length+header bytes and the body as zero-copy views.

    Writing ``prefix`` then each part gives the complete file; the caller never needs the
    whole block joined in memory.
    """
    names = sorted(arrays)
    if not names:
        raise ValueError("a KV block needs at least one tensor")
    version = _version(payload_kind, cache_kind)
    parts: list[memoryview] = []
    entries: dict[str, dict] = {}
    summary: dict[str, list] = {}
    body_hash = hashlib.sha256()
    offset = 0
    for name in names:
        if name == "__metadata__":
            raise ValueError("tensor name __metadata__ is reserved")
        arr = np.asarray(arrays[name])
        tag = _st_dtype(arr)
        if dtype_tags and name in dtype_tags:  # e.g. bfloat16 bits held in a uint16 array
            tag = dtype_tags[name]
            if np.dtype(_ST_TO_NP[tag]).itemsize != arr.dtype.itemsize:
                raise ValueError(f"{name}: tag {tag} does not match dtype {arr.dtype}")
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        arr = np.ascontiguousarray(arr)
        view = memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else memoryview(b"")
        body_hash.update(view)
        parts.append(view)
        entries[name] = {"dtype": tag, "shape": list(arr.shape), "data_offsets": [offset, offset + view.nbytes]}
        summary[name] = [tag, list(arr.shape)]
        offset += view.nbytes
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(version),
        "fingerprint": fingerprint,
        "block_hash": block_hash,
        "parent_hash": parent_hash,
        "payload_kind": payload_kind,
        "token_count": str(len(token_ids)),
        "token_ids": json.dumps([int(t) for t in token_ids], separators=(",", ":")),
        "tensors": json.dumps(summary, separators=(",", ":")),
        "body_bytes": str(offset),
        "body_sha256": body_hash.hexdigest(),
    }
    if cache_kind:
        metadata["cache_kind"] = cache_kind
    if payload_dtypes:
        metadata["payload_dtypes"] = json.dumps(dict(payload_dtypes), separators=(",", ":"))
    header = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode("utf-8")
    header += b" " * ((-(8 + len(header))) % 8)
    return struct.pack("<Q", len(header)) + header, parts


def _version(payload_kind: str, cache_kind: str) -> int:
    """The version a block is written at; ``ValueError`` (the store refuses the block) for a cache kind
    no version holds."""
    if cache_kind:
        if cache_kind not in CACHE_KINDS:
            raise ValueError(f"unknown cache kind {cache_kind!r}")
        return STATE_FORMAT_VERSION
    return CODES_FORMAT_VERSION if payload_kind == PAYLOAD_KV_CODES else FORMAT_VERSION


def encode_block_bytes(**kw) -> bytes:
    """The whole file as one ``bytes`` (tests, small blocks)."""
    prefix, parts = encode_block(**kw)
    return prefix + b"".join(bytes(p) for p in parts)


def parse_header(prefix: bytes, file_bytes: int, path: Path) -> BlockMeta:
    """Validate the header of a file of ``file_bytes`` bytes whose first bytes are ``prefix``.

    ``prefix`` must hold at least the 8-byte length and the whole header.
    """
    if file_bytes < 8 or len(prefix) < 8:
        raise BlockFileError("truncated", "shorter than the header length")
    (hlen,) = struct.unpack("<Q", prefix[:8])
    if hlen > _MAX_HEADER:
        raise BlockFileError("bad-header", f"header length {hlen} is implausible")
    if file_bytes < 8 + hlen or len(prefix) < 8 + hlen:
        raise BlockFileError("truncated", "header cut short")
    try:
        header = json.loads(prefix[8:8 + hlen].decode("utf-8"))
        md = header.pop("__metadata__")
    except (UnicodeDecodeError, ValueError, KeyError, AttributeError, TypeError) as e:
        raise BlockFileError("bad-header", type(e).__name__) from None
    if not isinstance(md, dict) or md.get("format") != FORMAT_NAME:
        raise BlockFileError("foreign-format", "not an hf2q KV block")
    versions = {str(v): kinds for v, kinds in VERSION_PAYLOADS.items()}
    if md.get("format_version") not in versions:
        raise BlockFileError("wrong-version", f"format version {md.get('format_version')!r}, "
                                              f"expected one of {', '.join(versions)}")
    try:
        tensors = {}
        for name, e in header.items():
            begin, end = (int(x) for x in e["data_offsets"])
            shape = tuple(int(x) for x in e["shape"])
            if e["dtype"] not in _ST_TO_NP or begin < 0 or end < begin:
                raise ValueError(name)
            want = int(np.prod(shape, dtype=np.int64)) * np.dtype(_ST_TO_NP[e["dtype"]]).itemsize
            if end - begin != want:
                raise ValueError(name)
            tensors[name] = TensorInfo(e["dtype"], shape, begin, end)
        body_bytes = int(md["body_bytes"])
        token_ids = tuple(int(t) for t in json.loads(md["token_ids"]))
        if int(md["token_count"]) != len(token_ids):
            raise ValueError("token_count")
        if md["payload_kind"] not in versions[md["format_version"]]:
            raise BlockFileError("unknown-payload", f"payload kind {md['payload_kind']!r} in a version "
                                                    f"{md['format_version']} block")
        payload_dtypes = {str(k): str(v) for k, v in json.loads(md.get("payload_dtypes", "{}")).items()}
        cache_kind = str(md.get("cache_kind", ""))
        if cache_kind not in VERSION_CACHE_KINDS[int(md["format_version"])]:
            raise BlockFileError("unknown-payload", f"cache kind {cache_kind!r} in a version "
                                                    f"{md['format_version']} block")
        meta = BlockMeta(block_hash=str(md["block_hash"]), parent_hash=str(md["parent_hash"]),
                         fingerprint=str(md["fingerprint"]), payload_kind=str(md["payload_kind"]),
                         token_ids=token_ids, body_sha256=str(md["body_sha256"]), tensors=tensors,
                         body_offset=8 + hlen, file_bytes=file_bytes, path=path, payload_dtypes=payload_dtypes,
                         cache_kind=cache_kind)
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise BlockFileError("bad-header", f"field {e}") from None
    try:
        chained = chain_hash(meta.parent_hash, meta.fingerprint, meta.token_ids)
    except (ValueError, UnicodeError):
        chained = None
    if chained != meta.block_hash:  # also makes parent links acyclic
        raise BlockFileError("bad-chain", "block hash does not chain from parent, fingerprint and tokens")
    spans = sorted((t.begin, t.end) for t in tensors.values())
    pos = 0
    for b, e in spans:
        if b != pos:
            raise BlockFileError("bad-header", "tensor offsets are not contiguous")
        pos = e
    if pos != body_bytes:
        raise BlockFileError("bad-header", "tensor offsets do not cover the body")
    if file_bytes < 8 + hlen + body_bytes:
        raise BlockFileError("truncated", f"{file_bytes} bytes, expected {8 + hlen + body_bytes}")
    if file_bytes > 8 + hlen + body_bytes:
        raise BlockFileError("bad-header", "trailing bytes after the body")
    return meta


def read_meta(path: str | os.PathLike) -> BlockMeta:
    """Parse and validate a block file's header and size (the body is not read)."""
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) == 8:
            (hlen,) = struct.unpack("<Q", head)
            if hlen <= _MAX_HEADER:
                head += f.read(hlen)
    return parse_header(head, size, path)


def verify_body(meta: BlockMeta, body: bytes | bytearray | memoryview) -> None:
    if len(body) != meta.file_bytes - meta.body_offset:
        raise BlockFileError("truncated", "body length changed")
    if hashlib.sha256(body).hexdigest() != meta.body_sha256:
        raise BlockFileError("bad-checksum", "body sha256 mismatch")


def read_block(path: str | os.PathLike, *, verify: bool = True) -> tuple[BlockMeta, dict[str, np.ndarray]]:
    """Read, verify and decode a block; arrays are writable views of one buffer."""
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(size)
        n = f.readinto(buf)
    if n != size:
        raise BlockFileError("truncated", "file shrank while reading")
    head_len = 8 + struct.unpack("<Q", buf[:8])[0] if size >= 8 else size
    meta = parse_header(bytes(buf[:min(size, head_len, 8 + _MAX_HEADER)]), size, path)
    body = memoryview(buf)[meta.body_offset:]
    if verify:
        verify_body(meta, body)
    arrays = {}
    for name, t in meta.tensors.items():
        arr = np.frombuffer(body[t.begin:t.end], dtype=np.dtype(_ST_TO_NP[t.dtype]).newbyteorder("<"))
        arrays[name] = arr.reshape(t.shape)
    return meta, arrays


def verify_file(path: str | os.PathLike) -> BlockMeta:
    """Full verification (header, size, checksum); raises ``BlockFileError``."""
    meta, _ = read_block(path, verify=True)
    return meta
