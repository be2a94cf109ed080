"""Pure planning of a disk → slot restore (no I/O beyond the store's index, no MLX, no trio).

A slot may already hold part of the prompt (``slot_cached`` tokens, its exact-prefix match)
while the disk holds a longer run of full blocks. Restoring means: trim the slot's sequence
back to a block boundary it already covers, then import the stored blocks after it. The
prompt's last token is never restored — prefill must compute it to produce the logits the
first sampled token comes from — and only whole blocks are imported (the engine's
``import_kv`` takes arrays of exactly ``n_tokens`` positions), so a prompt ending exactly on
a block boundary recomputes its last block.
"""

from __future__ import annotations

from typing import Sequence

import attrs

from hf2q.kvstore.blockfile import BlockMeta
from hf2q.kvstore.fingerprint import BLOCK_TOKENS


@attrs.frozen
class BlockImport:
    meta: BlockMeta
    n_tokens: int  # positions of this block to import (always the whole block today)


@attrs.frozen
class RestorePlan:
    keep_tokens: int  # trim the slot's sequence to this many tokens first
    imports: tuple[BlockImport, ...]  # then import these, in order

    @property
    def restored_tokens(self) -> int:
        return sum(i.n_tokens for i in self.imports)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the request does not recompute (report as ``cached_tokens``)."""
        return self.keep_tokens + self.restored_tokens


def plan_restore(store, prompt: Sequence[int], slot_cached: int = 0) -> RestorePlan | None:
    """What to import from ``store`` for ``prompt``, or None when the disk adds nothing.

    ``slot_cached`` is how many leading prompt tokens the slot's KV already holds.
    """
    limit = len(prompt) - 1  # keep at least one token for prefill
    if limit <= slot_cached:
        return None
    found = store.longest_prefix(prompt)
    keep = (slot_cached // BLOCK_TOKENS) * BLOCK_TOKENS
    imports = []
    for i, meta in enumerate(found):
        start = i * BLOCK_TOKENS
        if start < keep:
            continue
        if start + BLOCK_TOKENS > limit:
            break
        imports.append(BlockImport(meta, BLOCK_TOKENS))
    plan = RestorePlan(keep, tuple(imports))
    if plan.cached_tokens <= slot_cached:
        return None
    return plan
