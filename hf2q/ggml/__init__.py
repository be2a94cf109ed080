"""The GGML tensor types at conversion time: float32 weights to and from their bytes.

``codec`` is the API (``quantize`` / ``dequantize`` / ``row_bytes``), byte-identical to
llama.cpp's reference quantizer; the numpy codecs (``floats``, ``legacy``, ``kquants``,
``imatrix``), the numba ones (``jit_*``) and the plain per-block references (``*_ref``) sit
behind it. Converting runs without a GPU stack, so nothing here imports MLX.
"""
