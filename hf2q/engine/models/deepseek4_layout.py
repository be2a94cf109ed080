"""How wide a DeepSeek-V4 slot cache is, from the hyper-parameters alone (no MLX: the memory plan and
``hf2q info`` read it before any model loads).

Each position of each layer stores rows in the layer's K and V buffers (``models/deepseek4_attention.py``):
K the raw K=V vector, then the compressor's projected row (two series at ratio 4, one at 128) and the
indexer's (two series); V the compressor's and the indexer's gate logits. Every layer's buffers have the
same ``heads × piece`` channels — pieces of gcd(head, indexer head) channels, as many as the widest row
needs — because one ``SequenceCache`` layout holds them all.
"""

from __future__ import annotations

import math

from hf2q.formats.gguf_keys import ExtraKeys, Keys


def row_widths(head_dim: int, index_dim: int, ratio: int) -> tuple[int, int]:
    """(K, V) channels a layer of compression ``ratio`` stores per position."""
    if ratio == 0:
        return head_dim, 0
    if ratio == 4:
        return 3 * head_dim + 2 * index_dim, 2 * head_dim + 2 * index_dim
    return 2 * head_dim, head_dim


def cache_shape(head_dim: int, index_dim: int, ratios: list[int]) -> tuple[int, int]:
    """``(heads, piece)`` of the buffers every layer's rows fit in."""
    piece = math.gcd(head_dim, index_dim) if 4 in ratios else head_dim
    widest = max(max(row_widths(head_dim, index_dim, r)) for r in ratios)
    return -(-widest // piece), piece


def kv_bytes_per_token(hp, elem: int) -> int:
    """K and V bytes one position costs over all layers, for the ``GGUFHparams`` ``hp`` of a deepseek4 file."""
    n = hp.n_layers
    ratios = [int(r) for r in (hp.stored(ExtraKeys.COMPRESS_RATIOS) or [0] * n)][:n]
    heads, piece = cache_shape(int(hp.stored(Keys.Attention.KEY_LENGTH)),
                               int(hp.stored(Keys.Attention.Indexer.KEY_LENGTH) or 1), ratios)
    return n * heads * piece * 2 * elem
