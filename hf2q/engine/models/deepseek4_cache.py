"""A DeepSeek-V4 slot's compact cache (what it holds: ``models/deepseek4_layout.py``).

A query at position ``p`` needs, per layer, the raw rows of its window ``(p − window, p]`` and every
compressed entry closed before it; the entries are pure functions of ``ratio`` (or ``2·ratio``)
consecutive compressor rows. So instead of every position's rows this cache keeps, per layer,

* :class:`Rows` — raw rows, and compressor (and indexer) rows, of consecutive positions up to the
  length; before each forward (:meth:`Deepseek4Cache.reserve`) they let go of what the next query and
  the decode pipeline's one-position undo no longer need, so right after a forward every length
  inside it can still be returned to (a mid-prompt trim; a speculative verify publishes every length
  inside it as a reuse point, so a partial accept stops at the accepted length without a second forward);
* :class:`Entries` — the compressed entries (and indexer keys), appended as each block closes; while
  sequences decode together their entries are rows of shared buffers (:class:`EntryBatch`).

A forward's new rows and entries are staged by the attention layers (:meth:`stage`) and committed
only by :meth:`advance` (``ForwardBatch.finish``), so a failed forward leaves the last commit.
Entries are written past the committed count in place: they stay unread until committed.

**Reuse points** are ``recurrent_policy.ReusePoints`` (one every ``CHECKPOINT_INTERVAL`` tokens and
at the end of every prefill transaction, the newest ``WINDOW_POINTS_KEPT``), each with a copy of the
rows at that length; a transaction end that ages out of them is kept as well (the newest
``WINDOW_SNAPSHOTS_KEPT``), as ``SlidingWindow`` keeps its snapshots. The entries need no copy: a
point is never past the length, and the entries of a shorter length are a prefix of the live ones.
``trim`` honours 0, the length, any point, and any length whose rows are still held; anything else
raises ``PrefixNotReusable``.

**Export/import** move a block: the entries closed inside it (``entries.{i}``, ``index_entries.{i}``)
and, when the cache still holds them, the rows its end needs (``state.raw.{i}``, ``state.comp.{i}``,
``state.index.{i}``: its end is the length, a point, inside the last forward, or a block end a prompt's
prefill reached with ``keep_block_ends`` on — captured there for the persistent store, because by the
time a request has ended the rows of its earlier block ends are gone). Imported after a trim (or onto
an empty cache), the entries are appended and the rows, where the block has them, become the live
ones; after a block without them the cache runs no forward until a block with them is imported.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
from typing import NamedTuple

import numpy as np

from hf2q.engine.kv_cache import PrefixNotReusable, SequenceCache, StackedDecode, kept_row_before, own_copy, row_before
from hf2q.engine.kv_layout import END_STATE_PREFIX, HIDDEN_STATE, has_end_state
from hf2q.engine.models.deepseek4_layout import LayerRows
from hf2q.engine.recurrent_policy import (BLOCK_ENDS_KEPT, CHECKPOINT_INTERVAL, KV_GROW, WINDOW_POINTS_KEPT,
                                          WINDOW_SNAPSHOTS_KEPT, ReusePoints, block_ends_reached, keep_newest,
                                          room_for)


class BlockEnd(NamedTuple):
    """What a sequence keeps at a captured block end until that block is exported: every layer's rows there
    and, for a sequence that feeds an MTP head, the trunk streams ``[hc, hidden]`` before the end, which the
    head pairs with the block's next token (``deepseek4_mtp``); None for a sequence without."""

    rows: list[LayerState]
    hidden: mx.array | None = None


@attrs.frozen
class Rows:
    """Rows ``data [n, width]`` of the consecutive positions ``[start, start + n)``."""

    start: int
    data: mx.array

    @property
    def end(self) -> int:
        return self.start + self.data.shape[0]

    def span(self, first: int, end: int) -> mx.array:
        """The rows of positions ``[first, end)`` (which this holds)."""
        return self.data[first - self.start:end - self.start]

    def cut(self, first: int, end: int) -> "Rows":
        return Rows(first, self.span(first, end))

    def extended(self, new: mx.array) -> "Rows":
        return Rows(self.start, mx.concatenate([self.data, new.astype(self.data.dtype)], axis=0))


def _empty_rows(width: int, dtype) -> Rows:
    return Rows(0, mx.zeros((0, width), dtype=dtype))


@attrs.frozen
class LayerState:
    """One layer's rows at some length: raw, compressor, indexer compressor (the last two None
    where the layer has none)."""

    raw: Rows
    comp: Rows | None = None
    index: Rows | None = None

    def arrays(self) -> list[mx.array]:
        return [r.data for r in (self.raw, self.comp, self.index) if r is not None]


class EntryRows:
    """The buffer ``[rows, capacity, width]`` that :class:`Entries` write into: one row for a sequence on
    its own, one per sequence of a batched decode (:class:`EntryBatch`), so that a batched step attends
    over one slice of it rather than stacking every row's entries again. Grown in ``KV_GROW`` steps."""

    def __init__(self, n_rows: int, width: int, dtype, capacity: int = 0):
        self.n_rows, self.width, self.dtype = n_rows, width, dtype
        self.capacity = room_for(capacity)
        self.buf: mx.array | None = mx.zeros((n_rows, self.capacity, width), dtype=dtype) if self.capacity else None

    def ensure(self, n: int) -> None:
        """Room for ``n`` entries in every row (what the rows hold is kept)."""
        if n <= self.capacity:
            return
        grown = mx.zeros((self.n_rows, room_for(n), self.width), dtype=self.dtype)
        if self.buf is not None:
            grown[:, :self.capacity] = self.buf
        self.buf, self.capacity = grown, grown.shape[1]

    def head(self, count: int) -> mx.array:
        """Every row's first ``count`` entries ``[rows, count, width]`` (a slice, no copy)."""
        if self.buf is None:
            return mx.zeros((self.n_rows, 0, self.width), dtype=self.dtype)
        return self.buf[:, :count]


class Entries:
    """A layer's compressed entries ``[count, width]``: row ``row`` of an :class:`EntryRows` (its own, or a
    batched decode's)."""

    def __init__(self, width: int, dtype):
        self.width, self.dtype = width, dtype
        self.rows, self.row = EntryRows(1, width, dtype), 0
        self.count = 0

    @property
    def buf(self) -> mx.array | None:
        return self.rows.buf

    @property
    def nbytes(self) -> int:
        """This row's share of the buffer."""
        return self.rows.capacity * self.width * self.dtype.size if self.rows.buf is not None else 0

    def write(self, new: mx.array | None) -> int:
        """Write ``new [n, width]`` after the committed entries; the count they make (not committed)."""
        if new is None or not new.shape[0]:
            return self.count
        end = self.count + new.shape[0]
        self.rows.ensure(end)
        self.rows.buf[self.row, self.count:end] = new.astype(self.dtype)
        return end

    def view(self, count: int) -> mx.array:
        if self.rows.buf is None:
            return mx.zeros((0, self.width), dtype=self.dtype)
        return self.rows.buf[self.row, :count]

    def keep(self, count: int) -> None:
        """The first ``count`` entries stay (room beyond them given back, unless the row is a batch's)."""
        self.count = count
        room = room_for(count)
        if self.rows.n_rows == 1 and self.rows.buf is not None and room < self.rows.capacity:
            self.rows.buf = own_copy(self.rows.buf[:, :room]) if room else None
            self.rows.capacity = room

    def move_to(self, rows: EntryRows, row: int) -> None:
        """Hold the entries in row ``row`` of ``rows`` from now on (copied there)."""
        if self.count:
            rows.ensure(self.count)
            rows.buf[row, :self.count] = self.view(self.count)
        self.rows, self.row = rows, row

    def alone(self) -> None:
        """Back to a buffer of its own, of the room its count needs."""
        if self.rows.n_rows != 1:
            self.move_to(EntryRows(1, self.width, self.dtype, self.count), 0)


class EntryBatch:
    """The compressed entries of the sequences of a batched decode, every layer's in one
    :class:`EntryRows` with a row per sequence, while the same sequences keep decoding together.

    Why: with a buffer per sequence, every layer of every batched step padded and stacked each row's
    entries again — a copy of all of them per step, growing with the context. In shared rows a step
    writes only the entries its blocks close, in place, and attends over one slice (the per-row counts
    mask the rest). The rows stay the sequences' own meanwhile: a member's prefill, verify, trim, export
    or import reads and writes its row; only a change of members copies the entries (once) — the old
    batch's back to buffers of their own, the new one's into new rows."""

    MAX_PADDING, PADDING_ENTRIES = StackedDecode.MAX_PADDING, KV_GROW

    def __init__(self, caches: list["Deepseek4Cache"]):
        self.caches = list(caches)
        first = self.caches[0]
        self.rows: list[EntryRows] = []
        for part in ("entries", "index_entries"):
            for i, e in enumerate(getattr(first, part)):
                if e is None:
                    continue
                members = [getattr(c, part)[i] for c in self.caches]
                shared = EntryRows(len(members), e.width, e.dtype, max(m.count for m in members))
                for b, m in enumerate(members):
                    m.move_to(shared, b)
                self.rows.append(shared)
        self._probe = next((e for e in (*first.entries, *first.index_entries) if e is not None), None)

    @classmethod
    def fits(cls, caches) -> bool:
        """Whether sharing rows pads the shorter sequences by little (their entries are what the KV
        budget counts): at most ``MAX_PADDING`` of their own room, or ``PADDING_ENTRIES`` a row."""
        if len(caches) < 2 or len({id(c) for c in caches}) != len(caches):
            return False
        counts = [max((e.count for e in c.entries if e is not None), default=0) for c in caches]
        need = room_for(max(counts) + 1)
        own = sum(room_for(n + 1) for n in counts)
        return len(caches) * need - own <= max(own * cls.MAX_PADDING, cls.PADDING_ENTRIES * len(caches))

    def holds(self, caches) -> bool:
        """Whether this batch's rows are exactly ``caches``', in order."""
        if len(caches) != len(self.caches) or any(a is not b for a, b in zip(caches, self.caches)):
            return False
        return self._probe is None or self._probe.rows is self.rows[0]

    def dissolve(self) -> None:
        for c in self.caches:
            for e in (*c.entries, *c.index_entries):
                if e is not None and any(e.rows is r for r in self.rows):
                    e.alone()
        self.caches, self.rows = [], []


def batch_entries(batch: EntryBatch | None, caches) -> EntryBatch | None:
    """The :class:`EntryBatch` a batched decode over ``caches`` reads: ``batch`` while it holds them,
    else a new one (``batch`` dissolved), or None where sharing rows would pad too much (each row's
    entries are then stacked per step)."""
    if batch is not None and batch.holds(caches):
        return batch
    if batch is not None:
        batch.dissolve()
    return EntryBatch(list(caches)) if EntryBatch.fits(caches) else None


class Deepseek4Cache(SequenceCache):
    """The compact cache of one sequence (see the module doc). Not a ``StackedDecode`` row: a batched
    decode reads each row's own raw and compressor rows, and its entries from an :class:`EntryBatch`."""

    #: the payload marking a point that ends a prefill transaction
    TRANSACTION_END = "end"

    def __init__(self, layers: list[LayerRows], window: int, dtype, interval: int = CHECKPOINT_INTERVAL,
                 keep: int = WINDOW_POINTS_KEPT, ends_kept: int = WINDOW_SNAPSHOTS_KEPT,
                 mtp_streams: tuple[int, int] | None = None):
        """``mtp_streams``: ``(hc, hidden)``, the shape of the trunk streams an MTP head pairs with (its last
        layer in ``layers``); None without a head."""
        super().__init__(len(layers), 1, layers[0].head_dim, dtype)
        self.specs, self.size = list(layers), window
        self.states = [self._empty_state(s) for s in self.specs]
        self.entries = [Entries(s.head_dim, dtype) if s.ratio else None for s in self.specs]
        self.index_entries = [Entries(s.index_dim, dtype) if s.overlap else None for s in self.specs]
        self.points = ReusePoints(interval, keep)
        #: transaction ends older than the kept points: length → rows per layer
        self.ends: dict[int, list[LayerState]] = {}
        self.ends_kept = ends_kept
        #: where the last forward started (its rows are all held until the next one)
        self._rollback: int | None = None
        #: the lengths inside the last forward, when it was a speculative verify (all its rows are held
        #: until the next forward, so a partial accept stops there instead of feeding the tokens again)
        self._verified: range = range(0)
        self._pending: dict[int, tuple[LayerState, int, int]] = {}
        self._transaction = True
        self.published_points = (0,)
        #: the persistent store's block size (``keep_block_ends``), None when off
        self.block_tokens: int | None = None
        #: length → what the prompt block ends reached and not exported yet keep (:class:`BlockEnd`)
        self._block_ends: dict[int, BlockEnd] = {}
        #: an MTP head's pairing rows (``models/deepseek4_mtp.py``): (position of the first, trunk streams
        #: ``[n, hc, hidden]``), None while the head is off or before the first forward
        self.mtp_hidden: tuple[int, mx.array] | None = None
        self.mtp_streams = mtp_streams
        #: ``(first position, trunk streams [n, hc, hidden])``: every row of the prompt forward in progress
        #: (the head's ``store``), which its block-end captures take their streams from; None outside one
        self.prompt_rows: tuple[int, mx.array] | None = None

    def _empty_state(self, s: LayerRows) -> LayerState:
        return LayerState(_empty_rows(s.head_dim, self.dtype),
                          _empty_rows(s.comp_width, self.dtype) if s.ratio else None,
                          _empty_rows(s.index_width, self.dtype) if s.overlap else None)

    # ---- what a length needs ----------------------------------------------------------------

    def raw_first(self, n: int) -> int:
        """The first raw row the query at ``n`` needs from the cache."""
        return max(0, n - self.size + 1)

    @staticmethod
    def comp_first(spec: LayerRows, n: int) -> int:
        """The first compressor row the blocks still open at ``n`` need."""
        return max(0, (n // spec.ratio - (1 if spec.overlap else 0)) * spec.ratio)

    def _needs(self, n: int):
        for spec, st in zip(self.specs, self.states):
            yield spec, st, self.raw_first(n), self.comp_first(spec, n) if spec.ratio else 0

    def _held(self, n: int) -> bool:
        return all(st.raw.start <= raw and (st.comp is None or st.comp.start <= comp)
                   for _, st, raw, comp in self._needs(n))

    def _state_at(self, n: int, end: int | None = None) -> list[LayerState]:
        """Every layer's rows from what ``n`` needs (which :meth:`_held`) up to ``end`` (default ``n``),
        as views of the live rows."""
        end = n if end is None else end
        return [LayerState(st.raw.cut(raw, end), st.comp.cut(comp, end) if st.comp is not None else None,
                           st.index.cut(comp, end) if st.index is not None else None)
                for _, st, raw, comp in self._needs(n)]

    # ---- the forward -------------------------------------------------------------------------

    def reserve(self, n_tokens: int) -> None:
        """Before a forward: let go of the rows neither the next query nor the one-position undo needs."""
        if self._awaiting_state:
            raise PrefixNotReusable("this deepseek4 cache was restored up to a block without its rows")
        self._pending = {}
        self._verified = range(0)
        self.prompt_rows = None
        if self._length and self._held(self._length - 1):  # (not after a return to a point: already minimal)
            self.states = self._state_at(self._length - 1, self._length)

    def stage(self, layer: int, state: LayerState, entries: int, index_entries: int, transaction: bool) -> None:
        """Layer ``layer``'s rows and entry counts after this forward (committed by :meth:`advance`)."""
        self._pending[layer] = (state, entries, index_entries)
        self._transaction = transaction

    def advance(self, n: int) -> None:
        if len(self._pending) != self.n_layers:
            raise RuntimeError("a deepseek4 forward did not stage every layer's rows")
        start = self._length
        for i, (state, e, ie) in sorted(self._pending.items()):
            self.states[i] = state
            if self.entries[i] is not None:
                self.entries[i].count = e
            if self.index_entries[i] is not None:
                self.index_entries[i].count = ie
        self._pending = {}
        self._length += n
        self._rollback = start
        self._verified = range(start + 1, start + n) if n > 1 and not self._transaction else range(0)
        self._add_points(start, n, self._transaction)
        self.published_points = self.reuse_points()

    def _add_points(self, start: int, n: int, transaction: bool) -> None:
        aged = self.points.add_reached(
            start, n, transaction, lambda p, end: (self.TRANSACTION_END if end else None, self._snapshot(p)))
        for p, (kind, rows) in aged.items():
            if kind == self.TRANSACTION_END:
                self.ends[p] = rows
        keep_newest(self.ends, self.ends_kept)
        self._capture_block_ends(start, n, transaction)

    def _snapshot(self, n: int) -> list[LayerState]:
        rows = [LayerState(*(None if r is None else Rows(r.start, own_copy(r.data))
                             for r in (st.raw, st.comp, st.index))) for st in self._state_at(n)]
        mx.eval([a for st in rows for a in st.arrays()])
        return rows

    def layer(self, i: int) -> tuple[LayerState, Entries | None, Entries | None]:
        return self.states[i], self.entries[i], self.index_entries[i]

    # ---- prefix operations ---------------------------------------------------------------------

    def reuse_points(self) -> tuple[int, ...]:
        points = {0, self._length} | {p for p in (*self.points, *self.ends) if p <= self._length}
        if self._verified.stop == self._length:  # (an import since the verify moved the length on)
            points |= set(self._verified)
        if self._rollback is not None and self._rollback <= self._length and self._held(self._rollback):
            points.add(self._rollback)
        return tuple(sorted(points))

    def trim(self, n_tokens: int) -> None:
        if n_tokens < 0 or n_tokens > self._length:
            raise ValueError(f"cannot trim a cache of {self._length} tokens to {n_tokens}")
        self._pending = {}
        self.prompt_rows = None
        if n_tokens == self._length:
            return
        self._awaiting_state = False
        for p in [p for p in self._block_ends if p > n_tokens]:
            del self._block_ends[p]
        if n_tokens == 0:
            self.states = [self._empty_state(s) for s in self.specs]
            self.points.clear()
            self.ends.clear()
        elif n_tokens in self.points:
            self.states = list(self.points[n_tokens][1])
        elif n_tokens in self.ends:
            self.states = list(self.ends[n_tokens])
        elif self._held(n_tokens):
            self.states = self._state_at(n_tokens)
        else:
            raise PrefixNotReusable(
                f"cannot trim a deepseek4 cache of {self._length} tokens to {n_tokens}: it keeps only the last "
                f"window's rows; it can return to {self.reuse_points()} tokens")
        self._cut_entries(n_tokens)
        self.points.drop_after(n_tokens)
        for p in [p for p in self.ends if p > n_tokens]:
            del self.ends[p]
        self._length = n_tokens
        self._rollback, self._verified = None, range(0)
        self.published_points = self.reuse_points()

    def _cut_entries(self, n: int) -> None:
        for spec, e, ie in zip(self.specs, self.entries, self.index_entries):
            for ents in (e, ie):
                if ents is not None:
                    ents.keep(n // spec.ratio)

    # ---- memory ----------------------------------------------------------------------------------

    @property
    def keys(self) -> list[mx.array]:
        """Every array the cache holds, the staged forward's included (what a forward's eval must reach)."""
        states = [self._pending[i][0] if i in self._pending else st for i, st in enumerate(self.states)]
        out = [a for st in states for a in st.arrays()] + ([self.mtp_hidden[1]] if self.mtp_hidden is not None else [])
        out += [self.prompt_rows[1]] if self.prompt_rows is not None else []  # what the block ends copy
        return out + [e.buf for e in (*self.entries, *self.index_entries) if e is not None and e.buf is not None]

    @property
    def values(self) -> list[mx.array]:
        return []

    @property
    def bytes_per_token(self) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        live = sum(a.nbytes for st in self.states for a in st.arrays())
        kept = [rows for _, rows in (self.points[p] for p in self.points)] + list(self.ends.values())
        kept += [e.rows for p, e in self._block_ends.items() if p not in self.points and p not in self.ends]
        copies = sum(a.nbytes for rows in kept for st in rows for a in st.arrays())
        streams = sum(e.hidden.nbytes for e in self._block_ends.values() if e.hidden is not None)
        return (live + copies + streams
                + sum(e.nbytes for e in (*self.entries, *self.index_entries) if e is not None))

    # ---- export / import ---------------------------------------------------------------------------

    @property
    def persist_kind(self) -> str:
        """``deepseek4``; ``deepseek4-mtp`` with an MTP head (its blocks carry the head's window layer like
        the trunk's, and the streams it pairs with next)."""
        return "deepseek4" if self.mtp_streams is None else "deepseek4-mtp"

    @property
    def block_ends(self) -> dict[int, BlockEnd]:
        return self._block_ends

    def keep_block_ends(self, block_tokens: int) -> None:
        """Capture the rows at every multiple of ``block_tokens`` a prompt's prefill reaches, until that
        block is exported (the persistent store turns this on for every slot's sequence)."""
        self.block_tokens = block_tokens

    def _capture_block_ends(self, start: int, n: int, transaction: bool) -> None:
        """The rows at the block ends a prompt forward of ``n`` tokens from ``start`` reached: the copy its
        reuse point there made, or (a point already aged out within this forward) a copy of the live
        rows, which hold every length inside the last forward; with a head, with the trunk streams before
        it, copied out of the forward's :attr:`prompt_rows`."""
        prompt_rows, self.prompt_rows = self.prompt_rows, None  # they live one forward only
        if not self.block_tokens or n <= 1 or not transaction:
            return
        for p in block_ends_reached(start, n, self.block_tokens):
            rows = self.points[p][1] if p in self.points else self._snapshot(p)
            hidden = kept_row_before(prompt_rows, p) if self.mtp_streams is not None else None
            self._block_ends[p] = BlockEnd(rows, hidden)
        keep_newest(self._block_ends, BLOCK_ENDS_KEPT)

    def _rows_at(self, end: int) -> list[LayerState] | None:
        if end == self._length or self._held(end):
            return self._state_at(end)
        if end in self._block_ends:
            return self._block_ends[end].rows
        if end in self.points:
            return self.points[end][1]
        return self.ends.get(end)

    def export(self, start: int, end: int) -> dict[str, np.ndarray]:
        """The entries closed in ``[start, end)`` and, where this still holds them, the rows ``end``
        needs (which the export then lets go of, if captured for it)."""
        if not 0 <= start <= end <= self._length:
            raise ValueError(f"export range [{start}, {end}) outside 0..{self._length}")
        rows = self._rows_at(end)
        hidden = self._hidden_at(end) if rows is not None else None
        if self.mtp_streams is not None and hidden is None:  # a head's sequence: all of its end state or none
            rows = None
        host = lambda a: np.array(a.astype(mx.float32))  # noqa: E731
        out = {}
        for i, spec in enumerate(self.specs):
            if spec.ratio:
                out[f"entries.{i}"] = host(self.entries[i].view(end // spec.ratio)[start // spec.ratio:])
            if spec.overlap:
                out[f"index_entries.{i}"] = host(self.index_entries[i].view(end // spec.ratio)[start // spec.ratio:])
            if rows is not None:
                out[f"{END_STATE_PREFIX}raw.{i}"] = host(rows[i].raw.data)
                if spec.ratio:
                    out[f"{END_STATE_PREFIX}comp.{i}"] = host(rows[i].comp.data)
                if spec.overlap:
                    out[f"{END_STATE_PREFIX}index.{i}"] = host(rows[i].index.data)
        if rows is not None:
            if hidden is not None:
                out[HIDDEN_STATE] = host(hidden)
            self._block_ends.pop(end, None)
        elif not out:  # a model of window layers only: a block is its end rows or nothing
            raise PrefixNotReusable(f"cannot export a deepseek4 cache of {self._length} tokens up to {end}: its "
                                    f"rows there are no longer held (it can: {self.reuse_points()})")
        return out

    def _hidden_at(self, end: int) -> mx.array | None:
        """The trunk streams before ``end`` an MTP head pairs with next, where this still holds them."""
        if self.mtp_streams is None:
            return None
        row = row_before(self.mtp_hidden, end) if end == self._length else None
        if row is None and end in self._block_ends:
            row = self._block_ends[end].hidden
        return row

    def _imported_hidden(self, arrays: dict[str, np.ndarray]) -> mx.array | None:
        """A head's sequence: the streams a block with end rows carries (checked), else None."""
        if self.mtp_streams is None or not has_end_state(arrays):
            return None
        got = None if HIDDEN_STATE not in arrays else tuple(np.shape(arrays[HIDDEN_STATE]))
        if got != tuple(self.mtp_streams):
            raise ValueError(f"KV block part {HIDDEN_STATE!r} has shape {got}, expected the MTP head's trunk streams "
                             f"{tuple(self.mtp_streams)}")
        return self._put(arrays, HIDDEN_STATE)

    def import_(self, arrays: dict[str, np.ndarray], n_tokens: int) -> None:
        """Append a block ``export`` gave: its entries, and its end rows as the live ones when it has them
        (with an MTP head, also the trunk streams it pairs with next)."""
        start, end = self._length, self._length + n_tokens
        with_rows = has_end_state(arrays)
        hidden = self._imported_hidden(arrays)
        self.mtp_hidden = None  # rows of another continuation may sit past the length
        rows = []
        for i, spec in enumerate(self.specs):
            raw_first, comp_first = self.raw_first(end), self.comp_first(spec, end) if spec.ratio else 0
            n_entries = end // spec.ratio - start // spec.ratio if spec.ratio else 0
            want = {}
            if spec.ratio:
                want[f"entries.{i}"] = (n_entries, spec.head_dim)
            if spec.overlap:
                want[f"index_entries.{i}"] = (n_entries, spec.index_dim)
            if with_rows:
                want[f"{END_STATE_PREFIX}raw.{i}"] = (end - raw_first, spec.head_dim)
                if spec.ratio:
                    want[f"{END_STATE_PREFIX}comp.{i}"] = (end - comp_first, spec.comp_width)
                if spec.overlap:
                    want[f"{END_STATE_PREFIX}index.{i}"] = (end - comp_first, spec.index_width)
            for name, shape in want.items():
                got = None if name not in arrays else tuple(np.shape(arrays[name]))
                if got != shape:
                    raise ValueError(f"layer {i}: KV block part {name!r} has shape {got}, expected {shape}")
            if with_rows:
                rows.append(LayerState(Rows(raw_first, self._put(arrays, f"{END_STATE_PREFIX}raw.{i}")),
                                       Rows(comp_first, self._put(arrays, f"{END_STATE_PREFIX}comp.{i}")) if spec.ratio else None,
                                       Rows(comp_first, self._put(arrays, f"{END_STATE_PREFIX}index.{i}")) if spec.overlap else None))
        for i, spec in enumerate(self.specs):  # every part checked: now append
            if spec.ratio:
                self.entries[i].count = self.entries[i].write(self._put(arrays, f"entries.{i}"))
            if spec.overlap:
                self.index_entries[i].count = self.index_entries[i].write(self._put(arrays, f"index_entries.{i}"))
        if with_rows:
            self.states = rows
            if hidden is not None:
                self.mtp_hidden = (end - 1, hidden[None])
        elif start and not self._awaiting_state:  # where a failed restore can be trimmed back to
            self.points.add(start, (None, self._snapshot(start)))
        self._awaiting_state = not with_rows
        mx.eval(self.keys)
        self._length, self._rollback = end, None
        if with_rows:  # the restored prefix's end stays a length to return to (a prompt diverging after it)
            self.points.add(end, (None, self._snapshot(end)))
        self.published_points = self.reuse_points()

    def _put(self, arrays: dict[str, np.ndarray], name: str) -> mx.array:
        return mx.array(arrays[name]).astype(self.dtype)
