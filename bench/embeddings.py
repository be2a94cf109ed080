"""Embedding throughput: texts/s of our engine against stock ``llama-embedding`` on the same GGUF.

Models: all-MiniLM-L6-v2 (the real checkpoint, converted by ``hf2q convert``), a random-weight GGUF
of nomic-embed-text-v1.5's shape (12 × 768, SwiGLU 3072, rotary; speed does not depend on the values;
MiniLM's WordPiece vocabulary), both in batches of 1, 32 and 256; and a random-weight GGUF of
nomic-embed-text-v2-moe's shape (12 × 768, GELU 3072, 8 experts of which 2 are used in every second
block) whose header — hyper-parameters and the real 250k-piece XLM-R Unigram vocabulary with its
charsmap — is the one llama.cpp's sdist ships as ``models/ggml-vocab-nomic-bert-moe.gguf``, in batches
of 1, 8 and 32. Inputs: the first N sentences of the shipped calibration corpus.

What is timed: the forward pass of one batch, tokenisation excluded on both sides. Ours:
``MlxModelRunner.embed`` after one warm-up call. llama.cpp: one ``llama-embedding`` process per run with
context, batch and micro-batch sized to the whole batch, so every text of it goes through one decode; its
time is the process's wall time minus the log timestamp of its first ``batch_decode`` line (model load
and tokenisation before it are left out, printing the vectors is left in). Both use ``--threads``
threads (``HF2Q_BLAS_THREADS``/``OPENBLAS_NUM_THREADS`` and ``-t``). ``min_cosine`` is the lowest cosine
between the two sides' vectors for the same text and ``max_one_minus_cos`` its distance from 1: both
computed the same thing.

    python bench/embeddings.py [--models minilm,nomic-v1.5,nomic-v2-moe] [--threads 1] [--repeats 3]
                               [--work DIR] [-o report.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCHES = (1, 32, 256)
#: the MoE model is the heaviest per token (8 experts' weights read per MoE block): smaller batches
MOE_BATCHES = (1, 8, 32)
_STAMP = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) I batch_decode", re.M)


def sentences(n: int) -> list[str]:
    """``n`` sentences of the shipped calibration corpus, cycled if it has fewer."""
    from hf2q.quality.corpus import load_corpus

    text = load_corpus("calibration").text
    parts = [p.strip() for p in re.split(r"(?<=[.!?])\s+|\n+", text) if len(p.strip()) > 3]
    return [parts[i % len(parts)] for i in range(n)]


def minilm_gguf(work: Path) -> Path:
    from hf2q.cli import main
    from hf2q.fetch import MINILM, fetch

    out = work / "all-minilm-l6-v2-f16.gguf"
    if not out.exists():
        assert main(["convert", str(fetch(MINILM)), "-q", "f16", "-o", str(out), "--no-integrity"]) == 0
    return out


class RandomTensors:
    """Seeded random weights for a shape-only GGUF: F16 matrices scaled by 1/sqrt(width), F32 vectors."""

    def __init__(self, seed: int = 0):
        self._rng = np.random.default_rng(seed)

    def mat(self, *shape):
        return (self._rng.standard_normal(shape, dtype=np.float32) * shape[-1] ** -0.5).astype(np.float16)

    def vec(self, n, around):
        return (around + 0.1 * self._rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    def embeddings(self, w, vocab: int, hidden: int, token_types: int) -> None:
        """The token, token-type and embedding-norm tensors every BERT-like GGUF starts with."""
        w.add_tensor("token_embd.weight", self.mat(vocab, hidden))
        w.add_tensor("token_types.weight", self._rng.standard_normal((token_types, hidden),
                                                                     dtype=np.float32) * 0.1)
        w.add_tensor("token_embd_norm.weight", self.vec(hidden, 1.0))
        w.add_tensor("token_embd_norm.bias", self.vec(hidden, 0.0))


    def post_norms(self, w, prefix: str, hidden: int) -> None:
        for norm in ("attn_output_norm", "layer_output_norm"):
            w.add_tensor(prefix + norm + ".weight", self.vec(hidden, 1.0))
            w.add_tensor(prefix + norm + ".bias", self.vec(hidden, 0.0))


def copy_fields(w, src, keep) -> None:
    """The key/values of GGUF ``src`` whose names ``keep`` accepts, as they are."""
    for field in src.fields.values():
        if keep(field.name):
            sub = field.types[-1] if len(field.types) > 1 else None
            w.add_key_value(field.name, field.contents(), field.types[0], sub)


def finish(w, out: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def nomic_shape_gguf(work: Path, vocab_from: Path) -> Path:
    """A random-weight nomic-bert GGUF of v1.5's shape (F16 matrices), MiniLM's tokenizer metadata."""
    import gguf
    from hf2q.formats.gguf_keys import Keys

    out = work / "nomic-v1.5-shape-f16.gguf"
    if out.exists():
        return out
    src = gguf.GGUFReader(vocab_from)
    h, ff, layers, heads = 768, 3072, 12, 12
    a = "nomic-bert"
    w = gguf.GGUFWriter(out, a)
    for key, v in ((Keys.LLM.BLOCK_COUNT, layers), (Keys.LLM.CONTEXT_LENGTH, 2048), (Keys.LLM.EMBEDDING_LENGTH, h),
                   (Keys.LLM.FEED_FORWARD_LENGTH, ff), (Keys.Attention.HEAD_COUNT, heads),
                   (Keys.Attention.KEY_LENGTH, h // heads), (Keys.Attention.VALUE_LENGTH, h // heads),
                   (Keys.LLM.POOLING_TYPE, int(gguf.PoolingType.MEAN))):
        w.add_uint32(key.format(arch=a), v)
    w.add_float32(Keys.Rope.FREQ_BASE.format(arch=a), 1000.0)
    w.add_float32(Keys.Attention.LAYERNORM_EPS.format(arch=a), 1e-12)
    w.add_bool(Keys.Attention.CAUSAL.format(arch=a), False)
    copy_fields(w, src, lambda name: name.startswith("tokenizer."))
    rand = RandomTensors()
    rand.embeddings(w, len(src.fields[Keys.Tokenizer.LIST].data), h, token_types=2)
    for i in range(layers):
        p = f"blk.{i}."
        for name, rows, cols in (("attn_qkv", 3 * h, h), ("attn_output", h, h), ("ffn_gate", ff, h),
                                 ("ffn_up", ff, h), ("ffn_down", h, ff)):
            w.add_tensor(p + name + ".weight", rand.mat(rows, cols))
        rand.post_norms(w, p, h)
    return finish(w, out)


def nomic_v2_shape_gguf(work: Path) -> Path:
    """A random-weight nomic-bert-moe GGUF (F16 matrices) under the header of llama.cpp's vocab file of the
    real model: its hyper-parameters decide every tensor's shape, its tokenizer keys are kept whole."""
    import gguf
    from hf2q.fetch import LLAMA_CPP_SDIST, fetch
    from hf2q.formats.gguf_hparams import moe_block
    from hf2q.formats.gguf_keys import Keys

    out = work / "nomic-v2-moe-shape-f16.gguf"
    if out.exists():
        return out
    src = gguf.GGUFReader(fetch(LLAMA_CPP_SDIST) / "models" / "ggml-vocab-nomic-bert-moe.gguf")
    a = "nomic-bert-moe"

    def hp(key):
        return int(src.fields[key.format(arch=a)].contents())

    h, ff, layers = hp(Keys.LLM.EMBEDDING_LENGTH), hp(Keys.LLM.FEED_FORWARD_LENGTH), hp(Keys.LLM.BLOCK_COUNT)
    experts, every = hp(Keys.LLM.EXPERT_COUNT), hp(Keys.LLM.MOE_EVERY_N_LAYERS)
    w = gguf.GGUFWriter(out, a)
    copy_fields(w, src, lambda name: not name.startswith("GGUF.") and name != Keys.General.ARCHITECTURE)
    rand = RandomTensors()
    mat, vec = rand.mat, rand.vec
    rand.embeddings(w, len(src.fields[Keys.Tokenizer.LIST].data), h, token_types=1)
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_qkv.weight", mat(3 * h, h))
        w.add_tensor(p + "attn_qkv.bias", vec(3 * h, 0.0))
        w.add_tensor(p + "attn_output.weight", mat(h, h))
        w.add_tensor(p + "attn_output.bias", vec(h, 0.0))
        if moe_block(i, every):
            w.add_tensor(p + "ffn_gate_inp.weight", mat(experts, h).astype(np.float32) * 3.0)
            w.add_tensor(p + "ffn_up_exps.weight", mat(experts, ff, h))
            w.add_tensor(p + "ffn_down_exps.weight", mat(experts, h, ff))
        else:
            w.add_tensor(p + "ffn_up.weight", mat(ff, h))
            w.add_tensor(p + "ffn_up.bias", vec(ff, 0.0))
            w.add_tensor(p + "ffn_down.weight", mat(h, ff))
            w.add_tensor(p + "ffn_down.bias", vec(h, 0.0))
        rand.post_norms(w, p, h)
    return finish(w, out)


def ours(runner, tokens, repeats: int) -> tuple[float, "object"]:
    runner.embed(tokens)  # warm-up: first-use kernel builds and allocations
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = runner.embed(tokens)
        best = min(best, time.perf_counter() - t0)
    return best, out


def theirs(model: Path, texts: list[str], n_tokens: int, threads: int, repeats: int) -> tuple[float, "object"]:
    from tests.tools import llama_cpp

    size = max(512, 1 << (n_tokens - 1).bit_length())
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(texts))
    args = [str(llama_cpp.tool("llama-embedding")), "-m", str(model), "-f", f.name, "-t", str(threads),
            "-c", str(size), "-b", str(size), "-ub", str(size), "--embd-normalize", "2",
            "--embd-output-format", "array"]
    env = {**llama_cpp.env(), "OMP_NUM_THREADS": str(threads)}
    best, vectors = float("inf"), None
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            r = subprocess.run(args, env=env, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            if r.returncode != 0:
                raise RuntimeError(f"llama-embedding failed: {r.stderr[-1500:]}")
            stamps = _STAMP.findall(r.stderr)
            if len(stamps) != 1:
                raise RuntimeError(f"llama-embedding ran {len(stamps)} decodes for one batch (expected 1)")
            m, s, ms, us = map(int, stamps[0])
            best = min(best, wall - (m * 60 + s + ms / 1e3 + us / 1e6))
            vectors = np.array(json.loads(r.stdout), dtype=np.float32)
    finally:
        os.unlink(f.name)
    return best, vectors


#: --models key → (row label, GGUF builder, batch sizes)
MODELS = {
    "minilm": ("all-MiniLM-L6-v2 F16", minilm_gguf, BATCHES),
    "nomic-v1.5": ("nomic-embed-text-v1.5 shape F16 (random)", lambda work: nomic_shape_gguf(work, minilm_gguf(work)),
                   BATCHES),
    "nomic-v2-moe": ("nomic-embed-text-v2-moe shape F16 (random)", nomic_v2_shape_gguf, MOE_BATCHES),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="which rows, comma-separated")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "hf2q-bench-embeddings"))
    ap.add_argument("-o", "--out")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF2Q_BLAS_THREADS", str(args.threads))
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))
    from bench.common import emit
    from hf2q.engine.factory import load_runner  # the fast CPU BLAS before MLX
    from hf2q.text.tokenizer import GGUFTokenizer

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    chosen = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(chosen) - set(MODELS))
    if unknown:
        ap.error(f"--models: unknown {', '.join(unknown)} (choose from {', '.join(MODELS)})")
    rows = []
    for key in chosen:
        label, build, batches = MODELS[key]
        path = build(work)
        runner = load_runner(path)
        tok = GGUFTokenizer.from_gguf(path)
        for n in batches:
            texts = sentences(n)
            tokens = [tok.encode(t) for t in texts]
            n_tok = sum(len(t) for t in tokens)
            t_ours, v_ours = ours(runner, tokens, args.repeats)
            t_theirs, v_theirs = theirs(path, texts, n_tok, args.threads, args.repeats)
            cos = np.sum(np.asarray(v_ours) * v_theirs, axis=1) / np.linalg.norm(v_theirs, axis=1)
            rows.append({"model": label, "batch": n, "tokens": n_tok,
                         "hf2q_texts_per_s": round(n / t_ours, 1), "llama_cpp_texts_per_s": round(n / t_theirs, 1),
                         "ratio": round(t_theirs / t_ours, 2), "min_cosine": round(float(cos.min()), 6),
                         "max_one_minus_cos": float(f"{1.0 - float(cos.min()):.3g}")})
            print(rows[-1], file=sys.stderr)
    return emit({"bench": "embeddings", "threads": args.threads, "repeats": args.repeats, "rows": rows}, args.out)


if __name__ == "__main__":
    sys.exit(main())
