"""Where a decode step's time goes: Python graph construction vs evaluation, and the pipelined rate.

    python bench/decode_anatomy.py model.gguf [more.gguf ...]      # JSON line per model

``build_ms``: building one single-token decode graph (no evaluation); ``eval_after_build_ms``: evaluating it.
A blocking step costs about their sum; ``decode_async`` overlaps the next build with this evaluation.
"""
import json, sys, time
sys.path.insert(0, ".")
import mlx.core as mx
import numpy as np
from hf2q.engine.runner import MlxModelRunner
from hf2q.engine.sampling.device import DeviceSampler
from hf2q.engine.kv_cache import ForwardBatch
from hf2q.sched.contracts import SamplingParams

def main(path):
    res = {}
    r = MlxModelRunner.load(path)
    s = r.new_sequence()
    tok = int(np.argmax(r.prefill(s, list(range(100, 116)))))
    # graph build only
    builds = []
    for _ in range(20):
        t0 = time.perf_counter()
        fb = ForwardBatch([s], 1)
        logits = r.model(mx.array([[tok]], dtype=mx.int32), fb)
        builds.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        mx.eval(logits, fb.eval_state())
        fb.finish()
        builds[-1] = (builds[-1], time.perf_counter() - t1)
    res["build_ms"] = round(1e3 * np.median([b[0] for b in builds]), 2)
    res["eval_after_build_ms"] = round(1e3 * np.median([b[1] for b in builds]), 2)
    sm = [DeviceSampler(SamplingParams(temperature=0.0))]
    for label, params in (("greedy", SamplingParams(temperature=0.0)), ("topp", SamplingParams(temperature=0.7, top_p=0.9, seed=1))):
        sm = [DeviceSampler(params)]
        p = r.decode_async([s], [tok], sm)
        t0 = time.perf_counter()
        for _ in range(64):
            n = r.decode_async([s], p, sm); p.result(); p = n
        p.result()
        res[f"pipelined_{label}_tok_s"] = round(64 / (time.perf_counter() - t0), 1)
    print(json.dumps(res), flush=True)

for p in sys.argv[1:]:
    print(p); main(p)
