"""Quantizer throughput: MB/s of float32 input for every codec type, 1 and 2 threads.

    python bench/quantize.py                       # 4096×4096, all types, JSON on stdout
    python bench/quantize.py --rows 1024 --types Q4_K Q6_K Q8_0 --threads 1 2 4

When the llama.cpp build from ``tests/tools/llama_cpp.py`` is present, the same matrix is
also quantized by stock ``ggml_quantize_chunk`` (single-threaded C reference quantizer) and
reported beside ours as ``llama_cpp_mb_s`` — together with whether the bytes are identical.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType as T

from hf2q.kernels import codec

ALL_TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def _llama_cpp():
    try:
        from tests.tools import llama_cpp
        from tests.tools.make_quant_fixtures import Ggml
        if (llama_cpp.bin_dir() / "libggml-base.so").exists():
            return Ggml(llama_cpp.bin_dir())
    except (ImportError, OSError):  # the peer is optional
        return None
    return None


def _timed(fn, repeat: int):
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--types", nargs="+", default=ALL_TYPES)
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--no-peer", action="store_true", help="skip the llama.cpp comparison")
    args = ap.parse_args(argv)

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((args.rows, args.cols)) * 0.02).astype(np.float16).astype(np.float32)
    mb = x.nbytes / 1e6
    peer = None if args.no_peer else _llama_cpp()
    results = []
    for name in args.types:
        row = {"type": name, "shape": list(x.shape), "input_mb": round(mb, 1)}
        ours = None
        qtype = T[name]
        for th in args.threads:
            sec, ours = _timed(lambda th=th, qtype=qtype: codec.quantize(x, qtype, threads=th), args.repeat)
            row[f"mb_s_{th}t"] = round(mb / sec, 1)
        if peer is not None:
            sec, theirs = _timed(lambda name=name: peer.quantize(x, name), args.repeat)
            row["llama_cpp_mb_s"] = round(mb / sec, 1)
            row["identical_to_llama_cpp"] = bool(np.array_equal(ours, theirs))
        sec, _ = _timed(lambda ours=ours, qtype=qtype: codec.dequantize(ours, qtype, x.shape), args.repeat)
        row["dequantize_mb_s"] = round(mb / sec, 1)
        results.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "quantize", "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
