"""Benchmark: the 8-bit KV cache (``--kv-cache-type q8|q8-rotated``) against the f16 cache, and
llama.cpp's ``--cache-type-k/v q8_0`` on the same GGUF in the same run.

Per model (SmolLM2-135M and Gemma3-270m, the test GGUFs) and cache type: KV bytes per token (the
engine's own, and on a 16-bit GPU engine), how many ``--slot-ctx`` slots fit ``--budget``, prefill
and decode tokens/s at ``--speed-ctx`` tokens of context, and KL divergence / top-1 agreement /
perplexity change against the same model's f16 cache over ``--windows`` windows of ``--n-ctx``
tokens of the shipped calibration text (``hf2q.quality.kv_scores``). llama.cpp: ``llama-perplexity
--kl-divergence`` of its q8_0 cache against its f16 cache, and ``llama-bench`` prefill/decode speed
of both. JSON on stdout. ``--device gpu`` (the default where MLX has a GPU) runs our engine there.

    python bench/kvcache.py [--models smollm2,gemma3] [--n-ctx 512] [--windows 8] [--speed-ctx 512]
                            [--decode-steps 16] [--budget 1G] [--slot-ctx 8192] [--device cpu|gpu]
                            [--threads 2] [--no-llama-cpp] [-o results.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import emit  # noqa: E402

MODELS = {"smollm2": "smollm2_gguf", "gemma3": "gemma3_gguf"}
KV_TYPES = ("f16", "q8", "q8-rotated")
QUALITY = ("kld_mean", "kld_p99", "kld_max", "same_top", "ppl", "ppl_ref", "ln_ppl_ratio")


def _speed(runner, tokens: list[int], steps: int) -> dict:
    """Prefill ``tokens`` (chunks of 512) into a fresh sequence, then ``steps`` single-sequence decodes."""
    seq = runner.new_sequence()
    runner.prefill(seq, tokens[:512])  # first-use compilation (the prefill shape, then decode) outside the timing
    runner.decode([seq], [tokens[0]])
    seq.trim(0)
    t0 = time.perf_counter()
    for a in range(0, len(tokens), 512):
        logits = runner.prefill(seq, tokens[a:a + 512])
    t1 = time.perf_counter()
    tok = int(logits.argmax())
    for _ in range(steps):
        tok = int(runner.decode([seq], [tok])[0].argmax())
    t2 = time.perf_counter()
    return {"prefill_tok_s": len(tokens) / (t1 - t0), "decode_tok_s": steps / (t2 - t1),
            "host_decode_step": runner.host_decoder is not None}


def _slots(hp, elem: int, kv_type: str, budget: int, ctx: int, on_cpu: bool = False) -> int:
    """Slots of ``ctx`` tokens in ``budget``; ``on_cpu``: the host decode step keeps every position of
    gemma3's local layers."""
    from hf2q.engine.memory_plan import kv_need

    return budget // kv_need(hp, elem, on_cpu=on_cpu, kv_type=kv_type).slot_bytes(ctx)


def ours(path: Path, args, text_tokens: list[int], bos: int | None) -> dict:
    from hf2q.engine.factory import load_runner
    from hf2q.engine.memory_plan import token_bytes
    from hf2q.quality.kv_scores import kv_type_scores, runners_by_kv_type

    base = load_runner(path, ctx=max(args.n_ctx, args.speed_ctx + args.decode_steps + 8))
    runners = runners_by_kv_type(base, KV_TYPES)
    hp, elem = base.gguf.hparams, base.dtype.size
    # the runner's figure leaves out the layers a cache windows (gemma3 off the CPU host step): the all-layer
    # figures compare the storage alone
    out = {t: {"kv_bytes_per_token": r.kv_bytes_per_token,
               "kv_bytes_per_token_all_layers": token_bytes(hp, elem, t),
               "kv_bytes_per_token_16bit": token_bytes(hp, 2, t),
               f"slots_{args.slot_ctx}_in_budget": _slots(hp, elem, t, args.budget, args.slot_ctx,
                                                          r.host_decoder is not None),
               f"slots_{args.slot_ctx}_in_budget_16bit": _slots(hp, 2, t, args.budget, args.slot_ctx)}
           for t, r in runners.items()}
    for t, r in runners.items():
        out[t].update(_speed(r, text_tokens[:args.speed_ctx], args.decode_steps))
        out[t]["bytes_smaller_than_f16"] = (out["f16"]["kv_bytes_per_token_all_layers"]
                                            / out[t]["kv_bytes_per_token_all_layers"])
        out[t]["bytes_smaller_than_f16_16bit"] = (out["f16"]["kv_bytes_per_token_16bit"]
                                                  / out[t]["kv_bytes_per_token_16bit"])
    if base.host_decoder is not None:  # every cache type on the MLX graph too: what the host step saves
        from hf2q.engine.runner import MlxModelRunner

        for t in KV_TYPES:
            graph = MlxModelRunner(base.gguf, base.model, base.dtype, base.n_ctx, t)
            graph.host_decoder = None
            out[f"{t}_mlx_graph"] = _speed(graph, text_tokens[:args.speed_ctx], args.decode_steps)
    if args.no_quality:
        return out
    t0 = time.perf_counter()
    scores = kv_type_scores(runners, text_tokens, args.n_ctx, bos_id=bos, chunks=args.windows)
    for t, s in scores.items():
        out[t].update({k: s[k] for k in QUALITY if k in s} | {"scored_tokens": s["tokens"]})
    out["quality_s"] = time.perf_counter() - t0
    out["dtype"] = str(base.dtype)
    return out


def _llama_bench(path: Path, args, cache: str) -> dict:
    from tests.tools import llama_cpp

    exe = llama_cpp.tool("llama-bench")
    # as ours: the prompt prefilled from an empty cache, then decode steps at that depth
    runs = {"prefill_tok_s": ("-p", str(args.speed_ctx), "-n", "0"),
            "decode_tok_s": ("-p", "0", "-n", str(args.decode_steps), "-d", str(args.speed_ctx))}
    pick = {}
    for key, shape in runs.items():
        cmd = [str(exe), "-m", str(path), *shape, "-r", "1", "-t", str(args.threads), "-ngl", "99",
               "-ctk", cache, "-ctv", cache, "-fa", "on", "-o", "json"]
        p = subprocess.run(cmd, env=dict(llama_cpp.env(), OMP_NUM_THREADS=str(args.threads)), capture_output=True,
                           text=True)
        if p.returncode != 0:
            return {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}"}
        pick[key] = json.loads(p.stdout)[0]["avg_ts"]
    return pick


def theirs(path: Path, args, corpus_file: Path) -> dict:
    """llama.cpp's q8_0 cache against its f16 cache (flash attention on for both: llama.cpp's
    quantized V cache needs it), on the same text, context and windows."""
    from tests.tools import llama_perplexity

    out: dict = {"f16": {}, "q8_0": {}}
    if not args.no_quality:
        with tempfile.TemporaryDirectory() as tmp:
            logits = Path(tmp) / "base.kld"
            fa = ("-fa", "on")
            out["f16"] = llama_perplexity.base(path, corpus_file, args.n_ctx, args.windows, logits, args.threads, fa)
            q8 = ("-ctk", "q8_0", "-ctv", "q8_0", *fa)
            got = llama_perplexity.kl(path, corpus_file, args.n_ctx, args.windows, logits, args.threads, q8)
            out["q8_0"] = {k: got[k] for k in QUALITY if k in got}
    for cache in ("f16", "q8_0"):
        out[cache].update(_llama_bench(path, args, cache))
    return out


def main(argv: list[str] | None = None) -> int:
    from hf2q.cli import parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,gemma3", help="test models by name ('' for none)")
    ap.add_argument("--gguf", action="append", default=[], help="also this GGUF (repeatable; e.g. a random-weight "
                    "real shape from bench/synth_gguf.py, with --no-quality)")
    ap.add_argument("--n-ctx", type=int, default=512, help="tokens per scored window")
    ap.add_argument("--windows", type=int, default=8, help="windows scored (8 × 512 = 4096 tokens of text)")
    ap.add_argument("--speed-ctx", type=int, default=512, help="prompt tokens before the decode steps")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--budget", type=parse_size, default=parse_size("1G"), help="KV budget the slot count uses")
    ap.add_argument("--slot-ctx", type=int, default=8192, help="context of one slot in the slot count")
    ap.add_argument("--device", choices=["cpu", "gpu"], default=None, help="default: the GPU where MLX has one")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--no-quality", action="store_true", help="bytes and speed only")
    ap.add_argument("-o", "--out")
    args = ap.parse_args(argv)

    from hf2q.engine.factory import prepare_mlx

    prepare_mlx()
    import mlx.core as mx

    if args.device:
        mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    from hf2q.quality.corpus import load_corpus
    from hf2q.text.tokenizer import GGUFTokenizer
    from tests.models import real

    corpus = load_corpus("calibration")
    report = {"device": mx.default_device().type.name, "n_ctx": args.n_ctx, "windows": args.windows,
              "speed_ctx": args.speed_ctx, "decode_steps": args.decode_steps, "budget": args.budget,
              "slot_ctx": args.slot_ctx, "corpus": corpus.name, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        corpus_file = Path(tmp) / "corpus.txt"
        corpus_file.write_text(corpus.text)
        named = {n: Path(getattr(real, MODELS[n])()) for n in args.models.split(",") if n}
        for name, path in (named | {Path(g).stem: Path(g) for g in args.gguf}).items():
            tok = GGUFTokenizer.from_gguf(path)
            ids = tok.encode(corpus.text, add_special=False)
            entry = {"gguf": path.name, "text_tokens": len(ids), "ours": ours(path, args, ids, tok.bos_id)}
            if not args.no_llama_cpp:
                entry["llama_cpp"] = theirs(path, args, corpus_file)
            report["models"][name] = entry
    return emit(report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
