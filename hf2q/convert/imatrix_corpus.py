"""``convert --imatrix-corpus``: the importance matrix a conversion computes for itself, with our engine over
a calibration corpus, then read back exactly as ``--imatrix FILE`` would be. One step for every GGUF writer
that takes a matrix (the plain pipeline and GGUF DWQ)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

log = logging.getLogger("hf2q.convert")


def computed_imatrix(src: Path, args: argparse.Namespace, output: Path):
    """``--imatrix-corpus``: compute the matrix from ``src`` with our engine (kept at --imatrix-out,
    else in a temporary file beside the output) and read it back as ``--imatrix FILE`` would be."""
    import dataclasses
    import tempfile

    from hf2q.quality.corpus import load_corpus
    from hf2q.quality.imatrix_run import DEFAULT_N_CTX, compute_imatrix
    from hf2q.sources.imatrix import read_imatrix

    corpus = load_corpus(args.imatrix_corpus)
    n_ctx = args.imatrix_n_ctx or DEFAULT_N_CTX
    with tempfile.TemporaryDirectory(prefix=".hf2q-imatrix-", dir=output.parent) as tmp:
        out = Path(args.imatrix_out) if args.imatrix_out else Path(tmp) / f"{src.name}.imatrix.gguf"
        summary = compute_imatrix(src, corpus, out, n_ctx=n_ctx, chunks=getattr(args, "imatrix_chunks", None),
                                  threads=args.threads)
        imatrix = read_imatrix(out)
    log.info("computed imatrix over %s: %d entries, %d chunks of %d tokens", corpus.name, summary.entries,
             summary.chunks, n_ctx)
    if args.imatrix_out:
        return imatrix, str(out)
    # the temporary file is gone: the report and metadata name the corpus it came from instead
    return dataclasses.replace(imatrix, path=Path(corpus.name)), corpus.name
