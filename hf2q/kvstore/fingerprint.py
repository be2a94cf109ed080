"""Model fingerprints and chained block hashes: the keys of the persistent KV store.

A KV block is only reusable by the exact model that produced it, under the exact prompt
prefix that led to it. So a block's key chains three things: the hash of the block before
it (the whole prefix, transitively), the model fingerprint, and the block's own token ids.
Two prompts share block *i* only if they agree on every token up to the end of block *i*.

The model fingerprint covers the GGUF's content (not its path: a copied or renamed file
keeps its blocks, a re-converted one loses them), the quant name, the chat template, the
engine's KV format version and the engine's identity (backend, device, KV dtype). Hashing a multi-GB GGUF takes seconds, so content hashes
are memoised in ``cache_root()/kv-fingerprints.json`` keyed by (real path, size, mtime).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from hf2q.atomic import atomic_write_text
from hf2q.errors import InputError
from hf2q.paths import cache_root
from hf2q.sources.integrity import sha256_file

BLOCK_TOKENS = 256
"""Tokens per block; only full blocks are stored."""

ROOT_PARENT = "0" * 64
"""The parent hash of a prompt's first block."""



def _content_cache_file() -> Path:
    return cache_root() / "kv-fingerprints.json"


def gguf_content_hash(gguf_path: str | os.PathLike) -> str:
    """sha256 of the file's bytes, memoised by (real path, size, mtime_ns)."""
    path = Path(gguf_path)
    try:
        real = path.resolve(strict=True)
        st = real.stat()
    except OSError as e:
        raise InputError(f"cannot fingerprint model {str(gguf_path)!r}: {e.strerror or e}") from None
    key = f"{real}|{st.st_size}|{st.st_mtime_ns}"
    cache_file = _content_cache_file()
    memo: dict[str, str] = {}
    with contextlib.suppress(OSError, ValueError):
        memo = json.loads(cache_file.read_text("utf-8"))
        if not isinstance(memo, dict):
            memo = {}
    if isinstance(memo.get(key), str):
        return memo[key]
    try:
        digest = sha256_file(real)
    except OSError as e:
        raise InputError(f"cannot read model {str(gguf_path)!r}: {e.strerror or e}") from None
    # drop stale entries for the same path, keep the memo small
    memo = {k: v for k, v in memo.items() if not k.startswith(f"{real}|")}
    memo[key] = digest
    with contextlib.suppress(OSError):  # a read-only cache only costs speed
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cache_file, json.dumps(memo, indent=0, sort_keys=True))
    return digest


def model_fingerprint(gguf_path: str | os.PathLike, quant: str | None, chat_template: str | None,
                      format_version: int | str, kv_identity: str = "") -> str:
    """64-hex fingerprint of (GGUF content, quant, chat template, KV format version, engine).

    ``kv_identity`` is the runner's ``ModelRunner.kv_identity`` (backend, device kind, KV dtype):
    the same GGUF served on a CPU (float32 KV) and on a GPU (float16/bfloat16 KV) yields
    different KV values, so their blocks must never be mixed in one directory.
    """
    ident = {
        "gguf_sha256": gguf_content_hash(gguf_path),
        "quant": quant or "",
        "chat_template": chat_template or "",
        "format_version": str(format_version),
    }
    if kv_identity:  # absent, the fingerprint is what it was before engines reported one
        ident["kv_identity"] = kv_identity
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode("utf-8")).hexdigest()


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32, the byte form hashed into block keys; a block holding an
    image's tokens (ids above uint32 that carry the image's content digest,
    ``hf2q.engine.vision.prompt_images``) as uint64, so its key names the image it was computed from."""
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and arr.min() < 0:
        raise ValueError("token ids must not be negative")
    return arr.astype("<u8" if arr.size and arr.max() > 0xFFFFFFFF else "<u4").tobytes()


def chain_hash(parent_hash: str, fingerprint: str, block_tokens: Sequence[int]) -> str:
    """Key of one block: sha256(parent hash ‖ fingerprint ‖ token ids)."""
    h = hashlib.sha256()
    h.update(parent_hash.encode("ascii") + b"\0")
    h.update(fingerprint.encode("utf-8") + b"\0")
    h.update(token_bytes(block_tokens))
    return h.hexdigest()


def block_hashes(fingerprint: str, tokens: Sequence[int]) -> list[str]:
    """Chained hashes of every *full* ``BLOCK_TOKENS`` block of ``tokens`` (a trailing partial block has none)."""
    out: list[str] = []
    parent = ROOT_PARENT
    n_full = len(tokens) // BLOCK_TOKENS
    for i in range(n_full):
        parent = chain_hash(parent, fingerprint, tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])
        out.append(parent)
    return out
