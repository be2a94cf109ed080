"""How much a tensor loses at each GGML type, measured with hf2q's own codecs on a row sample.

The error of a tensor at a type is the importance-weighted squared error of its quantized
rows relative to the weighted energy of the rows themselves,

    e(q) = Σ_rows Σ_j w_j (x_j − x̂_j)² / Σ_rows Σ_j w_j x_j²

with ``w`` the tensor's imatrix entry (the mean squared activation feeding column ``j``; each
expert its own) or 1 without one. For a linear layer that is the relative power of the noise
the quantization adds to its output (activations taken as uncorrelated), so it compares
across tensors of any scale. The rows are first rounded to float16, as llama.cpp quantizes
from its F16 export, and quantized with the same weights the conversion will use.
"""

from __future__ import annotations

from collections.abc import Sequence

import gguf
import numpy as np

from hf2q.ggml import codec

T = gguf.GGMLQuantizationType
SAMPLE_ELEMENTS = 1 << 16  # values per tensor measured (whole rows, spread over the tensor)
SAMPLE_RUNS = 8  # the sample is read as this many runs of consecutive rows


def sample_row_ranges(n_rows: int, ncols: int) -> list[tuple[int, int]]:
    """Row ranges ``[lo, hi)`` spread evenly over the tensor, about ``SAMPLE_ELEMENTS`` values in all."""
    want = max(1, min(n_rows, SAMPLE_ELEMENTS // max(1, ncols)))
    runs = min(SAMPLE_RUNS, want)
    per = -(-want // runs)
    starts = np.linspace(0, max(0, n_rows - per), runs).astype(np.int64)
    out: list[tuple[int, int]] = []
    for s in starts.tolist():
        lo, hi = int(s), min(n_rows, int(s) + per)
        if out and lo < out[-1][1]:
            lo = out[-1][1]
        if lo < hi:
            out.append((lo, hi))
    return out


def relative_errors(rows: np.ndarray, row_ids: np.ndarray, qtypes: Sequence[T],
                    weights: np.ndarray | None = None, rows_per_expert: int = 0) -> dict[T, float]:
    """``e(q)`` for each type over ``rows`` (float32 ``[n, ncols]``, tensor rows ``row_ids``).

    ``weights``: ``[n_expert, ncols]`` imatrix rows; row ``r`` uses expert ``r // rows_per_expert``."""
    x = rows.astype(np.float16).astype(np.float32)
    if weights is None:
        groups = [(np.arange(x.shape[0]), None)]
    else:
        experts = row_ids // max(1, rows_per_expert) if weights.shape[0] > 1 else np.zeros_like(row_ids)
        groups = [(np.flatnonzero(experts == e), weights[e]) for e in np.unique(experts).tolist()]
    out: dict[T, float] = {}
    for q in qtypes:
        num = den = 0.0
        for idx, w in groups:
            xs = x[idx]
            if q in (T.F16, T.F32):
                y = xs
            else:
                y = codec.dequantize(codec.quantize(xs, q, threads=1, imatrix=w), q, xs.shape)
            ww = np.ones(xs.shape[1], dtype=np.float64) if w is None else w.astype(np.float64)
            d = (xs.astype(np.float64) - y) ** 2
            num += float((d * ww).sum())
            den += float((xs.astype(np.float64) ** 2 * ww).sum())
        out[q] = num / den if den > 0 else 0.0
    return out
