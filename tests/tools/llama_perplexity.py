"""Stock ``llama-perplexity`` as the peer of ``hf2q quality``: run it, read its figures.

``base(...)`` runs the reference with ``--kl-divergence-base`` (its PPL, and the file of its
log-probabilities); ``kl(...)`` runs a converted model against that file with ``--kl-divergence``
and returns the final statistics block. One batch per chunk (``-b n_ctx``) and one thread unless
told otherwise, to share the machine.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.tools import llama_cpp

#: final-statistics lines of ``--kl-divergence`` → our key names (hf2q.quality.scores.summarize)
_KL_LINES = {
    "ppl": r"Mean PPL\(Q\)\s*:\s*(\S+)\s*±\s*(\S+)",
    "ppl_ref": r"Mean PPL\(base\)\s*:\s*(\S+)\s*±\s*(\S+)",
    "ln_ppl_ratio": r"Mean ln\(PPL\(Q\)/PPL\(base\)\)\s*:\s*(\S+)\s*±\s*(\S+)",
    "kld_mean": r"Mean\s+KLD:\s*(\S+)\s*±\s*(\S+)",
    "kld_max": r"Maximum KLD:\s*(\S+)",
    "kld_p99.9": r"99\.9%\s+KLD:\s*(\S+)",
    "kld_p99": r"99\.0%\s+KLD:\s*(\S+)",
    "kld_p95": r"95\.0%\s+KLD:\s*(\S+)",
    "kld_median": r"Median\s+KLD:\s*(\S+)",
    "dp_rms": r"RMS Δp\s*:\s*(\S+)\s*±\s*(\S+)\s*%",
    "same_top": r"Same top p:\s*(\S+)\s*±\s*(\S+)\s*%",
}
_PERCENT = {"dp_rms", "same_top"}


def _run(args: list[str], threads: int) -> str:
    exe = llama_cpp.tool("llama-perplexity")
    if exe is None:
        raise RuntimeError(f"llama-perplexity is not built in {llama_cpp.bin_dir()}")
    env = dict(llama_cpp.env(), OMP_NUM_THREADS=str(threads))
    p = subprocess.run([str(exe), *args, "-t", str(threads)], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"llama-perplexity failed ({p.returncode}): {p.stderr[-1500:]}")
    return p.stdout + p.stderr


def _common(model: Path, corpus_file: Path, n_ctx: int, chunks: int) -> list[str]:
    return ["-m", str(model), "-f", str(corpus_file), "-c", str(n_ctx), "-b", str(n_ctx), "--chunks", str(chunks)]


def base(model: Path, corpus_file: Path, n_ctx: int, chunks: int, logits_out: Path, threads: int = 1,
         extra: tuple[str, ...] = ()) -> dict:
    """The reference's run: ``{"ppl", "ppl_err"}``; writes the log-probability file ``logits_out``
    (``extra``: more llama-perplexity arguments, e.g. cache types)."""
    text = _run([*_common(model, corpus_file, n_ctx, chunks), *extra, "--kl-divergence-base", str(logits_out)],
                threads)
    m = re.search(r"Final estimate: PPL = (\S+) \+/- (\S+)", text)
    if m is None:
        raise RuntimeError(f"no final PPL in llama-perplexity's output: {text[-800:]}")
    return {"ppl": float(m.group(1)), "ppl_err": float(m.group(2))}


def kl(model: Path, corpus_file: Path, n_ctx: int, chunks: int, base_logits: Path, threads: int = 1,
       extra: tuple[str, ...] = ()) -> dict:
    """A converted model against ``base_logits``: the final statistics (needs ≥ 100 scored tokens)."""
    text = _run([*_common(model, corpus_file, n_ctx, chunks), *extra, "--kl-divergence-base", str(base_logits),
                 "--kl-divergence"], threads)
    out = {}
    for key, pattern in _KL_LINES.items():
        m = re.search(pattern, text)
        if m is None:
            raise RuntimeError(f"llama-perplexity printed no {key} line: {text[-800:]}")
        scale = 0.01 if key in _PERCENT else 1.0
        out[key] = float(m.group(1)) * scale
        if m.lastindex and m.lastindex > 1:
            out[f"{key}_err"] = float(m.group(2)) * scale
    return out
