"""One decode-first mixed GPU step, composed in the engine thread: decode rows, a prefill chunk, sampling.

The GPU owner (``hf2q.actors.gpu_owner``) plans each step and hands it here as one job; what
this module returns is per-slot ``Sampled`` / ``SampleError`` / ``Drafted`` (or None for a
prefill chunk that is not a prompt's last).
"""

from __future__ import annotations

from typing import Any

import attrs

from hf2q.engine.decode_pipeline import DecodePipeline
from hf2q.engine.sampling.rows import SampleError, guarded_sample, sample_rows


@attrs.frozen
class Drafted:
    """A speculative step's yield for its request: the accepted draft tokens and one of the model's
    own, in order (``len(tokens)`` tokens are now in the KV: the fed one and the accepted drafts)."""

    tokens: tuple[int, ...]
    drafted: int


def run_step(runner, decode: list, tokens: list[int], prefill,
             pipeline: DecodePipeline | None = None, first=None, draft: list[int] | None = None) -> dict[int, Any]:
    """One decode-first mixed step, in the GPU thread: slot → Sampled | SampleError | None.

    Every run of ``decode`` is fed its token of ``tokens`` in one batched ``runner.decode``
    — or, when ``pipeline`` can serve the batch (MLX graph, device-sampled rows), through the
    step it queued last time, queueing the next one before this one is read. A runner with
    ``decode_with_prefill`` takes the decode and the prefill chunk as one call (the CPU host
    step runs both as rows of one pass over the weights).
    ``first`` is the request whose first token ``prefill``'s logits give (its last chunk).
    ``draft`` (only with one decode run): tokens to verify after its fed token in one
    ``runner.verify`` forward (speculative decoding), or ``draft(runner)`` that drafts them here (the
    model's MTP head); its result is then ``Drafted`` (a plain step when no draft came).
    Errors raised by the runner propagate (they poison the engine).
    """
    results: dict[int, Any] = {}
    if callable(draft):
        if pipeline is not None:
            pipeline.settle()  # the draft reads the sequence's caches
        draft = draft(runner)
    if draft:
        if pipeline is not None:
            pipeline.settle()
        results[decode[0].slot] = _verify(runner, decode[0], tokens[0], draft)
        decode, tokens = [], []
    pipelined = pipeline is not None and bool(decode) and pipeline.usable(runner, decode)
    # the prefill's cache must hold only fed tokens before its trim: settled later, the queued step's
    # rollback would cut the reused prefix by one position (or, on a recurrent state, be refused)
    if pipeline is not None and (not pipelined or (prefill is not None and pipeline.holds(prefill.seq))):
        pipeline.settle()
    if prefill is not None and prefill.keep is not None:
        prefill.seq.trim(prefill.keep)  # its own cache: no decode row of this step reads it
    prefill_logits = None
    if pipelined:
        for r, res in zip(decode, pipeline.step(runner, decode, tokens)):
            results[r.slot] = res
    elif decode:
        seqs = [r.seq for r in decode]
        if prefill is not None and hasattr(runner, "decode_with_prefill"):
            logits, prefill_logits = runner.decode_with_prefill(seqs, tokens, prefill.seq, prefill.tokens)
        else:
            logits = runner.decode(seqs, tokens)
        for r, res in zip(decode, sample_rows(decode, logits)):
            results[r.slot] = res
    if prefill is not None:
        if prefill_logits is None:
            prefill_logits = runner.prefill(prefill.seq, prefill.tokens)
        results[prefill.slot] = guarded_sample(first, prefill_logits) if first is not None else None
    return results


def _verify(runner, run, token: int, draft: list[int]):
    """Feed ``token`` and ``draft`` in one forward, keep what the acceptance rule accepts."""
    from hf2q.engine.speculative import accept_draft, keep_accepted

    seq = run.seq
    start = seq.length
    rows = runner.verify(seq, [token] + list(draft))
    try:
        out = accept_draft(run.sampler, draft, rows, run.history)
    except Exception as e:  # noqa: BLE001 — a sampling failure is this request's alone
        keep_accepted(runner, seq, start, [token])
        return SampleError(500, "sampling_failed", f"sampling failed: {type(e).__name__}: {e}")
    keep_accepted(runner, seq, start, [token] + list(draft[:len(out) - 1]))  # the fed token and the accepted drafts
    return Drafted(tuple(out), len(draft))
