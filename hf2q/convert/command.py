"""``hf2q convert``: argument checks and dispatch (GGUF here; mlx, batch and Hub elsewhere)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from hf2q.errors import InputError, UsageError

log = logging.getLogger("hf2q.convert")


def default_output(src: Path, quant: str) -> Path:
    return Path.cwd() / f"{src.name}-{quant.lower()}.gguf"


def _wants_gguf(args: argparse.Namespace) -> bool:
    """``--format gguf``, or no format but an output path ending in ``.gguf``."""
    if args.format is not None:
        return args.format == "gguf"
    return bool(args.output) and str(args.output).lower().endswith(".gguf")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "batch", None):
        from hf2q.convert.batch import run_batch
        return run_batch(args)
    quant = (args.quant or "").lower()
    if quant.startswith("mlx") and _wants_gguf(args):
        from hf2q.convert.quant_names import GGUF_QUANTS
        raise UsageError(f"--quant {args.quant} is an mlx quantization (use --format mlx, or for GGUF one of "
                         f"{', '.join(GGUF_QUANTS)})")
    if args.format == "mlx" or quant.startswith("mlx"):
        from hf2q.convert.mlx_writer import convert_mlx
        return convert_mlx(args)

    from hf2q.convert.pipeline import convert_gguf, dry_run
    from hf2q.convert.quant_names import parse_gguf_quant

    if args.repo and args.src:
        raise UsageError("give either SRC or --repo, not both")
    if args.repo:
        from hf2q.sources.hub import resolve_repo
        src = Path(resolve_repo(args.repo, args.revision, args.cache_dir))
    elif args.src:
        src = Path(args.src)
    else:
        raise UsageError("convert needs SRC (an HF model directory) or --repo ID")
    q = parse_gguf_quant(args.quant)
    imatrix = None
    if args.imatrix:
        from hf2q.sources.imatrix import read_imatrix
        imatrix = read_imatrix(args.imatrix)  # read once; bad files stop here with exit 3
        log.info("imatrix %s: %d entries, %d chunks", args.imatrix, len(imatrix.weights), imatrix.chunk_count)
    elif q.needs_imatrix and args.dry_run:  # llama-quantize --dry-run also only warns
        log.warning("%s will need an importance matrix (--imatrix FILE) to actually convert", q.name)
    elif q.needs_imatrix:
        raise InputError(f"{q.name} needs an importance matrix (--imatrix FILE); {q.no_imatrix_hint}")

    mtp = "drop" if getattr(args, "no_mtp", False) else "only" if getattr(args, "mtp", False) else "keep"
    if args.dry_run:
        for line in dry_run(src, q, has_imatrix=imatrix is not None, mtp=mtp, imatrix=imatrix):
            print(line)
        return 0
    output = Path(args.output) if args.output else default_output(src, q.name)
    rep = convert_gguf(src, output, q, threads=args.threads, integrity=not args.no_integrity,
                       report_path=Path(args.json_report) if args.json_report else None,
                       imatrix=imatrix, imatrix_arg=args.imatrix, mtp=mtp)
    t = rep["timings_s"]
    print(f"wrote {output} ({rep['output_bytes'] / 2**20:.1f} MiB, {rep['tensor_count']} tensors, "
          f"{rep['bits_per_weight']:.2f} bpw) in {t['total_s']:.1f}s")
    return 0
