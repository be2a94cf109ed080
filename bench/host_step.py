"""The CPU host decode step by batch size: best step time and the share spent in the quantized matvecs.

    python bench/host_step.py [--model GGUF] [--batches 1,2,4,8] [--reps 40] [--chunk 19]

A diagnostic beside ``bench/decode_depth.py`` (which races llama.cpp): how much a batch of *n* sequences
costs against one on this CPU (short contexts, 40-token prompts), so batching's efficiency is measured,
not guessed; and a decode-first mixed step (3 sequences decoding while a ``--chunk``-token prompt suffix
prefills, the shape of a new request joining three running ones) as one pass against decode then prefill.
JSON out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import chat_model, emit  # noqa: E402 (bench/ is on the path of a bench script)

from hf2q.engine.factory import prepare_mlx  # noqa: E402

prepare_mlx()  # the fast CPU BLAS before MLX
import numpy as np  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF (default: the built-in default chat model)")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--chunk", type=int, default=19, help="prefill rows of the mixed step")
    p.add_argument("--out")
    args = p.parse_args(argv)
    path = chat_model(args.model)
    from hf2q.engine.runner import MlxModelRunner
    from hf2q.kernels import cpu_pool, cpu_qmatvec

    r = MlxModelRunner.load(path, ctx=4096)
    if r.host_decoder is None:
        return emit({"model": str(path), "error": "no host decode step for this model here"}, args.out)
    spent = [0.0]
    run = cpu_qmatvec.QMatrixGroup.run

    def timed(self, *a):
        t = time.perf_counter()
        run(self, *a)
        spent[0] += time.perf_counter() - t
    cpu_qmatvec.QMatrixGroup.run = timed
    report = {"model": str(path), "threads": cpu_pool.threads(), "reps": args.reps}
    base = None
    for b in (int(x) for x in args.batches.split(",")):
        seqs = [r.new_sequence() for _ in range(b)]
        for i, s in enumerate(seqs):
            r.prefill(s, [int(t) for t in np.random.default_rng(i).integers(100, 20000, 40)])
        toks = np.full(b, 200, dtype=np.int32)
        best, best_mv = float("inf"), 0.0
        steps = []
        for _ in range(args.reps):
            spent[0] = 0.0
            t = time.perf_counter()
            r.host_decoder.step(toks, seqs)
            dt = time.perf_counter() - t
            steps.append(dt)
            if dt < best:
                best, best_mv = dt, spent[0]
        base = base or best
        # best step (the machine at its quietest) and median (what a run of steps gets on a shared box)
        report[f"b{b}"] = {"step_ms": round(best * 1e3, 2), "median_step_ms": round(float(np.median(steps)) * 1e3, 2),
                           "matvec_ms": round(best_mv * 1e3, 2),
                           "vs_one_sequence": round(best / base, 3), "tokens_per_sec": round(b / best, 1)}
    seqs = [r.new_sequence() for _ in range(3)]
    for i, s in enumerate(seqs):
        r.prefill(s, [int(t) for t in np.random.default_rng(i).integers(100, 20000, 40)])
    chunk = [int(t) for t in np.random.default_rng(9).integers(100, 20000, args.chunk)]
    times = {"one_pass": [], "apart": []}
    for _ in range(args.reps):
        for how in times:
            new = r.new_sequence()
            r.prefill(new, chunk[:1])
            t = time.perf_counter()
            if how == "one_pass":
                r.decode_with_prefill(seqs, [5, 6, 7], new, chunk)
            else:
                r.decode(seqs, [5, 6, 7])
                r.prefill(new, chunk)
            times[how].append(time.perf_counter() - t)
            for s in seqs:
                s.trim(s.length - 1)
    report[f"mixed_b3_chunk{args.chunk}"] = {f"{how}_ms": round(min(ts) * 1e3, 2) for how, ts in times.items()}
    return emit(report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
