"""The importance matrix a GGUF conversion takes: ``--imatrix FILE`` read before any work, or
``--imatrix-corpus`` computed by our engine over a calibration corpus once the output's directory is known,
then read back exactly as a file would be. One pair of steps for every GGUF writer that takes a matrix (the
plain pipeline and GGUF DWQ), so a bad file or a missing corpus stops both the same way."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

log = logging.getLogger("hf2q.convert")


def early_imatrix(args: argparse.Namespace):
    """Before any work: ``--imatrix FILE`` read (a bad file is exit 3 here), None otherwise; a missing
    ``--imatrix-corpus`` stops here too."""
    path = getattr(args, "imatrix", None)
    if path:
        from hf2q.sources.imatrix import read_imatrix

        imatrix = read_imatrix(path)
        log.info("imatrix %s: %d entries, %d chunks", path, len(imatrix.weights), imatrix.chunk_count)
        return imatrix
    if getattr(args, "imatrix_corpus", None):
        from hf2q.quality.corpus import load_corpus

        load_corpus(args.imatrix_corpus)
    return None


def final_imatrix(src: Path, args: argparse.Namespace, output: Path, imatrix):
    """``(matrix, the name its metadata records)`` the conversion to ``output`` uses: ``early_imatrix``'s,
    or with ``--imatrix-corpus`` the one computed now (``computed_imatrix``)."""
    if not getattr(args, "imatrix_corpus", None):
        return imatrix, getattr(args, "imatrix", None)
    from hf2q.errors import InputError

    if not output.parent.is_dir():
        raise InputError(f"output directory {output.parent} does not exist")
    return computed_imatrix(src, args, output)


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
