"""The CUDA few-row quantized matvec (``hf2q.kernels.cuda_qmv``) against MLX's ``quantized_matmul``: agreement
with the numpy reference, and µs per call for 1–8 rows. JSON lines out; needs an NVIDIA GPU (mlx-cuda).

    python bench/gpu_qmv.py
"""
import json
import sys
import time

sys.path.insert(0, ".")
import mlx.core as mx  # noqa: E402

from hf2q.kernels import cuda_qmv  # noqa: E402
from tests.cuda_qmv_check import check  # noqa: E402


def timing(bits: int, N: int, K: int, rows: int, reps: int = 50) -> dict:
    w = mx.random.normal((N, K)).astype(mx.float16)
    wq, s, b = mx.quantize(w, group_size=32, bits=bits)
    x = mx.random.normal((rows, K)).astype(mx.float16)
    mx.eval(wq, s, b, x)
    out = {}
    for name, f in (("mlx", lambda: mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=32, bits=bits)),
                    ("hf2q", lambda: cuda_qmv.qmv(x, wq, s, b, bits, 32))):
        if name == "hf2q" and not 1 <= rows <= cuda_qmv.MAX_ROWS:
            continue
        mx.eval(f())
        ys = []
        t0 = time.perf_counter()
        for _ in range(reps):
            ys.append(f())
        mx.eval(ys)
        out[name + "_us"] = round((time.perf_counter() - t0) / reps * 1e6, 1)
    return out


def main() -> None:
    if not cuda_qmv.available():
        print(json.dumps({"error": "no CUDA device"}))
        return
    errs = {f"{bits}b_g{gs}_M{m}_{str(dt).rsplit('.', 1)[-1]}": round(check(bits, gs, m, dtype=dt), 7)
            for bits in (4, 8) for gs in (32, 64) for m in (2, 3, 7) for dt in (mx.float16, mx.bfloat16)}
    print(json.dumps({"max_rel_error": errs}), flush=True)
    for bits in (8, 4):
        for N, K in ((12288, 4096), (4096, 12288), (1024, 4096)):
            print(json.dumps({f"{bits}b_{N}x{K}": {f"M{m}": timing(bits, N, K, m) for m in (1, 2, 3, 4, 6, 8)}}),
                  flush=True)


if __name__ == "__main__":
    main()
