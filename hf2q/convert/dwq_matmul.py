"""The linear layers of the DWQ forward, in two interchangeable implementations.

``native_linear`` is plain MLX (``mx.quantized_matmul`` / ``@``): the reference, and the one to use
on a GPU. MLX's CPU quantized matmul is an untuned loop, so on the CPU ``HostLinear`` runs each
matrix product through OpenBLAS (``hf2q.kernels.cpu_blas``, load-aware threads; numpy's BLAS where
that is unavailable) inside an ``mx.custom_function`` whose vjp we give by hand: for
``y = x · Wᵀ`` with ``W = codes · s + b`` per group of ``g`` input columns, ``dx = dy · W`` and,
with ``dW = dyᵀ · x``, ``ds = Σ_group dW · codes`` and ``db = Σ_group dW``. MLX autograd still
owns the graph (norms, RoPE, attention, the loss), so ``mx.value_and_grad`` and the optimizers
see one differentiable function either way.

A quantized module's ``X.weight`` is either mlx's packed codes or, for the GGUF blocks DWQ fits
(``dwq_gguf``), the codes unpacked as uint8 ``[out, in]``; both implementations take either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from hf2q.convert.dwq_forward import QuantLayout

Linear = Callable[[Mapping[str, Any], str, Any], Any]  # (weights, module, x) -> y (without bias)


def native_linear(layout: QuantLayout | None) -> Linear:
    import mlx.core as mx

    def linear(w, module, x):
        if f"{module}.scales" in w:
            bits, gs = layout.of(module)  # type: ignore[union-attr]
            if w[f"{module}.weight"].dtype == mx.uint8:
                return x @ unpacked_weight(mx, w, module, gs).T
            return mx.quantized_matmul(x, w[f"{module}.weight"], w[f"{module}.scales"], w[f"{module}.biases"],
                                       transpose=True, group_size=gs, bits=bits)
        return x @ w[f"{module}.weight"].T
    return linear


class HostLinear:
    """BLAS-backed linears; the integer codes of each quantized module are unpacked once and kept as uint8."""

    def __init__(self, layout: QuantLayout | None):
        self.layout = layout
        self._fns: dict[str, Any] = {}

    def __call__(self, w, module, x):
        fn = self._fns.get(module)
        if fn is None:
            fn = self._fns[module] = self._build(w, module)
        if f"{module}.scales" in w:
            return fn(x, w[f"{module}.scales"], w[f"{module}.biases"])
        return fn(x)

    def _build(self, w, module):
        import mlx.core as mx

        if f"{module}.scales" not in w:
            weight = np.asarray(w[f"{module}.weight"], dtype=np.float32)

            @mx.custom_function
            def dense(x):
                return mx.array(_mm_t(_rows(x), weight)).reshape(*x.shape[:-1], weight.shape[0])

            @dense.vjp
            def dense_vjp(primals, cotangent, output):
                (x,) = primals
                return mx.array(_mm_t(_rows(cotangent), np.ascontiguousarray(weight.T))).reshape(x.shape)
            return dense

        bits, gs = self.layout.of(module)  # type: ignore[union-attr]
        s0 = w[f"{module}.scales"]
        if w[f"{module}.weight"].dtype == mx.uint8:
            codes = np.asarray(w[f"{module}.weight"])
        else:
            codes = np.asarray(mx.dequantize(w[f"{module}.weight"], mx.ones_like(s0), mx.zeros_like(s0),
                                             group_size=gs, bits=bits), dtype=np.float32).astype(np.uint8)
        n_out, n_in = codes.shape
        grouped = codes.reshape(n_out, n_in // gs, gs)

        def weight_of(s, b):
            sf = np.asarray(s, dtype=np.float32)[..., None]
            bf = np.asarray(b, dtype=np.float32)[..., None]
            return (grouped * sf + bf).reshape(n_out, n_in)

        @mx.custom_function
        def affine(x, s, b):
            return mx.array(_mm_t(_rows(x), weight_of(s, b))).reshape(*x.shape[:-1], n_out)

        @affine.vjp
        def affine_vjp(primals, cotangent, output):
            x, s, b = primals
            dy = _rows(cotangent)
            dx = mx.array(_mm_t(dy, np.ascontiguousarray(weight_of(s, b).T))).reshape(x.shape)
            dw = _mm_t(np.ascontiguousarray(dy.T), np.ascontiguousarray(_rows(x).T)).reshape(n_out, n_in // gs, gs)
            return dx, mx.array((dw * grouped).sum(-1)).astype(s.dtype), mx.array(dw.sum(-1)).astype(b.dtype)
        return affine


def unpacked_weight(mx, w, module: str, gs: int):
    """``codes · s + b`` per group, for a module whose codes are stored unpacked (uint8 ``[out, in]``)."""
    codes = w[f"{module}.weight"]
    n_out, n_in = codes.shape
    s, b = w[f"{module}.scales"], w[f"{module}.biases"]
    grouped = codes.astype(s.dtype).reshape(n_out, n_in // gs, gs)
    return (grouped * s[..., None] + b[..., None]).reshape(n_out, n_in)


def _mm_t(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x · wᵀ`` in float32."""
    from hf2q.kernels import cpu_blas

    return cpu_blas.matmul_t(x, w) if cpu_blas.has_matmul() else x @ w.T


def _rows(a) -> np.ndarray:
    arr = np.asarray(a, dtype=np.float32)
    return arr.reshape(-1, arr.shape[-1])


def default_linear(layout: QuantLayout | None) -> Linear:
    """BLAS-backed on the CPU, MLX's own kernels on a GPU."""
    import mlx.core as mx

    return HostLinear(layout) if mx.default_device() == mx.cpu else native_linear(layout)
