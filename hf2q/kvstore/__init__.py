"""Persistent block-prefix KV cache (``serve --kv-persist DIR``; docs/KVSTORE.md).

A prompt's KV is saved in blocks of ``BLOCK_TOKENS`` tokens, one file per block, keyed by
a hash chained over (parent block hash, model fingerprint, token ids), so block *i* of two
prompts is shared exactly when they agree on all tokens up to its end. A restarted server
rebuilds a slot from the longest stored prefix instead of recomputing it.

Runtime integration (stable API)::

    fp = model_fingerprint(gguf_path, quant, chat_template, format_version=KV_LAYOUT_VERSION)
    store = BlockStore.open(dir, fp, budget_bytes)       # blocking: run before serving / in a thread
    store.recovery                                       # RecoveryReport (log it, export it)
    async with open_kv_writer(store, capacity=8) as writer:   # hf2q.actors.kv_writer
        # hydrate: when the disk holds more of the prompt than the chosen slot
        seq.keep_block_ends(BLOCK_TOKENS)                # a hybrid / V4 / windowed cache: capture end states
        plan = plan_restore(store, tokens, slot_cached,  # cheap, index only; None = nothing to do
                            seq.published_points, seq.persist_kind)  # (None, "" for plain K/V)
        seq.trim(plan.keep_tokens)                       # on the GPU thread
        blocks = []
        for imp in plan.imports:
            try:
                blocks.append(store.read(imp.meta))      # blocking, verified
            except BlockUnavailable:
                break                                    # keep the blocks read so far
        while blocks and not plan.imports[len(blocks) - 1].meta.has_end_state:
            blocks.pop()                                 # stop only where the end's state is saved
        for arrays, imp in zip(end_rows_last_only(blocks, seq.persist_kind), plan.imports):  # window rows once
            runner.import_kv(seq, arrays, imp.n_tokens)  # on the GPU thread
        # report plan.cached_tokens (minus any blocks that failed to read) as cached_tokens
        # persist: after prefill, for blocks not yet on disk
        for span in store.missing_spans(tokens):
            arrays = runner.export_kv(seq, span.start, span.end)   # on the GPU thread
            writer.submit_nowait(KVBlock.from_span(span, tokens, arrays, seq.persist_kind))  # False = skipped
    store.stats()                                        # StoreStats for /metrics
    store.close()

``block_hashes(fingerprint, tokens)`` gives the chain without a store. ``store.read`` and
``BlockStore.open`` do blocking file I/O: call them via ``trio.to_thread.run_sync`` (no MLX
involved) or before the event loop starts.
"""

from hf2q.kvstore.blockfile import FORMAT_VERSION, BlockFileError, BlockMeta
from hf2q.kvstore.fingerprint import BLOCK_TOKENS, block_hashes, model_fingerprint
from hf2q.kvstore.hydrate import BlockImport, RestorePlan, end_rows_last_only, plan_restore
from hf2q.kvstore.recovery import RecoveryReport
from hf2q.kvstore.store import BlockSpan, BlockStore, BlockUnavailable, KVBlock, StoreStats

__all__ = [
    "BLOCK_TOKENS", "FORMAT_VERSION", "BlockFileError", "BlockImport", "BlockMeta", "BlockSpan", "BlockStore",
    "BlockUnavailable", "KVBlock", "RecoveryReport", "RestorePlan", "StoreStats", "block_hashes",
    "model_fingerprint", "open_kv_writer", "plan_restore", "end_rows_last_only",
]


def __getattr__(name):  # the writer actor imports trio; load it only when asked for
    if name == "open_kv_writer":
        from hf2q.actors.kv_writer import open_kv_writer

        return open_kv_writer
    raise AttributeError(name)
