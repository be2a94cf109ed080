"""Numeric kernels.

``codec`` (with the ``ggml_*`` modules behind it) converts float32 weights to and from the GGML
tensor types, byte-identical to llama.cpp's reference quantizer; the engine's MLX / CPU
kernels live beside it in ``mlx_*`` / ``cpu_*``.
"""
