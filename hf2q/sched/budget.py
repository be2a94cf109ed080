"""KV budget accounting and the admission decision (pure).

One physical KV budget is shared by every slot. A running request reserves
KV for its whole life — ``min(prompt + max_tokens, ctx)`` tokens — so it can never run
out mid-stream. Idle slots keep their cached KV, but that cache is evictable: admission
drops the least recently used idle caches when the newcomer would not fit otherwise.

- can never fit (prompt longer than the context, or its reservation larger than the
  whole budget) → ``Never`` (the API answers 400);
- cannot fit now (no idle slot, a finishing slot about to offer much more reuse than any idle
  one, or the running reservations leave too little) → ``Wait`` (queue, or 429 when the queue
  is full);
- otherwise ``Admit(slot, cached_tokens, evict)``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import attrs

from hf2q.sched.ledger import SlotLedger, reusable_prefix

#: prompt tokens a finishing slot must save over the best idle one before a request waits for it
FINISHING_MIN_GAIN = 16


@attrs.frozen
class Admit:
    slot: int
    cached_tokens: int
    evict: tuple[int, ...] = ()  # idle slots whose cached KV must be dropped first


@attrs.frozen
class Wait:
    reason: str  # "slots" (all busy) | "kv" (budget held by running requests)


@attrs.frozen
class Never:
    code: str  # "context_length_exceeded" | "kv_budget_unsatisfiable"
    message: str


@attrs.frozen
class KvBudget:
    bytes_per_token: int
    budget_bytes: int
    ctx: int  # per slot, full (never divided by the slot count)

    def reservation(self, prompt_len: int, max_tokens: int) -> int:
        """Tokens of KV a request may need over its whole life."""
        return min(prompt_len + max_tokens, self.ctx)

    def never_fits(self, prompt_len: int, max_tokens: int) -> Never | None:
        if prompt_len == 0:
            return Never("invalid_request", "the prompt is empty")
        if prompt_len >= self.ctx:
            return Never("context_length_exceeded",
                         f"prompt has {prompt_len} tokens; the per-slot context is {self.ctx} "
                         f"(at least one token must remain for the answer)")
        need = self.reservation(prompt_len, max_tokens) * self.bytes_per_token
        if need > self.budget_bytes:
            return Never("kv_budget_unsatisfiable",
                         f"request needs {need} bytes of KV ({prompt_len} prompt + up to {max_tokens} "
                         f"new tokens) but the whole KV budget is {self.budget_bytes} bytes")
        return None

    def decide(self, ledger: SlotLedger, reservations: Mapping[int, int], prompt: Sequence[int],
               max_tokens: int) -> Admit | Wait | Never:
        """Where ``prompt`` goes now. ``reservations``: tokens reserved by each busy slot."""
        never = self.never_fits(len(prompt), max_tokens)
        if never is not None:
            return never
        route = ledger.route(prompt)
        if route is None or ledger.worth_waiting_for(prompt, route.cached_tokens, FINISHING_MIN_GAIN):
            return Wait("slots")
        need = self.reservation(len(prompt), max_tokens)
        busy = sum(reservations.get(s, ledger.resident_tokens(s)) for s in ledger.busy_slots())
        idle = [s for s in ledger.idle_slots() if s != route.slot]
        held = {s: ledger.resident_tokens(s) for s in idle}
        total = busy + need + sum(held.values())
        evict: list[int] = []
        for s in sorted(idle, key=lambda s: ledger.entries[s].last_used):
            if total <= self.budget_tokens:
                break
            if held[s]:
                evict.append(s)
                total -= held[s]
        if total > self.budget_tokens:
            return Wait("kv")
        return Admit(route.slot, route.cached_tokens, tuple(evict))

    @property
    def budget_tokens(self) -> int:
        return self.budget_bytes // max(self.bytes_per_token, 1)


def cached_after_restore(held: Sequence[int], prompt: Sequence[int], on_disk: int) -> int:
    """Tokens reused when a slot holding ``held`` could also restore ``on_disk`` prompt tokens
    from the persistent store: whichever prefix is longer (leaving one token to compute)."""
    return max(reusable_prefix(held, prompt), min(on_disk, max(len(prompt) - 1, 0)))
