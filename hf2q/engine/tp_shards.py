"""The cuts every tensor-parallel split is made of: a GGUF tensor sliced along one axis in its stored block
form, the row-parallel layer that ends a split product in one all-reduce, and a rank's share of a routed
MoE's choices. Apart from
``tensor_parallel`` so that a family's own split (``models/deepseek4_tp.py``) uses them without importing
the module that dispatches to it."""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES

from hf2q.errors import InputError
from hf2q.formats.gguf_file import GGUFTensor


def _rows_view(t: GGUFTensor) -> np.ndarray:
    """The tensor's data as ``[..., out, row]`` where ``row`` is elements (float types) or bytes (blocks)."""
    return np.asarray(t.data).reshape(*t.shape[:-1], -1)


def slice_tensor(t: GGUFTensor, axis: int, start: int, stop: int) -> GGUFTensor:
    """``t`` restricted to ``[start, stop)`` along ``axis`` (of ``t.shape``), without dequantizing.

    Any axis but the last is a plain slice of whole rows. The last axis (the input
    columns of a weight) is cut in quant blocks and must be block-aligned.
    """
    nd = len(t.shape)
    axis = axis % nd
    if not 0 <= start < stop <= t.shape[axis]:
        raise ValueError(f"{t.name}: slice [{start}, {stop}) outside axis {axis} of {t.shape}")
    view = _rows_view(t)
    index: list[Any] = [slice(None)] * nd
    if axis < nd - 1:
        index[axis] = slice(start, stop)
    elif view.shape[-1] == t.shape[-1]:  # one element per column (F32/F16/BF16…)
        index[-1] = slice(start, stop)
    else:
        block, type_size = GGML_QUANT_SIZES[t.qtype]
        if start % block or stop % block:
            raise InputError(f"{t.name}: columns [{start}, {stop}) are not aligned to the {block}-element "
                             f"{t.qtype.name} blocks; this tensor-parallel size cannot split it")
        index[-1] = slice(start // block * type_size, stop // block * type_size)
    data = view[tuple(index)]
    shape = list(t.shape)
    shape[axis] = stop - start
    if len(shape) == 1:
        data = data.reshape(-1)
    return GGUFTensor(t.name, t.qtype, tuple(shape), data, int(data.nbytes))


def gather_ranges(t: GGUFTensor, axis: int, ranges: list[tuple[int, int]]) -> GGUFTensor:
    """``t`` restricted to the concatenation of ``ranges`` along ``axis`` (each cut as by :func:`slice_tensor`)."""
    parts = [slice_tensor(t, axis, a, b) for a, b in ranges]
    if len(parts) == 1:
        return parts[0]
    nd = len(t.shape)
    data_axis = -1 if axis % nd == nd - 1 else axis % nd
    data = np.concatenate([np.asarray(q.data) for q in parts], axis=data_axis)
    shape = list(t.shape)
    shape[axis] = sum(b - a for a, b in ranges)
    return GGUFTensor(t.name, t.qtype, tuple(shape), data, int(data.nbytes))


class RowParallel:
    """A row-parallel linear layer: the local partial product, then one ``all_sum`` over the group.

    A bias (if any) is added by rank 0 only, so the sum carries it exactly once.
    """

    def __init__(self, inner, group):
        import mlx.core as mx

        self.inner = inner
        self.group = group
        self._mx = mx
        if group.rank() != 0 and getattr(inner, "bias", None) is not None:
            inner.bias = None

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def params(self):
        return self.inner.params()

    def __call__(self, x):
        return self._mx.distributed.all_sum(self.inner(x), group=self.group)


def own_experts(idx, weights, first: int, n_local: int):
    """A rank's share of a routed MoE's choices ``idx`` / ``weights`` ``[N, k]`` (every rank routes alike):
    its experts ``[first, first + n_local)`` renumbered from 0, the others' weight 0 (and index 0, a valid one),
    so the ranks' weighted sums add up to the model's."""
    import mlx.core as mx

    local = idx - first
    mine = (local >= 0) & (local < n_local)
    return mx.where(mine, local, 0).astype(idx.dtype), mx.where(mine, weights, 0.0)
