"""Per-conversation KV caches and the batch context of one forward pass.

A :class:`SequenceCache` belongs to one slot: per layer a K and a V buffer
``[kv_heads, capacity, head_dim]`` grown in steps of ``GROW`` tokens, and ``length``,
the number of valid positions. ``trim(n)`` keeps a token prefix (prefix reuse) and
gives back capacity beyond it. ``nbytes`` is what is allocated, so the scheduler's
shared byte budget can count it; ``bytes_per_token`` is the static figure it plans with.

A :class:`ForwardBatch` describes one forward: either one sequence advancing by T
tokens (prefill) or N sequences advancing by one token each (batched decode). It writes
the new K/V into each cache and hands attention the keys/values to attend over plus a
boolean mask: causal within the chunk, padding beyond each sequence's own length in a
batch, and the sliding window for local-attention layers.

With ``--kv-cache-type q8|q8-rotated`` a cache has a codec (``kv_quant.KvCodec``) and each layer's
buffer is a tuple of planes — 8-bit codes and their scales, the same ``[kv_heads, capacity, ·]`` layout —
that every operation below applies to plane by plane (``_each``), so growth, trims, windows, snapshots
and stacked batches hold 8-bit rows exactly as they hold float ones; ``update`` then returns the planes.

Hybrid models (qwen35) also give each sequence a :class:`RecurrentState`: for every
linear-attention layer the last ``K − 1`` conv inputs and the delta-rule matrix, which
summarise the whole history and cannot be cut back token by token. It is a separate part
of the cache, beside the K/V of the full-attention layers. It keeps the state before the
last forward (the decode pipeline's one-position rollback) and reuse points: the state every
``CHECKPOINT_INTERVAL`` tokens and at the end of every prefill transaction, so a later prompt
that diverges inside the history restarts from the last point before the divergence.
``trim`` to any other earlier position raises :class:`PrefixNotReusable` rather than leaving K/V
and recurrent state out of step. For the persistent KV store (``keep_block_ends``) the state is also
captured at every block end a prompt's prefill reaches, while the forward still has it, and a block's
export carries it: its K/V plus, where its end was captured, ``state.conv.{j}`` / ``state.ssm.{j}`` (and, for a
sequence that feeds an MTP draft head, ``state.hidden``: the main model's hidden row the head reads next).

Sliding-window models (gemma4, gemma3's local layers off the CPU host step) give each sequence a :class:`SlidingWindow`: its window layers keep
only the positions a later query or a kept reuse point can see, so their K/V stays bounded. The
points are placed by the same :class:`~hf2q.engine.recurrent_policy.ReusePoints`; a prompt end that
ages out of them keeps a copy of its window (docs/ENGINE.md, "Sliding-window layers"). For the persistent
store the same ``keep_block_ends`` captures the window layers' last rows at each block end a prompt's
prefill reaches, and a block's export carries the full layers' K/V plus, where captured, ``state.k.{i}`` /
``state.v.{i}``.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple, Sequence

import mlx.core as mx
import numpy as np

from hf2q.engine.kv_layout import END_STATE_PREFIX, HIDDEN_STATE, has_end_state
from hf2q.engine.kv_quant import KvCodec
from hf2q.engine.recurrent_policy import (BLOCK_ENDS_KEPT, CHECKPOINT_INTERVAL, CHECKPOINTS_KEPT, KV_GROW,
                                          WINDOW_POINTS_KEPT, WINDOW_SNAPSHOTS_KEPT, ReusePoints, block_ends_reached,
                                          keep_newest, room_for)

GROW = KV_GROW


_VERSIONS = itertools.count(1)  # unique across all caches, so (cache, version) never repeats


class PrefixNotReusable(ValueError):
    """A prefix operation a recurrent state cannot honour (trim to an earlier position, KV export/import)."""






class BlockEnd(NamedTuple):
    """What a recurrent sequence keeps at a captured block end until that block is exported: the state there
    and, for a sequence that feeds an MTP draft head, the main model's final-normed hidden row before the
    end, which the head pairs with the block's next token (``qwen35_mtp``); None for a sequence without."""

    conv: list
    ssm: list
    hidden: mx.array | None = None


class RecurrentState:
    """Per-sequence state of the recurrent layers: conv windows ``[K − 1, channels]`` (compute dtype)
    and delta-rule matrices ``[value heads, value dim, key dim]`` (float32), one per recurrent layer.

    ``None`` stands for the zero state of a fresh sequence. MLX arrays are never written in place,
    so a checkpoint is a list of references, not a copy. Two kinds are kept:

    * the *rollback* state before the last forward (the decode pipeline's one-position undo);
    * *reuse points*: the state at every multiple of ``interval`` tokens and at the end of every
      prefill forward (a transaction, so the end of each prompt), the newest ``keep`` of them — the
      positions a later prompt that diverges inside this history can restart from;
    * *verify states*: after a speculative verify forward, the state after each of its tokens, so the
      sequence can stop at the last accepted one; they live until the next forward or trim.

    ``hidden`` is not recurrent state but lives beside it for the same models: ``(first position,
    rows [n, d])``, the main model's final-normed hidden rows the last forward leaves (its last two; a
    verify's every row and the one before), which a multi-token-prediction draft head reads
    (``engine/models/qwen35_mtp.py``).
    """

    def __init__(self, n_layers: int, conv_shape: tuple[int, int], ssm_shape: tuple[int, int, int], dtype,
                 interval: int = CHECKPOINT_INTERVAL, keep: int = CHECKPOINTS_KEPT):
        self.n_layers = n_layers
        self.conv_shape, self.ssm_shape, self.dtype = tuple(conv_shape), tuple(ssm_shape), dtype
        self.interval, self.keep = interval, keep
        self.conv: list[mx.array | None] = [None] * n_layers
        self.ssm: list[mx.array | None] = [None] * n_layers
        #: (length, conv, ssm) before the last forward, or None
        self._checkpoint: tuple[int, list, list] | None = None
        #: length → (conv, ssm) per layer at that length
        self.points = ReusePoints(interval, keep)
        #: length → (conv, ssm) per layer inside the last verify forward
        self.verify_states: dict[int, tuple[list, list]] = {}
        self.hidden: tuple[int, mx.array] | None = None
        #: the persistent store's block size (``SequenceCache.keep_block_ends``), None when off
        self.block_tokens: int | None = None
        #: length → what the prompt block ends reached and not exported yet keep (:class:`BlockEnd`)
        self.block_ends: dict[int, BlockEnd] = {}
        #: a sequence that feeds an MTP draft head (``MlxModelRunner.new_sequence``): its block ends keep
        #: the head's input row too, and its blocks are ``recurrent-mtp``
        self.feeds_head = False
        #: ``(first position, rows)``: every hidden row of the prompt forward in progress (the head's
        #: ``store``), which its block-end captures take their row from; None outside such a forward
        self.prompt_rows: tuple[int, mx.array] | None = None

    @property
    def state_nbytes(self) -> int:
        """One copy of the state (every recurrent layer's conv window and matrix)."""
        per_layer = math.prod(self.conv_shape) * self.dtype.size + math.prod(self.ssm_shape) * 4
        return self.n_layers * per_layer

    @property
    def nbytes(self) -> int:
        """The live state plus the reuse points and block ends held, with the head's input rows kept at those
        ends (the rollback state shares arrays with them or lives one forward only)."""
        extra = sum(1 for n in self.block_ends if n not in self.points)
        rows = sum(e.hidden.nbytes for e in self.block_ends.values() if e.hidden is not None)
        return (1 + len(self.points) + extra) * self.state_nbytes + rows

    def checkpoint(self, length: int) -> None:
        """Remember the state at ``length`` tokens (called before each forward)."""
        self._checkpoint = (length, list(self.conv), list(self.ssm))
        self.verify_states = {}

    def checkpoint_length(self) -> int | None:
        return None if self._checkpoint is None else self._checkpoint[0]

    def restore(self) -> None:
        length, self.conv, self.ssm = self._checkpoint
        self._checkpoint = None
        self.verify_states = {}
        self._drop_after(length)

    def reset(self) -> None:
        self.conv, self.ssm = [None] * self.n_layers, [None] * self.n_layers
        self._checkpoint = None
        self.verify_states = {}
        self.hidden = None
        self.points.clear()
        self.block_ends.clear()
        self.prompt_rows = None

    def _drop_after(self, length: int) -> None:
        self.points.drop_after(length)
        for n in [n for n in self.block_ends if n > length]:
            del self.block_ends[n]

    def add_point(self, length: int, conv: list, ssm: list, prompt: bool = False) -> None:
        """Keep the state at ``length`` as a reuse point (the oldest beyond ``keep`` is dropped); a
        ``prompt`` forward's point at a block end is also captured for the persistent store (with the head's
        input row there, copied out of the forward's rows)."""
        self.points.add(length, (list(conv), list(ssm)))
        if prompt and self.block_tokens and length % self.block_tokens == 0:
            hidden = kept_row_before(self.prompt_rows, length) if self.feeds_head else None
            self.block_ends[length] = BlockEnd(list(conv), list(ssm), hidden)
            keep_newest(self.block_ends, BLOCK_ENDS_KEPT)

    def state_at(self, length: int, current: int) -> tuple[list, list] | None:
        """(conv, ssm) at ``length`` if this still holds it (``current`` is the sequence's length)."""
        if length == current:
            return self.conv, self.ssm
        if length in self.block_ends:
            return self.block_ends[length][:2]
        return self.points[length] if length in self.points else None

    def hidden_at(self, length: int) -> mx.array | None:
        """The main model's hidden row before ``length`` (an MTP head's input there) if this still holds it."""
        row = row_before(self.hidden, length)
        if row is None and length in self.block_ends:
            row = self.block_ends[length].hidden
        return row

    def due_points(self, start: int, n_new: int) -> list[int]:
        return self.points.due(start, n_new)

    def restore_point(self, length: int) -> None:
        conv, ssm = self.points[length]
        self.conv, self.ssm = list(conv), list(ssm)
        self._checkpoint = None
        self.verify_states = {}
        self._drop_after(length)

    def restore_verified(self, length: int) -> None:
        """Stop inside the last verify forward, after its token at ``length`` (the rollback state then
        stays the one before that forward: it is still an earlier state of this history)."""
        self.conv, self.ssm = (list(a) for a in self.verify_states[length])
        self.verify_states = {}
        self._drop_after(length)

    def batched(self, caches: Sequence["SequenceCache"], layer: int) -> tuple[mx.array, mx.array]:
        """Layer ``layer``'s states of ``caches`` stacked: conv ``[B, K − 1, C]``, ssm ``[B, Hv, Dv, Dk]``."""
        conv = [c.recurrent.conv[layer] for c in caches]
        ssm = [c.recurrent.ssm[layer] for c in caches]
        if len(caches) == 1:
            return (conv[0][None] if conv[0] is not None else mx.zeros((1, *self.conv_shape), dtype=self.dtype),
                    ssm[0][None] if ssm[0] is not None else mx.zeros((1, *self.ssm_shape), dtype=mx.float32))
        return (mx.stack([a if a is not None else mx.zeros(self.conv_shape, dtype=self.dtype) for a in conv]),
                mx.stack([a if a is not None else mx.zeros(self.ssm_shape, dtype=mx.float32) for a in ssm]))

    def arrays(self) -> list[mx.array]:
        hidden = [self.hidden[1]] if self.hidden is not None else []
        return [a for a in self.conv + self.ssm if a is not None] + hidden


def own_copy(a: mx.array) -> mx.array:
    """``a`` in a buffer of its own (a slice or view would keep its whole source alive)."""
    return a + mx.zeros((), dtype=a.dtype)


def row_before(kept: tuple[int, mx.array] | None, position: int) -> mx.array | None:
    """The row of position ``position − 1`` in ``kept`` (the position of its first row, rows ``[n, …]``: the
    hidden rows the last forward left for an MTP head), None where it holds none."""
    if kept is None or position < 1 or not 0 <= position - 1 - kept[0] < kept[1].shape[0]:
        return None
    return kept[1][position - 1 - kept[0]]


def kept_row_before(kept: tuple[int, mx.array] | None, position: int) -> mx.array | None:
    """:func:`row_before` as a captured block end keeps it: in a buffer of its own, evaluated (not a view
    holding the whole forward's rows)."""
    row = row_before(kept, position)
    if row is not None:
        row = own_copy(row)
        mx.eval(row)
    return row


class SlidingWindow:
    """Where a sequence's sliding-window layers keep their K/V: only the positions a later query or a
    kept reuse point can still see.

    Their buffers ``[kv_heads, capacity, head_dim]`` hold positions ``[base, base + capacity)``;
    ``base`` moves forward in whole ``GROW`` steps (before a forward, :meth:`SequenceCache.reserve`)
    to the first position the window of the oldest of ``min(points)`` and ``length − 1`` needs, so a
    slot's window K/V stays bounded (``recurrent_policy.window_positions``) however long its context.
    Keys are stored after RoPE at their absolute positions, so attention over the kept positions is
    exact; the mask gives each kept key its position (``ForwardBatch.mask_np``).

    A transaction end (a prompt's end) that ages out of ``points`` is kept as a *snapshot*: a copy of
    the window before it, ``snapshots[length] = (first position, keys, values)`` per window layer, the
    newest ``snapshots_kept``; ``trim`` to it puts the copy back as the buffer.

    For the persistent store (``block_tokens`` set, ``SequenceCache.keep_block_ends``) a prompt's prefill
    also copies the last ``size`` rows before every block end it reaches (``block_ends``, the same form
    as a snapshot): after the request the buffer has let go of them, and a block restored without them
    could not continue.
    """

    #: the payload marking a point that ends a prefill transaction
    TRANSACTION_END = "end"

    def __init__(self, size: int, layers: frozenset[int], interval: int = CHECKPOINT_INTERVAL,
                 keep: int = WINDOW_POINTS_KEPT, snapshots_kept: int = WINDOW_SNAPSHOTS_KEPT):
        self.size = size
        self.layers = frozenset(layers)
        self.base = 0
        self.capacity = 0
        self.points = ReusePoints(interval, keep)
        self.snapshots: dict[int, tuple[int, dict[int, mx.array], dict[int, mx.array]]] = {}
        self.snapshots_kept = snapshots_kept
        #: the persistent store's block size (``SequenceCache.keep_block_ends``), None when off
        self.block_tokens: int | None = None
        #: length → (first position, keys, values) at the prompt block ends reached and not exported yet
        self.block_ends: dict[int, tuple[int, dict[int, mx.array], dict[int, mx.array]]] = {}

    @property
    def snapshot_positions(self) -> int:
        """Positions held in copies beside the buffer: the snapshots and the captured block ends."""
        return sum(n - first for held in (self.snapshots, self.block_ends) for n, (first, _, _) in held.items())

    def first_needed(self, length: int) -> int:
        """The first position the buffer must keep at ``length``: the window of ``length − 1`` (the
        decode pipeline's one-position rollback) and of every kept point."""
        oldest = min([max(length - 1, 0), *self.points])
        return max(0, oldest - self.size + 1)

    def wants_move(self, length: int) -> bool:
        """Whether the buffer's first position would move forward at ``length`` (whole ``GROW`` steps)."""
        return (self.first_needed(length) // GROW) * GROW > self.base

    def reachable(self, length: int) -> bool:
        """Whether the next query at ``length`` finds every key of its window still kept."""
        return max(0, length - self.size + 1) >= self.base


def _planes(buf) -> tuple[mx.array, ...]:
    """A buffer's arrays: itself (a float cache), or its codes and scales (``kv_quant``)."""
    return buf if isinstance(buf, tuple) else (buf,)


def _each(fn, *bufs):
    """``fn`` applied to the matching arrays of ``bufs``, keeping their structure."""
    if isinstance(bufs[0], tuple):
        return tuple(fn(*arrays) for arrays in zip(*bufs))
    return fn(*bufs)


def _write(buf, at: int, new) -> None:
    """Positions ``[at, at + n)`` of ``buf [heads, capacity, ·]`` set to ``new [heads, n, ·]`` in place."""
    for dst, src in zip(_planes(buf), _planes(new)):
        dst[:, at:at + src.shape[1], :] = src


class SequenceCache:
    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, dtype, v_head_dim: int | None = None,
                 recurrent: RecurrentState | None = None, window: SlidingWindow | None = None,
                 codec: KvCodec | None = None):
        self.n_layers = n_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.dtype = dtype
        #: how K/V rows are stored: None keeps them in ``dtype``; a codec keeps 8-bit codes + scales
        self.codec = codec
        self._keys: list[mx.array | None] = [None] * n_layers
        self._values: list[mx.array | None] = [None] * n_layers
        #: positions the layers that keep every position have room for
        self.capacity = 0
        self._length = 0
        #: changes whenever a K/V buffer array is replaced (grown, trimmed, written through MLX), so
        #: host code holding buffer addresses knows when to fetch them again
        self.version = next(_VERSIONS)
        #: the :class:`StackedDecode` holding this sequence's K/V, while one does
        self._stack: StackedDecode | None = None
        #: the recurrent layers' state (hybrid models), None for pure attention models
        self.recurrent = recurrent
        #: the sliding-window layers' K/V (kept to the window), None when every layer keeps every position
        self.window = window
        #: :meth:`reuse_points` as of the last forward or trim: an immutable copy the serving runtime's
        #: trio side may read while the engine thread runs the next step
        self.published_points: tuple[int, ...] | None = None if recurrent is None and window is None else (0,)
        #: a hybrid sequence imported up to a block without the recurrent state at its end (``import_``)
        self._awaiting_state = False

    @property
    def length(self) -> int:
        return self._length

    @property
    def keys(self) -> list[mx.array | None]:
        """Per layer ``[kv_heads, capacity, head_dim]`` (taking the sequence out of a stacked batch first);
        a sliding-window layer's buffer starts at position ``window.base``."""
        self.unstack()
        return self._keys

    @property
    def values(self) -> list[mx.array | None]:
        self.unstack()
        return self._values

    @property
    def stacked(self) -> bool:
        return self._stack is not None

    def unstack(self) -> None:
        """Give the K/V held by a stacked decode batch back to every sequence of that batch."""
        if self._stack is not None:
            self._stack.dissolve()

    def _full_layers(self) -> range | list[int]:
        if self.window is None:
            return range(self.n_layers)
        return [i for i in range(self.n_layers) if i not in self.window.layers]

    @property
    def position_bytes(self) -> int:
        """K/V bytes of one position in one layer."""
        if self.codec is not None:
            return self.kv_heads * (self.codec.row_nbytes(self.head_dim) + self.codec.row_nbytes(self.v_head_dim))
        return self.kv_heads * (self.head_dim + self.v_head_dim) * self.dtype.size

    def empty(self, lead: tuple[int, ...], capacity: int, width: int):
        """A zeroed buffer ``[*lead, capacity, width]`` in this cache's storage (planes for a codec)."""
        if self.codec is None:
            return mx.zeros((*lead, capacity, width), dtype=self.dtype)
        return tuple(mx.zeros((*lead, capacity, w), dtype=t) for w, t in self.codec.planes(width))

    @property
    def bytes_per_token(self) -> int:
        """K/V bytes one more token of context costs: the layers that keep every position."""
        return len(self._full_layers()) * self.position_bytes

    @property
    def window_nbytes(self) -> int:
        """K/V allocated for the sliding-window layers (bounded, whatever the length)."""
        if self.window is None:
            return 0
        return len(self.window.layers) * (self.window.capacity + self.window.snapshot_positions) * self.position_bytes

    @property
    def nbytes(self) -> int:
        """K/V allocated, plus the recurrent state once it exists (its checkpoint shares its arrays)."""
        rec = self.recurrent.nbytes if self.recurrent is not None and self._length else 0
        return self.capacity * self.bytes_per_token + self.window_nbytes + rec

    def reserve(self, n_tokens: int, importing: bool = False) -> None:
        """Make room for at least ``n_tokens`` positions (keeps the contents); a window's buffer first
        lets go of the positions no query or kept point needs any more."""
        if self._awaiting_state and not importing:
            raise PrefixNotReusable(f"this {self.persist_kind} sequence was restored up to a block without its "
                                    "end state; import up to a block with one, or trim it first")
        self.unstack()
        if self.window is not None and not importing:  # an import puts its window rows in itself
            self._reserve_window(n_tokens)
        if n_tokens <= self.capacity:
            return
        new_cap = room_for(n_tokens)
        for i in self._full_layers():
            for store, d in ((self._keys, self.head_dim), (self._values, self.v_head_dim)):
                grown = self.empty((self.kv_heads,), new_cap, d)
                if store[i] is not None and self._length:
                    _write(grown, 0, _each(lambda a: a[:, : self._length, :], store[i]))
                store[i] = grown
        self.capacity = new_cap
        self.version = next(_VERSIONS)

    def _reserve_window(self, n_tokens: int) -> None:
        w = self.window
        base = (w.first_needed(self._length) // GROW) * GROW if w.wants_move(self._length) else w.base
        if base == w.base and n_tokens - base <= w.capacity:
            return
        new_cap = room_for(n_tokens - base)
        kept = self._length - base  # positions [base, length) move to the front
        for i in w.layers:
            for store, d in ((self._keys, self.head_dim), (self._values, self.v_head_dim)):
                moved = self.empty((self.kv_heads,), new_cap, d)
                if store[i] is not None and kept > 0:
                    _write(moved, 0, _each(lambda a: a[:, base - w.base: self._length - w.base, :], store[i]))
                store[i] = moved
        mx.eval([a for i in w.layers for buf in (self._keys[i], self._values[i]) for a in _planes(buf)])
        w.base, w.capacity = base, new_cap
        self.version = next(_VERSIONS)

    def trim(self, n_tokens: int) -> None:
        if n_tokens < 0 or n_tokens > self._length:
            raise ValueError(f"cannot trim a cache of {self._length} tokens to {n_tokens}")
        if self.window is not None and n_tokens and n_tokens != self._length \
                and not self.window.reachable(n_tokens) and n_tokens not in self.window.snapshots:
            raise PrefixNotReusable(
                f"cannot trim a sliding-window cache of {self._length} tokens to {n_tokens}: its window layers "
                f"keep positions from {self.window.base} on only; it can return to {self.reuse_points()} tokens")
        if self.window is not None and (n_tokens == 0 or not self.window.reachable(n_tokens)):
            self.unstack()  # the window buffer itself changes (emptied, or a snapshot put back)
        if self.recurrent is not None:
            self._trim_recurrent(n_tokens)
        self._awaiting_state = self._awaiting_state and n_tokens == self._length
        self._length = n_tokens
        if self.window is not None:
            self._trim_window(n_tokens)
        if self.recurrent is not None or self.window is not None:
            self.published_points = self.reuse_points()
        if self._stack is not None:  # a row of a stacked batch keeps its (padded) room; positions
            return  # past the length are never attended, and the next write overwrites them
        keep = room_for(n_tokens)
        if keep < self.capacity:
            for store in (self._keys, self._values):
                for i in self._full_layers():
                    store[i] = _each(lambda a: mx.array(a[:, :keep, :]), store[i]) if keep else None
            self.capacity = keep
            self.version = next(_VERSIONS)

    def _trim_window(self, n_tokens: int) -> None:
        w = self.window
        w.points.drop_after(n_tokens)
        for held in (w.snapshots, w.block_ends):
            for p in [p for p in held if p > n_tokens or not n_tokens]:
                del held[p]
        if n_tokens == 0:
            w.points.clear()
            w.base = 0
        elif not w.reachable(n_tokens):  # back to a snapshot: its copy becomes the buffer
            first, keys, values = w.snapshots.pop(n_tokens)
            w.base, w.capacity = first, room_for(n_tokens - first)
            for store, saved, d in ((self._keys, keys, self.head_dim), (self._values, values, self.v_head_dim)):
                for i in w.layers:
                    n = _planes(saved[i])[0].shape[1]
                    store[i] = _each(lambda a, z: mx.concatenate([a, z], axis=1), saved[i],
                                     self.empty((self.kv_heads,), w.capacity - n, d))
            w.points.clear()
            w.points.add(n_tokens, SlidingWindow.TRANSACTION_END)
            self.version = next(_VERSIONS)
            return
        keep = room_for(n_tokens - w.base)
        if keep < w.capacity and self._stack is None:  # a stacked row keeps its padded room
            for store in (self._keys, self._values):
                for i in w.layers:
                    store[i] = _each(lambda a: mx.array(a[:, :keep, :]), store[i]) if keep else None
            w.capacity = keep
            self.version = next(_VERSIONS)

    def _trim_recurrent(self, n_tokens: int) -> None:
        """Bring the recurrent state to ``n_tokens``: unchanged at the current length, zero at 0, the
        checkpoint at the last forward's start; any other position cannot be reconstructed."""
        rec = self.recurrent
        rec.prompt_rows = None  # no forward runs during a trim: a failed prompt forward's rows go
        if n_tokens == self._length:
            return
        if n_tokens == 0:
            rec.reset()
        elif n_tokens == rec.checkpoint_length():
            rec.restore()
        elif n_tokens in rec.points:
            rec.restore_point(n_tokens)
        elif n_tokens in rec.verify_states:
            rec.restore_verified(n_tokens)
        else:
            raise PrefixNotReusable(
                f"cannot trim a hybrid-recurrent cache of {self._length} tokens to {n_tokens}: its recurrent state "
                f"exists only at {self.reuse_points()} tokens")

    def reuse_points(self) -> tuple[int, ...] | None:
        """The lengths this sequence can be trimmed back to, ascending (0 and its length included);
        None when it can be trimmed anywhere (no recurrent state, no sliding window)."""
        if self.recurrent is None and self.window is None:
            return None
        points = {0, self._length}
        if self.recurrent is not None:
            rec = self.recurrent
            rollback = () if rec.checkpoint_length() is None else (rec.checkpoint_length(),)
            points |= {p for p in (*rollback, *rec.points, *rec.verify_states) if p <= self._length}
        if self.window is not None:
            w = self.window
            held = {p for p in w.points if p <= self._length and w.reachable(p)}
            held |= {p for p in w.snapshots if p <= self._length}
            points = held | {0, self._length} if self.recurrent is None else \
                {p for p in points if p in (0, self._length) or w.reachable(p)}
        return tuple(sorted(points))

    def add_window_points(self, start: int, n_new: int, transaction: bool) -> None:
        """The reuse points a forward of ``n_new`` tokens from ``start`` reached (its tokens are all
        in the window buffer until the next forward moves the buffer's first position)."""
        w = self.window
        aged = w.points.add_reached(start, n_new, transaction,
                                    lambda _, end: SlidingWindow.TRANSACTION_END if end else None)
        for p, kind in aged.items():
            if kind == SlidingWindow.TRANSACTION_END and w.reachable(p):
                w.snapshots[p] = self._window_copy(max(0, p - w.size + 1), p)
                keep_newest(w.snapshots, w.snapshots_kept)
        if n_new > 1 and transaction:
            for end in block_ends_reached(start, n_new, w.block_tokens):
                w.block_ends[end] = self._window_copy(max(0, end - w.size), end)
            keep_newest(w.block_ends, BLOCK_ENDS_KEPT)

    def _window_copy(self, first: int, end: int) -> tuple[int, dict, dict]:
        """Positions ``[first, end)`` of every window layer copied out of the buffers (still there: the
        first position moves only at the next ``reserve``): a snapshot ``trim`` can return to, or a
        block end's rows."""
        self.unstack()
        w = self.window
        cut = slice(first - w.base, end - w.base)
        # "+ 0": a copy, not a view that would keep the whole buffer
        copy = lambda a: own_copy(a[:, cut, :])  # noqa: E731
        keys = {i: _each(copy, self._keys[i]) for i in w.layers}
        values = {i: _each(copy, self._values[i]) for i in w.layers}
        mx.eval([a for buf in (*keys.values(), *values.values()) for a in _planes(buf)])
        return first, keys, values

    def advance(self, n: int) -> None:
        self._length += n

    def write_ahead(self, layer: int, at: int, k: mx.array, v: mx.array) -> None:
        """Rows ``[at, at + n)`` of ``layer`` set to ``k, v [kv_heads, n, d]`` (encoded by the codec) in
        place, at or past the length, whose room :meth:`reserve` made: a draft's rows (the MTP head's),
        which the next forward writes over; the length does not move."""
        if at < self._length or at + k.shape[1] > self.capacity:
            raise ValueError(f"rows {at}..{at + k.shape[1]} are not between the length {self._length} and the "
                             f"capacity {self.capacity}")
        if self.codec is not None:
            k, v = self.codec.encode(k), self.codec.encode(v)
        _write(self.keys[layer], at, k)
        _write(self.values[layer], at, v)
        self.version = next(_VERSIONS)

    # ---- the persistent store's blocks ------------------------------------------------------

    @property
    def persist_kind(self) -> str:
        """What this sequence's blocks hold (``kvstore.blockfile.CACHE_KINDS``): "" plain K/V,
        ``recurrent`` the K/V plus, at captured block ends, the recurrent state there; ``recurrent-mtp``
        also an MTP head's K/V layer and, at those ends, the hidden row the head reads next; ``window`` the
        full-attention layers' K/V plus, at captured block ends, the window layers' rows there."""
        if self.recurrent is not None:
            return "recurrent-mtp" if self.recurrent.feeds_head else "recurrent"
        return "window" if self.window is not None else ""

    def keep_block_ends(self, block_tokens: int) -> None:
        """Capture the state at every multiple of ``block_tokens`` a prompt's prefill reaches, until that
        block is exported (the persistent store turns this on for every slot's sequence)."""
        if self.recurrent is not None:
            self.recurrent.block_tokens = block_tokens
        elif self.window is not None:
            self.window.block_tokens = block_tokens

    @property
    def block_ends(self) -> dict:
        """The captured block ends (length → state) not exported yet; empty for plain K/V."""
        if self.recurrent is not None:
            return self.recurrent.block_ends
        return self.window.block_ends if self.window is not None else {}

    def forget_block_ends(self, keep) -> None:
        """Let go of the captured block ends whose length is not in ``keep`` (their blocks are on disk)."""
        ends = self.block_ends  # the recurrent state's or the window's
        for n in [n for n in ends if n not in keep]:
            del ends[n]

    def _refuse_transfer(self, what: str, start: int, end: int) -> None:
        rec = self.recurrent
        if rec is not None and (not rec.block_tokens or start % rec.block_tokens or end % rec.block_tokens):
            raise PrefixNotReusable(f"KV {what} of a hybrid-recurrent sequence moves whole persistent-store blocks "
                                    f"only (block ends kept: {rec.block_tokens}); got [{start}, {end})")

    def export(self, start: int, end: int) -> dict[str, np.ndarray]:
        """Host copies of positions ``[start, end)`` of every layer's K and V (a sliding-window sequence:
        of the layers that keep every position); the block also carries the state at ``end`` when this
        still holds it (``state.*``: a hybrid's recurrent state, the window layers' last rows), which the
        export then lets go of (the block has it)."""
        self._refuse_transfer("export", start, end)
        out = {}
        for i in self._full_layers():
            for name, buf in ((f"k.{i}", self.keys[i]), (f"v.{i}", self.values[i])):
                out.update(self._host_rows(name, _each(lambda a: a[:, start:end, :], buf)))
        if self.window is not None:
            self._export_window_end(end, out)
        rec = self.recurrent
        state = None if rec is None else rec.state_at(end, self._length)
        hidden = rec.hidden_at(end) if rec is not None and rec.feeds_head else None
        if state is not None and all(a is not None for a in (*state[0], *state[1])) \
                and (hidden is not None or not rec.feeds_head):  # a head's sequence: all of its end or none
            for j, (conv, ssm) in enumerate(zip(*state)):
                out[f"{END_STATE_PREFIX}conv.{j}"] = np.array(conv.astype(mx.float32))
                out[f"{END_STATE_PREFIX}ssm.{j}"] = np.array(ssm.astype(mx.float32))
            if hidden is not None:
                out[HIDDEN_STATE] = np.array(hidden.astype(mx.float32))
            rec.block_ends.pop(end, None)
        return out

    def _host_rows(self, name: str, part) -> dict[str, np.ndarray]:
        if self.codec is None:
            return {name: np.array(part.astype(mx.float32))}
        return self.codec.to_host(name, part)  # the codes and scales themselves: restored bit for bit

    def _export_window_end(self, end: int, out: dict) -> None:
        """``state.k.{i}`` / ``state.v.{i}``: the window layers' rows ``[end − size, end)`` (what a query at
        ``end`` and the one-position rollback before it attend over), from the captured block end or from
        the buffer while it still holds them."""
        w = self.window
        first = max(0, end - w.size)
        if end in w.block_ends:
            first, keys, values = w.block_ends.pop(end)
        elif end <= self._length and first >= w.base:
            cut = lambda a: a[:, first - w.base:end - w.base, :]  # noqa: E731
            keys = {i: _each(cut, self.keys[i]) for i in w.layers}
            values = {i: _each(cut, self.values[i]) for i in w.layers}
        else:
            return
        for i in sorted(w.layers):
            out.update(self._host_rows(f"{END_STATE_PREFIX}k.{i}", keys[i]))
            out.update(self._host_rows(f"{END_STATE_PREFIX}v.{i}", values[i]))

    def import_(self, arrays: dict[str, np.ndarray], n_tokens: int) -> None:
        """Append ``n_tokens`` positions ``export`` gave. A hybrid or sliding-window sequence takes the state
        at the block's end from a block that carries it; after one that does not, it cannot run a forward
        until a later block brings the state (a restore imports up to a block with one, in one transaction)."""
        start = self._length
        self._refuse_transfer("import", start, start + n_tokens)
        rec = self.recurrent
        if rec is not None:
            state = self._imported_state(arrays, rec)
        elif self.window is not None:
            state = self._imported_window(arrays, start + n_tokens) if has_end_state(arrays) else None
        self.reserve(start + n_tokens, importing=True)
        for i in self._full_layers():
            k, v = arrays[f"k.{i}"], arrays[f"v.{i}"]
            if k.shape != (self.kv_heads, n_tokens, self.head_dim) or v.shape[1] != n_tokens:
                raise ValueError(f"layer {i}: KV block has shape {k.shape}, expected "
                                 f"{(self.kv_heads, n_tokens, self.head_dim)}")
            for buf, name, width in ((self.keys[i], f"k.{i}", self.head_dim),
                                     (self.values[i], f"v.{i}", self.v_head_dim)):
                _write(buf, start, self._device_rows(arrays, name, width))
        mx.eval([a for i in self._full_layers() for buf in (self.keys[i], self.values[i]) for a in _planes(buf)])
        self._length += n_tokens
        self.version = next(_VERSIONS)
        if rec is not None:
            rec._checkpoint, rec.verify_states, rec.hidden = None, {}, None
            if state is None:
                if start and not self._awaiting_state:  # where a failed restore can be trimmed back to
                    rec.points.add(start, (list(rec.conv), list(rec.ssm)))
                self._awaiting_state = True
            else:
                rec.conv, rec.ssm, hidden = state
                if hidden is not None:  # the row before the block's end, which the head reads next
                    rec.hidden = (self._length - 1, hidden[None])
                mx.eval(rec.conv + rec.ssm + ([hidden] if hidden is not None else []))
                rec.points.add(self._length, (list(rec.conv), list(rec.ssm)))
                self._awaiting_state = False
            self.published_points = self.reuse_points()
        elif self.window is not None:
            if state is None:
                self._awaiting_state = True  # the window buffer still ends at a point a failed restore trims to
            else:
                self._put_window(self._length, *state)
                self._awaiting_state = False
            self.published_points = self.reuse_points()

    def _device_rows(self, arrays: dict[str, np.ndarray], name: str, width: int):
        # an 8-bit cache takes its exported codes and scales back as they are (``KvCodec.from_host``)
        return self.codec.from_host(arrays, name, width) if self.codec else mx.array(arrays[name]).astype(self.dtype)

    def _imported_window(self, arrays: dict[str, np.ndarray], end: int) -> tuple[dict, dict]:
        """The window layers' rows before ``end`` a block carries (checked against this cache's shapes)."""
        rows = min(self.window.size, end)
        keys, values = {}, {}
        for i in sorted(self.window.layers):
            for kind, out, width in (("k", keys, self.head_dim), ("v", values, self.v_head_dim)):
                name = f"{END_STATE_PREFIX}{kind}.{i}"
                got = None if name not in arrays else tuple(np.shape(arrays[name]))
                if got != (self.kv_heads, rows, width):
                    raise ValueError(f"window layer {i}: KV block part {name!r} has shape {got}, expected "
                                     f"{(self.kv_heads, rows, width)}")
                out[i] = self._device_rows(arrays, name, width)
        return keys, values

    def _put_window(self, end: int, keys: dict, values: dict) -> None:
        """The window layers' buffers become ``keys`` / ``values`` (their rows before ``end``), and ``end``
        their one reuse point."""
        w = self.window
        rows = _planes(keys[min(w.layers)])[0].shape[1]
        w.base, w.capacity = end - rows, room_for(rows + 1)
        for store, saved, d in ((self._keys, keys, self.head_dim), (self._values, values, self.v_head_dim)):
            for i in w.layers:
                buf = self.empty((self.kv_heads,), w.capacity, d)
                _write(buf, 0, saved[i])
                store[i] = buf
        mx.eval([a for i in w.layers for buf in (self._keys[i], self._values[i]) for a in _planes(buf)])
        w.points.clear()
        w.points.add(end, SlidingWindow.TRANSACTION_END)

    def _imported_state(self, arrays: dict[str, np.ndarray], rec: RecurrentState
                        ) -> tuple[list, list, mx.array | None] | None:
        """The recurrent state a block carries (checked against this model's shapes) and, for a sequence
        that feeds an MTP head, the hidden row before its end; None if it has none."""
        if not has_end_state(arrays):
            return None
        hidden = None
        if rec.feeds_head:
            row = arrays.get(HIDDEN_STATE)
            if row is None or np.ndim(row) != 1:
                raise ValueError(f"KV block part {HIDDEN_STATE!r} has shape {None if row is None else np.shape(row)}, "
                                 "expected one hidden row")
            hidden = mx.array(row).astype(rec.dtype)
        conv, ssm = [], []
        for j in range(rec.n_layers):
            for name, shape, out, dtype in ((f"{END_STATE_PREFIX}conv.{j}", rec.conv_shape, conv, rec.dtype),
                                            (f"{END_STATE_PREFIX}ssm.{j}", rec.ssm_shape, ssm, mx.float32)):
                got = None if name not in arrays else tuple(np.shape(arrays[name]))
                if got != shape:
                    raise ValueError(f"recurrent layer {j}: KV block part {name!r} has shape {got}, expected {shape}")
                out.append(mx.array(arrays[name]).astype(dtype))
        return conv, ssm, hidden


def _padded(buf, n: int):
    """The first ``n`` positions of a cache buffer, zero-padded when its capacity is smaller
    (masked out anyway; a short sequence in a batch never grows its own cache for it)."""
    def one(a: mx.array) -> mx.array:
        if a.shape[1] >= n:
            return a[:, :n, :]
        return mx.concatenate([a, mx.zeros((a.shape[0], n - a.shape[1], a.shape[2]), dtype=a.dtype)], axis=1)
    return _each(one, buf)


def _stacked(bufs: list):
    """Buffers of the rows of a batch stacked along a new first axis (each plane on its own)."""
    return _each(lambda *arrays: mx.stack(arrays), *bufs)


class StackedDecode:
    """The K/V of the sequences of a batched decode, stacked per layer as ``[B, kv_heads, capacity, d]``.

    Why: with one buffer per sequence, every layer of a batched decode step writes each row's new
    K/V and slices, pads and stacks each row's keys and values again — about 4·B + 2 ops and as
    many kernel launches per layer, and a copy of every row's whole cache per step. On a GPU,
    where the host builds and launches the step while the device waits, the step then cost
    9 ms at one sequence and 20 ms at four (H200, Qwen3-8B). Stacked, a layer writes all rows
    with one scatter and attends over one slice, whatever the batch.

    The batch holds its sequences' K/V while the same sequences keep decoding together; the
    sequences hold none meanwhile. Anything else that touches one of them (``keys``/``values``,
    ``reserve``, export, import, a prefill) first dissolves the stack (:meth:`dissolve`), handing
    every row back as the sequence's own buffers — so the stack is an optimisation no caller can
    observe.
    """

    #: refuse to stack when padding every row to the longest would add more than this share of
    #: the rows' own room, and more than ``PADDING_TOKENS`` positions (the KV budget counts
    #: tokens, not padding)
    MAX_PADDING = 0.25
    PADDING_TOKENS = 4 * GROW

    def __init__(self, caches: Sequence[SequenceCache]):
        self.caches = list(caches)
        first = self.caches[0]
        self.n_layers = first.n_layers
        #: sliding-window layers (their rows start at each sequence's ``window.base``, frozen while stacked)
        self.window_layers = first.window.layers if first.window is not None else frozenset()
        if self.window_layers:
            for c in self.caches:  # let go of what the windows no longer need before copying
                c.reserve(c.length + 1)
        self.capacity = max(c.capacity for c in self.caches)
        self.window_capacity = max(c.window.capacity for c in self.caches) if self.window_layers else 0
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        for i in range(self.n_layers):  # layer by layer, so the copy never holds more than one extra layer
            cap = self._capacity(i)
            self.keys.append(_stacked([_padded(c._keys[i], cap) for c in self.caches]))
            self.values.append(_stacked([_padded(c._values[i], cap) for c in self.caches]))
            mx.eval(*_planes(self.keys[i]), *_planes(self.values[i]))
            for c in self.caches:
                c._keys[i] = c._values[i] = None
        for c in self.caches:
            c._stack = self
            c.capacity = self.capacity
            if self.window_layers:
                c.window.capacity = self.window_capacity
            c.version = next(_VERSIONS)

    def _capacity(self, layer: int) -> int:
        return self.window_capacity if layer in self.window_layers else self.capacity

    def windows_move(self) -> bool:
        """Whether a row's window buffer would now let go of positions (``SequenceCache.reserve``): the
        stack is then dissolved and rebuilt, so a window stays bounded while its rows keep decoding."""
        return any(c.window.wants_move(c.length) for c in self.caches) if self.window_layers else False

    @classmethod
    def fits(cls, caches: Sequence[SequenceCache], n_new: int = 1) -> bool:
        """True when ``caches`` can be stacked: distinct, one K/V layout, allocated, and the
        padding to the longest is small."""
        if len(caches) < 2 or len({id(c) for c in caches}) != len(caches):
            return False
        first = caches[0]
        layout = lambda c: (c.n_layers, c.kv_heads, c.head_dim, c.v_head_dim, c.dtype, c.codec)  # noqa: E731
        if any(c.stacked or c.capacity == 0 or layout(c) != layout(first) for c in caches):
            return False
        need = max(room_for(c.length + n_new) for c in caches)
        own = sum(max(c.capacity, c.length + n_new) for c in caches)
        return len(caches) * need - own <= max(own * cls.MAX_PADDING, cls.PADDING_TOKENS)

    def holds(self, caches: Sequence[SequenceCache]) -> bool:
        """True when this stack is live and its rows are exactly ``caches``, in order."""
        return (len(caches) == len(self.caches) and all(c._stack is self for c in self.caches)
                and all(a is b for a, b in zip(caches, self.caches)))

    def reserve(self, n_tokens: int, window_tokens: int = 0) -> None:
        """Room for ``n_tokens`` positions in every row (grown in steps of ``GROW``), and for
        ``window_tokens`` in the window layers' rows."""
        if n_tokens > self.capacity:
            self.capacity = self._grow([i for i in range(self.n_layers) if i not in self.window_layers], n_tokens)
            for c in self.caches:
                c.capacity = self.capacity
        if window_tokens > self.window_capacity:
            self.window_capacity = self._grow(sorted(self.window_layers), window_tokens)
            for c in self.caches:
                c.window.capacity = self.window_capacity

    def _grow(self, layers: list[int], n_tokens: int) -> int:
        new_cap = room_for(n_tokens)
        for store in (self.keys, self.values):
            for i in layers:
                store[i] = _each(lambda a: mx.concatenate([a, mx.zeros(
                    (a.shape[0], a.shape[1], new_cap - a.shape[2], a.shape[3]), dtype=a.dtype)], axis=2), store[i])
        return new_cap

    def write(self, layer: int, k, v, offsets: mx.array, total: int, indices: dict):
        """Store one new position per row (``k, v [B, kv_heads, 1, d]`` at ``offsets [B]``, or their
        codec planes) with one scatter per array; return keys/values ``[B, kv_heads, total, ·]``.
        ``indices`` keeps the scatter indices by shape across the layers of one step."""

        def put(buf: mx.array, new: mx.array) -> mx.array:
            idx = indices.get(new.shape)
            if idx is None:
                idx = indices[new.shape] = mx.broadcast_to(offsets[:, None, None, None], new.shape)
            return mx.put_along_axis(buf, idx, new, axis=2)
        self.keys[layer] = _each(put, self.keys[layer], k)
        self.values[layer] = _each(put, self.values[layer], v)
        head = lambda a: a[:, :, :total, :]  # noqa: E731
        return _each(head, self.keys[layer]), _each(head, self.values[layer])

    def dissolve(self) -> None:
        """Every row back to its sequence as its own buffers (room for its length, in ``GROW``
        steps); the stack is empty afterwards."""
        if not self.caches:
            return
        own = [room_for(c.length) for c in self.caches]
        own_window = [room_for(c.length - c.window.base) if self.window_layers else 0 for c in self.caches]
        for i in range(self.n_layers):  # layer by layer: the stack's layer is freed as its rows are copied out
            for b, c in enumerate(self.caches):
                n = own_window[b] if i in self.window_layers else own[b]
                if n:
                    c._keys[i] = _each(lambda a: mx.array(a[b, :, :n, :]), self.keys[i])
                    c._values[i] = _each(lambda a: mx.array(a[b, :, :n, :]), self.values[i])
            mx.eval([a for c in self.caches for buf in (c._keys[i], c._values[i]) if buf is not None
                     for a in _planes(buf)])
            self.keys[i] = self.values[i] = None
        for c, n, n_window in zip(self.caches, own, own_window):
            c.capacity = n
            if self.window_layers:
                c.window.capacity = n_window
            c._stack = None
            c.version = next(_VERSIONS)
        self.caches, self.keys, self.values = [], [], []

    def arrays(self) -> list[mx.array]:
        return [a for buf in self.keys + self.values for a in _planes(buf)]


class ForwardBatch:
    """The sequences one forward advances; built by the runner, consumed by attention layers.

    A batched decode whose sequences a :class:`StackedDecode` holds (``stack``) writes and reads
    through it; otherwise each sequence's own buffers are used.
    """

    def __init__(self, caches: Sequence[SequenceCache], n_new: int, stack: StackedDecode | None = None,
                 end_point: bool = True):
        if n_new > 1 and len(caches) != 1:
            raise ValueError("multi-token steps advance exactly one sequence")
        self.caches = list(caches)
        self.n_new = n_new
        #: a multi-token forward keeps a recurrent reuse point at its end (a prefill transaction);
        #: a speculative verify does not, so drafts do not push the prompt's points out
        self.end_point = end_point
        self.offsets = [c.length for c in self.caches]
        self.total = max(self.offsets) + n_new  # keys attended over (padded)
        if stack is not None and not (n_new == 1 and stack.holds(self.caches)):
            raise ValueError("the stacked batch does not hold exactly these sequences")
        self.stack = stack
        if stack is not None:
            stack.reserve(self.total)
            self._offsets_mx = mx.array(self.offsets, dtype=mx.int32)
        else:
            for c, off in zip(self.caches, self.offsets):
                c.reserve(off + n_new)  # each cache grows only for its own tokens
                c.version = next(_VERSIONS)  # update()'s slice assignments give every buffer a new array
        #: the sliding-window layers' part of the caches (one model: the same layers in every cache)
        self.window = self.caches[0].window
        #: how the caches store K/V (one model: the same in every cache); None: in the compute dtype
        self.codec = self.caches[0].codec
        if self.window is not None:
            self._bases = [c.window.base for c in self.caches]
            self.window_total = max(off + n_new - b for off, b in zip(self.offsets, self._bases))
            if stack is not None:
                stack.reserve(self.total, self.window_total)
                self._window_offsets_mx = mx.array([o - b for o, b in zip(self.offsets, self._bases)], dtype=mx.int32)
        self._offset: mx.array | None = None
        self._indices: dict = {}  # the stacked batch's scatter indices by shape, one set per step
        self._window_indices: dict = {}
        self._masks: dict[object, mx.array | str | None] = {}
        self._np_masks: dict[int | None, np.ndarray | None] = {}
        self._staged: dict[int, tuple[mx.array, mx.array]] = {}
        #: reuse points inside a prefill forward: position relative to its start → layer → (conv, ssm)
        self._staged_points: dict[int, dict[int, tuple[mx.array, mx.array]]] = {}

    @property
    def rows_as_steps(self) -> bool:
        """Whether this is a speculative verify of one sequence (several rows, no reuse point at its end):
        each row must compute what the one-token step decoding it would, bit for bit, so attention whose
        kernel depends on the query count attends its rows one at a time (``models.decoder``)."""
        return self.n_new > 1 and not self.end_point and len(self.caches) == 1 and self.stack is None

    def recurrent_state(self, layer: int) -> tuple[mx.array, mx.array]:
        """Recurrent layer ``layer``'s state of every sequence: conv ``[B, K − 1, C]``, ssm ``[B, Hv, Dv, Dk]``."""
        return self.caches[0].recurrent.batched(self.caches, layer)

    def set_recurrent_state(self, layer: int, conv: mx.array, ssm: mx.array) -> None:
        """The states after this forward (rows in batch order), committed to the caches by :meth:`finish`
        only, so a forward that fails half-way leaves every sequence at its last commit."""
        self._staged[layer] = (conv, ssm)

    def recurrent_cuts(self) -> list[int]:
        """Positions inside this (single-sequence) forward, relative to its first token, after which
        the recurrent layers hand in their state as a reuse point (:meth:`set_recurrent_point`)."""
        rec = self.caches[0].recurrent
        if rec is None or len(self.caches) != 1:
            return []
        if self.keeps_every_state:
            return list(range(1, self.n_new))
        return rec.due_points(self.offsets[0], self.n_new)

    @property
    def keeps_every_state(self) -> bool:
        """A speculative verify keeps the recurrent state after each of its tokens (``verify_states``)."""
        return not self.end_point and self.n_new > 1

    def set_recurrent_point(self, layer: int, cut: int, conv: mx.array, ssm: mx.array) -> None:
        """Layer ``layer``'s state after the first ``cut`` tokens of this forward (batch of one)."""
        self._staged_points.setdefault(cut, {})[layer] = (conv, ssm)

    @property
    def offset(self) -> int | mx.array:
        """Position of the first new token: an int for one sequence, an array for a batch (made once a step,
        not once a layer)."""
        if len(self.caches) == 1:
            return self.offsets[0]
        if self._offset is None:  # a stacked batch has made it already, for its cache writes
            self._offset = self._offsets_mx if self.stack is not None else mx.array(self.offsets, dtype=mx.int32)
        return self._offset

    @property
    def offset_array(self) -> mx.array:
        """:attr:`offset` as an int32 array for one sequence too (a traced step takes positions as an input)."""
        if self._offset is None and len(self.caches) == 1:
            self._offset = mx.array(self.offsets[0], dtype=mx.int32)
        return self._offset if len(self.caches) == 1 else self.offset

    def mask_np(self, window: int | None) -> np.ndarray | None:
        """Boolean ``[B, 1, n_new, total]`` (True = attend), or None when nothing is masked."""
        if window in self._np_masks:
            return self._np_masks[window]
        T, L = self.n_new, self.total
        q_pos = (np.asarray(self.offsets)[:, None] + np.arange(T)[None, :])[:, :, None]  # [B,T,1]
        k_pos = np.arange(L)[None, None, :]
        if self._windowed(window):  # each row's kept keys start at its own first kept position
            k_pos = np.asarray(self._bases)[:, None, None] + np.arange(self.window_total)[None, None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        m = None if allowed.all() else allowed[:, None, :, :]
        self._np_masks[window] = m
        return m

    def mask(self, window: int | None) -> mx.array | str | None:
        """The same mask for ``mx.fast.scaled_dot_product_attention``.

        A plain causal chunk of one sequence is ``"causal"`` (MLX aligns it to the last key,
        which is exactly "prefix + chunk"): the fused kernels then skip the masked tiles
        instead of reading a ``[T, L]`` boolean array.
        """
        if window not in self._masks:
            m = self.mask_np(window)
            if m is not None and len(self.caches) == 1 and self._plain_causal(window):
                self._masks[window] = "causal"
            else:
                self._masks[window] = None if m is None else mx.array(m)
        return self._masks[window]

    def mask_array(self, window: int | None) -> mx.array | None:
        """:meth:`mask_np` as an MLX array (for attention with no ``"causal"`` shortcut, ``kv_quant``)."""
        key = ("array", window)
        if key not in self._masks:
            m = self.mask_np(window)
            self._masks[key] = None if m is None else mx.array(m)
        return self._masks[key]

    def _plain_causal(self, window: int | None) -> bool:
        if self._windowed(window):
            return window >= self.window_total
        return window is None or window >= self.total

    def _windowed(self, window: int | None) -> bool:
        """Whether layers masked by ``window`` keep only their window (``SlidingWindow``)."""
        return window is not None and self.window is not None and window == self.window.size

    def update(self, layer: int, k: mx.array, v: mx.array):
        """Store new ``k, v`` ``[B, kv_heads, n_new, d]``; return all keys/values ``[B, kv_heads, total, d]``
        (a codec cache: its planes, ``kv_quant.KvCodec.attend`` reads them). A sliding-window layer's
        position ``p`` lives at ``p − base`` of its row."""
        if self.codec is not None:
            k, v = self.codec.encode(k), self.codec.encode(v)
        windowed = self.window is not None and layer in self.window.layers
        if self.stack is not None:
            if windowed:
                return self.stack.write(layer, k, v, self._window_offsets_mx, self.window_total, self._window_indices)
            return self.stack.write(layer, k, v, self._offsets_mx, self.total, self._indices)
        bases = self._bases if windowed else [0] * len(self.caches)
        total = self.window_total if windowed else self.total
        if len(self.caches) == 1:
            c, at = self.caches[0], self.offsets[0] - bases[0]
            _write(c.keys[layer], at, _each(lambda a: a[0], k))
            _write(c.values[layer], at, _each(lambda a: a[0], v))
            head = lambda a: a[None, :, :at + self.n_new, :]  # noqa: E731
            return _each(head, c.keys[layer]), _each(head, c.values[layer])
        ks, vs = [], []
        for i, (c, off, base) in enumerate(zip(self.caches, self.offsets, bases)):
            _write(c.keys[layer], off - base, _each(lambda a: a[i], k))
            _write(c.values[layer], off - base, _each(lambda a: a[i], v))
            ks.append(_padded(c.keys[layer], total))
            vs.append(_padded(c.values[layer], total))
        return _stacked(ks), _stacked(vs)

    def finish(self) -> None:
        for b, c in enumerate(self.caches):
            if self._staged:
                rec = c.recurrent
                rec.checkpoint(c.length)
                due = set(rec.due_points(c.length, self.n_new))
                for cut, layers in sorted(self._staged_points.items()):
                    if len(layers) == rec.n_layers:  # every recurrent layer handed its state in
                        order = sorted(layers)
                        state = [layers[i][0][b] for i in order], [layers[i][1][b] for i in order]
                        if self.keeps_every_state:
                            rec.verify_states[c.length + cut] = state
                        if cut in due:
                            rec.add_point(c.length + cut, *state, prompt=self.n_new > 1 and self.end_point)
                for layer, (conv, ssm) in self._staged.items():
                    rec.conv[layer], rec.ssm[layer] = conv[b], ssm[b]
                if rec.points.ends_at(c.length + self.n_new, self.n_new, self.end_point):
                    rec.add_point(c.length + self.n_new, rec.conv, rec.ssm, prompt=self.n_new > 1 and self.end_point)
                rec.prompt_rows = None  # the block ends it reached took their rows
            if c.window is not None:
                c.add_window_points(c.length, self.n_new, self.end_point)
            c.advance(self.n_new)
            if c.recurrent is not None or c.window is not None:
                c.published_points = c.reuse_points()

    def eval_state(self) -> list[mx.array]:
        if self.stack is not None:
            return self.stack.arrays() + self._recurrent_arrays()
        out = [a for c in self.caches for buf in c.keys + c.values if buf is not None for a in _planes(buf)]
        return out + self._recurrent_arrays()

    def _recurrent_arrays(self) -> list[mx.array]:
        staged = [a for pair in self._staged.values() for a in pair]
        staged += [a for layers in self._staged_points.values() for pair in layers.values() for a in pair]
        return staged + [a for c in self.caches if c.recurrent is not None for a in c.recurrent.arrays()]
