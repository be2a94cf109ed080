"""How close the CPU quantized matvec runs to this core's limits, by batch size. JSON out.

    python bench/host_matvec.py [--batches 1,2,4,8] [--reps 400]

A diagnostic for the decode kernel (``hf2q/kernels/cpu_qmatvec.py``), so claims about what bounds a
batched step are measured rather than read off a CPU model number (a VM may report a made-up one):

* the core clock (a chain of dependent integer multiplies, 3 cycles each) and the 512-bit (else
  256-bit) FMAs per cycle of one thread and of two threads at once — two FMA ports show as ~2 per
  cycle, two vCPUs sharing one physical core as a drop when both run;
* cycles per row-group (one weight row × one 32-weight group) of the kernel on one thread with the
  matrix in cache (a 1536×576 4-bit and a 1024×576 8-bit matrix, SmolLM2's FFN and head widths),
  so memory is out of the picture: the arithmetic cost of each extra batch row;
* the same for the whole SmolLM2-135M shape streamed from memory (30 layers of 4-bit q/k/v, o,
  gate/up, down and the 8-bit head) on the pool's threads, as a decode step runs it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import emit  # noqa: E402 (bench/ is on the path of a bench script)

import numpy as np  # noqa: E402

#: clock and FMA-rate probes in C
PROBE = Path(__file__).with_name("host_matvec_probe.c")


def probe_core() -> dict:
    from hf2q.kernels.cpu_build import KernelBuildError, compile_library

    try:
        lib = ctypes.CDLL(str(compile_library("bench_core_probe", PROBE)))
    except KernelBuildError as e:
        return {"error": f"the probe did not build: {e}"}
    lib.imul_chain.restype = ctypes.c_double
    lib.imul_chain.argtypes = [ctypes.c_int64]
    lib.fma_rate.restype = ctypes.c_double
    lib.fma_rate.argtypes = [ctypes.c_int64, ctypes.c_int]
    n = 300_000_000
    ghz = max(3 * n / lib.imul_chain(n) / 1e9 for _ in range(3))
    one = max(lib.fma_rate(20_000_000, 1) for _ in range(3))
    two = max(lib.fma_rate(20_000_000, 2) for _ in range(3))
    return {"clock_ghz": round(ghz, 2), "vector_lanes": lib.vector_lanes(),
            "fma_per_cycle_one_thread": round(one / (ghz * 1e9), 2),
            "fma_per_cycle_each_of_two_threads": round(two / (ghz * 1e9), 2)}


def _matrix(rng, rows: int, n: int, bits: int) -> tuple:
    packed = rng.integers(0, 256, (rows, n * bits // 8), dtype=np.uint8)
    scales = rng.random((rows, n // 32), dtype=np.float32) * 0.01
    biases = -rng.random((rows, n // 32), dtype=np.float32) * 0.08
    return packed, scales, biases, bits


def _time(group, batch: int, n: int, reps: int) -> float:
    x = np.random.default_rng(1).standard_normal((batch, n)).astype(np.float32)
    y = np.empty((batch, group.rows), dtype=np.float32)
    xp, yp = x.ctypes.data, y.ctypes.data
    for _ in range(10):
        group.run(xp, yp, batch)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            group.run(xp, yp, batch)
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--reps", type=int, default=400)
    p.add_argument("--out")
    p.add_argument("--in-cache-at-ghz", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    from hf2q.kernels import cpu_pool, cpu_qmatvec

    if cpu_qmatvec.kernel() is None:
        return emit({"error": "the CPU matvec kernel is not available (no compiler)"}, args.out)
    rng = np.random.default_rng(0)
    if args.in_cache_at_ghz:  # the child run: one pool thread (HF2Q_CPU_THREADS=1), matrices in cache
        in_cache = {}
        for bits, rows in ((4, 1536), (8, 1024)):
            g = cpu_qmatvec.QMatrixGroup([_matrix(rng, rows, 576, bits)])
            row_groups = rows * 576 // 32
            in_cache[f"{bits}bit"] = {f"b{b}": round(_time(g, b, 576, args.reps) * args.in_cache_at_ghz * 1e9
                                                     / row_groups, 2) for b in batches}
        return emit(in_cache, args.out)
    report: dict = {"core": probe_core(), "simd_width": cpu_qmatvec.kernel().simd_width(),
                    "pool_threads": cpu_pool.threads()}
    ghz = report["core"].get("clock_ghz") or 1.0
    child = subprocess.run([sys.executable, __file__, "--batches", args.batches, "--reps", str(args.reps),
                            "--in-cache-at-ghz", str(ghz)], env={**os.environ, "HF2Q_CPU_THREADS": "1"},
                           capture_output=True, text=True, check=True)
    report["in_cache_cycles_per_row_group"] = json.loads(child.stdout)
    # the SmolLM2-135M shape streamed from memory, as a decode step calls it (4 calls a layer + the head)
    layers = []
    for _ in range(30):
        layers += [(cpu_qmatvec.QMatrixGroup([_matrix(rng, r, 576, 4) for r in (576, 192, 192)]), 576),
                   (cpu_qmatvec.QMatrixGroup([_matrix(rng, 576, 576, 4)]), 576),
                   (cpu_qmatvec.QMatrixGroup([_matrix(rng, r, 576, 4) for r in (1536, 1536)]), 576),
                   (cpu_qmatvec.QMatrixGroup([_matrix(rng, 576, 1536, 4)]), 1536)]
    head = cpu_qmatvec.QMatrixGroup([_matrix(rng, 49152, 576, 8)])
    streamed = {}
    for b in batches:
        xs = {n: np.random.default_rng(2).standard_normal((b, n)).astype(np.float32) for n in (576, 1536)}
        ys = [np.empty((b, g.rows), dtype=np.float32) for g, _ in layers]
        yh = np.empty((b, head.rows), dtype=np.float32)
        best_l = best_h = float("inf")
        for _ in range(12):
            t = time.perf_counter()
            for (g, n), y in zip(layers, ys):
                g.run(xs[n].ctypes.data, y.ctypes.data, b)
            t1 = time.perf_counter()
            head.run(xs[576].ctypes.data, yh.ctypes.data, b)
            t2 = time.perf_counter()
            best_l, best_h = min(best_l, t1 - t), min(best_h, t2 - t1)
        streamed[f"b{b}"] = {"layers_ms": round(best_l * 1e3, 2), "head_ms": round(best_h * 1e3, 2),
                             "total_ms": round((best_l + best_h) * 1e3, 2)}
    base = streamed[f"b{batches[0]}"]["total_ms"]
    for v in streamed.values():
        v["vs_first"] = round(v["total_ms"] / base, 3)
    report["smollm2_shape_streamed"] = streamed
    return emit(report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
