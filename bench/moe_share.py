"""What a mixture-of-experts model's routed experts cost in one decode step and one prefill chunk.

    python bench/moe_share.py model.gguf [--steps 20] [--chunk 512]

Times blocking decode steps (one sequence, after a 64-token prompt) and a prefill chunk with the model as
loaded, then with every routed-experts block replaced by zeros (the rest of the graph unchanged), so the
difference is what the experts take: the routing, the gathered products and the weighted sum. Works for the
families whose expert block is a separate object (qwen3moe / qwen35moe ``MoEFeedForward``, gemma4
``Gemma4Experts``). Prints one JSON object (ms; median of ``--steps``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit  # noqa: E402


def _expert_classes():
    from hf2q.engine.models.gemma4 import Gemma4Experts
    from hf2q.engine.models.qwen3_moe import MoEFeedForward

    return (Gemma4Experts, MoEFeedForward)


def timed(runner, steps: int, chunk: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    seq = runner.new_sequence()
    runner.prefill(seq, [int(t) for t in rng.integers(100, 5000, 64)])
    tok = 100
    for _ in range(3):  # first uses compile kernels
        tok = int(np.argmax(runner.decode([seq], [tok])[0]))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tok = int(np.argmax(runner.decode([seq], [tok])[0]))
        times.append(time.perf_counter() - t0)
    prompt = [int(t) for t in rng.integers(100, 5000, chunk)]
    runner.prefill(runner.new_sequence(), prompt)  # warm the chunk's shapes
    fills = []
    for _ in range(3):
        t0 = time.perf_counter()
        runner.prefill(runner.new_sequence(), prompt)
        fills.append(time.perf_counter() - t0)
    return {"decode_step_ms": round(1e3 * statistics.median(times), 2),
            f"prefill_{chunk}_ms": round(1e3 * statistics.median(fills), 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import mlx.core as mx

    from hf2q.engine.runner import MlxModelRunner

    runner = MlxModelRunner.load(a.gguf, ctx=4096)
    report = {"gguf": a.gguf, "device": str(mx.default_device()), "with_experts": timed(runner, a.steps, a.chunk)}
    saved = {cls: cls.__call__ for cls in _expert_classes()}
    try:
        for cls in saved:
            cls.__call__ = lambda self, x, *rest: mx.zeros_like(x)
        report["experts_zeroed"] = timed(runner, a.steps, a.chunk)
    finally:
        for cls, fn in saved.items():
            cls.__call__ = fn
    report["experts_share"] = {k: round(1 - report["experts_zeroed"][k] / v, 3)
                               for k, v in report["with_experts"].items() if v}
    return emit(report, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
