"""``hf2q quality CONVERTED --reference SOURCE``: how far a conversion is from its source.

Prints perplexity of both, KL divergence, top-1 agreement and Δp (llama-perplexity
``--kl-divergence``'s figures, docs/QUALITY.md), then the per-tensor RMSE / cosine that convert
recorded in ``CONVERTED.report.json`` when that report is there.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from hf2q.errors import InputError
from hf2q.quality.corpus import load_corpus

log = logging.getLogger("hf2q.quality")

#: tensors listed by name in the text summary, worst cosine first
WORST_SHOWN = 3


def tensor_errors(converted: Path) -> dict:
    """The convert report's per-tensor errors, or ``{"report": None}`` when there is none."""
    from hf2q.convert.report import default_path

    path = default_path(Path(converted))
    if not path.is_file():
        return {"report": None}
    try:
        rep = json.loads(path.read_text("utf-8"))
        rows = [{"name": t["name"], "type": t["type"], "rmse": float(t["rmse"]), "cosine": float(t["cosine"])}
                for t in rep["tensors"]]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring the convert report %s: %s", path, e)
        return {"report": None}
    return {"report": str(path), "bits_per_weight": rep.get("bits_per_weight"), "tensors": rows}


def score(converted: Path, reference: Path, corpus_spec: str | None, n_ctx: int, chunks: int | None) -> dict:
    """Scores of CONVERTED against SOURCE on the corpus (the dict ``--json`` prints)."""
    from hf2q.quality.evaluate import reference_run, score_converted
    from hf2q.quality.logit_sources import converted_kind

    converted_kind(converted)
    corpus = load_corpus(corpus_spec)
    with reference_run(reference, corpus, n_ctx, chunks) as run:
        figures = score_converted(run, converted)
    return {"converted": str(converted), "reference": str(reference), "scores": figures,
            "tensor_errors": tensor_errors(converted)}


def add_to_report(rep: dict, src: Path, output: Path, corpus_spec: str | None, n_ctx: int,
                  report_path: Path | None) -> str:
    """``convert --quality``: score the GGUF just written against its HF source, into its report;
    returns the one-line summary convert prints."""
    from hf2q.convert import report as report_mod

    result = score(output, src, corpus_spec, n_ctx, None)
    rep["quality"] = {"reference": str(src), **result["scores"]}
    report_mod.write(rep, report_path or report_mod.default_path(output))
    s = result["scores"]
    return (f"quality: PPL {s['ppl']:.4f} (source {s['ppl_ref']:.4f}), mean KL {s['kld_mean']:.6f}, "
            f"top-1 agreement {100 * s['same_top']:.2f} % over {s['tokens']} tokens of {s['corpus']}")


def render(result: dict) -> list[str]:
    s = result["scores"]
    lines = [
        f"{result['converted']} against {result['reference']}: corpus {s['corpus']}, "
        f"{s['chunks']} chunks of {s['n_ctx']} tokens, {s['tokens']} scored",
        f"PPL              {s['ppl']:.4f} ± {s['ppl_err']:.4f}   "
        f"reference {s['ppl_ref']:.4f} ± {s['ppl_ref_err']:.4f}",
        f"ln(PPL/PPL ref)  {s['ln_ppl_ratio']:.5f} ± {s['ln_ppl_ratio_err']:.5f}",
        f"KL divergence    mean {s['kld_mean']:.6f} ± {s['kld_mean_err']:.6f}   p99 {s['kld_p99']:.6f}   "
        f"max {s['kld_max']:.6f}   median {s['kld_median']:.6f}",
        f"top-1 agreement  {100 * s['same_top']:.3f} ± {100 * s['same_top_err']:.3f} %",
        f"Δp RMS           {100 * s['dp_rms']:.3f} ± {100 * s['dp_rms_err']:.3f} %",
    ]
    te = result["tensor_errors"]
    if te["report"] is None:
        lines.append("tensors          no convert report beside the converted model; per-tensor errors not shown")
    elif te["tensors"]:
        rows = sorted(te["tensors"], key=lambda t: t["cosine"])
        worst = ", ".join(f"{t['name']} ({t['type']}) {t['cosine']:.5f}" for t in rows[:WORST_SHOWN])
        lines.append(f"tensors          {len(rows)} in {te['report']}; lowest cosine: {worst}; "
                     f"largest RMSE {max(t['rmse'] for t in rows):.3g}")
    return lines


def run(args: argparse.Namespace) -> int:
    converted, reference = Path(args.converted), Path(args.reference)
    if not converted.exists():
        raise InputError(f"no such file or directory: {converted}")
    if not reference.exists():
        raise InputError(f"--reference {reference}: no such file or directory")
    result = score(converted, reference, args.corpus, args.n_ctx, args.chunks)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print("\n".join(render(result)))
    return 0
