"""What a user's first requests still pay for kernel compilation after ``warm_up`` (GPU).

    python bench/gpu_first_use.py /tmp/hf2q-gpu/qwen3-8b-q8_0.gguf

Loads the model, times ``hf2q.engine.runner.warm_up``, then prefills prompts of new lengths
(and continuations of a cached prefix) and times each first use and a repeat: a length whose
first prefill is far slower than its repeat met a kernel the warm-up did not compile. For a
cold measurement remove MLX's kernel cache (``/tmp/mlx/<version>``) and the driver's
(``~/.nv/ComputeCache``) first. Prints one JSON object per line.
"""
import json
import sys
import time

sys.path.insert(0, ".")
import numpy as np  # noqa: E402

from hf2q.engine.runner import MlxModelRunner, warm_up  # noqa: E402


def main(path: str) -> None:
    t0 = time.perf_counter()
    r = MlxModelRunner.load(path, ctx=4096)
    print(json.dumps({"load_s": round(time.perf_counter() - t0, 1)}), flush=True)
    t0 = time.perf_counter()
    warm_up(r)
    print(json.dumps({"warm_up_s": round(time.perf_counter() - t0, 1)}), flush=True)
    rng = np.random.default_rng(0)

    def toks(n):
        return [int(t) for t in rng.integers(100, 30000, n)]

    for label, cached, n in (("p20", 0, 20), ("p30", 0, 30), ("p59", 0, 59), ("p59_again", 0, 59), ("p61", 0, 61),
                             ("p100", 0, 100), ("cont_58+1", 58, 1), ("cont_58+5", 58, 5),
                             ("cont_58+5_again", 58, 5), ("p300", 0, 300), ("p301", 0, 301)):
        s = r.new_sequence()
        if cached:
            r.prefill(s, toks(cached))
        t0 = time.perf_counter()
        r.prefill(s, toks(n))
        t1 = time.perf_counter()
        r.decode([s], [5])
        print(json.dumps({label: {"prefill_s": round(t1 - t0, 3), "decode_s": round(time.perf_counter() - t1, 3)}}),
              flush=True)
    a, b = r.new_sequence(), r.new_sequence()
    r.prefill(a, toks(20))
    r.prefill(b, toks(30))
    for i in range(3):
        t0 = time.perf_counter()
        r.decode([a, b], [5, 6])
        print(json.dumps({f"decode_B2_{i}": round(time.perf_counter() - t0, 3)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
