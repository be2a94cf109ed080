"""Building blocks shared by every family graph: linear layers over GGUF weights,
embeddings, norms, RoPE attention over slot KV caches, gated MLPs.

Weights stay quantized in MLX's affine form (``quant_repack``). On the CPU backend
MLX's quantized matmul is slow for many rows (≈1 GFLOP/s), so a linear layer fed more
than ``DENSE_ROWS`` rows dequantizes its weight to float32 for that call and runs one
BLAS sgemm instead; decode (few rows) runs the C kernel of ``hf2q.kernels.cpu_qmatvec``
directly on the packed MLX buffers (MLX's own quantized matvec is ~4x slower there).

CPU prefill runs on the host: the input is read through a zero-copy view of the MLX
buffer, the product is one OpenBLAS sgemm per row slice split over the BLAS workers
(``hf2q.kernels.cpu_blas``), and a gated MLP keeps gate/up/activation/down in numpy with a
single hand-back to MLX. The float32 copy of a quantized weight is kept between calls
while the total kept stays under ``HF2Q_DENSE_CACHE_MB`` (default 512; 0 = never): all of
a small model's weights (SmolLM2-135M: 0.43 GB) so later chunks skip dequantizing, only
the first layers of a large one. See docs/ENGINE.md.
"""

from __future__ import annotations

import math
import os
import weakref

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T

from hf2q.engine.device_probe import EXACT_GPU_SCALES  # HF2Q_EXACT_SCALES=1: float32 group scales on GPUs
from hf2q.engine.quant_repack import FLOAT_TYPES, QUANTIZED_TYPES, to_affine
from hf2q.errors import InputError
from hf2q.formats.gguf_file import GGUFTensor
from hf2q.kernels import cuda_qmv

DENSE_ROWS = 8

#: the importance-matrix collector of an ``hf2q imatrix`` run (``hf2q.quality.imatrix_run``), told the
#: input of every matrix product; None — always, outside such a run — costs one test per product
_observer = None


def set_observer(observer) -> None:
    """Install (or, with None, remove) the object whose ``dense(name, x)`` / ``experts(name, x, ids,
    n_expert)`` receive each product's input as float32 numpy."""
    global _observer
    _observer = observer


def _observe_dense(name: str, x) -> None:
    if isinstance(x, mx.array):
        x = np.array(x.astype(mx.float32))
    _observer.dense(name, x)


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def float_array(t: GGUFTensor, dtype) -> mx.array:
    """A float tensor (or any type, dequantized) as an MLX array of ``dtype``."""
    if t.qtype in FLOAT_TYPES:
        raw = np.asarray(t.data)
        if t.qtype == T.BF16:
            raw = (np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return mx.array(np.ascontiguousarray(raw).reshape(t.shape)).astype(dtype)
    from gguf import quants

    return mx.array(quants.dequantize(np.asarray(t.data), t.qtype).reshape(t.shape)).astype(dtype)


def host_prefill(rows: int) -> bool:
    """Whether a product over ``rows`` rows runs on the host BLAS path (CPU prefill)."""
    if not on_cpu() or rows <= DENSE_ROWS:
        return False
    from hf2q.kernels import cpu_blas

    return cpu_blas.has_matmul()


def host_rows(x: mx.array) -> np.ndarray:
    """``x [..., n]`` float32 as a numpy ``[rows, n]`` view of the evaluated MLX buffer (copied only
    when its layout cannot be viewed that way)."""
    mx.eval(x)
    a = np.asarray(memoryview(x))
    return a.reshape(-1, a.shape[-1])


def _dense_cache_budget() -> int:
    try:
        return int(float(os.environ.get("HF2Q_DENSE_CACHE_MB", "512")) * 2 ** 20)
    except ValueError:
        return 512 * 2 ** 20


_DENSE_KEPT = [0]  # bytes of float32 weight copies currently kept


def _release_dense(nbytes: int) -> None:
    _DENSE_KEPT[0] -= nbytes




class Linear:
    """``y = x @ W.T (+ b)`` with W either float or MLX-affine quantized (leading expert dims allowed)."""

    def __init__(self, t: GGUFTensor, dtype, bias: mx.array | None = None):
        self.name = t.name
        self.shape = t.shape  # (..., out, in)
        self.qtype = t.qtype
        self.bias = bias
        self.dtype = dtype
        if t.qtype in FLOAT_TYPES:
            self.weight = float_array(t, dtype)
            self.quantized = False
        elif t.qtype in QUANTIZED_TYPES:
            a = to_affine(t.data, t.qtype, t.shape)
            lead = t.shape[:-1]
            self.weight = mx.array(a.packed.reshape(*lead, -1))
            self.scales = mx.array(a.scales.reshape(*lead, -1))
            self.biases = mx.array(a.biases.reshape(*lead, -1))
            self.bits, self.group_size, self.exact = a.bits, a.group_size, a.exact
            if not on_cpu() and self.scales.dtype != dtype and not EXACT_GPU_SCALES:
                # GPU kernels take their fast path when scales match the activations; float32
                # scales (kept where f16 would round, e.g. Q4_K's d*sc) cost 2-4x in decode.
                # The rounding is ~2^-11 of a scale, far below the quantization error.
                self.scales, self.biases = self.scales.astype(dtype), self.biases.astype(dtype)
            self.quantized = True
        else:
            raise InputError(f"tensor {t.name}: unsupported GGUF type {t.qtype.name}")
        mx.eval(self.params())
        self._dense_kept: np.ndarray | None = None
        self._host = None
        if self.quantized and len(t.shape) == 2 and on_cpu():
            from hf2q.kernels import cpu_qmatvec

            if cpu_qmatvec.kernel() is not None:
                # zero-copy numpy views of the MLX buffers for the C decode kernel; odd widths
                # (3/5/6-bit) unpack slowly, so they keep one byte per weight for it instead
                sc, bi = np.asarray(memoryview(self.scales)), np.asarray(memoryview(self.biases))
                if self.bits in (4, 8):
                    self._host = (np.asarray(memoryview(self.weight)).view(np.uint8).reshape(t.shape[0], -1),
                                  sc, bi, self.bits)
                else:
                    from hf2q.engine.quant_repack import unpack_bits

                    self._host = (unpack_bits(a.packed, self.bits, t.shape[-1]), sc, bi, 8)

    def params(self) -> list[mx.array]:
        ps = [self.weight] + ([self.scales, self.biases] if self.quantized else [])
        return ps + ([self.bias] if self.bias is not None else [])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params())

    def dense(self) -> mx.array:
        """The float weight (dequantized on the fly when quantized)."""
        if not self.quantized:
            return self.weight
        return mx.dequantize(self.weight, self.scales, self.biases, group_size=self.group_size,
                             bits=self.bits).astype(self.dtype)

    def dense_host(self) -> np.ndarray:
        """The float32 weight ``[out, in]`` as numpy (a view of the MLX buffer; quantized weights are
        dequantized, and the result kept while the ``HF2Q_DENSE_CACHE_MB`` budget allows)."""
        if self._dense_kept is not None:
            return self._dense_kept
        w = self.dense()
        mx.eval(w)
        a = np.asarray(memoryview(w))
        if not self.quantized:
            self._dense_kept = a
        elif _DENSE_KEPT[0] + a.nbytes <= _dense_cache_budget():
            _DENSE_KEPT[0] += a.nbytes
            weakref.finalize(self, _release_dense, a.nbytes)
            self._dense_kept = a
        return a

    def host_matmul(self, x: np.ndarray) -> np.ndarray:
        """``x [rows, in]`` float32 numpy → ``[rows, out]`` numpy (CPU prefill path)."""
        from hf2q.kernels import cpu_blas

        y = cpu_blas.matmul_t(x, self.dense_host())
        if self.bias is not None:
            y += np.asarray(memoryview(self.bias))
        return y

    def on_host(self, rows: int) -> bool:
        return len(self.shape) == 2 and self.dtype == mx.float32 and host_prefill(rows)

    def __call__(self, x: mx.array) -> mx.array:
        rows = math.prod(x.shape[:-1])
        if _observer is not None:
            _observe_dense(self.name, x)
        if self.on_host(rows) and x.dtype == mx.float32:
            return mx.array(self.host_matmul(host_rows(x))).reshape(*x.shape[:-1], self.shape[0])
        if not self.quantized:
            y = x @ self.weight.T
        elif on_cpu() and rows > DENSE_ROWS:
            y = x @ self.dense().T
        elif self._host is not None:
            from hf2q.kernels.cpu_qmatvec import qmatvec

            xs = x.reshape(rows, x.shape[-1]).astype(mx.float32)
            mx.eval(xs)
            packed, sc, bi, bits = self._host
            y = mx.array(qmatvec(packed, sc, bi, np.array(xs), bits)).reshape(*x.shape[:-1], self.shape[0])
        elif (len(self.shape) == 2 and cuda_qmv.takes(rows, self.shape[0], self.shape[1], self.bits, self.group_size)
              and cuda_qmv.available()):  # 2-7 rows on a CUDA GPU: one read of the weights for all rows
            y = cuda_qmv.qmv(x, self.weight, self.scales, self.biases, self.bits, self.group_size)
        else:  # as one [rows, in] matrix: MLX treats [B, 1, in] as B matvecs and reads the weight B times
            y = mx.quantized_matmul(x.reshape(rows, x.shape[-1]), self.weight, self.scales, self.biases,
                                    transpose=True, group_size=self.group_size,
                                    bits=self.bits).reshape(*x.shape[:-1], self.shape[0])
        if y.dtype != self.dtype:
            y = y.astype(self.dtype)
        return y + self.bias if self.bias is not None else y

    def gather(self, x: mx.array, indices: mx.array) -> mx.array:
        """Expert-stacked weight ``[E, out, in]``: ``x [N, 1, 1, in]`` through experts ``indices [N, k]``
        → ``[N, k, 1, out]`` (one fused gather-matmul, as in a SwitchGLU)."""
        if _observer is not None:
            _observer.experts(self.name, np.array(x.astype(mx.float32)).reshape(x.shape[0], x.shape[1], -1),
                              np.array(indices), self.shape[0])
        if self.quantized:
            return mx.gather_qmm(x, self.weight, self.scales, self.biases, rhs_indices=indices, transpose=True,
                                 group_size=self.group_size, bits=self.bits)
        return mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=indices)

    def rows(self, ids: mx.array) -> mx.array:
        """Rows of W (embedding lookup), dequantized to the compute dtype."""
        if not self.quantized:
            return self.weight[ids]
        return mx.dequantize(self.weight[ids], self.scales[ids], self.biases[ids], group_size=self.group_size,
                             bits=self.bits).astype(self.dtype)


def rms_norm(x: mx.array, w: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, w, eps)


def layer_norm(x: mx.array, w: mx.array, b: mx.array, eps: float) -> mx.array:
    return mx.fast.layer_norm(x, w, b, eps)


def gelu_tanh(x: mx.array) -> mx.array:
    return 0.5 * x * (1.0 + mx.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def gelu_erf(x: mx.array) -> mx.array:
    return 0.5 * x * (1.0 + mx.erf(x / math.sqrt(2.0)))


def silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


class GatedMLP:
    """``down(act(gate(x)) * up(x))`` — SwiGLU (llama, qwen) or GeGLU-tanh (gemma)."""

    def __init__(self, gate: Linear, up: Linear, down: Linear, act=silu):
        self.gate, self.up, self.down, self.act = gate, up, down, act

    def __call__(self, x: mx.array) -> mx.array:
        from hf2q.kernels import cpu_ops

        rows = math.prod(x.shape[:-1])
        if (self.act in (silu, gelu_tanh) and x.dtype == mx.float32
                and all(isinstance(lin, Linear) and lin.on_host(rows) for lin in (self.gate, self.up, self.down))):
            # (a tensor-parallel RowParallel down projection keeps the MLX path: it ends in an all_sum)
            # CPU prefill: gate, up, the activation (in place) and down all on the host
            xh = host_rows(x)
            g, u = self.gate.host_matmul(xh), self.up.host_matmul(xh)
            (cpu_ops.silu_mul_inplace if self.act is silu else cpu_ops.gelu_tanh_mul_inplace)(g, u)
            if _observer is not None:
                for lin, inp in ((self.gate, xh), (self.up, xh), (self.down, g)):
                    _observe_dense(lin.name, inp)
            return mx.array(self.down.host_matmul(g)).reshape(*x.shape[:-1], self.down.shape[0])
        if self.act is silu:
            h = cpu_ops.silu_mul(self.gate(x), self.up(x))
        elif self.act is gelu_tanh:
            h = cpu_ops.gelu_tanh_mul(self.gate(x), self.up(x))
        else:
            h = self.act(self.gate(x)) * self.up(x)
        return self.down(h)
