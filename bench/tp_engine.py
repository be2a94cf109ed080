"""Tensor-parallel engine speed: the same GGUF at ``--sizes 1,2`` ranks (mx.distributed), JSON out.

On a multi-GPU host the ranks use NCCL (one GPU each, ``NCCL_NVLS_ENABLE=0``); on a CPU
machine the ring backend. Uses ``bench/decode.py``'s timing (warm-up, pp512/pp2048 in
2048-token transactions, tg128) on ``hf2q.engine.tp_launch.runner_factory``.

    python bench/tp_engine.py --model /tmp/qwen3-8b-q4_k_m.gguf --sizes 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--sizes", default="1,2")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=8192)
    a = ap.parse_args()
    from bench.decode import bench_runner
    from hf2q.engine import tp_launch

    out = {"model": Path(a.model).name, "runs": {}}
    for n in [int(x) for x in a.sizes.split(",")]:
        t0 = time.time()
        runner = tp_launch.runner_factory(a.model, n, a.ctx)()
        load_s = time.time() - t0
        figs = bench_runner(runner, [512, 2048], 128, a.reps, 2048)
        out["runs"][n] = {"load_s": round(load_s, 1), **{k: round(v, 1) for k, v in figs.items()}}
        print(json.dumps({"ranks": n, **out["runs"][n]}), flush=True)
        for name in ("close", "shutdown", "stop"):
            if hasattr(runner, name):
                getattr(runner, name)()
                break
        del runner
    if 1 in out["runs"]:
        base = out["runs"][1]
        out["speedup"] = {n: {k: round(v / base[k], 3) for k, v in r.items() if k != "load_s"}
                          for n, r in out["runs"].items() if n != 1}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
