"""Pure planning of a disk → slot restore (no I/O beyond the store's index, no MLX, no trio).

A slot may already hold part of the prompt (``slot_cached`` tokens, its exact-prefix match)
while the disk holds a longer run of full blocks. Restoring means: trim the slot's sequence
back to a block boundary it already covers, then import the stored blocks after it. The
prompt's last token is never restored — prefill must compute it to produce the logits the
first sampled token comes from — and only whole blocks are imported (the engine's
``import_kv`` takes arrays of exactly ``n_tokens`` positions), so a prompt ending exactly on
a block boundary recomputes its last block.

A cache that is not plain per-position K/V (``points`` given: a hybrid model's recurrent state,
DeepSeek-V4's compact cache, a sliding-window model's window layers) can only be trimmed to its reuse
points, and a restore can only stop at a block that carries the state its end needs
(``BlockMeta.has_end_state``): the slot is trimmed to its deepest block-aligned point within what it holds, and the blocks after it are imported up
to the deepest one with an end state (the blocks before that one give their K/V or compressed
entries only). A sliding-window model's window rows serve only at the block the restore stops at
(each import of rows rebuilds the window buffers, and the next one replaces them): the blocks before it
are imported without theirs (:func:`end_rows_last_only`).
"""

from __future__ import annotations

from typing import Sequence

import attrs

from hf2q.engine.kv_layout import END_STATE_PREFIX
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


def plan_restore(store, prompt: Sequence[int], slot_cached: int = 0, points: Sequence[int] | None = None,
                 cache_kind: str = "") -> RestorePlan | None:
    """What to import from ``store`` for ``prompt``, or None when the disk adds nothing.

    ``slot_cached`` is how many leading prompt tokens the slot's KV already holds; ``points`` the
    lengths its sequence can be trimmed to (``seq.published_points``; None: any length) and
    ``cache_kind`` its ``persist_kind``, which the blocks must match.
    """
    limit = len(prompt) - 1  # keep at least one token for prefill
    if limit <= slot_cached:
        return None
    found = store.longest_prefix(prompt)
    if points is None:
        keep = (slot_cached // BLOCK_TOKENS) * BLOCK_TOKENS
    else:
        keep = max(p for p in (0, *points) if p <= slot_cached and p % BLOCK_TOKENS == 0)
    imports = []
    for i, meta in enumerate(found):
        start = i * BLOCK_TOKENS
        if start < keep:
            continue
        if start + BLOCK_TOKENS > limit or meta.cache_kind != cache_kind:
            break
        imports.append(BlockImport(meta, BLOCK_TOKENS))
    while imports and not imports[-1].meta.has_end_state:
        imports.pop()  # a restore stops only where the state is saved
    plan = RestorePlan(keep, tuple(imports))
    if plan.cached_tokens <= slot_cached:
        return None
    return plan



def end_rows_last_only(blocks: Sequence[dict], cache_kind: str) -> list[dict]:
    """The arrays of the blocks a restore imports, in order, a ``window`` sequence's without the window
    rows (``state.*``) but the last block's: only the last end's rows become the window buffers. A hybrid's
    or a compact cache's end states are kept (each is a reuse point of the restored sequence)."""
    if cache_kind != "window":
        return list(blocks)
    last = len(blocks) - 1
    return [b if i == last else {k: v for k, v in b.items() if not k.startswith(END_STATE_PREFIX)}
            for i, b in enumerate(blocks)]
