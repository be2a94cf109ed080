"""The MLX model engine: GGUF loader, family graphs, KV caches, the model runner.

Importing this package (or any module of it) changes nothing in the process: the fast CPU
BLAS that MLX needs is loaded by :func:`hf2q.engine.factory.load_runner` /
:func:`~hf2q.engine.factory.prepare_mlx`, called by whoever is about to build a runner.
"""
