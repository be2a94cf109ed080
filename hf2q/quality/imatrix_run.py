"""Computing an importance matrix with our own engine: tokenize the corpus, run it chunk by chunk,
let the collector watch every matrix product, write llama.cpp's ``.imatrix.gguf``.

The chunking is llama-imatrix's: the whole text is tokenized once with the model's special tokens
added (BOS when the vocabulary asks for it) and special-token text left as plain text; it is cut
into ``n_ctx``-token chunks (at least two are needed, the remainder is dropped, ``--chunks`` keeps
the first N); each chunk starts a fresh context with its first token replaced by BOS (when the
model adds one), and every position of the chunk flows through every layer. A chunk longer than
llama.cpp's default micro-batch (:data:`MICRO_BATCH` tokens) is fed in pieces of that size, so the
small-batch rule of :mod:`hf2q.quality.imatrix_collect` applies to the same rows as there.

An HF checkpoint directory is first converted to a temporary F16 GGUF by our converter (beside
the output, deleted afterwards); a GGUF is used as it is.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from hf2q.errors import InputError
from hf2q.quality.corpus import Corpus
from hf2q.quality.logit_sources import gguf_of
from hf2q.quality.scores import windows

log = logging.getLogger("hf2q.imatrix")

#: llama.cpp's default ``n_ubatch``: the most tokens one graph evaluation takes
MICRO_BATCH = 512
DEFAULT_N_CTX = 512


@dataclass
class ImatrixSummary:
    """What a run produced (the ``--json`` summary)."""

    output: str
    model: str
    dataset: str
    n_ctx: int
    chunks: int
    corpus_tokens: int
    entries: int
    seconds: float
    partial: list[str] = field(default_factory=list)  # expert tensors some experts never saw

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def corpus_chunks(gguf_path: Path, corpus: Corpus, n_ctx: int, chunks: int | None) -> tuple[list[list[int]], int]:
    """The chunks of ``corpus`` under the GGUF's tokenizer, and the corpus's token count."""
    from hf2q.text.tokenizer import GGUFTokenizer

    tokenizer = GGUFTokenizer.from_gguf(gguf_path)
    tokens = tokenizer.encode(corpus.text, add_special=True, parse_special=False)
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    try:  # llama-imatrix cuts the text as llama-perplexity does: one chunker for both
        pieces = windows(tokens, n_ctx, chunks, bos)
    except ValueError as e:
        raise InputError(f"corpus {corpus.name}: {e}") from None
    return pieces.tolist(), len(tokens)


def collect(gguf_path: Path, pieces: list[list[int]], progress=None) -> dict:
    """Run the engine over the token chunks ``pieces``; the collector's result."""
    import mlx.core as mx

    from hf2q.engine import layers
    from hf2q.engine.factory import load_runner
    from hf2q.engine.kv_cache import ForwardBatch
    from hf2q.quality.imatrix_collect import ImatrixCollector

    runner = load_runner(gguf_path, ctx=max(len(p) for p in pieces))
    if runner.is_embedding_model:
        raise InputError(f"{gguf_path.name} is an embedding model; imatrix needs a generative one")
    collector = ImatrixCollector()
    layers.set_observer(collector)
    try:
        for chunk in pieces:
            seq = runner.new_sequence()
            for a in range(0, len(chunk), MICRO_BATCH):
                part = chunk[a:a + MICRO_BATCH]
                fb = ForwardBatch([seq], len(part))
                logits = runner.model(mx.array([part], dtype=mx.int32), fb, last_only=True)
                mx.eval(logits, fb.eval_state())
                fb.finish()
            if progress is not None:
                progress.advance(1)
    finally:
        layers.set_observer(None)
    return collector.result()


def compute_imatrix(model: Path, corpus: Corpus, output: Path, n_ctx: int = DEFAULT_N_CTX,
                    chunks: int | None = None, threads: int | None = None) -> ImatrixSummary:
    """Compute and write the importance matrix of ``model`` over ``corpus`` to ``output``."""
    from hf2q.progress import progress_bar
    from hf2q.sources.imatrix import write_imatrix

    t0 = time.perf_counter()
    output = Path(output)
    if not output.parent.is_dir():
        raise InputError(f"output directory {output.parent} does not exist")
    with gguf_of(Path(model), output.parent, threads, prefix=".hf2q-imatrix-") as g:
        pieces, n_tokens = corpus_chunks(g, corpus, n_ctx, chunks)
        with progress_bar(f"imatrix over {corpus.name}", len(pieces)) as bar:
            entries = collect(g, pieces, bar)
    if not entries:
        raise InputError(f"{model}: no blk.* matrix products were seen; nothing to write")
    write_imatrix(output, entries, datasets=(corpus.name,), chunk_count=len(pieces), chunk_size=n_ctx)
    partial = [name for name, (_, counts) in entries.items() if counts.size > 1 and (counts == 0).any()]
    for name in partial:
        log.warning("imatrix entry %s has experts that saw no tokens (they get weight 1)", name)
    return ImatrixSummary(str(output), str(model), corpus.name, n_ctx, len(pieces), n_tokens, len(entries),
                          round(time.perf_counter() - t0, 3), partial)


__all__ = ["DEFAULT_N_CTX", "ImatrixSummary", "compute_imatrix", "corpus_chunks"]
