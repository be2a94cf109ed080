"""Decode scaling with the batch size on a GPU (engine alone), and MLX's quantized matmul by row count.

    python bench/gpu_batch.py /tmp/hf2q-gpu/qwen3-8b-q8_0.gguf

For 1, 2, 4 and 8 sequences (64-token prompts): aggregate tok/s of blocking ``decode`` steps and
of pipelined ``decode_async`` steps, and the median time to build and launch one pipelined step
(the host's share; when it exceeds the device's, the step is launch-bound). First, MLX's
``quantized_matmul`` on a 12288×4096 weight at M = 1, 2, 4, 8 rows (8- and 4-bit, group 32).
Prints one JSON object per line.
"""
import json
import sys
import time

sys.path.insert(0, ".")
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from hf2q.engine.sampling.device import DeviceSampler  # noqa: E402
from hf2q.engine.runner import MlxModelRunner, warm_up  # noqa: E402
from hf2q.sched.contracts import SamplingParams  # noqa: E402


def qmm_rates() -> dict:
    out = {}
    for bits in (8, 4):
        w = mx.random.normal((12288, 4096)).astype(mx.float16)
        wq, s, b = mx.quantize(w, group_size=32, bits=bits)
        mx.eval(wq, s, b)
        for m in (1, 2, 4, 8):
            x = mx.random.normal((m, 4096)).astype(mx.float16)
            mx.eval(x)

            def chain(x=x):
                y = x
                for _ in range(50):
                    y = mx.quantized_matmul(y, wq, s, b, transpose=True, group_size=32, bits=bits)[:, :4096]
                return y
            mx.eval(chain())
            t0 = time.perf_counter()
            mx.eval(chain())
            out[f"{bits}b_M{m}_us"] = round((time.perf_counter() - t0) / 50 * 1e6, 1)
    return out


def decode_step_s(r, batch: int, steps: int, *, pipelined: bool, reps: int = 1,
                  prompt_len: int = 64) -> tuple[float, float]:
    """Median seconds per decode step over ``batch`` sequences (``reps`` runs of ``steps``) and, when
    ``pipelined``, the median seconds to build and launch one step (the host's share), else 0.

    Blocking steps read each step's logits back; pipelined ones go through ``decode_async`` (greedy
    on the device, step n+1 queued before step n is read), the way the serving runtime's decode
    pipeline runs a steady batch. Three untimed steps first build the batch (stacked or not)."""
    seqs = [r.new_sequence() for _ in range(batch)]
    toks = [int(np.argmax(r.prefill(s, [int(t) % r.vocab_size
                                        for t in np.random.default_rng(i).integers(100, 30000, prompt_len)])))
            for i, s in enumerate(seqs)]
    times, builds = [], []
    if not pipelined:
        for _ in range(3):
            toks = [int(t) for t in np.argmax(r.decode(seqs, toks), -1)]
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(steps):
                toks = [int(t) for t in np.argmax(r.decode(seqs, toks), -1)]
            times.append((time.perf_counter() - t0) / steps)
        return float(np.median(times)), 0.0
    samplers = [DeviceSampler(SamplingParams(temperature=0.0)) for _ in seqs]
    pending = r.decode_async(seqs, toks, samplers)
    for _ in range(3):
        ahead = r.decode_async(seqs, pending, samplers)
        pending.result()
        pending = ahead
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(steps):
            tb = time.perf_counter()
            ahead = r.decode_async(seqs, pending, samplers)
            builds.append(time.perf_counter() - tb)
            pending.result()
            pending = ahead
        times.append((time.perf_counter() - t0) / steps)
    pending.result()
    return float(np.median(times)), float(np.median(builds))


def aggregate_decode(r, cases=((1, True), (2, True), (4, True), (8, True), (4, False), (8, False)),
                     steps: int = 48) -> dict:
    """Aggregate decode tok/s per (sequences, stacked) case on a loaded, warmed runner."""
    out = {}
    for batch, stack in cases:
        r.stack_decode = stack  # kv_cache.StackedDecode for batches of 2+ (off: per-sequence buffers)
        blocking, _ = decode_step_s(r, batch, steps, pipelined=False)
        piped, build = decode_step_s(r, batch, steps, pipelined=True)
        key = f"B{batch}" + ("" if stack or batch == 1 else "_unstacked")
        out[key] = {"blocking_tok_s": round(batch / blocking, 1), "pipelined_tok_s": round(batch / piped, 1),
                    "build_ms": round(1000 * build, 2)}
        print(json.dumps({key: out[key]}), flush=True)
    r.stack_decode = True
    return out


def main(path: str, steps: int = 48) -> None:
    print(json.dumps({"qmm": qmm_rates()}), flush=True)
    r = MlxModelRunner.load(path, ctx=4096)
    warm_up(r)
    aggregate_decode(r, steps=steps)


if __name__ == "__main__":
    main(sys.argv[1])
