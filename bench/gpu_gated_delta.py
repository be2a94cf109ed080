"""The gated delta rule on a GPU: hf2q's CUDA kernel (``hf2q.kernels.cuda_gated_delta``) against MLX's
``mx.fast.gated_delta_update`` at real Qwen 3.5 head shapes — agreement with the numpy reference, and
milliseconds per layer call for a prefill chunk and a decode step. JSON lines out; needs mlx-cuda.

    python bench/gpu_gated_delta.py
"""
import json
import sys
import time

sys.path.insert(0, ".")
import mlx.core as mx  # noqa: E402

from hf2q.kernels import cuda_gated_delta  # noqa: E402
from tests.gated_delta_check import check, random_case  # noqa: E402

# (name, key heads, value heads, key dim, value dim): Qwen3.5-9B / 35B-A3B and 27B linear-attention layers
SHAPES = [("qwen35-9b", 16, 32, 128, 128), ("qwen35-27b", 16, 48, 128, 128)]


def _mlx_fused(q, k, v, gamma, beta, state):
    reps = (1, 1, v.shape[2] // q.shape[2], 1)
    return mx.fast.gated_delta_update(mx.tile(q, reps), mx.tile(k, reps), v, gamma, beta, state)


def timing(fn, B: int, T: int, hk: int, hv: int, dk: int, dv: int, reps: int) -> float:
    args = [mx.array(a) for a in random_case(B, T, hk, hv, dk, dv)]
    mx.eval(fn(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn(*args))
    return round((time.perf_counter() - t0) / reps * 1e3, 4)


def main() -> None:
    if not cuda_gated_delta.available():
        print(json.dumps({"error": "no CUDA device"}))
        return
    errs = {f"{name}_T{T}": [round(e, 7) for e in check(cuda_gated_delta.gated_delta, 1, T, hk, hv, dk, dv)]
            for name, hk, hv, dk, dv in SHAPES for T in (1, 100)}
    print(json.dumps({"max_abs_error_y_state": errs}), flush=True)
    for name, hk, hv, dk, dv in SHAPES:
        for B, T in ((1, 512), (1, 2048), (1, 1), (4, 1), (8, 1)):
            row = {"shape": name, "batch": B, "tokens": T}
            for label, fn in (("mlx_fast_ms", _mlx_fused), ("hf2q_ms", cuda_gated_delta.gated_delta)):
                row[label] = timing(fn, B, T, hk, hv, dk, dv, reps=3 if T > 1 else 50)
            row["speedup"] = round(row["mlx_fast_ms"] / row["hf2q_ms"], 1)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
