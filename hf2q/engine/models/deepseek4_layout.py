"""What a DeepSeek-V4 slot cache holds, from the hyper-parameters alone (no MLX: the memory plan and
``hf2q info`` read it before any model loads; ``models/deepseek4_cache.py`` holds it).

Per layer of compression ratio ``m`` a slot keeps

* the **raw rows** (the shared K=V vector, one head wide) of the positions the next query's sliding
  window sees, plus the forward in flight — bounded whatever the length;
* at ``m > 0``, the **compressed entries** (one head wide; ``m = 4`` adds the indexer's keys, one
  indexer head wide), one appended per closed block of ``m`` positions — the only part that grows, at
  ``1/m`` of a row per token;
* at ``m > 0``, the **compressor rows** (projected row and gate logits) of the unfinished block, and at
  ``m = 4`` of the block before it too, because its windows overlap — at most ``2m`` positions;
* and, per kept reuse point, a copy of the raw and compressor rows at that point (the entries are a
  prefix of the live ones).
"""

from __future__ import annotations

import attrs

from hf2q.engine.recurrent_policy import KV_GROW, WINDOW_POINTS_KEPT, WINDOW_SNAPSHOTS_KEPT
from hf2q.formats.gguf_keys import ExtraKeys, Keys

#: the ratio whose compressor windows overlap and whose layers have the lightning indexer
SPARSE_RATIO = 4


@attrs.frozen
class LayerRows:
    """The widths (channels per position) of one layer's rows."""

    ratio: int
    head_dim: int
    index_dim: int

    @property
    def overlap(self) -> bool:
        return self.ratio == SPARSE_RATIO

    @property
    def comp_width(self) -> int:
        """The compressor's projected row (two series when overlapping) and its gate logits."""
        if not self.ratio:
            return 0
        return 2 * (2 if self.overlap else 1) * self.head_dim

    @property
    def index_width(self) -> int:
        """The indexer compressor's projected rows and gate logits (sparse layers only)."""
        return 4 * self.index_dim if self.overlap else 0

    @property
    def entry_width(self) -> int:
        """A compressed entry, plus the indexer's key of the same block."""
        if not self.ratio:
            return 0
        return self.head_dim + (self.index_dim if self.overlap else 0)

    def tail_rows(self) -> int:
        """Most compressor rows kept at one length: the unfinished block, and the one before it when
        windows overlap."""
        return ((2 if self.overlap else 1) * self.ratio - 1) if self.ratio else 0

    def snapshot_values(self, window: int) -> int:
        """Values one reuse point's copy holds for this layer."""
        return (window - 1) * self.head_dim + self.tail_rows() * (self.comp_width + self.index_width)

    def live_values(self, window: int, new_tokens: int) -> int:
        """Most raw and compressor values held while a forward of ``new_tokens`` runs, and the room
        the entries buffer has beyond the entries themselves (it grows in ``KV_GROW`` steps)."""
        rows = (window + new_tokens) * self.head_dim
        rows += (self.tail_rows() + 1 + new_tokens) * (self.comp_width + self.index_width)
        return rows + KV_GROW * self.entry_width


def layer_rows(head_dim: int, index_dim: int, ratios: list[int]) -> list[LayerRows]:
    return [LayerRows(r, head_dim, index_dim) for r in ratios]


@attrs.frozen
class CompactNeed:
    """A slot's bytes: ``per_token`` (the entries, rounded up over the layers) and what it holds
    whatever its length (``bounded(new_tokens)``)."""

    per_token: int
    layers: tuple[LayerRows, ...]
    window: int
    elem: int

    #: reuse points whose rows a slot keeps a copy of: the newest kept points and the prompt ends aged out
    COPIES = WINDOW_POINTS_KEPT + WINDOW_SNAPSHOTS_KEPT

    def fixed(self, new_tokens: int = 1) -> int:
        """The live rows while a forward of ``new_tokens`` runs — every layer's window and unfinished
        blocks' compressor rows — and the room of the entries buffers beyond the entries."""
        return sum(lay.live_values(self.window, new_tokens) for lay in self.layers) * self.elem

    def point_copy(self) -> int:
        """Most bytes one reuse point's copy of the rows holds."""
        return sum(lay.snapshot_values(self.window) for lay in self.layers) * self.elem

    def bounded(self, new_tokens: int = 1) -> int:
        return self.fixed(new_tokens) + self.COPIES * self.point_copy()


def compact_need(hp, elem: int, mtp: bool = False) -> CompactNeed:
    """The slot figures of the ``GGUFHparams`` ``hp`` of a deepseek4 file at ``elem`` bytes a value; ``mtp``:
    with the MTP draft head's layer (``models/deepseek4_mtp.py``: a window layer, ratio 0)."""
    n = hp.n_main_layers
    ratios = [int(r) for r in (hp.stored(ExtraKeys.COMPRESS_RATIOS) or [0] * n)][:n] + ([0] if mtp else [])
    layers = tuple(layer_rows(int(hp.stored(Keys.Attention.KEY_LENGTH)),
                              int(hp.stored(Keys.Attention.Indexer.KEY_LENGTH) or 0), ratios))
    growth = sum(lay.entry_width * elem / lay.ratio for lay in layers if lay.ratio)
    return CompactNeed(int(-(-growth // 1)), layers, int(hp.sliding_window or 0), elem)
