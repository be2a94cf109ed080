"""Which token ids each slot's KV holds, and which slot a new prompt should go to.

A slot keeps its ledger (and its KV) after a request ends, so the next request whose
prompt starts with the same tokens skips that much prefill. Routing is pure
bookkeeping: longest exact prefix among idle slots, else an empty slot, else the least
recently used one. No trio, no MLX.

A slot whose request has ended but that has not reported back yet is *finishing*: an agent
client sends its next turn the moment it reads the last event, often before the slot is free.
:meth:`SlotLedger.worth_waiting_for` says when such a slot will offer that turn more reuse than
any idle one, so admission waits for it instead of starting the turn cold elsewhere.
"""

from __future__ import annotations

from typing import Sequence

import attrs


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def reusable_prefix(held: Sequence[int], prompt: Sequence[int], *, whole_history_only: bool = False,
                    points: Sequence[int] | None = None) -> int:
    """Prompt tokens whose KV can be kept: the common prefix, leaving at least one token to
    compute (the last prompt token must go through the model to produce logits).

    A hybrid model's cache cannot be cut back anywhere (its recurrent state exists only at some
    lengths): ``points`` are the lengths it can return to, and the reuse is the longest of them
    within the common prefix; ``whole_history_only`` without points means only all of ``held`` or
    nothing."""
    n = min(common_prefix(held, prompt), max(len(prompt) - 1, 0))
    if points is not None:
        return max((p for p in points if p <= n), default=0)
    return 0 if whole_history_only and n != len(held) else n


@attrs.define
class SlotEntry:
    tokens: list[int] = attrs.Factory(list)
    busy: bool = False
    last_used: int = 0
    #: the lengths the slot's cache can be trimmed back to (hybrid models), None = any
    points: tuple[int, ...] | None = None
    #: busy, but its request has ended: the prompt it is known to hold once it reports back
    finishing: tuple[int, ...] | None = None


@attrs.frozen
class Route:
    slot: int
    cached_tokens: int


class SlotLedger:
    """Per-slot token ledgers, busy flags and an LRU clock."""

    def __init__(self, n_slots: int, *, whole_history_only: bool = False):
        if n_slots <= 0:
            raise ValueError("need at least one slot")
        self.entries = [SlotEntry() for _ in range(n_slots)]
        self._clock = 0
        #: the model's caches cannot be trimmed to an earlier position (see :func:`reusable_prefix`)
        self.whole_history_only = whole_history_only

    def __len__(self) -> int:
        return len(self.entries)

    def tokens(self, slot: int) -> list[int]:
        return self.entries[slot].tokens

    def idle_slots(self) -> list[int]:
        return [i for i, e in enumerate(self.entries) if not e.busy]

    def busy_slots(self) -> list[int]:
        return [i for i, e in enumerate(self.entries) if e.busy]

    def resident_tokens(self, slot: int) -> int:
        return len(self.entries[slot].tokens)

    def route(self, prompt: Sequence[int], *, exclude: Sequence[int] = ()) -> Route | None:
        """Best idle slot for ``prompt``, or None if every slot is busy.

        Longest reusable prefix wins (ties: the least recently used); with no reuse at all,
        an empty slot beats evicting someone's cache, and among non-empty ones the LRU goes.
        """
        best: tuple | None = None
        for i, e in enumerate(self.entries):
            if e.busy or i in exclude:
                continue
            cached = reusable_prefix(e.tokens, prompt, whole_history_only=self.whole_history_only, points=e.points)
            key = (cached, cached == 0 and not e.tokens, -e.last_used, -i)
            if best is None or key > best[0]:
                best = (key, i, cached)
        if best is None:
            return None
        return Route(best[1], best[2])

    def mark_finishing(self, slot: int, prompt: Sequence[int]) -> None:
        """The busy slot's request has ended; it will soon be idle holding at least ``prompt``."""
        e = self.entries[slot]
        if e.busy and e.finishing is None:
            e.finishing = tuple(prompt)

    def worth_waiting_for(self, prompt: Sequence[int], cached: int, min_gain: int) -> bool:
        """Whether a finishing slot will reuse at least ``min_gain`` more prompt tokens than ``cached``
        (what the best idle slot offers now)."""
        room = max(len(prompt) - 1, 0)
        return any(min(common_prefix(e.finishing, prompt), room) - cached >= min_gain
                   for e in self.entries if e.busy and e.finishing is not None)

    def acquire(self, slot: int, keep_tokens: int) -> None:
        """Mark ``slot`` busy; its ledger keeps only the first ``keep_tokens`` ids."""
        e = self.entries[slot]
        if e.busy:
            raise RuntimeError(f"slot {slot} is already busy")
        if keep_tokens > len(e.tokens):
            raise ValueError(f"slot {slot} holds {len(e.tokens)} tokens, cannot keep {keep_tokens}")
        del e.tokens[keep_tokens:]
        e.points = None if e.points is None else tuple(p for p in e.points if p <= keep_tokens)
        e.busy = True
        self._touch(e)

    def extend(self, slot: int, tokens: Sequence[int]) -> None:
        """Record that the slot's KV now also holds ``tokens``."""
        self.entries[slot].tokens.extend(tokens)

    def replace(self, slot: int, tokens: Sequence[int], points: Sequence[int] | None = None) -> None:
        """The busy slot's KV now holds exactly ``tokens`` (and, for a hybrid model, can be trimmed
        back to ``points``)."""
        e = self.entries[slot]
        if not e.busy:
            raise RuntimeError(f"slot {slot} is idle")
        e.tokens[:] = list(tokens)
        e.points = None if points is None else tuple(p for p in points if p <= len(e.tokens))

    def release(self, slot: int) -> None:
        """The request ended; the slot keeps its ledger for prefix reuse."""
        e = self.entries[slot]
        if not e.busy:
            raise RuntimeError(f"slot {slot} released twice")
        e.busy = False
        e.finishing = None
        self._touch(e)

    def evict(self, slot: int) -> int:
        """Forget an idle slot's cache; returns the number of tokens dropped."""
        e = self.entries[slot]
        if e.busy:
            raise RuntimeError(f"cannot evict busy slot {slot}")
        n = len(e.tokens)
        e.tokens.clear()
        e.points = None if e.points is None else (0,)
        return n

    def _touch(self, e: SlotEntry) -> None:
        self._clock += 1
        e.last_used = self._clock
