"""What building one decode step costs the host: Python and MLX graph construction, no evaluation.

    python bench/step_host.py                                  # synthesised 36-layer Qwen3 files, Q8_0 + Q4_K_M
    python bench/step_host.py --gguf /tmp/q8.gguf --batches 1,8 --steps 40 --profile 12

On a GPU the pipelined decode step at one sequence is bound by this build (docs/ENGINE.md, GPU section); the build
is the same Python and graph work on the CPU, so it is measured here on the MLX graph path (the CPU host decode
step and the host C kernels are turned off, so every product is an ``mx.quantized_matmul`` node, as on the GPU).
The default files are ``bench/synth_gguf.py --shape qwen3-tiny --layers 36`` (Qwen3's layer layout and op count,
36 layers, small widths: host cost follows the number of ops, not their sizes).

For each file and batch size: that many sequences after a 64-token prompt, a few warm steps, then ``--steps``
steps each timed (wall clock, and this thread's CPU time: steadier on a shared machine) from the call to the
step's lazy outputs (the runner's graph step plus greedy device sampling,
what ``decode_async`` builds before ``mx.async_eval``); each step is then evaluated, untimed. ``ops`` is the
number of primitive nodes in one step's graph (``mx.export_to_dot``), ``compute_ops`` those that are not views of
their input (reshapes, slices, transposes, broadcasts: kernels a GPU launches, roughly), ``top_ops`` the commonest.
``--profile N`` adds, for each batch size, the N functions with the most own time (cProfile) over its timed builds.
``HF2Q_NO_STEP_COMPILE=1`` times the step without its traced q/k norms and RoPE (``layers.qk_rotation``).
Prints one JSON report (``--out`` also writes it).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF2Q_NO_HOST_DECODE", "1")  # the MLX graph decode path, as on a GPU
os.environ.setdefault("HF2Q_NO_CPU_KERNELS", "1")  # no host C matvec evaluated inside the build

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import emit, synth_file  # noqa: E402
from hf2q.engine.factory import prepare_mlx  # noqa: E402

prepare_mlx()
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

PROMPT = 64
WARM_STEPS = 4


#: primitives that make a view of their input (no kernel of their own unless a later op needs a contiguous copy)
VIEWS = frozenset({"Reshape", "Slice", "ExpandDims", "Transpose", "Broadcast", "Squeeze", "Flatten", "Unflatten",
                   "AsStrided", "StopGradient"})


def graph_ops(*outputs: mx.array) -> collections.Counter:
    """Primitive nodes of the unevaluated graph behind ``outputs``, by name."""
    buf = io.StringIO()
    mx.export_to_dot(buf, *outputs)
    return collections.Counter(re.findall(r'\[label ="([^"]+)", shape=rectangle\]', buf.getvalue()))


def build_step(runner, seqs, ids: mx.array, samplers):
    """One decode step's lazy outputs, as ``decode_async`` builds them: (tokens, logprobs)."""
    from hf2q.engine.sampling.device import sample_rows

    logits, _ = runner._graph_step(seqs, ids)
    return sample_rows(logits, samplers)


def time_batch(runner, batch: int, steps: int, profiler: cProfile.Profile | None) -> dict:
    from hf2q.engine.sampling.device import DeviceSampler
    from hf2q.sched.contracts import SamplingParams

    rng = np.random.default_rng(batch)
    seqs = [runner.new_sequence() for _ in range(batch)]
    first = [int(np.argmax(runner.prefill(s, [int(t) for t in rng.integers(100, 30000, PROMPT)]))) for s in seqs]
    samplers = [DeviceSampler(SamplingParams(temperature=0.0)) for _ in seqs]
    ids = mx.array(np.asarray(first, dtype=np.int32)[:, None])
    for _ in range(WARM_STEPS):
        toks, lps = build_step(runner, seqs, ids, samplers)
        mx.eval(toks, lps)
        ids = toks[:, None]
    ops = None
    times, cpu = [], []
    for i in range(steps):
        c0, t0 = time.thread_time(), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        toks, lps = build_step(runner, seqs, ids, samplers)
        if profiler is not None:
            profiler.disable()
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        if ops is None:
            ops = graph_ops(toks, lps)
        mx.eval(toks, lps)
        ids = toks[:, None]
    for s in seqs:  # give the stacked batch back before the next case
        s.unstack()
    return {"build_ms": round(1e3 * statistics.median(times), 3), "build_ms_min": round(1e3 * min(times), 3),
            "build_cpu_ms": round(1e3 * statistics.median(cpu), 3), "build_cpu_ms_min": round(1e3 * min(cpu), 3),
            "ops": sum(ops.values()), "compute_ops": sum(n for k, n in ops.items() if k not in VIEWS),
            "quantized_products": ops["QuantizedMatmul"], "top_ops": dict(ops.most_common(8))}


def profile_lines(profiler: cProfile.Profile, n: int) -> list[str]:
    s = io.StringIO()
    pstats.Stats(profiler, stream=s).sort_stats("tottime").print_stats(n)
    keep = [ln.rstrip() for ln in s.getvalue().splitlines() if re.match(r"\s*\d", ln)]
    return [re.sub(r"\s+", " ", ln.replace(str(ROOT) + "/", "")).strip() for ln in keep][:n]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", action="append", default=[], help="time these files (default: synthesised ones)")
    p.add_argument("--mixes", default="q8_0,q4_k_m", help="mixes of the synthesised files")
    p.add_argument("--layers", type=int, default=36, help="layers of the synthesised files")
    p.add_argument("--work", default=None, help="where synthesised files are kept (default: a temp dir)")
    p.add_argument("--vocab-gguf", default=None, help="tokenizer of the synthesised files (default: llama.cpp's "
                   "ggml-vocab-qwen2.gguf from the oracle's source tree)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--profile", type=int, default=0, metavar="N", help="also list the N top functions (cProfile)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from hf2q.engine.runner import MlxModelRunner

    with tempfile.TemporaryDirectory(prefix="hf2q-step-host-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        files = [Path(g) for g in args.gguf] or [synth_file(work, "qwen3-tiny", args.layers, m, args.vocab_gguf)
                                                   for m in args.mixes.split(",")]
        report = {"device": str(mx.default_device()), "prompt": PROMPT, "steps": args.steps, "runs": {}}
        for path in files:
            runner = MlxModelRunner.load(path, ctx=PROMPT + WARM_STEPS + args.steps + 8)
            row = {"layers": runner.model.cfg.n_layers}
            for b in (int(x) for x in args.batches.split(",") if x):
                profiler = cProfile.Profile() if args.profile else None
                row[f"B{b}"] = time_batch(runner, b, args.steps, profiler)
                print(f"{path.name} B{b}: {row[f'B{b}']}", file=sys.stderr, flush=True)
                if profiler is not None:
                    row[f"B{b}"]["profile"] = profile_lines(profiler, args.profile)
            report["runs"][path.name] = row
            del runner
        return emit(report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
