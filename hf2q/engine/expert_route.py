"""The layout a mixture-of-experts feed-forward runs its expert products in.

**Per pair** (decode steps, short chunks, the CPU): ``gather_qmm`` of ``x [N, 1, 1, in]`` through ``idx [N, k]``, one
matrix-vector product per (token, expert) pair. MLX's CUDA ``gather_qmm`` runs that shape as N·k one-row products,
each reading its expert's whole matrix, so a 2,048-token prefill chunk of a 128-expert top-8 model reads every expert
matrix about 128 times over.

**Grouped** (many pairs on a GPU): the pairs sorted by expert into a padded slab ``[E, C, in]`` (``C`` the most pairs
one expert got, rounded up to :data:`CAPACITY_STEP` so few slab shapes are ever compiled), and one ``gather_qmm``
whose batch ``e`` is expert ``e``'s ``C`` rows: each expert matrix is read once per projection, by the tiled kernel.
The price is one host sync per layer (``C`` is read back from the device) and the padding rows' arithmetic.

``HF2Q_MOE_GROUPED=1`` groups every call (tests hold the two layouts within float32 rounding of each other on the
CPU), ``=0`` never.
"""

from __future__ import annotations

import os

import attrs
import mlx.core as mx

#: slab rows per expert come in multiples of this
CAPACITY_STEP = 16


def grouping(pairs: int, n_experts: int) -> bool:
    """Whether ``pairs`` (token, expert) pairs over ``n_experts`` experts run grouped."""
    forced = os.environ.get("HF2Q_MOE_GROUPED")
    if forced is not None:
        return forced == "1"
    return mx.default_device().type == mx.DeviceType.gpu and pairs >= max(256, 4 * n_experts)


@attrs.frozen
class ExpertRoute:
    """Where each (token, expert) pair of ``idx [N, k]`` goes: its slab row (``slots [N·k]``) and, for each slab row,
    the token feeding it (``tokens [E·C]``, ``N`` for a padding row); both None per pair."""

    idx: mx.array
    n_experts: int
    slots: mx.array | None = None
    tokens: mx.array | None = None
    capacity: int = 0

    @classmethod
    def of(cls, idx: mx.array, n_experts: int) -> "ExpertRoute":
        n, k = idx.shape
        if not grouping(n * k, n_experts):
            return cls(idx, n_experts)
        pairs = idx.reshape(-1).astype(mx.int32)
        counts = mx.zeros((n_experts,), mx.int32).at[pairs].add(mx.ones_like(pairs))
        capacity = int(counts.max().item())  # the one sync: the slab's shape
        capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
        order = mx.argsort(pairs)
        by_expert = pairs[order]
        starts = mx.cumsum(counts) - counts
        slot_sorted = by_expert * capacity + (mx.arange(n * k, dtype=mx.int32) - starts[by_expert])
        slots = mx.zeros((n * k,), mx.int32).at[order].add(slot_sorted)
        tokens = mx.full((n_experts * capacity,), n, mx.int32)
        tokens[slot_sorted] = order.astype(mx.int32) // k
        return cls(idx, n_experts, slots, tokens, capacity)

    @property
    def grouped(self) -> bool:
        return self.slots is not None

    def inputs(self, flat: mx.array) -> mx.array:
        """The experts' input from the tokens' rows ``flat [N, in]``."""
        if not self.grouped:
            return flat[:, None, None, :]
        padded = mx.concatenate([flat, mx.zeros((1, flat.shape[-1]), flat.dtype)])
        return padded[self.tokens].reshape(self.n_experts, self.capacity, flat.shape[-1])

    def apply(self, linear, x: mx.array) -> mx.array:
        """``linear`` (an expert-stacked weight ``[E, out, in]``) over inputs of this layout, in the same layout."""
        return linear.grouped(x) if self.grouped else linear.gather(x, self.idx)

    def outputs(self, y: mx.array) -> mx.array:
        """Expert outputs of this layout → ``[N, k, out]`` in the pairs' order."""
        n, k = self.idx.shape
        if not self.grouped:
            return y[:, :, 0, :]
        return y.reshape(-1, y.shape[-1])[self.slots].reshape(n, k, y.shape[-1])
