"""Accumulating an importance matrix: for each weight matrix, Σ x² over every input column and the
number of input rows that went into the sums.

The definitions are llama-imatrix's (``tools/imatrix/imatrix.cpp`` in the llama.cpp sources), so
that a file we write means to llama-quantize what one of its own means:

* only weights named ``blk.*`` count (not the embedding, not ``output.weight``);
* a plain matrix product adds nothing when it multiplies fewer than :data:`MIN_ROWS` rows at once
  (llama.cpp's graph callback ignores such small batches); otherwise every row's squared values go
  into one sum per column and the row count into one counter;
* an expert-stacked product (``[E, out, in]``, the routed MoE projections) counts per expert: each
  (token, chosen expert) pair adds that token's input to the chosen expert's row of sums and one to
  that expert's counter, whatever the batch size. A projection whose input is shared by the chosen
  experts (gate/up) sees the same vector once per choice; down sees each choice's own input.

Sums are kept in float64 (llama.cpp keeps float32; the difference is far below what the file's
float32 holds) and handed out as float32, the counts as the float32 the file stores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hf2q.errors import InputError

#: llama-imatrix skips plain matrix products over fewer rows than this
MIN_ROWS = 16
#: only weights whose GGUF name starts with this are collected
COLLECTED_PREFIX = "blk."


@dataclass
class ImatrixEntry:
    """The running sums of one weight: ``sums [n_mat, n_in]`` float64, ``counts [n_mat]`` int64."""

    sums: np.ndarray
    counts: np.ndarray


class ImatrixCollector:
    """Receives matrix-product inputs from the engine's observer hook and keeps the sums."""

    def __init__(self):
        self.entries: dict[str, ImatrixEntry] = {}

    @staticmethod
    def wants(name: str | None) -> bool:
        return bool(name) and name.startswith(COLLECTED_PREFIX)

    def _entry(self, name: str, n_mat: int, n_in: int) -> ImatrixEntry:
        e = self.entries.get(name)
        if e is None:
            e = self.entries[name] = ImatrixEntry(np.zeros((n_mat, n_in)), np.zeros(n_mat, dtype=np.int64))
        elif e.sums.shape != (n_mat, n_in):
            raise InputError(f"imatrix: {name} was seen with {e.sums.shape[1]} inputs × {e.sums.shape[0]} "
                             f"matrices and now with {n_in} × {n_mat}")
        return e

    def dense(self, name: str, x: np.ndarray) -> None:
        """``x [..., n_in]``: the rows one product of the 2-D weight ``name`` multiplies."""
        if not self.wants(name):
            return
        rows = np.asarray(x).reshape(-1, np.shape(x)[-1])
        if rows.shape[0] < MIN_ROWS:
            return
        e = self._entry(name, 1, rows.shape[1])
        r = rows.astype(np.float64, copy=False)
        e.sums[0] += np.einsum("ij,ij->j", r, r)
        _check_finite(name, e.sums[0])
        e.counts[0] += rows.shape[0]

    def experts(self, name: str, x: np.ndarray, ids: np.ndarray, n_expert: int) -> None:
        """``x [N, S, n_in]`` (S = 1 when the chosen experts share the token's input, else S = k) and
        ``ids [N, k]``: the experts each of N tokens was routed to, for the stacked weight ``name``."""
        if not self.wants(name):
            return
        x = np.asarray(x)
        ids = np.asarray(ids).astype(np.int64, copy=False)
        n, k = ids.shape
        if x.ndim != 3 or x.shape[0] != n or x.shape[1] not in (1, k):
            raise ValueError(f"{name}: expert inputs {x.shape} do not match routing {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= n_expert):
            raise ValueError(f"{name}: routed expert id outside 0..{n_expert - 1}")
        e = self._entry(name, n_expert, x.shape[2])
        sq = np.square(x.astype(np.float64, copy=False))  # [N, S, n_in]
        if x.shape[1] == 1:
            sq = np.broadcast_to(sq, (n, k, x.shape[2]))
        flat_ids = ids.reshape(-1)
        order = np.argsort(flat_ids, kind="stable")
        sorted_ids = flat_ids[order]
        starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]]) if n else np.zeros(0, np.int64)
        if starts.size:
            rows = sq.reshape(n * k, -1)[order]
            e.sums[sorted_ids[starts]] += np.add.reduceat(rows, starts, axis=0)
            touched = np.unique(sorted_ids)
            _check_finite(name, e.sums[touched])
        e.counts += np.bincount(flat_ids, minlength=n_expert)

    def result(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``{name: (in_sum2 float32 [n_mat, n_in], counts float32 [n_mat])}``, names sorted."""
        return {name: (e.sums.astype(np.float32), e.counts.astype(np.float32))
                for name, e in sorted(self.entries.items())}


def _check_finite(name: str, values: np.ndarray) -> None:
    if not np.all(np.isfinite(values)):
        raise InputError(f"imatrix: the inputs of {name} are not finite (the model overflows on this text)")


__all__ = ["COLLECTED_PREFIX", "MIN_ROWS", "ImatrixCollector", "ImatrixEntry"]
