"""The MLX model engine: GGUF loader, family graphs, KV caches, the model runner.

Importing this package first loads an optimised CPU BLAS (``hf2q.kernels.cpu_blas``),
so it must happen before anything else in the process calls into MLX's matmul.
"""

from hf2q.kernels import cpu_blas as _cpu_blas

_cpu_blas.preload()
