"""Benchmark: DWQ into GGUF Q4_1 / Q5_1 against the plain quantization of the same type, by KL divergence.

Per model and type: the F16 GGUF is the reference, ``hf2q convert -q q4_1`` (llama-quantize's bytes) the
plain file and ``hf2q convert -q dwq-q4_1`` the distilled one — same size, same types, only the blocks'
scales, mins and codes differ. Every file is scored by stock ``llama-perplexity --kl-divergence`` against the
F16 on the evaluation text ``bench/tiers.py`` uses (not the calibration text the fit trains on), with
the DWQ report's held-out figures (our engine, calibration tail) beside. JSON on stdout.

``--imatrix``: both files of a pair are converted with one in-tree importance matrix (``hf2q imatrix`` of the
F16 on the shipped ``calibration`` corpus, as ``bench/tiers.py`` computes it), so the plain file is
llama-quantize's imatrix-weighted one and the fit starts from its blocks.

    python bench/dwq_gguf.py [--models smollm2,off-grid] [--types q4_1,q5_1] [--dwq-steps 32] [--imatrix]
                             [--n-ctx 256] [--chunks 11] [--threads 1] [--work DIR] [-o results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import emit  # noqa: E402
from bench.tiers import add_scoring_args, f16_reference, hf2q, scored, workspace  # noqa: E402


def bench_model(name: str, args, work: Path, eval_file: Path) -> dict:
    d, src, f16, base, ref = f16_reference(name, args, work, eval_file)
    imatrix = d / "calibration.imatrix.gguf" if args.imatrix else None
    imatrix_s = 0.0
    if imatrix is not None and not imatrix.exists():
        t0 = time.perf_counter()
        hf2q("imatrix", f16, "--corpus", "calibration", "-o", imatrix, "--n-ctx", args.imatrix_n_ctx,
             "--chunks", args.imatrix_chunks)
        imatrix_s = time.perf_counter() - t0
    rows = []
    for qt in args.types.split(","):
        row = {"type": qt}
        for kind, quant in (("plain", qt), ("dwq", f"dwq-{qt}")):
            out = d / f"{quant}.gguf"
            argv = ["convert", src, "-q", quant, "-o", out, "--threads", args.threads, "--no-integrity"]
            argv += ["--imatrix", imatrix] if imatrix is not None else []
            if kind == "dwq":
                argv += ["--dwq-steps", args.dwq_steps, "--dwq-lr", args.dwq_lr]
            t0 = time.perf_counter()
            try:
                hf2q(*argv)
                row[kind] = {"convert_s": time.perf_counter() - t0, **scored(out, args, eval_file, base)}
                if kind == "dwq":
                    rep = json.loads(Path(f"{out}.report.json").read_text())["dwq"]
                    row[kind]["heldout"] = {k: rep.get(k) for k in (
                        "heldout_before", "heldout_after", "heldout_rerounded", "heldout_written", "heldout_tokens",
                        "codes", "start")}
            except Exception as e:  # noqa: BLE001 — one failed file is a row entry, not the end of the run
                row[kind] = {"error": f"{type(e).__name__}: {e}"}
            out.unlink(missing_ok=True)
            Path(f"{out}.report.json").unlink(missing_ok=True)
        print(f"{name}: {json.dumps(row)}", file=sys.stderr, flush=True)
        rows.append(row)
    return {"model": name, "source": str(src), "ppl_f16": ref["ppl"], "imatrix_s": imatrix_s, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,off-grid")
    ap.add_argument("--types", default="q4_1,q5_1")
    ap.add_argument("--dwq-steps", type=int, default=32)
    ap.add_argument("--dwq-lr", type=float, default=1e-4)
    ap.add_argument("--imatrix", action="store_true", help="convert both files with one in-tree imatrix")
    ap.add_argument("--imatrix-n-ctx", type=int, default=512)
    ap.add_argument("--imatrix-chunks", type=int, default=8)
    add_scoring_args(ap)
    args = ap.parse_args()
    with workspace(args, "hf2q-bench-dwq-") as (work, eval_file):
        results = [bench_model(m, args, work, eval_file) for m in args.models.split(",")]
    return emit({"bench": "dwq_gguf", "eval": args.eval, "eval_bytes": args.eval_bytes, "n_ctx": args.n_ctx,
                 "chunks": args.chunks, "dwq_steps": args.dwq_steps, "dwq_lr": args.dwq_lr,
                 "imatrix": {"corpus": "calibration", "n_ctx": args.imatrix_n_ctx, "chunks": args.imatrix_chunks}
                 if args.imatrix else None, "results": results},
                args.output)


if __name__ == "__main__":
    sys.exit(main())
