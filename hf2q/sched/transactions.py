"""How one prompt's prefill is cut into bounded transactions (pure).

A transaction is the prompt rows one GPU step computes for one slot. Its size is a per-family
candidate: Gemma 4 takes 4,096 rows (an eager-versus-resumed parity test through the server checks
that a resumed prefill gives the same tokens as one eager forward), every other family the 2,048
it had before. An operator's ``--prefill-chunk`` wins over the candidate.

The cuts also land on the prompt's *stable-prefix boundary*: where the part of the prompt that the
conversation's next request repeats (the rendered history, without the generation prompt) ends. A
transaction that ends there leaves the cache in a state the next turn resumes from — a hybrid model
keeps a recurrent reuse point at every transaction's end, and a windowed layer can keep its window
there — instead of one somewhere inside the generation prompt that the next turn rewrites.

The row ceiling is shared, never multiplied: a GPU step runs at most one transaction
(:mod:`hf2q.sched.planner`), so however many cold prompts are installed, one step computes at most
one transaction's rows, and the prompts take turns by slot.
"""

from __future__ import annotations

from hf2q.sched.planner import prefill_chunks

#: rows per transaction for the families without a candidate of their own
DEFAULT_TRANSACTION_TOKENS = 2048
#: per-family candidates (GGUF ``general.architecture``)
FAMILY_TRANSACTION_TOKENS = {"gemma4": 4096}


def transaction_tokens(arch: str | None, configured: int | None) -> int:
    """Rows per transaction: the operator's ``configured`` value, else the family's candidate."""
    if configured is not None:
        return configured
    return FAMILY_TRANSACTION_TOKENS.get(arch or "", DEFAULT_TRANSACTION_TOKENS)


def plan_transactions(start: int, end: int, chunk: int, boundary: int = 0) -> list[tuple[int, int]]:
    """``[start, end)`` in transactions of at most ``chunk`` rows, one of them ending at ``boundary``
    when it falls strictly inside the range (the stable-prefix boundary; 0: none)."""
    if start < boundary < end:
        return prefill_chunks(start, boundary, chunk) + prefill_chunks(boundary, end, chunk)
    return prefill_chunks(start, end, chunk)
