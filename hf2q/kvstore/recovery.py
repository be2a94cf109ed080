"""Start-up recovery: turn whatever a crash left in ``DIR/blocks`` into a trustworthy index.

Writes are temp → fsync → rename → directory fsync, so a crash leaves only complete block
files or temp files. Recovery still trusts nothing: it removes temps whose writer is dead
(their flock is free), verifies every block file (header, size, version, and by default the
body checksum), and moves anything wrong into ``DIR/quarantine/`` named
``<file>.<reason>`` — kept for inspection, never loaded, the newest ``QUARANTINE_KEEP``
retained. Runs under the exclusive recovery lock so concurrent starters take turns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

import attrs

from hf2q.atomic import TMP_SUFFIX, fsync_dir
from hf2q.kvstore.blockfile import BLOCK_SUFFIX, BlockFileError, BlockMeta, read_meta, verify_file
from hf2q.kvstore.locks import RECOVERY_LOCK, FileLock, temp_owner_alive

log = logging.getLogger("hf2q.kvstore")

BLOCKS_DIR = "blocks"
QUARANTINE_DIR = "quarantine"
QUARANTINE_KEEP = 64
AUTO_VERIFY_MAX_BYTES = 2 << 30
"""``verify_bodies=None`` checksums every body at start-up only for stores up to this size."""


@attrs.frozen
class RecoveryReport:
    """What start-up recovery found; logged once and exported in /metrics."""

    blocks: int  # good blocks indexed (any fingerprint)
    bytes: int  # their size on disk
    own_blocks: int  # of those, blocks of this store's fingerprint
    quarantined: tuple[tuple[str, str], ...]  # (file name, reason)
    temps_removed: int
    temps_in_use: int  # temps of a live writer (another process), left alone
    seconds: float
    verified_bodies: bool = True  # False: headers and sizes only (bodies are verified on read)

    def as_dict(self) -> dict:
        return {"blocks": self.blocks, "bytes": self.bytes, "own_blocks": self.own_blocks,
                "quarantined": len(self.quarantined), "temps_removed": self.temps_removed,
                "temps_in_use": self.temps_in_use, "seconds": round(self.seconds, 4),
                "verified_bodies": int(self.verified_bodies)}


def quarantine(root: Path, path: Path, reason: str) -> bool:
    """Move a bad block aside; False if it had already vanished."""
    qdir = root / QUARANTINE_DIR
    qdir.mkdir(exist_ok=True)
    dest = qdir / f"{path.name}.{reason}"
    if dest.exists():
        dest = qdir / f"{path.name}.{time.time_ns()}.{reason}"
    try:
        os.replace(path, dest)
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    fsync_dir(qdir)
    _trim_quarantine(qdir)
    return True


def _trim_quarantine(qdir: Path) -> None:
    with contextlib.suppress(OSError):
        entries = sorted(qdir.iterdir(), key=lambda p: p.stat().st_mtime_ns)
        for old in entries[:-QUARANTINE_KEEP]:
            with contextlib.suppress(OSError):
                old.unlink()


def eviction_order(entries: list[tuple[int, BlockMeta]]) -> list[BlockMeta]:
    """Blocks least valuable first: by last use, where a block counts as used whenever any
    block below it in its chain was (a descendant is useless without its ancestors), and a
    parent always after its children — so eviction trims prompts from the tail, keeping
    their shared heads."""
    by_hash = {m.block_hash: (t, m) for t, m in entries}
    recency = {h: t for h, (t, _) in by_hash.items()}
    depth: dict[str, int] = {}

    def depth_of(h: str) -> int:
        chain = []
        while h in by_hash and h not in depth:
            chain.append(h)
            h = by_hash[h][1].parent_hash
        d = depth.get(h, -1)
        for x in reversed(chain):
            d += 1
            depth[x] = d
        return depth[chain[0]] if chain else d

    for h, (t, m) in by_hash.items():
        depth_of(h)
        parent = m.parent_hash
        while parent in by_hash and recency[parent] < t:
            recency[parent] = t
            parent = by_hash[parent][1].parent_hash
    order = sorted(by_hash, key=lambda h: (recency[h], -depth[h]))
    return [by_hash[h][1] for h in order]


def _block_bytes(blocks: Path) -> int:
    total = 0
    for entry in os.scandir(blocks):
        if entry.name.endswith(BLOCK_SUFFIX):
            with contextlib.suppress(OSError):
                total += entry.stat(follow_symlinks=False).st_size
    return total


def recover(root: Path, fingerprint: str, *,
            verify_bodies: bool | None = None) -> tuple[list[BlockMeta], RecoveryReport]:
    """Index good blocks (oldest use first), quarantine bad ones, drop dead temps.

    ``verify_bodies``: True checksums every body, False checks headers and sizes only,
    None (default) checksums when the store holds at most ``AUTO_VERIFY_MAX_BYTES``.
    """
    t0 = time.perf_counter()
    blocks = root / BLOCKS_DIR
    blocks.mkdir(parents=True, exist_ok=True)
    (root / QUARANTINE_DIR).mkdir(exist_ok=True)
    good: list[tuple[int, BlockMeta]] = []
    bad: list[tuple[str, str]] = []
    removed = in_use = 0
    with FileLock(root / RECOVERY_LOCK, exclusive=True):
        if verify_bodies is None:
            verify_bodies = _block_bytes(blocks) <= AUTO_VERIFY_MAX_BYTES
        for entry in os.scandir(blocks):
            path = Path(entry.path)
            if entry.name.endswith(TMP_SUFFIX):
                if temp_owner_alive(path):
                    in_use += 1
                    continue
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed += 1
                continue
            if not entry.name.endswith(BLOCK_SUFFIX) or not entry.is_file(follow_symlinks=False):
                continue
            try:
                meta = verify_file(path) if verify_bodies else read_meta(path)
                if meta.block_hash + BLOCK_SUFFIX != entry.name:
                    raise BlockFileError("name-mismatch", "file name differs from its block hash")
                mtime = entry.stat().st_mtime_ns
            except FileNotFoundError:
                continue  # evicted by another process meanwhile
            except BlockFileError as e:
                if quarantine(root, path, e.reason):
                    bad.append((entry.name, e.reason))
                    log.warning("kv store: quarantined a bad block", extra={"file": entry.name, "reason": e.reason})
                continue
            except OSError as e:
                if quarantine(root, path, "unreadable"):
                    bad.append((entry.name, "unreadable"))
                log.warning("kv store: unreadable block", extra={"file": entry.name, "error": str(e)})
                continue
            good.append((mtime, meta))
        if removed:
            fsync_dir(blocks)
    metas = eviction_order(good)
    report = RecoveryReport(blocks=len(metas), bytes=sum(m.file_bytes for m in metas),
                            own_blocks=sum(1 for m in metas if m.fingerprint == fingerprint),
                            quarantined=tuple(bad), temps_removed=removed, temps_in_use=in_use,
                            seconds=time.perf_counter() - t0, verified_bodies=verify_bodies)
    return metas, report
