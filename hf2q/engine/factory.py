"""Building a model runner: the one place a process readies itself for MLX, then imports it.

MLX's Linux CPU wheel links the reference BLAS. ``hf2q.kernels.cpu_blas.preload`` puts an
OpenBLAS into the global symbol scope (and sets OpenBLAS's thread variables, which it reads
when it loads), and that has to happen before MLX makes its first matmul — we do it before
``mlx.core`` is even imported. Importing ``hf2q.engine`` or any of its modules does none of
this: code that is about to load a model calls :func:`load_runner` (or :func:`prepare_mlx`
first, when it builds a runner another way), so a process that only reads GGUF headers or
plans memory keeps its environment and its loaded libraries untouched.
"""

from __future__ import annotations


def prepare_mlx() -> str:
    """Load the fast CPU BLAS before MLX (idempotent); returns ``cpu_blas.status()``."""
    from hf2q.kernels import cpu_blas

    return cpu_blas.preload()


def load_runner(path, ctx: int | None = None, kv_cache_type: str = "f16"):
    """An ``MlxModelRunner`` for the GGUF at ``path`` (a path, or the ``GGUFFile`` a caller already
    opened and checked), the process readied for MLX first. The model build checks the weights
    before any kernel sees them; the tokenizer is the callers' to check (serve's preflight and
    generate run the whole check `hf2q info` reports), since an engine-only copy may leave it out."""
    from hf2q.formats.gguf_file import GGUFFile, open_gguf

    g = path if isinstance(path, GGUFFile) else open_gguf(path)
    prepare_mlx()
    from hf2q.engine.runner import MlxModelRunner

    return MlxModelRunner.load(g, ctx=ctx, kv_cache_type=kv_cache_type)
