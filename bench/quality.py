"""Benchmark: what each quant type costs in quality, measured by ``hf2q quality`` and by llama.cpp.

For every model × quant name: the GGUF written by ``hf2q convert`` (its size, bits/weight and
convert time), then its perplexity, KL divergence from the model's own F16 conversion and top-1
agreement, scored twice on the same file, text and context — by our engine (``hf2q quality``'s
code) and by stock ``llama-perplexity --kl-divergence`` in the same run. The quant names are
every GGUF type ``hf2q.convert.quant_names`` knows plus any ``--quant`` the CLI accepts (new tiers
join without an edit here); types that need an importance matrix run only with ``--imatrix``.
JSON on stdout; ``--plot`` draws KL against bits/weight for both tools (needs matplotlib: the
``bench`` extra); ``--table`` writes the Markdown table docs/QUALITY.md shows.

    python bench/quality.py [--models smollm2,gemma3] [--quants q8_0,q4_k_m] [--quant dynamic-q4]
                            [--imatrix FILE] [--n-ctx 256] [--chunks 4] [--corpus NAME|FILE]
                            [--threads 2] [--plot kl.png] [--table table.md] [-o results.json]
    python bench/quality.py --from-json a.json --from-json b.json --plot kl.png --table table.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import emit  # noqa: E402

MODELS = {"smollm2": "smollm2_hf_dir", "gemma3": "gemma3_hf_dir"}
#: float types (16 and 32 bits) stay in the table but off the plot, whose interest is below 9 bits
PLOT_MAX_BPW = 12
FIGURES = ("ppl", "kld_mean", "kld_p99", "kld_max", "same_top")


def quant_names(only: list[str] | None, extra: list[str], has_imatrix: bool) -> list[str]:
    from hf2q.convert.quant_names import GGUF_QUANTS

    names = only or [n for n, q in GGUF_QUANTS.items() if has_imatrix or not q.needs_imatrix]
    return names + [n for n in extra if n not in names]


def convert(src: Path, quant: str, out: Path, threads: int, imatrix: str | None) -> tuple[float, dict]:
    """``hf2q convert`` through the CLI (so any name it accepts works), in this process so the codecs'
    compiled loops stay warm; returns (wall seconds, the convert report)."""
    from hf2q.cli import main

    argv = ["convert", str(src), "-q", quant, "-o", str(out), "--threads", str(threads), "--no-integrity"]
    if imatrix:
        argv += ["--imatrix", imatrix]
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        code = main(argv)
    wall = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"hf2q convert -q {quant} failed (exit {code})")
    return wall, json.loads(Path(f"{out}.report.json").read_text())


def bench_model(name: str, quants: list[str], args, work: Path) -> dict:
    from hf2q.quality.corpus import load_corpus
    from hf2q.quality.evaluate import reference_run, score_converted
    from tests.models import real
    from tests.tools import llama_perplexity

    src = Path(getattr(real, MODELS[name])())
    corpus = load_corpus(args.corpus)
    corpus_file = work / "corpus.txt"
    corpus_file.write_text(corpus.text, "utf-8")
    ref = work / f"{name}-f16.gguf"
    ref_s, _ = convert(src, "f16", ref, args.threads, None)
    base_logits = work / f"{name}-f16.kld"
    t0 = time.perf_counter()
    peer_base = llama_perplexity.base(ref, corpus_file, args.n_ctx, args.chunks, base_logits, args.threads)
    peer_base_s = time.perf_counter() - t0
    rows = []
    t0 = time.perf_counter()
    with reference_run(ref, corpus, args.n_ctx, args.chunks) as run:
        ref_run_s = time.perf_counter() - t0
        for q in quants:
            out = work / f"{name}-{q}.gguf"
            row = {"quant": q}
            try:
                row["convert_s"], rep = convert(src, q, out, args.threads, args.imatrix)
                row["bytes"] = out.stat().st_size
                row["bits_per_weight"] = rep["bits_per_weight"]
                t0 = time.perf_counter()
                ours = score_converted(run, out)
                row["score_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                theirs = llama_perplexity.kl(out, corpus_file, args.n_ctx, args.chunks, base_logits, args.threads)
                row["llama_cpp_s"] = time.perf_counter() - t0
                row["hf2q"] = {k: ours[k] for k in FIGURES}
                row["llama_cpp"] = {k: theirs[k] for k in FIGURES}
            except Exception as e:  # noqa: BLE001 — one failed type is a row, not the end of the run
                row["error"] = f"{type(e).__name__}: {e}"
            finally:
                for p in (out, Path(f"{out}.report.json")):
                    p.unlink(missing_ok=True)
            print(f"{name} {q}: {json.dumps(row)}", file=sys.stderr, flush=True)
            rows.append(row)
        tokens = int(len(run.windows) * (run.n_ctx - 1 - run.first))
        ppl_ref = run.perplexity()["ppl"]
    return {"model": name, "source": str(src), "reference": "f16 (hf2q convert)", "scored_tokens": tokens,
            "reference_convert_s": ref_s, "reference_run_s": ref_run_s, "llama_cpp_reference_s": peer_base_s,
            "llama_cpp_ppl_ref": peer_base["ppl"], "ppl_ref": ppl_ref, "rows": rows}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 5), squeeze=False)
    for ax, res in zip(axes[0], results):
        rows = [r for r in res["rows"] if "hf2q" in r and r["bits_per_weight"] < PLOT_MAX_BPW]
        rows = [r for r in rows if r["hf2q"]["kld_mean"] > 0]
        for tool, marker in (("hf2q", "o"), ("llama_cpp", "x")):
            pts = [(r["bits_per_weight"], r[tool]["kld_mean"]) for r in rows if r[tool]["kld_mean"] > 0]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker,
                       label="hf2q quality" if tool == "hf2q" else "llama-perplexity")
        for r in rows:
            ax.annotate(r["quant"], (r["bits_per_weight"], r["hf2q"]["kld_mean"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("bits per weight")
        ax.set_ylabel("mean KL divergence from F16 (nats/token)")
        ax.set_title(f"{res['model']}: {res['scored_tokens']} tokens, n_ctx {res['n_ctx']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(results: list[dict]) -> str:
    lines = []
    for res in results:
        lines += [f"**{res['model']}** (reference: its F16 conversion, PPL {res['ppl_ref']:.3f} here, "
                  f"{res['llama_cpp_ppl_ref']:.3f} in llama.cpp; {res['scored_tokens']} scored tokens)", "",
                  "| quant | MiB | bits/weight | convert s | PPL | KL mean | KL p99 | top-1 % "
                  "| llama.cpp PPL | llama.cpp KL mean | llama.cpp top-1 % |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in res["rows"]:
            if "error" in r:
                lines.append(f"| {r['quant']} | {r['error']} |")
                continue
            o, t = r["hf2q"], r["llama_cpp"]
            lines.append(f"| {r['quant']} | {r['bytes'] / 2**20:.1f} | {r['bits_per_weight']:.2f} | "
                         f"{r['convert_s']:.1f} | {o['ppl']:.3f} | {o['kld_mean']:.5f} | {o['kld_p99']:.4f} | "
                         f"{100 * o['same_top']:.1f} | {t['ppl']:.3f} | {t['kld_mean']:.5f} | "
                         f"{100 * t['same_top']:.1f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--quants", default=None, help="only these names (comma-separated; default every GGUF type)")
    ap.add_argument("--quant", action="append", default=[], help="an extra --quant name (repeatable)")
    ap.add_argument("--imatrix", default=None, help="importance matrix for the types that need one")
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--corpus", default=None, help="corpus file or shipped name (default: calibration)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plot", default=None, help="write the KL vs bits/weight PNG here")
    ap.add_argument("--table", default=None, help="write the Markdown table here")
    ap.add_argument("--from-json", action="append", default=[], metavar="FILE",
                    help="draw --plot / --table from earlier runs' JSON instead of running (repeatable)")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    if args.from_json:
        results = [res for f in args.from_json for res in json.loads(Path(f).read_text())["results"]]
        if args.plot:
            plot(results, Path(args.plot))
        if args.table:
            Path(args.table).write_text(table(results))
        return 0
    from hf2q.engine.factory import prepare_mlx

    prepare_mlx()
    quants = quant_names(args.quants.split(",") if args.quants else None, args.quant, bool(args.imatrix))
    results = []
    with tempfile.TemporaryDirectory(prefix="hf2q-bench-quality-") as tmp:
        for name in args.models.split(","):
            res = bench_model(name, quants, args, Path(tmp))
            res["n_ctx"], res["chunks"] = args.n_ctx, args.chunks
            results.append(res)
    if args.plot:
        plot(results, Path(args.plot))
    if args.table:
        Path(args.table).write_text(table(results))
    return emit({"bench": "quality", "corpus": args.corpus or "calibration", "n_ctx": args.n_ctx,
                 "chunks": args.chunks, "threads": args.threads, "results": results}, args.output)


if __name__ == "__main__":
    sys.exit(main())
