"""Decode speed deep into a context: hf2q vs llama.cpp on the same GGUF and machine.

Agentic clients send 10–20 KB prompts, so a step attends over thousands of positions and
reads the whole KV cache: that, not the weights, bounds decode there. For each depth this
prefills ``depth`` random tokens into 1 and ``--batch`` sequences, then times ``--tg`` decode
steps (aggregate tok/s), and runs ``llama-bench -p 0 -n tg -d depth`` on the same GGUF.
Prints JSON (and writes ``--out``).

    python bench/decode_depth.py --depths 0,4358 --out bench-depth.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import chat_model, emit  # noqa: E402 (bench/ is on the path of a bench script)

from hf2q.engine.factory import prepare_mlx  # noqa: E402

prepare_mlx()  # the fast CPU BLAS before MLX
import numpy as np  # noqa: E402


def hf2q_rates(path: Path, depths: list[int], tg: int, batch: int) -> dict:
    from hf2q.engine.runner import MlxModelRunner, warm_up

    r = MlxModelRunner.load(path, ctx=max(depths) + tg + 16)
    warm_up(r)
    out = {}
    for depth in depths:
        toks = [int(t) for t in np.random.default_rng(depth).integers(100, min(r.vocab_size, 20000), depth)]
        for b in sorted({1, batch}):
            seqs = [r.new_sequence() for _ in range(b)]
            for s in seqs:
                r.prefill(s, toks[:1] or [1])
                for i in range(1, depth, 2048):
                    r.prefill(s, toks[i:i + 2048])
            t0 = time.perf_counter()
            for _ in range(tg):
                r.decode(seqs, [5] * b)
            out[f"d{depth}_b{b}"] = round(tg * b / (time.perf_counter() - t0), 2)
    return out


def llama_cpp_rates(path: Path, depths: list[int], tg: int, threads: int) -> dict:
    from tests.tools import llama_cpp

    exe = llama_cpp.tool("llama-bench")
    if exe is None:
        return {}
    cmd = [str(exe), "-m", str(path), "-p", "0", "-n", str(tg), "-d", ",".join(map(str, depths)), "-t", str(threads),
           "-r", "1", "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **llama_cpp.env()})
    if r.returncode != 0:
        print(f"llama-bench failed: {r.stderr.strip()[-300:]}", file=sys.stderr)
        return {}
    return {f"d{row['n_depth']}_b1": round(row["avg_ts"], 2) for row in json.loads(r.stdout)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF (default: the built-in default chat model)")
    p.add_argument("--depths", default="0,4358")
    p.add_argument("--tg", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-bench threads")
    p.add_argument("--out")
    args = p.parse_args(argv)
    path = chat_model(args.model)
    depths = [int(d) for d in args.depths.split(",")]
    report = {"model": str(path), "tg": args.tg, "cpu_count": os.cpu_count(),
              "hf2q": hf2q_rates(path, depths, args.tg, args.batch),
              "llama.cpp": llama_cpp_rates(path, depths, args.tg, args.threads)}
    report["hf2q/llama.cpp"] = {k: round(v / report["llama.cpp"][k], 2) for k, v in report["hf2q"].items()
                                if report["llama.cpp"].get(k)}
    return emit(report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
