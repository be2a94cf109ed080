"""Tensor-parallel engine speed: the same GGUF at ``--sizes 1,2`` ranks (mx.distributed), JSON out.

On a multi-GPU host the ranks use NCCL (one GPU each, ``NCCL_NVLS_ENABLE=0``); on a CPU
machine the ring backend. Uses ``bench/decode.py``'s timing (warm-up, ``--prefill`` sizes in
2048-token transactions, ``--tg`` decode tokens) on ``hf2q.engine.tp_launch.runner_factory``,
plus what a decode step is made of: its time alone and with ``--slots`` sequences decoding
together (aggregate tokens/s), each also pipelined (``*_pipelined``: ``decode_async``, tokens
sampled on the device, the next step queued before the last is read) where the runner's graph
path allows it, and at TP > 1 the time of one ``all_sum`` of a decode step's
hidden state (``[1, hidden]`` and ``[slots, hidden]``) next to how many a step makes (two per
block), so the share of a step spent in all-reduces can be read off, and of the ``[1]`` one a
pipelined step adds to broadcast the sampled ids.

    python bench/tp_engine.py --model /tmp/qwen3-8b-q4_k_m.gguf --sizes 1,2
    python bench/tp_engine.py --model /tmp/q06.gguf --sizes 1,2 --prefill 128 --tg 32 --reps 3   # CPU
    # CPU pipelined rows: HF2Q_TP_PIPELINE=1 (the ring backend) and HF2Q_NO_HOST_DECODE=1 (one rank's graph path)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def step_anatomy(runner, n: int, a) -> dict:
    from bench.gpu_batch import decode_step_s

    hp = runner.gguf.hparams
    tg = 1000 / a.last_tg  # ms per single-sequence step, from bench_runner's tg
    steps = a.tg // 2 or 1
    batch = 1000 * decode_step_s(runner, a.slots, steps, pipelined=False, reps=a.reps, prompt_len=16)[0]
    out = {"step_ms": round(tg, 2), f"step_ms_{a.slots}_slots": round(batch, 2),
           f"tg_{a.slots}_slots_aggregate": round(1000 * a.slots / batch, 1)}
    if getattr(runner, "pipelines_decode", False):  # the pipelined rows: device sampling, next step queued
        out["step_ms_pipelined"] = round(1000 / a.last_tg_pipelined, 2)
        piped = 1000 * decode_step_s(runner, a.slots, steps, pipelined=True, reps=a.reps, prompt_len=16)[0]
        out[f"step_ms_{a.slots}_slots_pipelined"] = round(piped, 2)
        out[f"tg_{a.slots}_slots_aggregate_pipelined"] = round(1000 * a.slots / piped, 1)
    if n > 1:
        per_step = 2 * hp.n_layers
        for rows in (1, a.slots):  # median and 10th percentile: on a loaded CPU the peer's wake-up dominates
            ms = sorted(1000 * t for t in runner.time_all_sum([rows, hp.hidden], a.allsum_reps))
            out[f"all_sum_ms_{rows}x{hp.hidden}"] = round(statistics.median(ms), 3)
            out[f"all_sum_ms_{rows}x{hp.hidden}_p10"] = round(ms[len(ms) // 10], 3)
        # a pipelined step adds one all_sum of the sampled ids ([slots] int32; timed as float32 [1])
        ms = sorted(1000 * t for t in runner.time_all_sum([1], a.allsum_reps))
        out["all_sum_ms_1"], out["all_sum_ms_1_p10"] = round(statistics.median(ms), 3), round(ms[len(ms) // 10], 3)
        out["all_sums_per_step"] = per_step
        out["all_sum_share_of_step"] = round(per_step * out[f"all_sum_ms_1x{hp.hidden}"] / tg, 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--sizes", default="1,2")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--prefill", default="512,2048", help="prompt sizes to time (comma list)")
    ap.add_argument("--tg", type=int, default=128, help="decode tokens to time")
    ap.add_argument("--slots", type=int, default=4, help="sequences in the batched decode step")
    ap.add_argument("--allsum-reps", type=int, default=50)
    a = ap.parse_args()
    from bench.decode import bench_runner
    from hf2q.engine import tp_launch

    out = {"model": Path(a.model).name, "runs": {}}
    for n in [int(x) for x in a.sizes.split(",")]:
        t0 = time.time()
        runner = tp_launch.runner_factory(a.model, n, a.ctx)()
        load_s = time.time() - t0
        figs = bench_runner(runner, [int(x) for x in a.prefill.split(",")], a.tg, a.reps, 2048)
        a.last_tg = figs.get(f"tg{a.tg}_sync", figs[f"tg{a.tg}"])
        a.last_tg_pipelined = figs[f"tg{a.tg}"]
        out["runs"][n] = {"load_s": round(load_s, 1), **{k: round(v, 1) for k, v in figs.items()},
                          **step_anatomy(runner, n, a)}
        print(json.dumps({"ranks": n, **out["runs"][n]}), flush=True)
        for name in ("close", "shutdown", "stop"):
            if hasattr(runner, name):
                getattr(runner, name)()
                break
        del runner
    if 1 in out["runs"]:
        base = out["runs"][1]
        out["speedup"] = {n: {k: round(v / base[k], 3) for k, v in r.items()
                              if k in base and (k.startswith(("pp", "tg")))}
                          for n, r in out["runs"].items() if n != 1}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
