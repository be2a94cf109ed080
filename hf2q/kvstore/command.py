"""``hf2q cache list|size|clear``: inspect and empty the model cache or a persistent KV store.

With ``--kv-path DIR`` the commands act on a KV store: ``list`` prints one line per model
fingerprint (blocks, bytes, last use) plus quarantine, ``size`` the total bytes, ``clear``
deletes blocks, temps and quarantine — only when no server has the store open (its shared
lock is held) and only after confirmation (``--yes``, or "y" on a terminal). Without
``--kv-path`` they act on the model cache (``--cache-dir`` or ``hf2q.paths.cache_root()``).
Reading never modifies the store: listing parses headers only and leaves recovery to the
next server start.
"""

from __future__ import annotations

import collections
import os
import shutil
import sys
import time
from pathlib import Path

from hf2q.atomic import TMP_SUFFIX, fsync_dir
from hf2q.errors import InputError, UsageError
from hf2q.kvstore.blockfile import BLOCK_SUFFIX, BlockFileError, read_meta
from hf2q.kvstore.locks import LockBusy, exclusive_use
from hf2q.kvstore.recovery import BLOCKS_DIR, QUARANTINE_DIR
from hf2q.paths import cache_root, tree_bytes


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError


def _confirm(what: str, yes: bool) -> bool:
    if yes:
        return True
    if not sys.stdin.isatty():
        raise UsageError(f"refusing to clear {what} without --yes")
    return input(f"Delete {what}? [y/N] ").strip().lower() in ("y", "yes")


# ---- KV store ------------------------------------------------------------------------------


def _kv_root(path: str) -> Path:
    root = Path(path).expanduser()
    if not root.exists():
        raise InputError(f"no KV store at {path!r}")
    if not root.is_dir():
        raise InputError(f"--kv-path {path!r} is not a directory")
    return root


def _kv_scan(root: Path) -> dict:
    by_fp: dict[str, list] = collections.defaultdict(lambda: [0, 0, 0])  # blocks, bytes, newest mtime
    temps = unreadable = 0
    temp_bytes = unreadable_bytes = 0
    blocks = root / BLOCKS_DIR
    for entry in (os.scandir(blocks) if blocks.is_dir() else ()):
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if entry.name.endswith(TMP_SUFFIX):
            temps += 1
            temp_bytes += st.st_size
        elif entry.name.endswith(BLOCK_SUFFIX):
            try:
                fp = read_meta(entry.path).fingerprint
            except (BlockFileError, OSError):
                unreadable += 1
                unreadable_bytes += st.st_size
                continue
            row = by_fp[fp]
            row[0] += 1
            row[1] += st.st_size
            row[2] = max(row[2], st.st_mtime)
    qdir = root / QUARANTINE_DIR
    quarantined = list(qdir.iterdir()) if qdir.is_dir() else []
    return {"by_fingerprint": dict(by_fp), "temps": temps, "temp_bytes": temp_bytes,
            "unverified": unreadable, "unverified_bytes": unreadable_bytes,
            "quarantined": len(quarantined), "quarantine_bytes": sum(tree_bytes(p) for p in quarantined)}


def _kv_total(scan: dict) -> int:
    return (sum(r[1] for r in scan["by_fingerprint"].values()) + scan["temp_bytes"]
            + scan["unverified_bytes"] + scan["quarantine_bytes"])


def _kv_list(root: Path) -> int:
    scan = _kv_scan(root)
    print(f"KV store {root}")
    print(f"{'fingerprint':<18} {'blocks':>8} {'bytes':>12}  last used")
    for fp, (n, size, newest) in sorted(scan["by_fingerprint"].items(), key=lambda kv: -kv[1][2]):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(newest))
        print(f"{fp[:16]:<18} {n:>8} {human_bytes(size):>12}  {when}")
    if scan["unverified"]:
        print(f"{'(unreadable)':<18} {scan['unverified']:>8} {human_bytes(scan['unverified_bytes']):>12}")
    if scan["temps"]:
        print(f"{'(temp files)':<18} {scan['temps']:>8} {human_bytes(scan['temp_bytes']):>12}")
    print(f"{'(quarantine)':<18} {scan['quarantined']:>8} {human_bytes(scan['quarantine_bytes']):>12}")
    print(f"total {human_bytes(_kv_total(scan))}")
    return 0


def _kv_clear(root: Path, yes: bool) -> int:
    if not _confirm(f"every block in the KV store {root}", yes):
        print("nothing deleted")
        return 0
    freed = removed = 0
    try:
        with exclusive_use(root):
            for sub in (BLOCKS_DIR, QUARANTINE_DIR):
                d = root / sub
                if not d.is_dir():
                    continue
                for entry in os.scandir(d):
                    try:
                        size = entry.stat(follow_symlinks=False).st_size
                        if entry.is_dir(follow_symlinks=False):
                            shutil.rmtree(entry.path)
                        else:
                            os.unlink(entry.path)
                    except FileNotFoundError:
                        continue
                    freed += size
                    removed += 1
                fsync_dir(d)
    except LockBusy:
        raise InputError(f"KV store {str(root)!r} is in use by a running server; stop it first") from None
    except OSError as e:
        raise InputError(f"cannot clear KV store {str(root)!r}: {e.strerror or e}") from None
    print(f"removed {removed} files, freed {human_bytes(freed)}")
    return 0


# ---- model cache ---------------------------------------------------------------------------


def _model_cache_root(args) -> Path:
    d = getattr(args, "cache_dir", None)
    return Path(d).expanduser() if d else cache_root()


def _model_list(root: Path) -> int:
    print(f"model cache {root}")
    if not root.is_dir():
        print("(empty)")
        return 0
    total = 0
    for entry in sorted(root.iterdir()):
        children = sorted(entry.iterdir()) if entry.is_dir() and not entry.is_symlink() else [entry]
        for child in children:
            size = tree_bytes(child)
            total += size
            print(f"{human_bytes(size):>12}  {child.relative_to(root)}")
    print(f"total {human_bytes(total)}")
    return 0


def _model_clear(root: Path, yes: bool) -> int:
    if not root.is_dir():
        print("nothing to clear")
        return 0
    if not _confirm(f"everything in the model cache {root}", yes):
        print("nothing deleted")
        return 0
    freed = 0
    for entry in list(root.iterdir()):
        size = tree_bytes(entry)
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError as e:
            raise InputError(f"cannot remove {str(entry)!r}: {e.strerror or e}") from None
        freed += size
    print(f"freed {human_bytes(freed)}")
    return 0


def run(args) -> int:
    action = args.action
    if args.kv_path:
        root = _kv_root(args.kv_path)
        if action == "list":
            return _kv_list(root)
        if action == "size":
            print(_kv_total(_kv_scan(root)))
            return 0
        return _kv_clear(root, args.yes)
    root = _model_cache_root(args)
    if action == "list":
        return _model_list(root)
    if action == "size":
        print(tree_bytes(root) if root.exists() else 0)
        return 0
    return _model_clear(root, args.yes)
