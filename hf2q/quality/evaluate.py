"""Scoring a converted model against its reference on a corpus: the runs, not the arithmetic.

The reference runs first over every window and leaves its log-probabilities of the scored
positions in a memory-mapped scratch file, so only one model is loaded at a time and one
reference run serves any number of converted models (``bench/quality.py`` scores every quant type
against one). An HF checkpoint as the reference is first converted to a temporary F16 GGUF with
our converter; the tokens always come from the reference GGUF's tokenizer, as llama-perplexity
takes them from its base run.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

import numpy as np

from hf2q.errors import InputError
from hf2q.quality import scores
from hf2q.quality.corpus import Corpus
from hf2q.quality.logit_sources import GGUFLogits, gguf_of, open_converted

class ReferenceRun:
    """The reference's log-probabilities of every scored position of every window of the corpus."""

    def __init__(self, ref_path: Path, corpus: Corpus, n_ctx: int, chunks: int | None, scratch: Path):
        from hf2q.text.tokenizer import GGUFTokenizer

        tok = GGUFTokenizer.from_gguf(ref_path)
        tokens = tok.encode(corpus.text, add_special=True, parse_special=False)
        try:
            self.windows = scores.windows(tokens, n_ctx, chunks, tok.bos_id if tok.add_bos else None)
        except ValueError as e:
            raise InputError(f"corpus {corpus.name}: {e}") from None
        self.corpus, self.n_ctx = corpus.name, n_ctx
        self.first = scores.first_scored(n_ctx)
        model = GGUFLogits(ref_path, n_ctx)
        self.vocab_size = model.vocab_size
        rows = n_ctx - 1 - self.first
        self.logprobs = np.lib.format.open_memmap(scratch / "reference-logprobs.npy", mode="w+", dtype=np.float32,
                                                  shape=(len(self.windows), rows, self.vocab_size))
        for i, w in enumerate(self.windows):
            self.logprobs[i] = scores.log_softmax(model.logits(w)[self.first: n_ctx - 1])
        del model

    def targets(self, i: int) -> np.ndarray:
        return self.windows[i, self.first + 1:]

    def perplexity(self) -> dict:
        """The reference's own perplexity on the scored tokens."""
        nll = [-self.logprobs[i, np.arange(len(self.targets(i))), self.targets(i)] for i in range(len(self.windows))]
        return scores.perplexity(np.concatenate(nll))

    def score(self, converted) -> scores.TokenScores:
        """Per-token scores of ``converted`` (a logit source) against this reference."""
        parts = []
        for i, w in enumerate(self.windows):
            logits = converted.logits(w)
            if logits.shape[-1] != self.vocab_size:
                raise InputError(f"the converted model has {logits.shape[-1]} logits per token, the reference "
                                 f"{self.vocab_size}: not the same vocabulary")
            parts.append(scores.score_window(logits[self.first: self.n_ctx - 1], self.logprobs[i], self.targets(i)))
        return scores.concat(parts)


@contextlib.contextmanager
def reference_run(source: Path, corpus: Corpus, n_ctx: int, chunks: int | None):
    """A :class:`ReferenceRun` of SOURCE, its scratch files removed on exit."""
    scratch = Path(tempfile.mkdtemp(prefix="hf2q-quality-"))
    try:
        with gguf_of(source, scratch, prefix="reference-", what="--reference") as ref:
            run = ReferenceRun(ref, corpus, n_ctx, chunks, scratch)
        yield run
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def score_converted(run: ReferenceRun, converted: Path) -> dict:
    """llama-perplexity ``--kl-divergence``'s statistics of CONVERTED against ``run``'s reference."""
    model = open_converted(converted, run.n_ctx)
    out = scores.summarize(run.score(model))
    out.update({"corpus": run.corpus, "n_ctx": run.n_ctx, "chunks": int(len(run.windows)),
                "converted_kind": model.kind})
    return out
