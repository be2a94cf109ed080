"""``BlockStore``: the persistent prefix-KV index over one directory.

It answers two questions for the runtime — "which leading blocks of this prompt are on
disk?" (``longest_prefix``) and "which blocks still need writing?" (``missing_spans``) —
reads verified payloads back (``read``), and commits new blocks crash-safely
(``stage`` writes a private temp file, ``commit`` fsyncs, renames, fsyncs the directory,
indexes and evicts least-recently-used blocks down to the budget).

Blocking file I/O: call ``read`` / ``stage`` / ``commit`` from a worker thread (the writer
actor uses ``trio.to_thread.run_sync``); the in-memory index is guarded by a
``threading.Lock`` so lookups from other threads stay consistent. Recency is also stamped
into each file's mtime, so LRU order survives restarts and is shared by every process on
the directory. Several processes may open one directory: temp names are private, renames
are atomic, blocks another process wrote are found by probing the file name, and a block
evicted underneath a reader is simply a miss.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
import os
import secrets
import threading
from pathlib import Path
from typing import Mapping, Sequence

import attrs
import numpy as np

from hf2q.atomic import TMP_SUFFIX, fsync_dir
from hf2q.errors import InputError
from hf2q.kvstore import payload
from hf2q.kvstore.blockfile import (PAYLOAD_KINDS, PAYLOAD_KV, BlockFileError, BlockMeta, block_file_name,
                                    encode_block, parse_header, read_block, read_meta)
from hf2q.kvstore.fingerprint import BLOCK_TOKENS, ROOT_PARENT, block_hashes, chain_hash
from hf2q.kvstore.locks import RECOVERY_LOCK, USE_LOCK, FileLock
from hf2q.kvstore.recovery import BLOCKS_DIR, RecoveryReport, quarantine, recover

log = logging.getLogger("hf2q.kvstore")


class BlockUnavailable(Exception):
    """A block in the index could not be read back (vanished or failed verification)."""


@attrs.frozen
class BlockSpan:
    """Block ``index`` of a prompt: tokens ``[start, end)`` with their chained hash."""

    index: int
    start: int
    end: int
    block_hash: str
    parent_hash: str


@attrs.frozen
class KVBlock:
    """One block to persist: its key, its tokens and the engine's exported KV arrays.

    ``payload_kind`` describes ``arrays`` as handed over (always the engine's ``kv``); how
    they are stored is the store's choice (``BlockStore.open(payload_kind=…)``). ``cache_kind``
    is the exporting sequence's ``persist_kind`` ("" for plain K/V; ``blockfile.CACHE_KINDS``).
    """

    block_hash: str
    parent_hash: str
    token_ids: tuple[int, ...] = attrs.field(converter=lambda t: tuple(int(x) for x in t))
    arrays: Mapping[str, np.ndarray] = attrs.field(repr=False)
    payload_kind: str = PAYLOAD_KV
    cache_kind: str = ""

    @classmethod
    def from_span(cls, span: BlockSpan, tokens: Sequence[int], arrays: Mapping[str, np.ndarray],
                  cache_kind: str = "") -> "KVBlock":
        return cls(span.block_hash, span.parent_hash, tokens[span.start:span.end], arrays, cache_kind=cache_kind)

    @property
    def nbytes(self) -> int:
        return sum(int(np.asarray(a).nbytes) for a in self.arrays.values())


@attrs.frozen
class StoreStats:
    bytes_on_disk: int
    blocks: int
    budget_bytes: int | None
    hits: int  # blocks found by longest_prefix
    misses: int  # lookups that stopped before the prompt's last full block
    skipped: int  # blocks the writer refused because its channel was full
    errors: int  # I/O errors and blocks that failed verification on read
    quarantined: int  # at recovery and later
    written: int
    evicted: int
    pending: int = 0  # blocks promised to the disk and not written yet (queued or deferred)
    not_written: int = 0  # promised blocks given up: their KV was overwritten first, or the server stopped

    def as_dict(self) -> dict:
        return attrs.asdict(self)


@attrs.define(eq=False)
class StagedWrite:
    """A block written to its private temp file, not yet durable or visible."""

    fd: int
    tmp_path: Path
    final_path: Path
    meta: BlockMeta


class BlockStore:
    """Open with ``BlockStore.open(dir, fingerprint, budget_bytes)``; close (or ``with``) when done."""

    def __init__(self, root: Path, fingerprint: str, budget_bytes: int | None, metas: list[BlockMeta],
                 report: RecoveryReport, use_lock: FileLock, payload_kind: str = PAYLOAD_KV):
        self.root = root
        self.blocks_dir = root / BLOCKS_DIR
        self.fingerprint = fingerprint
        self.budget_bytes = budget_bytes
        self.recovery = report
        self.payload_kind = payload_kind
        self._use_lock = use_lock
        self._mu = threading.Lock()
        self._index: collections.OrderedDict[str, BlockMeta] = collections.OrderedDict(
            (m.block_hash, m) for m in metas)  # least recently used first
        self._bytes = sum(m.file_bytes for m in metas)
        self._counts = collections.Counter(quarantined=len(report.quarantined))

    # ---- lifecycle ----------------------------------------------------------------------

    @classmethod
    def open(cls, root: str | os.PathLike, fingerprint: str, budget_bytes: int | None = None, *,
             verify_bodies: bool | None = None, payload_kind: str = PAYLOAD_KV) -> "BlockStore":
        """Create/open ``root``, take the shared use lock, run recovery, evict to the budget.

        ``verify_bodies``: True checksums every block at start-up, False checks only headers
        and sizes (≈40× faster), None picks True for stores up to 2 GiB. Bodies are always
        verified when read, so a corrupt block is never imported either way.
        ``payload_kind="kv-q8"`` stores new blocks as 8-bit rows, ``"kv-f16"`` float32 KV as
        float16 (both approximate, see docs/KVSTORE.md); blocks of any kind are read back in the
        engine's dtype.
        """
        if payload_kind not in PAYLOAD_KINDS:
            raise InputError(f"unknown KV payload kind {payload_kind!r} (use {', '.join(PAYLOAD_KINDS)})")
        root = Path(root).expanduser()
        if budget_bytes is not None and budget_bytes < 0:
            raise InputError(f"--kv-persist-budget must not be negative: {budget_bytes}")
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock = FileLock(root / USE_LOCK, exclusive=False).acquire()
        except OSError as e:
            raise InputError(f"cannot use KV store directory {str(root)!r}: {e.strerror or e}") from None
        try:
            metas, report = recover(root, fingerprint, verify_bodies=verify_bodies)
        except OSError as e:
            lock.release()
            raise InputError(f"cannot recover KV store {str(root)!r}: {e.strerror or e}") from None
        store = cls(root, fingerprint, budget_bytes, metas, report, lock, payload_kind)
        log.info("kv store: recovered", extra={"kv_dir": str(root), **report.as_dict()})
        store._evict_to_budget()
        return store

    def close(self) -> None:
        self._use_lock.release()

    def __enter__(self) -> "BlockStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- lookups ------------------------------------------------------------------------

    def spans(self, tokens: Sequence[int]) -> list[BlockSpan]:
        """Every full block of ``tokens`` with its chained hash."""
        out, parent = [], ROOT_PARENT
        for i, h in enumerate(block_hashes(self.fingerprint, tokens)):
            out.append(BlockSpan(i, i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS, h, parent))
            parent = h
        return out

    def contains(self, block_hash: str) -> bool:
        return self._lookup(block_hash) is not None

    def missing_spans(self, tokens: Sequence[int]) -> list[BlockSpan]:
        """Full blocks of ``tokens`` not yet on disk (what the runtime should export and submit)."""
        return [s for s in self.spans(tokens) if not self.contains(s.block_hash)]

    def longest_prefix(self, tokens: Sequence[int]) -> list[BlockMeta]:
        """The stored blocks covering the longest leading run of full blocks of ``tokens``."""
        found: list[BlockMeta] = []
        hashes = block_hashes(self.fingerprint, tokens)
        for h in hashes:
            meta = self._lookup(h)
            if meta is None:
                break
            found.append(meta)
        with self._mu:
            self._counts["hits"] += len(found)
            self._counts["misses"] += int(len(found) < len(hashes))
            for m in reversed(found):  # the chain's head ends most recent: evicted last
                if m.block_hash in self._index:
                    self._index.move_to_end(m.block_hash)
        return found

    def _lookup(self, block_hash: str) -> BlockMeta | None:
        with self._mu:
            meta = self._index.get(block_hash)
        if meta is not None:
            return meta
        path = self.blocks_dir / block_file_name(block_hash)
        try:  # written by another process sharing the directory?
            meta = read_meta(path)
        except FileNotFoundError:
            return None
        except (BlockFileError, OSError):
            return None  # left for that writer / the next recovery to judge
        if meta.block_hash != block_hash:
            return None
        with self._mu:
            if block_hash not in self._index:
                self._index[block_hash] = meta
                self._bytes += meta.file_bytes
        return meta

    # ---- reads --------------------------------------------------------------------------

    def read(self, meta: BlockMeta) -> dict[str, np.ndarray]:
        """The block's verified KV arrays; ``BlockUnavailable`` if it vanished or is corrupt."""
        try:
            got, arrays = read_block(meta.path, verify=True)
            if got.block_hash != meta.block_hash or got.fingerprint != self.fingerprint \
                    or got.token_ids != meta.token_ids:
                raise BlockFileError("name-mismatch", "header differs from the index")
        except FileNotFoundError:
            self._forget(meta.block_hash)
            raise BlockUnavailable(f"block {meta.block_hash[:12]} was evicted") from None
        except BlockFileError as e:
            self._forget(meta.block_hash)
            moved = quarantine(self.root, meta.path, e.reason)
            with self._mu:
                self._counts["errors"] += 1
                self._counts["quarantined"] += int(moved)
            log.warning("kv store: block failed verification", extra={"block": meta.block_hash[:12],
                                                                      "reason": e.reason})
            raise BlockUnavailable(f"block {meta.block_hash[:12]}: {e}") from None
        except OSError as e:
            self.note_error()
            raise BlockUnavailable(f"block {meta.block_hash[:12]}: {e.strerror or e}") from None
        with contextlib.suppress(OSError):
            os.utime(meta.path)  # recency survives restarts (recovery propagates it to ancestors)
        return payload.decode_payload(arrays, got)

    # ---- writes -------------------------------------------------------------------------

    def stage(self, block: KVBlock) -> StagedWrite | None:
        """Write ``block`` into a private, locked temp file; None if it is already stored."""
        if chain_hash(block.parent_hash, self.fingerprint, block.token_ids) != block.block_hash:
            raise ValueError("block hash does not match its parent, tokens and this store's fingerprint")
        if self.contains(block.block_hash):
            return None
        kind = payload.block_kind(block.arrays, self.payload_kind)
        arrays, tags, dtypes = payload.encode_payload(block.arrays, kind)
        prefix, parts = encode_block(block_hash=block.block_hash, parent_hash=block.parent_hash,
                                     fingerprint=self.fingerprint, token_ids=block.token_ids, arrays=arrays,
                                     payload_kind=kind, payload_dtypes=dtypes, dtype_tags=tags,
                                     cache_kind=block.cache_kind)
        final = self.blocks_dir / block_file_name(block.block_hash)
        tmp = self.blocks_dir / f".{block.block_hash}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        # created and locked under recovery's lock, shared: recovery in another process leaves a locked temp
        # alone, and never finds this one between its creation and its lock (it would take it for a dead one)
        with FileLock(self.root / RECOVERY_LOCK, exclusive=False):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise
        try:
            for chunk in (prefix, *parts):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
            size = os.fstat(fd).st_size
            meta = parse_header(prefix, size, final)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        return StagedWrite(fd, tmp, final, meta)

    def commit(self, staged: StagedWrite, *, settles_pending: bool = False) -> BlockMeta:
        """fsync the temp, rename it into place, fsync the directory, index it, evict to budget.

        ``settles_pending``: the block was counted pending (``note_pending``); it stops being so in
        the same step that counts it written, so ``stats()`` never shows it as both."""
        try:
            os.fsync(staged.fd)
            os.replace(staged.tmp_path, staged.final_path)
        except BaseException:
            self.abort(staged)
            raise
        os.close(staged.fd)
        fsync_dir(self.blocks_dir)
        with self._mu:
            old = self._index.pop(staged.meta.block_hash, None)
            self._bytes -= old.file_bytes if old else 0
            self._index[staged.meta.block_hash] = staged.meta
            self._bytes += staged.meta.file_bytes
            self._counts["written"] += 1
            self._counts["pending"] -= int(settles_pending)
            parent = staged.meta.parent_hash  # ancestors count as used whenever a descendant is
            while parent in self._index:
                self._index.move_to_end(parent)
                parent = self._index[parent].parent_hash
        self._evict_to_budget()
        return staged.meta

    def abort(self, staged: StagedWrite) -> None:
        with contextlib.suppress(OSError):
            os.close(staged.fd)
        with contextlib.suppress(OSError):
            staged.tmp_path.unlink()

    def write(self, block: KVBlock) -> BlockMeta | None:
        """``stage`` + ``commit`` in one call (blocking)."""
        staged = self.stage(block)
        return None if staged is None else self.commit(staged)

    # ---- budget -------------------------------------------------------------------------

    def _evict_to_budget(self) -> int:
        if self.budget_bytes is None:
            return 0
        evicted = 0
        while True:
            with self._mu:
                if self._bytes <= self.budget_bytes or not self._index:
                    break
                _, meta = self._index.popitem(last=False)
                self._bytes -= meta.file_bytes
                self._counts["evicted"] += 1
            evicted += 1
            with contextlib.suppress(FileNotFoundError):
                meta.path.unlink()
        if evicted:
            fsync_dir(self.blocks_dir)
            log.debug("kv store: evicted blocks", extra={"evicted": evicted})
        return evicted

    def _forget(self, block_hash: str) -> None:
        with self._mu:
            meta = self._index.pop(block_hash, None)
            if meta is not None:
                self._bytes -= meta.file_bytes

    # ---- accounting ---------------------------------------------------------------------

    def note_skipped(self, n: int = 1) -> None:
        with self._mu:
            self._counts["skipped"] += n

    def note_pending(self, delta: int) -> None:
        with self._mu:
            self._counts["pending"] += delta

    def note_not_written(self, n: int = 1) -> None:
        with self._mu:
            self._counts["not_written"] += n

    def note_error(self, n: int = 1) -> None:
        with self._mu:
            self._counts["errors"] += n

    def lru_order(self) -> list[str]:
        """Block hashes in eviction order: least recently used first, children before parents."""
        with self._mu:
            return list(self._index)

    def stats(self) -> StoreStats:
        with self._mu:
            c = self._counts
            return StoreStats(bytes_on_disk=self._bytes, blocks=len(self._index), budget_bytes=self.budget_bytes,
                              hits=c["hits"], misses=c["misses"], skipped=c["skipped"], errors=c["errors"],
                              quarantined=c["quarantined"], written=c["written"], evicted=c["evicted"],
                              pending=c["pending"], not_written=c["not_written"])
