"""The C thread pool of the host kernels (``hf2q.kernels.cpu_pool``).

* every index of a job is run exactly once, whatever the chunking, across many back-to-back
  jobs (the case a late-waking worker could break);
* the kernels that share work over it give the same answer at any thread count: the quantized
  matvec bit for bit (its row blocks keep their tiles), the chunked attention to float rounding
  (its per-chunk softmax is combined after). The thread count is fixed when a process starts the
  pool, so those run in child processes at 1 and 3 threads.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from hf2q.kernels import cpu_pool

pytestmark = pytest.mark.skipif(cpu_pool.library() is None, reason="no C compiler")


def test_every_index_runs_exactly_once():
    lib = cpu_pool.library()
    rng = np.random.default_rng(0)
    for _ in range(300):
        n, grain = int(rng.integers(1, 400)), int(rng.integers(1, 20))
        hits = np.zeros(n, np.int64)
        lock = threading.Lock()

        def body(ctx, lo, hi):
            with lock:
                hits[lo:hi] += 1

        cb = cpu_pool.RANGE_FN(body)
        lib.pool_for(ctypes.cast(cb, ctypes.c_void_p), None, n, grain)
        assert (hits == 1).all(), (n, grain)


def test_thread_count_follows_the_container_quota(tmp_path, monkeypatch):
    monkeypatch.delenv("HF2Q_CPU_THREADS", raising=False)
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cpu_pool._cgroup_cpus(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_pool._cgroup_cpus(str(tmp_path)) is None
    monkeypatch.setattr(cpu_pool, "_cgroup_cpus", lambda: 1.0)
    monkeypatch.setattr(cpu_pool.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert cpu_pool.wanted_threads() == 1
    monkeypatch.setattr(cpu_pool, "_cgroup_cpus", lambda: None)
    assert cpu_pool.wanted_threads() == 8
    monkeypatch.setenv("HF2Q_CPU_THREADS", "3")
    assert cpu_pool.wanted_threads() == 3


def test_empty_job_returns():
    cb = cpu_pool.RANGE_FN(lambda ctx, lo, hi: pytest.fail("called"))
    cpu_pool.library().pool_for(ctypes.cast(cb, ctypes.c_void_p), None, 0, 4)


def test_a_forked_child_runs_jobs_inline():
    """The workers do not survive a fork: the child's jobs still complete (on its one thread)."""
    lib = cpu_pool.library()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            hits = np.zeros(100, np.int64)

            def body(ctx, lo, hi):
                hits[lo:hi] += 1

            cb = cpu_pool.RANGE_FN(body)
            lib.pool_for(ctypes.cast(cb, ctypes.c_void_p), None, 100, 3)
            os.write(w, b"ok" if (hits == 1).all() and lib.pool_threads() == 1 else b"bad")
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 8)
    os.waitpid(pid, 0)
    assert got == b"ok"


_CHILD = r"""
import ctypes, sys
import numpy as np
from hf2q.kernels import cpu_pool, cpu_qmatvec
from hf2q.kernels.cpu_decode_ops import library
from tests.test_cpu_decode_kernels import _quantized

assert cpu_pool.threads() == int(sys.argv[2])
out = {}
for bits in (3, 4, 8):
    mats = [_quantized(rows, 256, bits, seed)[3:] + (bits,) for rows, seed in ((1000, 1), (333, 2))]
    group = cpu_qmatvec.QMatrixGroup(mats)
    for batch in (1, 4, 5):
        x = np.random.default_rng(batch).standard_normal((batch, 256)).astype(np.float32)
        out[f"qmv{bits}-{batch}"] = group(x)
ops, rng = library(), np.random.default_rng(9)
B, H, Hkv, D, cap = 3, 8, 2, 64, 3000
pos = [2999, 40, 1700]
K = [rng.standard_normal((Hkv, cap, D)).astype(np.float32) for _ in range(B)]
V = [rng.standard_normal((Hkv, cap, D)).astype(np.float32) for _ in range(B)]
qkv = rng.standard_normal((B, (H + 2 * Hkv) * D)).astype(np.float32)
att = np.empty((B, H * D), np.float32)
P = lambda a: a.ctypes.data
assert ops.attend_layer(P(qkv), qkv.shape[1], (ctypes.c_void_p * B)(*map(P, K)), (ctypes.c_void_p * B)(*map(P, V)),
                        (ctypes.c_int * B)(*[cap] * B), (ctypes.c_int * B)(*[0] * B), (ctypes.c_int * B)(*pos), 0,
                        P(att), B, H, Hkv, D, 1, 1, 0.125) == 0
out["attend"] = att
np.savez(sys.argv[1], **out)
"""


def _child(tmp_path, threads: int) -> dict:
    path = tmp_path / f"t{threads}.npz"
    env = {**os.environ, "HF2Q_CPU_THREADS": str(threads)}
    subprocess.run([sys.executable, "-c", _CHILD, str(path), str(threads)], check=True, env=env,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return dict(np.load(path))


def test_results_do_not_depend_on_the_thread_count(tmp_path):
    one, three = _child(tmp_path, 1), _child(tmp_path, 3)
    assert one.keys() == three.keys()
    for k in one:
        if k.startswith("qmv"):
            np.testing.assert_array_equal(one[k], three[k], err_msg=k)
        else:
            np.testing.assert_allclose(one[k], three[k], rtol=1e-5, atol=1e-6, err_msg=k)
