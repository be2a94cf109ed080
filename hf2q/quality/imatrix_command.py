"""``hf2q imatrix``: compute an importance matrix with our engine (``hf2q.quality.imatrix_run``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def run(args: argparse.Namespace) -> int:
    from hf2q.quality.corpus import load_corpus
    from hf2q.quality.imatrix_run import compute_imatrix

    corpus = load_corpus(args.corpus)
    summary = compute_imatrix(Path(args.model), corpus, Path(args.output), n_ctx=args.n_ctx, chunks=args.chunks,
                              threads=args.threads)
    if args.json:
        print(json.dumps(summary.as_dict()))
    else:
        print(f"wrote {summary.output}: {summary.entries} tensors, {summary.chunks} chunks of {summary.n_ctx} "
              f"tokens from {summary.dataset} in {summary.seconds:.1f}s")
    return 0
