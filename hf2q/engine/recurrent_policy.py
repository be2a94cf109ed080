"""How much recurrent state a hybrid-model sequence keeps (qwen35, qwen35moe), without MLX, so the
memory plan and ``hf2q info`` count what the cache (``engine/kv_cache.py``) holds.

Besides the live state a sequence keeps the state before its last forward (the decode pipeline's
rollback) and up to ``CHECKPOINTS_KEPT`` reuse points, one every ``CHECKPOINT_INTERVAL`` tokens and
one at the end of each prefill transaction (docs/ENGINE.md, "Hybrid recurrent state").
"""

#: tokens between two kept recurrent-state checkpoints (a diverging prompt recomputes at most this many)
CHECKPOINT_INTERVAL = 256
#: most reuse points one sequence keeps (the oldest go first)
CHECKPOINTS_KEPT = 16
#: copies of the state one sequence may hold at once: live, rollback, reuse points
STATES_PER_SEQUENCE = 2 + CHECKPOINTS_KEPT
