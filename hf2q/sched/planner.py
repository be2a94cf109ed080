"""The step planner: what the next GPU step does (pure).

Every GPU step is one *decode-first mixed step*: one batched decode for every
slot that is decoding, and/or one bounded prefill transaction. Decoding slots therefore
never wait for a long prompt — a 100k-token prefill is cut into ``prefill_chunk``-sized
transactions and every decoding slot advances between them. When several prompts are
prefilling they take turns (round-robin by slot number), so a short prompt that arrives
during a long prefill gets its first token after one transaction, not after the long one.
"""

from __future__ import annotations

from typing import Iterable

import attrs


def prefill_chunks(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into transactions of at most ``chunk`` tokens."""
    if chunk <= 0:
        raise ValueError("prefill chunk must be positive")
    return [(a, min(a + chunk, end)) for a in range(start, end, chunk)]


@attrs.frozen
class Step:
    decode: tuple[int, ...]  # slots advanced together by one batched decode
    prefill: int | None  # slot whose pending prefill transaction runs in this step

    @property
    def empty(self) -> bool:
        return not self.decode and self.prefill is None


class StepPlanner:
    """Chooses each step from the slots that have posted work; remembers the round-robin turn."""

    def __init__(self, n_slots: int):
        self.n_slots = n_slots
        self._last_prefill = n_slots - 1  # so slot 0 gets the first turn

    def plan(self, decode_ready: Iterable[int], prefill_ready: Iterable[int]) -> Step:
        decode = tuple(sorted(set(decode_ready)))
        waiting = set(prefill_ready)
        chosen = None
        for k in range(1, self.n_slots + 1):
            s = (self._last_prefill + k) % self.n_slots
            if s in waiting:
                chosen = s
                break
        if chosen is not None:
            self._last_prefill = chosen
        return Step(decode, chosen)
