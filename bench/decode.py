"""Prefill and decode throughput: hf2q vs mlx-lm vs llama.cpp, same model, same machine.

For each quantization (default SmolLM2-135M in Q4_0, Q8_0, Q4_K_M):

* hf2q    — ``hf2q convert`` of the HF copy to that GGUF type, run by ``MlxModelRunner``;
* mlx-lm  — ``mlx_lm.convert`` of the same HF dir at the same bits (group 32; Q4_K_M → 4-bit),
            run by ``mlx_lm``'s model with its own prompt cache;
* llama.cpp — ``llama-bench`` on the same GGUF (skipped when the stock build is absent).

Prefill: N random tokens from an empty cache (hf2q in ``--chunk``-token transactions);
decode: ``tg`` single-token steps after a short prompt. Median of ``--reps``. Prints a
table with ratios and writes JSON (``--out``). On CPU the fast BLAS is loaded for both MLX
users (they share the process), so the comparison is about the engines, not the BLAS.

    python bench/decode.py --quants q4_0,q8_0,q4_k_m --prefill 512,2048 --tg 128 --out bench-decode.json
    python bench/decode.py --gguf /tmp/qwen35-0.8b-q8_0.gguf     # any GGUF: hf2q and llama.cpp only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hf2q.engine.factory import prepare_mlx  # noqa: E402

prepare_mlx()  # the fast CPU BLAS before MLX
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

MLX_BITS = {"q4_0": 4, "q4_1": 4, "q8_0": 8, "q4_k_m": 4, "q5_k_m": 5, "q6_k": 6}


def _tokens(n: int, vocab: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(100, min(vocab, 30000), n)]


def prepare(hf_dir: Path, quant: str, work: Path) -> tuple[Path, Path]:
    from hf2q.cli import main

    gguf = work / f"smollm2-{quant}.gguf"
    if not gguf.exists():
        assert main(["convert", str(hf_dir), "-q", quant, "-o", str(gguf), "--no-integrity"]) == 0
    mlx_dir = work / f"smollm2-mlx-{MLX_BITS[quant]}bit-g32"
    if not mlx_dir.exists():
        from mlx_lm import convert

        convert(str(hf_dir), mlx_path=str(mlx_dir), quantize=True, q_group_size=32, q_bits=MLX_BITS[quant])
    return gguf, mlx_dir


def bench_hf2q(gguf: Path, prefill: list[int], tg: int, reps: int, chunk: int) -> dict:
    from hf2q.engine.runner import MlxModelRunner

    return bench_runner(MlxModelRunner.load(gguf), prefill, tg, reps, chunk)


def bench_runner(r, prefill: list[int], tg: int, reps: int, chunk: int) -> dict:
    """Time any ``ModelRunner`` (single-process or tensor-parallel rank 0)."""
    from hf2q.engine.runner import warm_up

    for rows in sorted({min(chunk, n) for n in prefill}):  # first calls at a shape compile kernels (GPU): not timed
        warm = r.new_sequence()
        r.prefill(warm, _tokens(rows, r.vocab_size))
        del warm
    warm_up(r)  # decode and the device-sampling kernels, as `hf2q serve` does before it is ready
    pipelined = getattr(r, "pipelines_decode", False)  # the MLX graph path (GPUs); CPU host decode is synchronous
    out = {}
    for n in prefill:
        toks = _tokens(n, r.vocab_size)
        times = []
        for _ in range(reps):
            s = r.new_sequence()
            t0 = time.perf_counter()
            for i in range(0, n, chunk):
                r.prefill(s, toks[i:i + chunk])
            times.append(time.perf_counter() - t0)
        out[f"pp{n}"] = n / statistics.median(times)
    times = []
    for _ in range(reps):
        s = r.new_sequence()
        logits = r.prefill(s, _tokens(16, r.vocab_size))
        tok = int(np.argmax(logits))
        t0 = time.perf_counter()
        for _ in range(tg):
            tok = int(np.argmax(r.decode([s], [tok])[0]))
        times.append(time.perf_counter() - t0)
    out[f"tg{tg}_sync" if pipelined else f"tg{tg}"] = tg / statistics.median(times)
    if pipelined:  # greedy sampled on the device, step n+1 queued before n is read
        out[f"tg{tg}"] = tg / statistics.median(_pipelined_greedy(r, tg) for _ in range(reps))
    return out


def _pipelined_greedy(r, tg: int) -> float:
    """Seconds for ``tg`` greedy decode steps through ``decode_async`` (as ``hf2q generate`` runs them)."""
    from hf2q.engine.sampling.device import DeviceSampler
    from hf2q.sched.contracts import SamplingParams

    s = r.new_sequence()
    tok = int(np.argmax(r.prefill(s, _tokens(16, r.vocab_size))))
    samplers = [DeviceSampler(SamplingParams(temperature=0.0))]
    t0 = time.perf_counter()
    pending = r.decode_async([s], [tok], samplers)
    for _ in range(tg - 1):
        nxt = r.decode_async([s], pending, samplers)
        pending.result()
        pending = nxt
    pending.result()
    return time.perf_counter() - t0


def bench_mlx_lm(mlx_dir: Path, prefill: list[int], tg: int, reps: int) -> dict:
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(mlx_dir))
    vocab = model.args.vocab_size
    out = {}
    for n in prefill:
        toks = mx.array(_tokens(n, vocab))[None]
        times = []
        for _ in range(reps):
            cache = make_prompt_cache(model)
            t0 = time.perf_counter()
            mx.eval(model(toks, cache=cache)[:, -1, :])
            times.append(time.perf_counter() - t0)
        out[f"pp{n}"] = n / statistics.median(times)
    times = []
    for _ in range(reps):
        cache = make_prompt_cache(model)
        logits = model(mx.array(_tokens(16, vocab))[None], cache=cache)[:, -1, :]
        tok = mx.argmax(logits, axis=-1)
        mx.eval(tok)
        t0 = time.perf_counter()
        for _ in range(tg):
            tok = mx.argmax(model(tok.reshape(1, 1), cache=cache)[:, -1, :], axis=-1)
            mx.eval(tok)
        times.append(time.perf_counter() - t0)
    out[f"tg{tg}"] = tg / statistics.median(times)
    return out


def bench_llama_cpp(gguf: Path, prefill: list[int], tg: int, reps: int, threads: int,
                    extra: list[str] = ()) -> dict | None:
    from tests.tools import llama_cpp

    exe = llama_cpp.tool("llama-bench")
    if exe is None:
        return None
    env = {**os.environ, **llama_cpp.env(), "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [str(exe), "-m", str(gguf), "-p", ",".join(map(str, prefill)), "-n", str(tg), "-r", str(reps),
           "-t", str(threads), "-o", "json", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        print(f"llama-bench failed: {r.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    out = {}
    for row in json.loads(r.stdout):
        key = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
        out[key] = float(row["avg_ts"])
    return out


def bench_files(paths: list[Path], args) -> int:
    """hf2q and llama.cpp on each given GGUF (no HF source needed, so no mlx-lm)."""
    prefill = [int(x) for x in args.prefill.split(",") if x]
    results = {"device": str(mx.default_device()), "prefill": prefill, "tg": args.tg, "reps": args.reps, "runs": {}}
    for path in paths:
        row = {"hf2q": bench_hf2q(path, prefill, args.tg, args.reps, args.chunk),
               "llama.cpp": bench_llama_cpp(path, prefill, args.tg, args.reps, args.threads,
                                            args.llama_args.split())}
        if row["llama.cpp"]:
            row["hf2q/llama.cpp"] = {k: round(row["hf2q"][k] / v, 3) for k, v in row["llama.cpp"].items()
                                     if k in row["hf2q"] and v}
        results["runs"][path.name] = row
        print(json.dumps({path.name: row}), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quants", default="q4_0,q8_0,q4_k_m")
    p.add_argument("--prefill", default="512,2048")
    p.add_argument("--tg", type=int, default=128)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--engines", default="hf2q,mlx-lm,llama.cpp")
    p.add_argument("--work", default=None, help="where converted models are kept (default: hf2q cache/bench)")
    p.add_argument("--gguf", action="append", default=[],
                   help="time these GGUF files instead (hf2q and llama.cpp on each; e.g. bench/synth_gguf.py shapes)")
    p.add_argument("--llama-args", default="", help="extra llama-bench flags, e.g. '-fa 1' on a GPU")
    p.add_argument("--out", default="bench-decode.json")
    args = p.parse_args(argv)
    if args.gguf:
        return bench_files([Path(g) for g in args.gguf], args)

    from hf2q.paths import cache_root
    from tests.models.real import smollm2_hf_dir

    work = Path(args.work) if args.work else cache_root() / "bench"
    work.mkdir(parents=True, exist_ok=True)
    prefill = [int(x) for x in args.prefill.split(",") if x]
    engines = set(args.engines.split(","))
    hf_dir = smollm2_hf_dir()
    results = {"device": str(mx.default_device()), "model": "SmolLM2-135M-Instruct", "prefill": prefill,
               "tg": args.tg, "reps": args.reps, "runs": {}}
    for quant in args.quants.split(","):
        gguf, mlx_dir = prepare(hf_dir, quant, work)
        row = {}
        if "hf2q" in engines:
            row["hf2q"] = bench_hf2q(gguf, prefill, args.tg, args.reps, args.chunk)
        if "mlx-lm" in engines:
            row["mlx-lm"] = bench_mlx_lm(mlx_dir, prefill, args.tg, args.reps)
        if "llama.cpp" in engines:
            row["llama.cpp"] = bench_llama_cpp(gguf, prefill, args.tg, args.reps, args.threads)
        for peer in ("mlx-lm", "llama.cpp"):
            if row.get(peer) and row.get("hf2q"):
                row[f"hf2q/{peer}"] = {k: round(row["hf2q"][k] / v, 3) for k, v in row[peer].items()
                                      if k in row["hf2q"] and v}
        results["runs"][quant] = row
        print(f"\n{quant}:")
        for name, vals in row.items():
            if vals:
                print(f"  {name:16s} " + "  ".join(f"{k} {v:8.2f}" for k, v in vals.items()))
        sys.stdout.flush()
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
