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
the first layers of a large one; the others are dequantized per call by the C kernel
(``cpu_qmatvec.dequantize``, MLX's rounding) into one reused buffer. See docs/ENGINE.md.
"""

from __future__ import annotations

import math
import os
import threading
import weakref

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T

from hf2q.engine.device_probe import EXACT_GPU_SCALES  # HF2Q_EXACT_SCALES=1: float32 group scales on GPUs
from hf2q.engine.quant_repack import FLOAT_TYPES, GROUP, QUANTIZED_TYPES, repack_rows
from hf2q.engine.thread_compile import thread_compile
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


_SCRATCH = threading.local()
#: the largest weight dequantized into the scratch buffer (a bigger one, e.g. a verify's output head, gets
#: its own array, freed after the call, rather than a buffer that large kept for good)
SCRATCH_MAX_BYTES = 256 * 2 ** 20


def _dense_scratch(shape: tuple[int, int]) -> np.ndarray:
    """A float32 ``shape`` view of this thread's buffer for weights dequantized but not kept (grown to the
    largest asked for). Each product's weight is used only inside its own ``host_matmul``, so one buffer serves
    them all; a fresh array per call paid the kernel's page faults on every one (often more than the
    dequantizing itself)."""
    n = shape[0] * shape[1]
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.size < n:
        buf = _SCRATCH.buf = np.empty(n, dtype=np.float32)
    return buf[:n].reshape(shape)


_MX_DTYPES = {np.dtype(np.uint32): mx.uint32, np.dtype(np.float32): mx.float32}


def _repacked(tensors: "list[GGUFTensor]", shape: tuple[int, ...]):
    """The MLX affine form (packed, scales, biases, bits, exact) of ``tensors``' rows in order, ``shape``'s
    leading dims restored.

    The stored blocks are repacked band by band (``quant_repack.repack_rows``) straight into the MLX buffers on
    the CPU (elsewhere into one host array each, handed to MLX once): the load holds no second whole copy of a
    weight, and a stack of tensors costs what its parts would apart. On the CPU 5-bit codes are stored one a byte
    (``wide``): the same values as 8-bit groups, which the host kernels stream several times faster, in less
    memory than the 5-bit buffer plus the unpacked copy those kernels would otherwise keep."""
    total = math.prod(shape[:-1])
    in_place = on_cpu()
    outs: list = []

    def allocate(like) -> list[np.ndarray]:
        parts = (like.packed, like.scales, like.biases)
        if not in_place:
            outs.extend(np.empty((total, x.shape[1]), x.dtype) for x in parts)
            return outs
        outs.extend(mx.zeros((total, x.shape[1]), dtype=_MX_DTYPES[x.dtype]) for x in parts)
        mx.eval(outs)
        return [np.asarray(memoryview(o)) for o in outs]

    parts = [(np.asarray(t.data), t.qtype, math.prod(t.shape[:-1])) for t in tensors]
    bits, exact = repack_rows(parts, shape[-1], allocate, wide=in_place)
    if not in_place:
        outs = [mx.array(v) for v in outs]
    lead = shape[:-1]
    outs = [o.reshape(*lead, -1) if len(lead) > 1 else o for o in outs]
    return (*outs, bits, exact)


class Linear:
    """``y = x @ W.T (+ b)`` with W either float or MLX-affine quantized (leading expert dims allowed)."""

    def __init__(self, t: "GGUFTensor | list[GGUFTensor]", dtype, bias: mx.array | None = None):
        """``t`` one tensor, or quantized 2-D tensors of one type and width read as one linear over their rows in
        order (:func:`load_products`)."""
        tensors = list(t) if isinstance(t, (list, tuple)) else [t]  # a GGUFTensor or one shaped like it
        t = tensors[0]
        self.name = "+".join(x.name for x in tensors)
        self.shape = t.shape if len(tensors) == 1 else (sum(x.shape[0] for x in tensors), t.shape[1])
        self.qtype = t.qtype
        self.bias = bias
        self.dtype = dtype
        if t.qtype in FLOAT_TYPES and len(tensors) == 1:
            self.weight = float_array(t, dtype)
            self.quantized = False
        elif t.qtype in QUANTIZED_TYPES:
            self.weight, self.scales, self.biases, self.bits, self.exact = _repacked(tensors, self.shape)
            self.group_size = GROUP
            if not on_cpu() and self.scales.dtype != dtype and not EXACT_GPU_SCALES:
                # GPU kernels take their fast path when scales match the activations; float32
                # scales (kept where f16 would round, e.g. Q4_K's d*sc) cost 2-4x in decode.
                # The rounding is ~2^-11 of a scale, far below the quantization error.
                self.scales, self.biases = self.scales.astype(dtype), self.biases.astype(dtype)
            self.quantized = True
        else:
            raise InputError(f"tensor {t.name}: unsupported GGUF type {t.qtype.name}")
        self.observed = tuple(x.name for x in tensors)
        #: the linears a fused one stands for (``load_products``), None for one tensor's
        self.parts: list[Linear] | None = None
        self._ready()

    _DERIVE = object()

    def _ready(self, host=_DERIVE) -> None:
        """Evaluate the weights and fix, once, what each call would otherwise look up: where products run,
        and the C decode kernel's arrays (``host``, derived from the weights unless given) with its call's
        arguments built over them."""
        mx.eval(self.params())
        self._dense_kept: np.ndarray | None = None
        self._host = self._host_arrays() if host is Linear._DERIVE else host
        if self._host is not None:
            from hf2q.kernels.cpu_qmatvec import QMatrixGroup

            self._host_group = QMatrixGroup([self._host])
        self._cpu = on_cpu()
        #: a quantized 2-D weight off the CPU: every call is one quantized product (or the few-row CUDA kernel)
        self._device_qmm = self.quantized and len(self.shape) == 2 and not self._cpu
        self._few_rows = self._device_qmm and cuda_qmv.available() and cuda_qmv.takes(
            2, self.shape[0], self.shape[1], self.bits, self.group_size)  # the row count is checked per call

    def _host_arrays(self):
        """The C decode kernel's view of the weight (``(packed uint8 [out, ·], scales, biases, bits)``), or None:
        zero-copy numpy views of the MLX buffers; odd widths (3/5/6-bit) unpack slowly, so they keep one byte
        per weight for it instead."""
        if not (self.quantized and len(self.shape) == 2 and on_cpu()):
            return None
        from hf2q.kernels import cpu_qmatvec

        if cpu_qmatvec.kernel() is None:
            return None
        sc, bi = np.asarray(memoryview(self.scales)), np.asarray(memoryview(self.biases))
        packed = np.asarray(memoryview(self.weight))
        if self.bits in (4, 8):
            return packed.view(np.uint8).reshape(self.shape[0], -1), sc, bi, self.bits
        from hf2q.engine.quant_repack import unpack_bits

        return unpack_bits(packed, self.bits, self.shape[-1]), sc, bi, 8

    def _split_into(self, parts: "list[Linear]") -> None:
        """Point each of ``parts`` at its rows of this (stacked) linear's buffers and C-kernel arrays."""
        row = 0
        host = self._host
        for p in parts:
            rows = slice(row, row + p.shape[0])
            p.weight, p.scales, p.biases = self.weight[rows], self.scales[rows], self.biases[rows]
            p._ready(host=None if host is None else (host[0][rows], host[1][rows], host[2][rows], host[3]))
            row += p.shape[0]

    def _part(self, name: str, rows: int) -> "Linear":
        """A part of ``rows`` rows of this linear's layout, its buffers not yet set (:meth:`_split_into`)."""
        p = Linear.__new__(Linear)
        p.name, p.observed, p.parts, p.shape = name, (name,), None, (rows, self.shape[1])
        p.qtype, p.dtype, p.quantized, p.bias = self.qtype, self.dtype, True, None
        p.bits, p.group_size, p.exact = self.bits, self.group_size, self.exact
        return p

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
        nbytes = math.prod(self.shape) * 4
        keep = not self.quantized or _DENSE_KEPT[0] + nbytes <= _dense_cache_budget()
        a = self._dequantized_host(scratch=not keep and nbytes <= SCRATCH_MAX_BYTES)
        if a is None:
            w = self.dense()
            mx.eval(w)
            a = np.asarray(memoryview(w))
        if not self.quantized:
            self._dense_kept = a
        elif keep:
            _DENSE_KEPT[0] += a.nbytes
            weakref.finalize(self, _release_dense, a.nbytes)
            self._dense_kept = a
        return a

    def _dequantized_host(self, scratch: bool) -> np.ndarray | None:
        """The float32 weight from the C kernel over the decode kernel's arrays (into this thread's scratch
        buffer with ``scratch``, :func:`_dense_scratch`), or None (MLX's op then).

        A model too big for the dense cache dequantizes every weight it does not keep once per prefill chunk;
        MLX's CPU ``dequantize`` runs on one thread, the kernel one pass on every core (docs/ENGINE.md, "Gemma 4
        on the CPU"). Its values are rounded as MLX rounds them, so products are unchanged."""
        if self._host is None or self.dtype != mx.float32:
            return None
        from hf2q.kernels import cpu_qmatvec

        packed, scales, biases, bits = self._host
        return cpu_qmatvec.dequantize(packed, scales, biases, bits, _dense_scratch(self.shape) if scratch else None)

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
        if self._device_qmm:  # the GPU's path, first: every decode step makes ~7 of these calls a layer
            if _observer is not None:
                self._observe(x)
            y = self._quantized_product(x)
        else:
            rows = math.prod(x.shape[:-1])
            if self.parts is not None and self._cpu and rows > DENSE_ROWS:
                # BLAS rounds a product by the matrix's width: a CPU prefill chunk keeps one product per part
                return mx.concatenate([p(x) for p in self.parts], axis=-1)
            if _observer is not None:
                self._observe(x)
            if self._cpu and rows > DENSE_ROWS and x.dtype == mx.float32 and self.on_host(rows):  # bias included
                return mx.array(self.host_matmul(host_rows(x))).reshape(*x.shape[:-1], self.shape[0])
            y = self._product(x, rows)
        if y.dtype != self.dtype:
            y = y.astype(self.dtype)
        return y + self.bias if self.bias is not None else y

    def _observe(self, x: mx.array) -> None:
        for name in self.observed:
            _observe_dense(name, x)

    def _quantized_product(self, x: mx.array) -> mx.array:
        """``x`` through MLX's quantized product (or the few-row CUDA kernel), shaped as ``x``."""
        shape = x.shape
        rows = x.size // shape[-1]
        if self._few_rows and cuda_qmv.takes(rows, self.shape[0], self.shape[1], self.bits, self.group_size):
            # 1-7 rows on a CUDA GPU: one read of the weights for all rows, each row's sums as for one row
            return cuda_qmv.qmv(x, self.weight, self.scales, self.biases, self.bits, self.group_size)
        if len(shape) == 2 or rows == shape[-2]:  # one matrix already (a decode row, a prefill chunk)
            return mx.quantized_matmul(x, self.weight, self.scales, self.biases, transpose=True,
                                       group_size=self.group_size, bits=self.bits)
        # as one [rows, in] matrix: MLX treats [B, 1, in] as B matvecs and reads the weight B times
        return mx.quantized_matmul(x.reshape(rows, shape[-1]), self.weight, self.scales, self.biases, transpose=True,
                                   group_size=self.group_size, bits=self.bits).reshape(*shape[:-1], self.shape[0])

    def _product(self, x: mx.array, rows: int) -> mx.array:
        """The CPU's MLX-side products (the C kernel for few rows) and float weights anywhere."""
        if not self.quantized:
            return x @ self.weight.T
        if self._cpu and rows > DENSE_ROWS:
            return x @ self.dense().T
        if self._host is not None:
            y = self._host_group(host_rows(x.astype(mx.float32)))
            return mx.array(y).reshape(*x.shape[:-1], self.shape[0])
        return self._quantized_product(x)

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

    def grouped(self, x: mx.array) -> mx.array:
        """Expert-stacked weight ``[E, out, in]``: ``x [E, C, in]``, expert ``e``'s rows in batch ``e`` →
        ``[E, C, out]`` (``expert_route``'s grouped layout: each expert's matrix read once)."""
        every = mx.arange(self.shape[0], dtype=mx.uint32)
        if self.quantized:
            return mx.gather_qmm(x, self.weight, self.scales, self.biases, rhs_indices=every, transpose=True,
                                 group_size=self.group_size, bits=self.bits, sorted_indices=True)
        return mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=every, sorted_indices=True)

    def segments(self, x: np.ndarray, experts: list[int], starts: list[int], counts: list[int]) -> np.ndarray:
        """Expert-stacked weight ``[E, out, in]`` on the CPU: rows ``[starts[i], starts[i] + counts[i])`` of
        ``x [P, in]`` (float32) through expert ``experts[i]`` → ``[P, out]`` float32 (``expert_route``'s host
        layout). Quantized: one call of the C matvec kernel over every run; otherwise MLX's gather product, one
        row a pair as in the per-pair layout (a BLAS product per run would round by its row count, so a token's
        result would depend on the batch it came in)."""
        stack = self.expert_stack()
        if stack is not None:
            return stack(x, experts, starts, counts)
        which = mx.array(np.repeat(np.asarray(experts, np.int32), counts)[:, None])
        rows = mx.array(x).astype(self.dtype)[:, None, None, :]
        return np.array(self.gather(rows, which)[:, 0, 0, :].astype(mx.float32))

    def expert_host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """This expert-stacked quantized weight as the C kernel reads it: zero-copy views of the MLX buffers
        ``(packed [E, out, ·], scales, biases, bits)``."""
        return (np.asarray(memoryview(self.weight)), np.asarray(memoryview(self.scales)),
                np.asarray(memoryview(self.biases)), self.bits)

    def expert_stack(self, *others: "Linear"):
        """The C kernel's view of this expert-stacked quantized weight, with ``others`` (stacks of the same input
        width and expert count) side by side in its output; built once per set, or None where the kernel cannot
        take them."""
        stacks = self.__dict__.setdefault("_stacks", {})
        key = tuple(id(o) for o in others)
        if key not in stacks:
            from hf2q.kernels import cpu_qmatvec

            lins = (self, *others)
            takes = on_cpu() and cpu_qmatvec.kernel() is not None and all(
                lin.quantized and len(lin.shape) == 3 and lin.group_size == 32 and lin.scales.dtype == mx.float32
                and lin.shape[0] == self.shape[0] and lin.shape[2] == self.shape[2] for lin in lins)
            stacks[key] = cpu_qmatvec.ExpertStack([lin.expert_host() for lin in lins]) if takes else None
        return stacks[key]

    def rows(self, ids: mx.array) -> mx.array:
        """Rows of W (embedding lookup), dequantized to the compute dtype."""
        if not self.quantized:
            return self.weight[ids]
        return mx.dequantize(self.weight[ids], self.scales[ids], self.biases[ids], group_size=self.group_size,
                             bits=self.bits).astype(self.dtype)


def fusing() -> bool:
    """Whether models fuse projections that share an input at load (``HF2Q_NO_FUSED_PROJ=1``: never).

    The fusion is done on the host as the weights are read; on a GPU it stays off by default until its
    load and tokens/s are measured there (docs/ENGINE.md, "Fused projections"), ``HF2Q_FUSED_PROJ=1``
    turns it on anyway."""
    if os.environ.get("HF2Q_NO_FUSED_PROJ"):
        return False
    return bool(os.environ.get("HF2Q_FUSED_PROJ")) or mx.default_device().type != mx.DeviceType.gpu


def _stacks(t: GGUFTensor) -> tuple | None:
    """What tensors must share to load as one stacked linear (type and width), or None when ``t`` cannot."""
    if t.qtype not in QUANTIZED_TYPES or len(t.shape) != 2:
        return None
    return t.qtype, t.shape[1]


def load_products(tensors: "list[GGUFTensor]", dtype) -> tuple[list[Linear], tuple[tuple[Linear, tuple[int, ...]], ...]]:
    """The linears of ``tensors`` (one input, outputs side by side) and the products a forward runs: each run of
    adjacent tensors of one quantized type and width becomes one linear, with the widths to split its output by.

    One product instead of three (q, k, v) or two (gate, up) is fewer graph nodes for the host to build and fewer
    kernels for the device to launch; each output row is the same dot product as before, so results are equal.
    Where types differ (Q4_K_M's Q6_K attn_v beside Q4_K q/k) only the matching neighbours fuse. The fusion is
    done as the tensors are read: a run's stored blocks are repacked into one MLX buffer and each part is a view
    of its rows, so loading so costs no more time or memory than loading the parts apart, and leaves no
    device-side concatenation to evaluate."""
    groups: list[list[GGUFTensor]] = []
    for t in tensors:
        key = _stacks(t) if fusing() else None
        if groups and key is not None and _stacks(groups[-1][0]) == key:
            groups[-1].append(t)
        else:
            groups.append([t])
    parts: list[Linear] = []
    products = []
    for g in groups:
        if len(g) == 1:
            lin = Linear(g[0], dtype)
            parts.append(lin)
            products.append((lin, (lin.shape[0],)))
            continue
        f = Linear(g, dtype)
        mine = [f._part(t.name, t.shape[0]) for t in g]
        f.parts = mine
        f._split_into(mine)
        parts.extend(mine)
        products.append((f, tuple(t.shape[0] for t in g)))
    return parts, tuple(products)


def run_products(products, x: mx.array) -> list[mx.array]:
    """The outputs of :func:`load_products`' ``products`` on ``x``, one per original part, in order."""
    out = []
    for lin, widths in products:
        y = lin(x)
        if len(widths) == 1:
            out.append(y)
            continue
        at = 0
        for w in widths:
            out.append(y[..., at:at + w])
            at += w
    return out


def rms_norm(x: mx.array, w: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, w, eps)


def step_compiling() -> bool:
    """Whether a decode row's q/k norms and RoPE run as a graph traced once per batch size (:func:`qk_rotation`;
    ``HF2Q_NO_STEP_COMPILE=1``: never). Only one-token rows take it: their shapes are one per batch size, so the
    traces stay few, while a prefill chunk's length varies."""
    return not os.environ.get("HF2Q_NO_STEP_COMPILE")


def norm_rope(q: mx.array, k: mx.array, offset, q_norm: mx.array | None, k_norm: mx.array | None, *, dims: int,
              rope: dict, eps: float) -> tuple[mx.array, mx.array]:
    """Query and key heads ``[B, L, heads, d]`` RMS-normed (when ``q_norm``/``k_norm`` are given) and rotated from
    ``offset``, as ``[B, heads, L, d]``: the one body of the plain and the traced (:func:`qk_rotation`) paths."""
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    return (mx.fast.rope(q.transpose(0, 2, 1, 3), dims, offset=offset, **rope),
            mx.fast.rope(k.transpose(0, 2, 1, 3), dims, offset=offset, **rope))


_ROTATIONS: dict[tuple, object] = {}


def qk_rotation(dims: int, rope: dict, eps: float, qk_norm: bool):
    """``(q, k, offset, q_norm, k_norm) -> (q, k)``: :func:`norm_rope` of a decode row (``[B, 1, heads, d]``),
    replayed from one trace per batch size (shared by the layers of one RoPE configuration). ``offset`` is an
    int32 array (``ForwardBatch.offset_array``), so a new position is a new input, not a new trace."""
    key = (dims, eps, qk_norm, *((k, id(v) if isinstance(v, mx.array) else v) for k, v in sorted(rope.items())))
    if key not in _ROTATIONS:
        def rotate(q, k, offset, q_norm, k_norm):
            return norm_rope(q, k, offset, q_norm if qk_norm else None, k_norm, dims=dims, rope=rope, eps=eps)

        _ROTATIONS[key] = thread_compile(rotate)
    return _ROTATIONS[key]


def layer_norm(x: mx.array, w: mx.array, b: mx.array, eps: float) -> mx.array:
    return mx.fast.layer_norm(x, w, b, eps)


def gelu_tanh(x: mx.array) -> mx.array:
    return 0.5 * x * (1.0 + mx.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def gelu_erf(x: mx.array) -> mx.array:
    return 0.5 * x * (1.0 + mx.erf(x / math.sqrt(2.0)))


def silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


def _swiglu(g: mx.array, u: mx.array) -> mx.array:
    return g * mx.sigmoid(g) * u


def _geglu_tanh(g: mx.array, u: mx.array) -> mx.array:
    return 0.5 * g * (1.0 + mx.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3))) * u


#: the gated activations traced once into one fused elementwise node (one kernel on a GPU instead of 3 / 9; the
#: replay also skips building those ops in Python); the same arithmetic, op for op, as the plain expressions
GLU_COMPILED = {silu: thread_compile(_swiglu, shapeless=True), gelu_tanh: thread_compile(_geglu_tanh, shapeless=True)}


class GatedMLP:
    """``down(act(gate(x)) * up(x))`` — SwiGLU (llama, qwen) or GeGLU-tanh (gemma)."""

    def __init__(self, gate: Linear, up: Linear, down: Linear, act=silu, gate_up=None):
        self.gate, self.up, self.down, self.act = gate, up, down, act
        #: gate and up as the products a forward runs: one when ``load`` fused them as it read them, else two
        self.gate_up = ((gate, (gate.shape[0],)), (up, (up.shape[0],))) if gate_up is None else gate_up
        self._host_capable = act in (silu, gelu_tanh) and on_cpu()
        self._glu = GLU_COMPILED.get(act)

    @classmethod
    def load(cls, gate: GGUFTensor, up: GGUFTensor, down: GGUFTensor, dtype, act=silu) -> "GatedMLP":
        """The MLP of three stored tensors, gate and up fused as they are read (:func:`load_products`)."""
        (g, u), gate_up = load_products([gate, up], dtype)
        return cls(g, u, Linear(down, dtype), act, gate_up=gate_up)

    def __call__(self, x: mx.array) -> mx.array:
        from hf2q.kernels import cpu_ops

        rows = math.prod(x.shape[:-1])
        if (self._host_capable and x.dtype == mx.float32
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
        g, u = run_products(self.gate_up, x)
        if self._glu is None:
            h = self.act(g) * u
        elif self._host_capable and g.dtype == mx.float32 and g.size >= cpu_ops.HOST_MIN_ELEMENTS:
            h = (cpu_ops.silu_mul if self.act is silu else cpu_ops.gelu_tanh_mul)(g, u)  # big CPU rows: numpy
        else:
            h = self._glu(g, u)
        return self.down(h)
