"""Benchmark: mixed-bit tiers against llama.cpp's fixed mixes at equal size, by KL divergence.

For each model: its F16 GGUF (``hf2q convert``) is the reference; an importance matrix is computed
in-tree from it on the shipped ``calibration`` corpus (``hf2q imatrix``), and that one file is handed
to both tools. Each pair is llama.cpp's mix (``llama-quantize`` of the F16) beside the hf2q tier sized
against it (``hf2q convert`` of the HF source), without and with the imatrix; every file is scored by
stock ``llama-perplexity --kl-divergence`` against the F16 on an evaluation text that is not the
calibration text. JSON on stdout.

Models (bench/tier_sources.py says why the derived ones exist): ``smollm2`` (the test checkpoint, a
dequantised Q4_1), ``off-grid`` (its weights plus noise), ``moe`` (its noised weights as an upcycled
qwen3_moe; pairs with the APEX tiers).

    python bench/tiers.py [--models smollm2,off-grid,moe] [--eval FILE|NAME] [--n-ctx 256] [--chunks 11]
                          [--imatrix-chunks 8] [--tiers apex-balanced] [--no-imatrix | --imatrix-only]
                          [--threads 1] [--work DIR] [-o results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import emit  # noqa: E402

#: llama.cpp's mix → the tier sized against it (dense) or of its size class (APEX)
DENSE_PAIRS = (("q2_k", "dynamic-q2"), ("q3_k_m", "dynamic-q3"), ("q4_k_m", "dynamic-q4"))
MOE_PAIRS = (("q3_k_m", "apex-compact"), ("q4_k_m", "apex-balanced"), ("q5_k_m", "apex-quality"),
             ("q4_k_m", "dynamic-q4"))
DEFAULT_EVAL = "/usr/share/common-licenses/GPL-3"  # English prose that is not the calibration text
EVAL_BYTES = 14000
FIGURES = ("kld_mean", "kld_mean_err", "kld_p99", "same_top", "ppl")


def hf2q(*argv) -> None:
    from hf2q.cli import main

    with contextlib.redirect_stdout(sys.stderr):
        code = main([str(a) for a in argv])
    if code != 0:
        raise RuntimeError(f"hf2q {' '.join(map(str, argv[:3]))} … failed (exit {code})")


def llama_quantize(f16: Path, out: Path, mix: str, imatrix: Path | None, threads: int) -> None:
    from tests.tools import llama_cpp

    cmd = [str(llama_cpp.tool("llama-quantize"))] + (["--imatrix", str(imatrix)] if imatrix else [])
    p = subprocess.run(cmd + [str(f16), str(out), mix, str(threads)], env=llama_cpp.env(), capture_output=True,
                       text=True)
    if p.returncode != 0:
        raise RuntimeError(f"llama-quantize {mix} failed: {p.stderr[-600:]}")


def source(name: str, work: Path) -> Path:
    from bench import tier_sources
    from hf2q.quality.corpus import load_corpus
    from tests.models import real

    src = Path(real.smollm2_hf_dir())
    if name == "smollm2":
        return src
    out = work / f"{name}-hf"
    if (out / "config.json").exists():  # built by an earlier run with the same --work
        return out
    if name == "off-grid":
        return tier_sources.off_grid(src, out)
    if name == "moe":
        return tier_sources.upcycled_moe(src, out, load_corpus("calibration").text)
    raise SystemExit(f"unknown model {name!r}: smollm2, off-grid or moe")


def scored(path: Path, args, eval_file: Path, base: Path) -> dict:
    from tests.tools import llama_perplexity

    kl = llama_perplexity.kl(path, eval_file, args.n_ctx, args.chunks, base, args.threads)
    return {"bytes": path.stat().st_size, "mib": path.stat().st_size / 2**20, **{k: kl[k] for k in FIGURES}}


def plan_summary(report: Path) -> dict:
    """What bounded the tier's plan (the llama.cpp mix, or for APEX its table when that is smaller) and its
    type counts, from the conversion's report."""
    tier = json.loads(report.read_text())["tier"]
    counts: dict[str, int] = {}
    for t in tier["tensors"]:
        counts[t["type"]] = counts.get(t["type"], 0) + 1
    return {"bounded_by": tier["reference_mix"] or "apex table", "budget_bytes": tier["budget_bytes"],
            "types": dict(sorted(counts.items()))}


def f16_reference(name: str, args, work: Path, eval_file: Path):
    """(the model's work folder, its HF source, its F16 GGUF, llama-perplexity's base file, the F16's figures)."""
    from tests.tools import llama_perplexity

    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    src = source(name, work)
    f16 = d / "f16.gguf"
    if not f16.exists():
        hf2q("convert", src, "-q", "f16", "-o", f16, "--threads", args.threads, "--no-integrity")
    base = d / "f16.kld"
    return d, src, f16, base, llama_perplexity.base(f16, eval_file, args.n_ctx, args.chunks, base, args.threads)


def bench_model(name: str, args, work: Path, eval_file: Path) -> dict:
    d, src, f16, base, ref = f16_reference(name, args, work, eval_file)
    imatrix = d / "calibration.imatrix.gguf"
    t0 = time.perf_counter()
    if not imatrix.exists() and not args.no_imatrix:
        hf2q("imatrix", f16, "--corpus", "calibration", "-o", imatrix, "--n-ctx", args.imatrix_n_ctx,
             "--chunks", args.imatrix_chunks)
    imatrix_s = time.perf_counter() - t0
    rows, done = [], {}
    pairs = MOE_PAIRS if name == "moe" else DENSE_PAIRS
    for mix, tier in [(m, t) for m, t in pairs if not args.tiers or t in args.tiers.split(",")]:
        for weighted in (False,) if args.no_imatrix else (True,) if args.imatrix_only else (False, True):
            im = imatrix if weighted else None
            ours_name = tier.replace("apex-", "apex-i-") if weighted and tier.startswith("apex-") else tier
            row = {"llama_cpp_mix": mix, "tier": ours_name, "imatrix": weighted}
            try:
                key = (mix, weighted)
                if key not in done:
                    theirs = d / f"{mix}{'-im' if weighted else ''}.gguf"
                    llama_quantize(f16, theirs, mix, im, args.threads)
                    done[key] = scored(theirs, args, eval_file, base)
                    theirs.unlink()
                row["llama_cpp"] = done[key]
                ours = d / f"{ours_name}{'-im' if weighted else ''}.gguf"
                argv = ["convert", src, "-q", ours_name, "-o", ours, "--threads", args.threads, "--no-integrity"]
                t0 = time.perf_counter()
                hf2q(*argv, *(["--imatrix", imatrix] if weighted else []))
                row["convert_s"] = time.perf_counter() - t0
                row["hf2q"] = scored(ours, args, eval_file, base)
                row["plan"] = plan_summary(Path(f"{ours}.report.json"))
                ours.unlink()
                Path(f"{ours}.report.json").unlink(missing_ok=True)
                row["kl_ratio"] = row["llama_cpp"]["kld_mean"] / max(row["hf2q"]["kld_mean"], 1e-12)
            except Exception as e:  # noqa: BLE001 — one failed pair is a row, not the end of the run
                row["error"] = f"{type(e).__name__}: {e}"
            print(f"{name}: {json.dumps(row)}", file=sys.stderr, flush=True)
            rows.append(row)
    return {"model": name, "source": str(src), "ppl_f16": ref["ppl"], "imatrix_s": imatrix_s, "rows": rows}


def add_scoring_args(ap: argparse.ArgumentParser) -> None:
    """The evaluation text, its scoring windows, threads, the reusable work folder and the output file."""
    ap.add_argument("--eval", default=DEFAULT_EVAL, help="evaluation text (file or shipped corpus name)")
    ap.add_argument("--eval-bytes", type=int, default=EVAL_BYTES, help="use only this many leading bytes of it")
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", default=None, help="keep sources, references and imatrices here (reused)")
    ap.add_argument("-o", "--output", default=None)


@contextlib.contextmanager
def workspace(args, prefix: str):
    """(work folder, evaluation text file): ``--work`` or a temporary folder, MLX readied first."""
    from hf2q.engine.factory import prepare_mlx
    from hf2q.quality.corpus import load_corpus

    prepare_mlx()
    with contextlib.ExitStack() as stack:
        work = Path(args.work) if args.work else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))
        work.mkdir(parents=True, exist_ok=True)
        eval_file = work / "eval.txt"
        eval_file.write_text(load_corpus(args.eval).text.encode("utf-8")[:args.eval_bytes].decode("utf-8", "ignore"),
                             "utf-8")
        yield work, eval_file


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,off-grid,moe")
    add_scoring_args(ap)
    ap.add_argument("--imatrix-n-ctx", type=int, default=512)
    ap.add_argument("--imatrix-chunks", type=int, default=8)
    ap.add_argument("--no-imatrix", action="store_true", help="only the pairs without an importance matrix")
    ap.add_argument("--imatrix-only", action="store_true", help="only the pairs with the importance matrix")
    ap.add_argument("--tiers", default=None, help="only the pairs of these tiers (comma-separated)")
    args = ap.parse_args()
    with workspace(args, "hf2q-bench-tiers-") as (work, eval_file):
        results = [bench_model(m, args, work, eval_file) for m in args.models.split(",")]
    return emit({"bench": "tiers", "eval": args.eval, "eval_bytes": args.eval_bytes, "n_ctx": args.n_ctx,
                 "chunks": args.chunks, "imatrix": {"corpus": "calibration", "n_ctx": args.imatrix_n_ctx,
                                                    "chunks": args.imatrix_chunks},
                 "results": results}, args.output)


if __name__ == "__main__":
    sys.exit(main())
