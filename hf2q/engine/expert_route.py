"""The layout a mixture-of-experts feed-forward runs its expert products in.

**Per pair** (a GPU's decode steps and short chunks): ``gather_qmm`` of ``x [N, 1, 1, in]`` through ``idx [N, k]``, one
matrix-vector product per (token, expert) pair. MLX's CUDA ``gather_qmm`` runs that shape as N·k one-row products,
each reading its expert's whole matrix, so a 2,048-token prefill chunk of a 128-expert top-8 model reads every expert
matrix about 128 times over.

**Grouped** (many pairs on a GPU): the pairs sorted by expert into a padded slab ``[E, C, in]`` (``C`` the most pairs
one expert got, rounded up to :data:`CAPACITY_STEP` so few slab shapes are ever compiled), and one ``gather_qmm``
whose batch ``e`` is expert ``e``'s ``C`` rows: each expert matrix is read once per projection, by the tiled kernel.
The price is one host sync per layer (``C`` is read back from the device) and the padding rows' arithmetic.

**Sorted on the host** (the CPU, every call): the pairs sorted by expert in numpy, each expert's run of rows through
one C kernel call per projection (``Linear.segments``: the quantized matvec kernel over each expert's own rows; float
experts through MLX's gather product one row a pair). MLX's CPU ``gather_qmm`` is many times slower; here each
expert matrix is streamed once per projection and each output row is the sum the kernel gives that row alone, so a
decode step and a prefill chunk agree bit for bit. The imatrix observer (which watches per-pair products) keeps the
per-pair layout.

``HF2Q_MOE_GROUPED=1`` groups every call (tests hold the layouts within float32 rounding of each other on the
CPU), ``=0`` runs every call per pair; either turns the host layout off.
"""

from __future__ import annotations

import os

import attrs
import mlx.core as mx
import numpy as np

#: slab rows per expert come in multiples of this
CAPACITY_STEP = 16


def sorting_on_host() -> bool:
    """Whether the pairs run sorted on the host (the CPU with its C kernels, no layout forced, no observer)."""
    from hf2q.engine import layers

    if os.environ.get("HF2Q_MOE_GROUPED") is not None or layers._observer is not None or not layers.on_cpu():
        return False
    from hf2q.kernels import cpu_qmatvec

    return cpu_qmatvec.kernel() is not None


@attrs.frozen
class HostSort:
    """The pairs of ``idx [N, k]`` in expert order: ``order`` the pair numbers (token·k + slot) sorted by expert,
    stably, and the runs of that order each expert takes (experts without pairs left out)."""

    order: np.ndarray
    experts: list[int]
    starts: list[int]
    counts: list[int]

    @classmethod
    def of(cls, idx: np.ndarray, n_experts: int) -> "HostSort":
        pairs = idx.reshape(-1)
        order = np.argsort(pairs, kind="stable")
        counts = np.bincount(pairs, minlength=n_experts)
        experts = np.flatnonzero(counts)
        starts = np.cumsum(counts) - counts
        return cls(order, experts.tolist(), starts[experts].tolist(), counts[experts].tolist())


def host_glu(x: np.ndarray, sort: HostSort, k: int, weights: np.ndarray, gate_up, down, ops, kind: int) -> np.ndarray:
    """``[N, out]`` float32: rows ``x [N, in]`` through the gated experts of their pairs (``sort`` of ``[N, k]``
    choices), summed by ``weights [N, k]``, on the host: the pairs' rows gathered in expert order, ``gate_up``
    (a ``cpu_qmatvec.ExpertStack`` giving ``[gate | up]``) and ``down`` in one segment call each, the gated
    activation ``kind`` (0 SiLU, 1 tanh-GELU) of ``cpu_decode_ops.glu`` between them."""
    xs = np.ascontiguousarray(x[sort.order // k])
    gu = gate_up(xs, sort.experts, sort.starts, sort.counts)
    ff = gu.shape[1] // 2
    h = np.empty((xs.shape[0], ff), np.float32)
    ops.glu(gu.ctypes.data, h.ctypes.data, xs.shape[0], ff, kind)
    y = down(h, sort.experts, sort.starts, sort.counts)
    pairs = np.empty_like(y)
    pairs[sort.order] = y
    pairs = pairs.reshape(x.shape[0], k, -1)
    out = pairs[:, 0] * weights[:, :1]
    for j in range(1, k):  # slot by slot (an einsum's path, hence its rounding, depends on the row count)
        out += pairs[:, j] * weights[:, j:j + 1]
    return out


def grouping(pairs: int, n_experts: int) -> bool:
    """Whether ``pairs`` (token, expert) pairs over ``n_experts`` experts run grouped."""
    forced = os.environ.get("HF2Q_MOE_GROUPED")
    if forced is not None:
        return forced == "1"
    return mx.default_device().type == mx.DeviceType.gpu and pairs >= max(256, 4 * n_experts)


@attrs.frozen
class ExpertRoute:
    """Where each (token, expert) pair of ``idx [N, k]`` goes: grouped, its slab row (``slots [N·k]``) and, for each
    slab row, the token feeding it (``tokens [E·C]``, ``N`` for a padding row); sorted on the host, ``host``; per
    pair, none of them."""

    idx: mx.array
    n_experts: int
    slots: mx.array | None = None
    tokens: mx.array | None = None
    capacity: int = 0
    host: HostSort | None = None

    @classmethod
    def of(cls, idx: mx.array, n_experts: int) -> "ExpertRoute":
        n, k = idx.shape
        if sorting_on_host():
            return cls(idx, n_experts, host=HostSort.of(np.array(idx).astype(np.int64), n_experts))
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

    def glu(self, flat: mx.array, gate_up: "list", down, act, weights: mx.array) -> mx.array:
        """The routed experts' weighted sum ``[N, out]`` of ``down(act(gate·x) · up·x)`` for the tokens' rows
        ``flat [N, in]``, ``gate_up`` the two expert stacks or one fused ``[gate | up]`` stack, ``weights [N, k]``.
        On the host layout with C kernels for every part, one pass on the host (:func:`host_glu`); else the
        layout's products with the activation and the sum in MLX."""
        if self.host is not None:
            from hf2q.engine.layers import gelu_tanh, host_rows, silu
            from hf2q.kernels import cpu_decode_ops

            kind = {silu: 0, gelu_tanh: 1}.get(act)
            stack, down_stack = gate_up[0].expert_stack(*gate_up[1:]), down.expert_stack()
            ops = cpu_decode_ops.library() if kind is not None else None
            if stack is not None and down_stack is not None and ops is not None:
                y = host_glu(host_rows(flat.astype(mx.float32)), self.host, self.idx.shape[1],
                             np.array(weights.astype(mx.float32)), stack, down_stack, ops, kind)
                return mx.array(y).astype(flat.dtype)
        xe = self.inputs(flat)
        if len(gate_up) == 2:
            g, u = self.apply(gate_up[0], xe), self.apply(gate_up[1], xe)
        else:
            gu = self.apply(gate_up[0], xe)
            g, u = gu[..., :gu.shape[-1] // 2], gu[..., gu.shape[-1] // 2:]
        out = self.outputs(self.apply(down, act(g) * u))  # [N, k, out]
        return (out * weights[..., None].astype(out.dtype)).sum(axis=1)

    @property
    def grouped(self) -> bool:
        return self.slots is not None

    def inputs(self, flat: mx.array) -> mx.array:
        """The experts' input from the tokens' rows ``flat [N, in]``."""
        if self.host is not None:
            from hf2q.engine.layers import host_rows

            k = self.idx.shape[1]
            return mx.array(host_rows(flat.astype(mx.float32))[self.host.order // k])
        if not self.grouped:
            return flat[:, None, None, :]
        padded = mx.concatenate([flat, mx.zeros((1, flat.shape[-1]), flat.dtype)])
        return padded[self.tokens].reshape(self.n_experts, self.capacity, flat.shape[-1])

    def apply(self, linear, x: mx.array) -> mx.array:
        """``linear`` (an expert-stacked weight ``[E, out, in]``) over inputs of this layout, in the same layout."""
        if self.host is not None:
            from hf2q.engine.layers import host_rows

            h = self.host
            y = mx.array(linear.segments(host_rows(x.astype(mx.float32)), h.experts, h.starts, h.counts))
            return y if linear.dtype == mx.float32 else y.astype(linear.dtype)
        return linear.grouped(x) if self.grouped else linear.gather(x, self.idx)

    def outputs(self, y: mx.array) -> mx.array:
        """Expert outputs of this layout → ``[N, k, out]`` in the pairs' order."""
        n, k = self.idx.shape
        if self.host is not None:
            from hf2q.engine.layers import host_rows

            out = np.empty((n * k, y.shape[-1]), np.float32)
            out[self.host.order] = host_rows(y.astype(mx.float32))
            out = mx.array(out.reshape(n, k, -1))
            return out if y.dtype == mx.float32 else out.astype(y.dtype)
        if not self.grouped:
            return y[:, :, 0, :]
        return y.reshape(-1, y.shape[-1])[self.slots].reshape(n, k, y.shape[-1])
