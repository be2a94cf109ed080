"""The contract between the serving runtime and the model engine.

The GPU-owner actor (``hf2q/actors/gpu_owner.py``) is the only caller of a
``ModelRunner`` on the serving path, always from its one dedicated thread. Everything
here exchanges plain Python / numpy values so the scheduler, slots and tests never
import MLX. ``hf2q.engine.runner.MlxModelRunner`` is the real implementation;
``tests`` use fakes that honour the same contract.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class SequenceKV(Protocol):
    """One conversation's KV cache. Owned by exactly one slot at a time."""

    @property
    def length(self) -> int:
        """Tokens whose keys/values are held (positions ``0 .. length-1``)."""

    @property
    def nbytes(self) -> int:
        """Bytes of KV currently allocated for this sequence."""

    def trim(self, n_tokens: int) -> None:
        """Keep only the first ``n_tokens`` positions (prefix reuse)."""


class ModelRunner(Protocol):
    vocab_size: int
    n_ctx_train: int
    n_ctx: int  # the context this runner was loaded for (``--ctx``, default n_ctx_train); longer → InputError
    kv_bytes_per_token: int  # all layers, K and V, at the engine's KV dtype
    eos_token_ids: frozenset[int]
    is_embedding_model: bool
    #: what the KV values depend on besides the model file — backend, device kind, KV dtype (and
    #: anything else that changes them, e.g. a tensor-parallel split), e.g. "mlx-cpu-cpu-float32".
    #: The persistent KV store folds it into its fingerprint so blocks written by one engine are
    #: never imported by another. Read from the engine thread.
    kv_identity: str

    def new_sequence(self) -> SequenceKV: ...

    def prefill(self, seq: SequenceKV, tokens: Sequence[int]) -> np.ndarray:
        """Append ``tokens`` to ``seq`` and return float32 logits ``[vocab]`` of the last one.

        One call is one bounded GPU transaction; callers split long prompts into chunks.
        """

    def decode(self, seqs: Sequence[SequenceKV], tokens: Sequence[int]) -> np.ndarray:
        """Advance every sequence by one token in a single batched forward; float32 ``[N, vocab]``."""

    def embed(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        """Pooled, L2-normalised embeddings ``[N, dim]`` (embedding models only)."""

    def export_kv(self, seq: SequenceKV, start: int, end: int) -> dict[str, np.ndarray]:
        """Host copies of positions ``[start, end)`` of every layer's K and V (for the persistent store)."""

    def import_kv(self, seq: SequenceKV, arrays: dict[str, np.ndarray], n_tokens: int) -> None:
        """Append ``n_tokens`` positions exported by ``export_kv`` to ``seq``."""
