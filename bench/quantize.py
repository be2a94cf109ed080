"""Quantizer throughput: MB/s of float32 input per type — compiled (numba) path, numpy path, llama.cpp.

    python bench/quantize.py                       # 4096×4096, all types, JSON on stdout
    python bench/quantize.py --rows 1024 --types Q4_K Q6_K Q8_0 --threads 1 2 --imatrix
    python bench/quantize.py --compile-time        # cold JIT compile vs cached load, in fresh processes

For each type and thread count the same matrix goes through ``codec.jit_quantize`` (``jit_mb_s_<n>t``)
and ``codec.numpy_quantize`` (``numpy_mb_s_<n>t``).  When the llama.cpp build from
``tests/tools/llama_cpp.py`` is present, stock ``ggml_quantize_chunk`` (llama.cpp's
single-threaded C quantizer, what each llama-quantize worker thread runs) quantizes it too
(``llama_cpp_mb_s``), and every output is checked byte for byte against it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gguf import GGMLQuantizationType as T

from hf2q.ggml import codec

ALL_TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
QUANTIZED = [t for t in ALL_TYPES if not t.startswith(("F", "BF"))]


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


_COMPILE_PROBE = """
import time, numpy as np
t0 = time.perf_counter()
from gguf import GGMLQuantizationType as T
from hf2q.ggml import codec
x = np.random.default_rng(0).standard_normal((2, 512)).astype(np.float32)
w = np.ones(512, np.float32)
t1 = time.perf_counter()
codec.jit_quantize(x, T.Q4_0); codec.jit_quantize(x, T.Q4_0, imatrix=w)
t2 = time.perf_counter()
codec.jit_quantize(x, T.Q4_K); codec.jit_quantize(x, T.Q4_K, imatrix=w)
t3 = time.perf_counter()
print(round(t1 - t0, 2), round(t2 - t1, 2), round(t3 - t2, 2))
"""


def compile_time() -> dict:
    """First use in a fresh process with an empty numba cache (compile), then again (cached load)."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache, PYTHONPATH=str(ROOT))
        rows = []
        for phase in ("cold_compile", "cached"):
            t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
            out = subprocess.run([sys.executable, "-c", _COMPILE_PROBE], env=env, check=True,
                                 capture_output=True, text=True).stdout.split()
            total = time.perf_counter() - t0
            cpu = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - cpu0
            rows.append({"phase": phase, "process_s": round(total, 2), "process_cpu_s": round(cpu, 2), "import_s": float(out[0]),
                         "legacy_kernels_s": float(out[1]), "k_quant_kernels_s": float(out[2])})
    return {"benchmark": "jit_compile_time", "results": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--types", nargs="+", default=ALL_TYPES)
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--imatrix", action="store_true", help="quantize with a random importance matrix")
    ap.add_argument("--no-numpy", action="store_true", help="skip the numpy path (slow on big shapes)")
    ap.add_argument("--no-peer", action="store_true", help="skip the llama.cpp comparison")
    ap.add_argument("--compile-time", action="store_true", help="only measure JIT compile / cache-load time")
    args = ap.parse_args(argv)
    if args.compile_time:
        print(json.dumps(compile_time(), indent=1))
        return 0

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((args.rows, args.cols)) * 0.02).astype(np.float16).astype(np.float32)
    imatrix = rng.gamma(0.8, 1.0, args.cols).astype(np.float32) if args.imatrix else None
    mb = x.nbytes / 1e6
    peer = None if args.no_peer else _llama_cpp()
    jit = codec.numba_installed()
    results = []
    for name in args.types:
        qtype = T[name]
        row = {"type": name, "shape": list(x.shape), "input_mb": round(mb, 1), "imatrix": args.imatrix}
        outputs = {}
        paths = [("jit", codec.jit_quantize)] if jit and name in QUANTIZED else []
        if not args.no_numpy or name not in QUANTIZED:
            paths.append(("numpy", codec.numpy_quantize))
        for label, fn in paths:
            if label == "jit":
                fn(x[:8], qtype, imatrix=imatrix)  # first use of this kernel outside the timing
            for th in args.threads:
                sec, outputs[label] = _timed(lambda fn=fn, th=th, qtype=qtype: fn(x, qtype, threads=th, imatrix=imatrix),
                                             args.repeat)
                row[f"{label}_mb_s_{th}t"] = round(mb / sec, 1)
        if jit and not args.no_numpy and name in QUANTIZED:
            row["jit_over_numpy_1t"] = round(row["jit_mb_s_1t"] / row["numpy_mb_s_1t"], 2) if 1 in args.threads else None
        if peer is not None:
            sec, theirs = _timed(lambda name=name: peer.quantize(x, name, imatrix), args.repeat)
            row["llama_cpp_mb_s_1t"] = round(mb / sec, 1)
            for label, ours in outputs.items():
                row[f"{label}_identical_to_llama_cpp"] = bool(np.array_equal(ours, theirs))
            if "jit_mb_s_1t" in row:
                row["jit_over_llama_cpp_1t"] = round(row["jit_mb_s_1t"] / row["llama_cpp_mb_s_1t"], 2)
        ours = next(iter(outputs.values()))
        sec, _ = _timed(lambda ours=ours, qtype=qtype: codec.dequantize(ours, qtype, x.shape), args.repeat)
        row["dequantize_mb_s"] = round(mb / sec, 1)
        results.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "quantize", "jit_available": jit, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
