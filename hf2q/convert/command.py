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


def _mlx_output(args: argparse.Namespace) -> bool:
    """Whether this conversion writes an mlx-lm directory (``--format mlx``, or an mlx/dwq quant name)."""
    quant = (args.quant or "").lower()
    return args.format == "mlx" or quant.startswith("mlx") or (quant.startswith("dwq") and not quant.startswith("dwq-q"))


def _check_imatrix_flags(args: argparse.Namespace) -> None:
    corpus = getattr(args, "imatrix_corpus", None)
    if corpus and args.imatrix:
        raise UsageError("give --imatrix FILE or --imatrix-corpus, not both")
    for flag in ("imatrix_out", "imatrix_n_ctx", "imatrix_chunks"):
        if getattr(args, flag, None) is not None and not corpus:
            raise UsageError(f"--{flag.replace('_', '-')} needs --imatrix-corpus")
    if corpus and (_mlx_output(args) or getattr(args, "batch", None)):
        raise UsageError("--imatrix-corpus applies to a single GGUF conversion (not --format mlx or --batch)")


def run(args: argparse.Namespace) -> int:
    _check_imatrix_flags(args)
    if getattr(args, "mmproj_output", None) and not getattr(args, "mmproj", False):
        raise UsageError("--mmproj-output needs --mmproj")
    if getattr(args, "mmproj", False) and (_mlx_output(args) or getattr(args, "batch", None)):
        raise UsageError("--mmproj applies to a single GGUF conversion (not --format mlx or --batch)")
    if getattr(args, "batch", None):
        from hf2q.convert.batch import run_batch
        return run_batch(args)
    quant = (args.quant or "").lower()
    if getattr(args, "quality", False) and _mlx_output(args):
        raise UsageError("--quality scores GGUF output; for an mlx directory run hf2q quality DIR --reference SRC")
    if quant.startswith("dwq-q"):  # GGUF blocks with a float16 scale and min (dwq_gguf)
        if args.format == "mlx":
            raise UsageError(f"--quant {args.quant} writes GGUF; for mlx use --quant dwq-3 or dwq-4")
        from hf2q.convert.dwq_gguf import convert_dwq_gguf
        return convert_dwq_gguf(args, default_output)
    if quant.startswith("dwq"):
        if _wants_gguf(args):
            raise InputError(f"--quant {args.quant} (distilled weight quantization) needs --format mlx: "
                             "it fits mlx-lm's affine scales and biases; for GGUF use --quant dwq-q4_1 or "
                             "dwq-q5_1 (q4_1 / q5_1 blocks)")
        from hf2q.convert.dwq_convert import convert_dwq
        return convert_dwq(args)
    from hf2q.convert.dwq_convert import check_flags_unused
    check_flags_unused(args)
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
    from hf2q.convert.imatrix_corpus import early_imatrix, final_imatrix

    imatrix = early_imatrix(args)  # read once; a bad file or a missing corpus stops here with exit 3
    wants_corpus = bool(getattr(args, "imatrix_corpus", None))  # computed once the output's directory is known
    if imatrix is None and not wants_corpus and q.needs_imatrix:
        if not args.dry_run:
            raise InputError(f"{q.name} needs an importance matrix (--imatrix FILE); {q.no_imatrix_hint}")
        # llama-quantize --dry-run also only warns
        log.warning("%s will need an importance matrix (--imatrix FILE) to actually convert", q.name)

    mtp = "drop" if getattr(args, "no_mtp", False) else "only" if getattr(args, "mtp", False) else "keep"
    if args.mmproj:  # a checkpoint without a vision tower stops here, before the text conversion
        from hf2q.convert import mmproj
        mmproj.build_plan(src, mmproj.mmproj_type(q.name)).checkpoint.close()
    if args.dry_run:
        for line in dry_run(src, q, has_imatrix=imatrix is not None or wants_corpus, mtp=mtp, imatrix=imatrix):
            print(line)
        if args.mmproj:
            print("\n".join(mmproj.dry_run(src, mmproj.mmproj_type(q.name))))
        return 0
    output = Path(args.output) if args.output else default_output(src, q.name)
    if args.mmproj:  # and one whose projector cannot be written stops before the text model is
        kind = mmproj.mmproj_type(q.name)
        mmproj_path = Path(args.mmproj_output) if args.mmproj_output else mmproj.default_path(output, src, kind)
        mmproj.check_destination(mmproj_path)
    if getattr(args, "quality", False):  # a bad corpus stops here, before the conversion
        from hf2q.quality.corpus import load_corpus
        load_corpus(args.quality_corpus)
    imatrix, imatrix_arg = final_imatrix(src, args, output, imatrix)
    rep = convert_gguf(src, output, q, threads=args.threads, integrity=not args.no_integrity,
                       report_path=Path(args.json_report) if args.json_report else None,
                       imatrix=imatrix, imatrix_arg=imatrix_arg, mtp=mtp)
    quality = None
    if getattr(args, "quality", False):
        from hf2q.quality.quality_command import add_to_report
        quality = add_to_report(rep, src, output, args.quality_corpus, args.quality_n_ctx,
                                Path(args.json_report) if args.json_report else None)
    t = rep["timings_s"]
    print(f"wrote {output} ({rep['output_bytes'] / 2**20:.1f} MiB, {rep['tensor_count']} tensors, "
          f"{rep['bits_per_weight']:.2f} bpw) in {t['total_s']:.1f}s")
    if quality:
        print(quality)
    if args.mmproj:
        done = mmproj.convert_mmproj(src, mmproj_path, kind, threads=args.threads or 1)
        print(f"wrote {mmproj_path} ({done.total_bytes / 2**20:.1f} MiB, {len(done.tensors)} tensors, mmproj {kind})")
    return 0
