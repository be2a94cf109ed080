"""One slot's live numbers: what the operator view shows and what a request's ``Finished`` reports.

Written by the slot while it prefills and by the GPU owner's step loop while the request
decodes (the two never run at once for one request); read by the snapshot at any time.
It holds counts and times, never prompt text.
"""

from __future__ import annotations

import attrs

from hf2q.sched.contracts import Finished


@attrs.define
class SlotProgress:
    request_id: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    new_tokens: int = 0
    submitted_at: float = 0.0
    prefilled_tokens: int = 0
    prefill_seconds: float = 0.0
    generated_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    resident_tokens: int = 0  # tokens in the slot's KV now

    def prefill_rate(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    def decode_rate(self) -> float:
        if self.first_token_at is None or self.last_token_at is None or self.generated_tokens < 2:
            return 0.0
        span = self.last_token_at - self.first_token_at
        return (self.generated_tokens - 1) / span if span > 0 else 0.0

    def token_sent(self, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        self.generated_tokens += 1

    def finished(self, reason: str, now: float) -> Finished:
        """The request's terminal ``Finished`` with its usage and speeds."""
        first = self.first_token_at if self.first_token_at is not None else now
        return Finished(reason, self.prompt_tokens, self.generated_tokens, self.cached_tokens,
                        (first - self.submitted_at) * 1000.0, self.prefill_rate(), self.decode_rate())
