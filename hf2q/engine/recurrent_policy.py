"""Reuse points: where a sequence whose cache cannot be cut back token by token can still return to,
and how much it keeps for them. No MLX, so the memory plan and ``hf2q info`` count what the cache
(``engine/kv_cache.py``) holds.

Two parts of a cache cannot be cut anywhere: a hybrid model's recurrent state (qwen35, qwen35moe),
which summarises the whole history, and the K/V of sliding-window layers (gemma4, gemma3), which keep only the
positions a future query can still see. Both use the same points: one every ``CHECKPOINT_INTERVAL``
tokens and one at the end of each prefill transaction, the newest of them kept (docs/ENGINE.md,
"Hybrid recurrent state" and "Sliding-window layers"). A recurrent point carries a copy of the state;
a window point carries no copy — the window's buffer keeps the positions back to the oldest point's
window, in whole ``KV_GROW`` steps.
"""

from __future__ import annotations

import os

#: tokens between two kept reuse points (a diverging prompt recomputes at most this many)
CHECKPOINT_INTERVAL = 256
#: most recurrent-state reuse points one sequence keeps (the oldest go first)
CHECKPOINTS_KEPT = 16
#: copies of the recurrent state one sequence may hold at once: live, rollback, reuse points
STATES_PER_SEQUENCE = 2 + CHECKPOINTS_KEPT
#: block-end states a sequence keeps for the persistent store until they are exported (the newest);
#: with ``--kv-persist`` each may be one more copy beside the reuse points (a recurrent state, or the
#: window layers' last ``window`` rows)
BLOCK_ENDS_KEPT = 16
#: most reuse points a sliding-window sequence keeps: each holds the positions since it in every
#: window layer, so fewer than the recurrent state's (whose points cost one state each)
WINDOW_POINTS_KEPT = 4
#: transaction ends (prompt ends) a sliding-window sequence still keeps once they are older than its
#: kept points, each as a snapshot of its window: a reply longer than those points must not cost the
#: next turn its whole prompt (a template that drops the reply's reasoning diverges right there)
WINDOW_SNAPSHOTS_KEPT = 2
#: KV buffers grow, and a window buffer moves its first position, in steps of this many positions
KV_GROW = 256


def swa_full() -> bool:
    """``HF2Q_SWA_FULL=1``: sliding layers keep every position (prefix reuse anywhere), at the memory
    cost of a full cache; read by the runner, the memory plan and ``info`` alike."""
    return os.environ.get("HF2Q_SWA_FULL", "") not in ("", "0")


def room_for(n_tokens: int) -> int:
    """The capacity that holds ``n_tokens`` positions: buffers grow in whole steps of ``KV_GROW``."""
    return ((n_tokens + KV_GROW - 1) // KV_GROW) * KV_GROW


def window_positions(window: int, new_tokens: int = 1) -> int:
    """Most positions one sliding-window layer of a sequence holds while a forward of ``new_tokens``
    runs: the window, the ``WINDOW_POINTS_KEPT`` intervals back to the oldest kept point, the step the
    first position moves by, the forward's own tokens (a decode step: 1), and a window per snapshot."""
    live = room_for(WINDOW_POINTS_KEPT * CHECKPOINT_INTERVAL + window + KV_GROW + new_tokens)
    return live + WINDOW_SNAPSHOTS_KEPT * window


def block_ends_reached(start: int, n_new: int, block_tokens: int | None) -> range:
    """The persistent store's block ends (multiples of ``block_tokens``) a forward of ``n_new`` tokens from
    ``start`` reaches, its last position included; none when the store captures nothing."""
    if not block_tokens:
        return range(0)
    return range((start // block_tokens + 1) * block_tokens, start + n_new + 1, block_tokens)


def keep_newest(held: dict, kept: int) -> None:
    """Drop the lowest lengths of ``held`` (length → state) until at most ``kept`` remain."""
    while len(held) > kept:
        del held[min(held)]


class ReusePoints:
    """The lengths a sequence keeps a reuse point at, each with what that part of the cache needs to
    return there (a recurrent state; nothing for a window, whose buffer keeps the positions).

    A point falls at every multiple of ``interval`` a forward reaches and at the end of a prefill
    transaction; the newest ``keep`` are kept."""

    def __init__(self, interval: int = CHECKPOINT_INTERVAL, keep: int = CHECKPOINTS_KEPT):
        self.interval, self.keep = interval, keep
        self._at: dict[int, object] = {}

    def __contains__(self, length: int) -> bool:
        return length in self._at

    def __iter__(self):
        return iter(sorted(self._at))

    def __len__(self) -> int:
        return len(self._at)

    def __getitem__(self, length: int):
        return self._at[length]

    def add(self, length: int, payload: object = None) -> dict[int, object]:
        """Keep a point at ``length``; the oldest beyond ``keep`` are dropped (and returned)."""
        self._at[length] = payload
        dropped = {}
        while len(self._at) > self.keep:
            oldest = min(self._at)
            dropped[oldest] = self._at.pop(oldest)
        return dropped

    def due(self, start: int, n_new: int) -> list[int]:
        """Positions strictly inside a forward of ``n_new`` tokens from ``start`` where a point falls
        (multiples of ``interval``); relative to ``start``."""
        first = (start // self.interval + 1) * self.interval
        return [p - start for p in range(first, start + n_new, self.interval)]

    def add_reached(self, start: int, n_new: int, transaction: bool,
                    payload=lambda length, ends_transaction: None) -> dict[int, object]:
        """Keep every point a forward of ``n_new`` tokens from ``start`` reaches (inside it, and at its
        end); ``payload(length, ends_transaction)`` is what each carries. Returns the points pushed out
        (the caller decides what of them to keep otherwise, e.g. a prompt end's copy)."""
        aged: dict[int, object] = {}
        for cut in self.due(start, n_new):
            aged |= self.add(start + cut, payload(start + cut, False))
        end = start + n_new
        if self.ends_at(end, n_new, transaction):
            aged |= self.add(end, payload(end, n_new > 1 and transaction))
        return aged

    def ends_at(self, end: int, n_new: int, transaction: bool) -> bool:
        """Whether a forward of ``n_new`` tokens that ends at ``end`` leaves a point there: the end of
        a prefill transaction, or a multiple of ``interval``."""
        return (n_new > 1 and transaction) or end % self.interval == 0

    def drop_after(self, length: int) -> None:
        for p in [p for p in self._at if p > length]:
            del self._at[p]

    def clear(self) -> None:
        self._at.clear()
