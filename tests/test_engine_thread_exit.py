"""A thread that ran the engine's traced graphs ends *before* the interpreter finalizes, every time.

MLX keeps the graphs ``mx.compile`` traced in a cache that belongs to the calling thread (a C++
``thread_local``), and each entry holds a Python object (its output structure). Those entries are
destroyed by glibc's thread-local destructors, which run after ``Thread.join()`` has already returned
in the main thread; they take the GIL to drop that object. When the main thread has begun finalizing
by then, taking the GIL ends the thread by ``pthread_exit`` from inside a C++ destructor, and the
process dies by SIGABRT ("terminate called without an active exception"). A server's engine thread
ends a moment before its process does, so that was a rare abort of ``hf2q serve`` after a clean
drain. ``hf2q.engine.thread_compile`` keeps one compiled function per thread, dropped with the
thread's Python state, so the cache is empty before the thread's native end.

The reference for the traced values is the plain expression they replace.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import hf2q

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(hf2q.__file__).resolve().parent
RUNS = 5

#: an engine-like thread calls the engine's traced functions, then the script ends at once after the
#: join: the interpreter finalizes while the thread's native exit may still be under way
SCRIPT = r"""
import sys, threading
sys.path.insert(0, {root!r})
import mlx.core as mx
from hf2q.engine import layers

def engine(out):
    g, u = mx.array([[0.5, -1.0, 2.0]]), mx.array([[1.5, 2.0, -0.25]])
    glu = layers.GLU_COMPILED[layers.silu](g, u)
    plain = g * mx.sigmoid(g) * u
    pairs = [(glu, plain)]
    rope = dict(traditional=False, base=10000.0, scale=1.0)
    rotate = layers.qk_rotation(8, rope, 1e-6, False)
    for b in range(1, 17):  # one trace per batch size: the more entries, the longer the thread's native exit
        q = mx.arange(16 * b, dtype=mx.float32).reshape(b, 1, 2, 8) / 16
        k = mx.arange(8 * b, dtype=mx.float32).reshape(b, 1, 1, 8) / 8
        offset = mx.array(list(range(3, 3 + b)), dtype=mx.int32)
        traced = rotate(q, k, offset, None, None)
        pairs += zip(traced, layers.norm_rope(q, k, offset, None, None, dims=8, rope=rope, eps=1e-6))
    out.append(all(mx.allclose(a, b, atol=1e-5).item() for a, b in pairs))

out = []
t = threading.Thread(target=engine, args=(out,), name="hf2q-gpu-owner")
t.start()
t.join()
print("traced equal to plain:", out)
"""


def test_a_thread_that_ran_traced_graphs_lets_the_interpreter_finalize(tmp_path):
    script = tmp_path / "engine_exit.py"
    script.write_text(SCRIPT.format(root=str(ROOT)))
    for _ in range(RUNS):
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
        assert "terminate called" not in run.stderr and "Fatal Python error" not in run.stderr, run.stderr[-2000:]
        assert run.stdout.strip() == "traced equal to plain: [True]", run.stdout


def test_the_package_traces_graphs_only_through_thread_compile():
    """A bare ``mx.compile`` object called from the engine thread would bring the abort back."""
    bare = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "thread_compile.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "compile" and isinstance(node.value, ast.Name) \
                    and node.value.id == "mx":
                bare.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not bare, f"mx.compile outside hf2q/engine/thread_compile.py: {bare}"
