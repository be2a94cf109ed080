"""What each ``--kv-cache-type`` costs per stored row, without MLX (memory planning, ``info`` and the
CLI read it in processes that never load a model; ``kv_quant`` stores the rows)."""

from __future__ import annotations

import numpy as np

from hf2q.errors import InputError

#: what ``--kv-cache-type`` accepts; ``f16`` is the compute dtype's own cache (float32 on the CPU)
KV_CACHE_TYPES = ("f16", "q8", "q8-rotated")
#: values sharing one scale in an 8-bit row (a shorter row is one group)
GROUP = 64
#: families whose attention does not read an 8-bit cache (deepseek4: its cache rows are compressor
#: and indexer state, not K/V heads)
NO_QUANTIZED_KV = frozenset({"deepseek4"})


#: ``export_kv`` of an 8-bit cache: ``k.{i}`` / ``v.{i}`` are the codes themselves (uint8, the
#: row's values in ``[1, 255]``), and ``k.{i}`` + this suffix their scales (float32 host copies)
SCALES_SUFFIX = ".scales"
#: an exported block's tensors holding the state its end needs beside the K/V (a recurrent state,
#: a compact cache's rows): the persistent store keeps them lossless (``kvstore/blockfile.py``)
END_STATE_PREFIX = "state."
#: the end-state tensor of a block of a sequence that feeds an MTP draft head: the main model's
#: final-normed hidden row before the block's end, the head's input for the next token
HIDDEN_STATE = END_STATE_PREFIX + "hidden"


def has_end_state(names) -> bool:
    """Whether an exported block's tensor ``names`` carry the state its end needs."""
    return any(name.startswith(END_STATE_PREFIX) for name in names)


def group_size(width: int) -> int:
    return min(GROUP, width)


def row_nbytes(kv_type: str, width: int, elem: int) -> int:
    """Bytes of one stored K or V row of ``width`` values at ``elem`` bytes a compute value:
    the values themselves, or one byte each plus one scale (compute dtype) per group."""
    if kv_type == "f16":
        return width * elem
    return width + (width // group_size(width)) * elem


def check_kv_type(kv_type: str, widths, family: str) -> None:
    """``InputError`` (one line) when caches of rows ``widths`` cannot be stored as ``kv_type``."""
    if kv_type not in KV_CACHE_TYPES:
        raise InputError(f"--kv-cache-type must be one of {', '.join(KV_CACHE_TYPES)}, not {kv_type!r}")
    if kv_type != "f16" and family in NO_QUANTIZED_KV:
        raise InputError(f"--kv-cache-type {kv_type} is not supported for {family} yet (use f16)")
    for d in sorted(set(widths)):
        if kv_type != "f16" and d % 32:
            raise InputError(f"--kv-cache-type {kv_type}: {family} has head size {d}, not a multiple of 32")
        if kv_type == "q8-rotated" and d & (d - 1):
            raise InputError(f"--kv-cache-type q8-rotated needs a power-of-two head size; {family} has {d} "
                             "(use q8)")


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester–Hadamard matrix of order ``n`` (a power of two), float64; symmetric,
    so it is its own inverse."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"no Hadamard matrix of order {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)
