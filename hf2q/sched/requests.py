"""The request records and channel events, re-exported from their home ``hf2q.sched.contracts``."""

from hf2q.sched.contracts import (  # noqa: F401
    TERMINAL,
    Admitted,
    EmbeddingRequest,
    Failed,
    Finished,
    GenerationRequest,
    PrefillProgress,
    SamplingParams,
    Token,
)
