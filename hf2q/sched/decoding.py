"""When a decoding request ends: the token-level stop rules, as one pure function.

The GPU owner's step loop applies it once to every sampled token, right after the step:
``stop`` / ``length`` end the request there, otherwise the token is sent and fed to the
next batched step. Only a client that leaves (or a stop string the API finds) ends a
request earlier, and that is observed at the next step boundary.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class DecodeLimits:
    """The token-level limits of one request."""

    eos_ids: frozenset[int]  # the model's end-of-generation tokens
    stop_ids: frozenset[int]  # the request's stop_token_ids
    max_tokens: int  # completion tokens allowed
    ctx: int  # per-slot context: the KV may hold at most this many tokens

    def after_token(self, token: int, emitted: int, resident: int) -> str | None:
        """Verdict on a freshly sampled ``token``.

        ``emitted``: completion tokens already sent before this one; ``resident``: tokens
        in the slot's KV now (prompt + tokens fed so far; ``token`` is not in it yet).
        Returns ``"stop"`` (an end-of-generation or stop id: the token is not sent),
        ``"length"`` (the token is sent, then the request ends: ``max_tokens`` reached or
        no room in the context to feed it), or None (send it and feed it to the next step).
        """
        if token in self.eos_ids or token in self.stop_ids:
            return "stop"
        if emitted + 1 >= self.max_tokens or resident + 1 > self.ctx:
            return "length"
        return None
