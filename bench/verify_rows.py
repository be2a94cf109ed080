"""Does a speculative verify forward compute what plain decode steps compute? Row by row, op by op.

At T=0 speculative decoding is only exact if the verify forward's row ``i`` (the token after ``i`` accepted
drafts) has the same logits, bit for bit, as the plain one-token step that would have decoded it. The two run
different shapes (``k + 1`` rows against one), so every op whose kernel depends on the row count can move the
last bits. This script runs both on the same prefilled prompt (two sequences, the same tokens), records every
quantized/dense product, every attention call and every block's output of the plain first step and of the
verify's first row, and reports the first op whose *inputs* agree but whose *output* does not: the kernel to
make row-count invariant. Variants patch one suspect at a time:

* ``one-row-kernel``: one-row products of the large matrices go through the few-row CUDA kernel too
  (``hf2q.kernels.cuda_qmv``, whose per-row arithmetic does not depend on the row count);
* ``no-step-rotate``: one-token rows take the same q/k norm + RoPE ops as a chunk (no traced rotation).

    python bench/verify_rows.py --model qwen35.gguf --draft 3 --variants base,one-row-kernel --out rows.json

Prints one JSON object: per variant, the largest logit difference of each row, whether each row's argmax
agrees, and the first differing op (``index``, ``op``, ``where``: ``input`` or ``output``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

from bench.common import emit  # noqa: E402
from hf2q.engine import layers as layers_mod  # noqa: E402
from hf2q.engine.models import decoder  # noqa: E402
from hf2q.kernels import cuda_qmv  # noqa: E402


class Recorder:
    """Records ``(op, input rows, output rows)`` of every product and attention call while on."""

    def __init__(self) -> None:
        self.on = False
        self.calls: list[tuple[str, mx.array, mx.array]] = []
        self.names: dict[int, str] = {}

    def add(self, op: str, x: mx.array, y: mx.array) -> None:
        if self.on:
            self.calls.append((op, x, y))

    def take(self) -> list[tuple[str, np.ndarray, np.ndarray]]:
        mx.eval([a for _, x, y in self.calls for a in (x, y)])
        out = [(op, np.array(x.astype(mx.float32)), np.array(y.astype(mx.float32))) for op, x, y in self.calls]
        self.calls = []
        return out


REC = Recorder()


@contextlib.contextmanager
def recording():
    """Linear products and attention calls recorded (rows flattened to ``[rows, features]``)."""
    linear_call, attend = layers_mod.Linear.__call__, decoder.Attention.attend_rotated

    def linear(self, x):
        y = linear_call(self, x)
        REC.add(REC.names.get(id(self), "linear"), x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1]))
        return y

    def attention(self, q, k, v, fb):
        out = attend(self, q, k, v, fb)
        B, H, L, d = q.shape
        REC.add(f"attention.{self.layer}", q.transpose(0, 2, 1, 3).reshape(B * L, H * d), out.reshape(B * L, -1))
        return out

    layers_mod.Linear.__call__, decoder.Attention.attend_rotated = linear, attention
    try:
        yield
    finally:
        layers_mod.Linear.__call__, decoder.Attention.attend_rotated = linear_call, attend


@contextlib.contextmanager
def variant(name: str, model):
    """The patches of one variant (see the module docstring)."""
    saved_takes, rotations = cuda_qmv.takes, []
    if "one-row-kernel" in name:
        def takes(rows, out_features, in_features, bits, group_size):
            return saved_takes(max(rows, 2), out_features, in_features, bits, group_size)
        cuda_qmv.takes = takes
    if "no-step-rotate" in name:
        for block in model.layers:
            for part in vars(block).values():
                if isinstance(part, decoder.Attention) and part._rotate is not None:
                    rotations.append((part, part._rotate))
                    part._rotate = None
    try:
        yield
    finally:
        cuda_qmv.takes = saved_takes
        for part, rot in rotations:
            part._rotate = rot


def name_products(model) -> None:
    for i, block in enumerate(model.layers):
        for j, lin in enumerate(block.linears() if hasattr(block, "linears") else ()):
            REC.names[id(lin)] = f"blk.{i}.product{j}"
    if hasattr(model, "lm_head"):
        REC.names[id(model.lm_head)] = "lm_head"


def first_difference(plain: list, verify: list) -> dict | None:
    """The first op of ``plain`` (one row) whose input or output differs from ``verify``'s first row."""
    for idx, ((op, x, y), (op2, vx, vy)) in enumerate(zip(plain, verify)):
        if op != op2:
            return {"index": idx, "op": op, "where": f"order ({op2} in the verify)"}
        if not np.array_equal(x[0], vx[0]):
            return {"index": idx, "op": op, "where": "input", "max_diff": float(np.abs(x[0] - vx[0]).max())}
        if not np.array_equal(y[0], vy[0]):
            return {"index": idx, "op": op, "where": "output", "max_diff": float(np.abs(y[0] - vy[0]).max()),
                    "rows_in_verify": int(vx.shape[0])}
    return None if len(plain) == len(verify) else {"index": min(len(plain), len(verify)), "where": "count"}


def run_variant(runner, name: str, prompt: list[int], draft: int) -> dict:
    with variant(name, runner.model):
        plain_seq, verify_seq = runner.new_sequence(), runner.new_sequence()
        first = int(np.argmax(runner.prefill(plain_seq, prompt)))
        runner.prefill(verify_seq, prompt)
        tokens, plain_logits, plain_ops = [first], [], None
        with recording():
            for i in range(draft + 1):
                REC.on = i == 0
                logits = runner.decode([plain_seq], [tokens[-1]])[0]
                if i == 0:
                    plain_ops = REC.take()
                REC.on = False
                plain_logits.append(logits)
                if i < draft:
                    tokens.append(int(np.argmax(logits)))
            REC.on = True
            rows = runner.verify(verify_seq, tokens)
            verify_ops = REC.take()
            REC.on = False
    diffs = [float(np.abs(rows[i] - plain_logits[i]).max()) for i in range(len(tokens))]
    return {"variant": name, "rows": len(tokens), "max_logit_diff": diffs,
            "argmax_same": [int(np.argmax(rows[i])) == int(np.argmax(plain_logits[i])) for i in range(len(tokens))],
            "identical": all(d == 0.0 for d in diffs), "ops_recorded": len(plain_ops),
            "first_difference": first_difference(plain_ops, verify_ops)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--draft", type=int, default=3, help="draft tokens k: the verify has k + 1 rows")
    ap.add_argument("--variants", default="base,one-row-kernel,no-step-rotate,one-row-kernel+no-step-rotate")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from hf2q.engine.runner import MlxModelRunner

    runner = MlxModelRunner.load(a.model, ctx=a.ctx)
    name_products(runner.model)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(10, min(runner.vocab_size, 30000), a.prompt_tokens)]
    report = {"model": str(a.model), "device": str(mx.default_device()), "cuda": cuda_qmv.available(),
              "variants": [run_variant(runner, v, prompt, a.draft) for v in a.variants.split(",")]}
    emit(report, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
