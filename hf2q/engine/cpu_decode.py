"""A host (C kernels over numpy buffers) decode step for decoder models on the CPU backend.

On MLX's CPU backend every small op costs 25–300 µs of dispatch (``rms_norm`` on 576
values: ~110–290 µs), so a SmolLM2 decode step spent about two thirds of its time outside
the matvecs. For decode (a few rows) this module runs the same graph itself: the quantized
matvecs in ``hf2q.kernels.cpu_qmatvec`` (q/k/v as one call, gate/up as one call), the norms,
RoPE, attention and activations in ``hf2q.kernels.cpu_decode_ops``, all over float32 work
buffers (one set, grown to the largest batch seen), with the K/V written straight into the MLX cache
buffers through their addresses. That keeps a layer at about ten ctypes calls and no numpy
temporaries. A step is a list of rows (token, position, cache), so a short prefill chunk runs
through it too, one row per position (``prefill``); long chunks stay on MLX (BLAS bound, with
a tiled attention kernel). The kernels share their work over ``hf2q.kernels.cpu_pool``.
An 8-bit cache (``--kv-cache-type q8|q8-rotated``, ``engine/kv_quant.py``) is read by ``attend_q8``,
which quantizes each new K/V row into the cache's codes and scales and attends over them as stored;
for ``q8-rotated`` the step multiplies q, k and v by the Hadamard matrix before it and the heads'
outputs after it (one numpy matmul each: the C kernel never sees the rotation).
It covers dense families (llama,
qwen3, gemma3) and Qwen3-MoE's routed feed-forward (:class:`HostMoE`); Gemma 4, whose layers differ in shape
and whose window layers keep only the window, has its own step over the same pieces
(``engine/cpu_decode_gemma4.py``, the row logic of :class:`HostRows` shared). Anything a step does not know
(other MoE blocks, non-float activations) reports ``supported() == False`` and the MLX path runs.
Tests compare both paths token for token.
"""

from __future__ import annotations

import ctypes
import os

import mlx.core as mx
import numpy as np

from hf2q.engine.kv_layout import hadamard
from hf2q.engine.layers import GatedMLP, Linear, gelu_tanh, silu


def _np(a: mx.array) -> np.ndarray:
    mx.eval(a)
    v = np.asarray(memoryview(a))
    if v.shape != tuple(a.shape):
        raise ValueError("non-contiguous MLX buffer")
    return v


class _Vec:
    """A small float32 weight vector (norm weights) we own, with its address for the C ops."""

    def __init__(self, a: mx.array):
        self.array = np.array(_np(a), dtype=np.float32, copy=True)
        self.ptr = self.array.ctypes.data


def _addr(a: mx.array) -> int:
    """Address of an evaluated, contiguous MLX buffer (writable: the KV caches are written in place)."""
    mv = memoryview(a)
    if not mv.c_contiguous or mv.shape != tuple(a.shape):
        raise ValueError("non-contiguous MLX buffer")
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))


def _host_readable(lin) -> bool:
    """Whether a host step can run ``lin``: a float weight, or a quantized one with the C kernel's arrays (a
    wrapped one, e.g. a tensor-parallel shard with its all_sum, keeps the MLX graph)."""
    return isinstance(lin, Linear) and (not lin.quantized or lin._host is not None)


#: up to this many rows a float weight's product runs row by row (a BLAS product of many rows rounds by its row
#: count; a decode batch's rows must equal the same rows decoded alone)
DECODE_ROWS = 16


class HostProjection:
    """Linears sharing one input, evaluated together into one ``[B, Σ out]`` buffer
    (``[q | k | v]``, ``[gate | up]``): one kernel call when all are quantized for the host
    kernel, numpy matmuls for float weights."""

    def __init__(self, lins: list[Linear]):
        from hf2q.kernels.cpu_qmatvec import QMatrixGroup

        self.out = sum(int(lin.shape[0]) for lin in lins)
        biases = [None if lin.bias is None else _np(lin.bias) for lin in lins]
        self.bias = None if all(b is None for b in biases) else np.concatenate(
            [np.zeros(lin.shape[0], np.float32) if b is None else b for lin, b in zip(lins, biases)])
        self.group = None
        self.parts: list[tuple[int, int, object]] = []
        if all(lin.quantized for lin in lins):
            self.group = QMatrixGroup([lin._host for lin in lins])
        else:
            col = 0
            for lin in lins:
                w = QMatrixGroup([lin._host]) if lin.quantized else _np(lin.weight)
                self.parts.append((col, col + int(lin.shape[0]), w))
                col += int(lin.shape[0])

    def run(self, x: np.ndarray, x_ptr: int, y: np.ndarray, y_ptr: int, B: int) -> None:
        """``y[:B] = x[:B] @ W.T (+ bias)``; the pointers are those of ``x`` and ``y``."""
        if self.group is not None:
            self.group.run(x_ptr, y_ptr, B)
        else:
            for a, b, w in self.parts:
                if callable(w):
                    y[:B, a:b] = w(x[:B])
                elif B <= DECODE_ROWS:  # row by row: a decode row's logits must not depend on its batch
                    for r in range(B):
                        y[r, a:b] = w @ x[r]
                else:
                    y[:B, a:b] = x[:B] @ w.T
        if self.bias is not None:
            y[:B] += self.bias


class HostRouter:
    """An MoE router on the host: its matvec (one C call when quantized; a float one row by row, since a many-row
    BLAS product rounds by its row count and a near-tie between two experts must not resolve differently alone
    and in a batch), softmax over float32 logits and the top ``k`` — the MLX graph's routing step for step."""

    def __init__(self, router: Linear, top_k: int, normalize: bool):
        self.proj = HostProjection([router]) if router.quantized else None
        self.weight = None if router.quantized else _np(router.weight).astype(np.float32)
        self.n_experts, self.top_k, self.normalize = int(router.shape[0]), top_k, normalize

    def __call__(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(experts [B, k], weights [B, k])`` of the rows ``h [B, in]`` (renormalised to sum 1 with ``normalize``)."""
        B, k = h.shape[0], self.top_k
        logits = np.empty((B, self.n_experts), np.float32)
        if self.proj is not None:
            self.proj.run(h, h.ctypes.data, logits, logits.ctypes.data, B)
        else:
            for b in range(B):
                np.matmul(self.weight, h[b], out=logits[b])
        logits -= logits.max(axis=-1, keepdims=True)
        probs = np.exp(logits)
        probs /= probs.sum(axis=-1, keepdims=True)
        idx = np.argpartition(-probs, k - 1, axis=-1)[:, :k]
        weights = np.take_along_axis(probs, idx, axis=-1)
        if self.normalize:
            weights /= weights.sum(axis=-1, keepdims=True)
        return idx, weights


class HostMoE:
    """Qwen3-MoE's routed feed-forward on the host: the router's matvec, softmax and top-k in numpy, then the
    experts as ``expert_route.host_glu`` runs them (the pairs sorted by expert, gate|up and down in one segment
    call of the C kernel each) — the MLX graph's ``MoEFeedForward`` step for step (softmax over float32 logits,
    renormalised top-k)."""

    def __init__(self, ffn, ops):
        self.ops = ops
        self.router = HostRouter(ffn.router, ffn.top_k, ffn.normalize)
        self.gate_up = ffn.gate_exps.expert_stack(ffn.up_exps)
        self.down = ffn.down_exps.expert_stack()
        self.n_experts = int(ffn.gate_exps.shape[0])

    @staticmethod
    def takes(ffn) -> bool:
        from hf2q.engine.models.qwen3_moe import MoEFeedForward

        if type(ffn) is not MoEFeedForward or not _host_readable(ffn.router):
            return False
        return ffn.gate_exps.expert_stack(ffn.up_exps) is not None and ffn.down_exps.expert_stack() is not None

    def run(self, h: np.ndarray, out: np.ndarray) -> None:
        """``out[:B] =`` the routed feed-forward of the rows ``h [B, hidden]``."""
        from hf2q.engine.expert_route import HostSort, host_glu

        idx, weights = self.router(h)
        out[...] = host_glu(h, HostSort.of(idx, self.n_experts), self.router.top_k, weights, self.gate_up, self.down,
                            self.ops, 0)


class HostEmbedding:
    """Embedding rows dequantized in numpy from the host copy of the weight (``w = scale·q + bias``
    per 32-group), which costs microseconds where an MLX gather + dequantize costs ~0.5 ms."""

    def __init__(self, lin: Linear):
        self.lin = lin
        self.float_w = None if lin.quantized else _np(lin.weight)

    def __call__(self, ids: np.ndarray, out: np.ndarray) -> None:
        if self.float_w is not None:
            out[...] = self.float_w[ids]
            return
        if self.lin._host is None:
            out[...] = np.asarray(self.lin.rows(mx.array(ids.astype(np.int32))), dtype=np.float32)
            return
        packed, sc, bi, bits = self.lin._host
        q = packed[ids]
        B, n = out.shape
        if bits == 8:
            qf = q.astype(np.float32)
        elif bits == 4:
            qf = np.empty((B, n), dtype=np.float32)
            qf[:, 0::2] = q & 15
            qf[:, 1::2] = q >> 4
        else:
            from hf2q.engine.quant_repack import unpack_bits

            qf = unpack_bits(q, bits, n).astype(np.float32)
        w = qf.reshape(B, -1, 32)
        w *= sc[ids][..., None]
        w += bi[ids][..., None]
        out[...] = w.reshape(B, n)


class _Workspace:
    """The float32 buffers of a step of up to ``B`` rows and their addresses."""

    def __init__(self, B: int, sizes: dict[str, int]):
        self.arrays = {k: np.zeros((B, n), dtype=np.float32) for k, n in sizes.items()}
        self.ptr = {k: a.ctypes.data for k, a in self.arrays.items()}


class HostRows:
    """What every host step shares: rows at the next positions of their sequences (a decode step, a short prefill
    chunk as rows, the two in one pass), the caches reserved before and advanced after, and float32 work buffers
    grown to the largest batch seen. A model's step supplies ``_rows`` (the forward pass of the rows) and
    ``sizes`` (each work buffer's width)."""

    sizes: dict[str, int]
    #: the 8-bit cache's codec (None: float32 K/V)
    codec = None
    _ws: "_Workspace | None" = None
    _ws_rows = 0
    #: ``(id(cache), version, window base)`` of every row at the last :meth:`_kv_addresses`, and what it gave
    _kv_key: tuple | None = None
    _kv_value: tuple | None = None

    def _rows(self, tokens: np.ndarray, caches: list, pos: np.ndarray, logits_from: int) -> np.ndarray:
        raise NotImplementedError

    def _kv_addresses(self, caches, n_layers: int) -> tuple:
        """Per cache layer (the first ``n_layers``), the K and V buffer addresses of every row's sequence
        (``uint64 [L, B]``, layer-major), each row's capacity and first held position there (``int32 [L, B]``:
        a sliding-window layer's buffer holds positions from ``window.base``, the others from 0); fetched again
        whenever a cache's ``version`` says MLX replaced a buffer (prefill, import, trim, growth, a window
        move), else reused."""
        key = tuple((id(s), s.version, s.window.base if s.window is not None else 0) for s in caches)
        if self._kv_key == key:  # no buffer replaced since the last step: same addresses
            return self._kv_value
        unique: dict[int, int] = {}
        # per sequence: per plane (K, V; or K codes, K scales, V codes, V scales), per layer
        cols, caps, bases = [], [], []
        want = (mx.float32,) * 2 if self.codec is None else (mx.uint32, mx.float32) * 2
        for s in caches:
            if id(s) in unique:
                continue
            unique[id(s)] = len(cols)
            mx.eval(s.keys, s.values)
            windowed = s.window.layers if s.window is not None else frozenset()
            per_plane, cap, base = [[] for _ in want], [], []
            for li in range(n_layers):
                planes = (s.keys[li], s.values[li]) if self.codec is None else (*s.keys[li], *s.values[li])
                for p, (a, dtype) in enumerate(zip(planes, want)):
                    if a.dtype != dtype or a.shape[1] != planes[0].shape[1]:
                        raise ValueError("host decode needs the KV buffers of its cache type, K and V of one capacity")
                    per_plane[p].append(_addr(a))
                cap.append(int(planes[0].shape[1]))
                base.append(s.window.base if li in windowed else 0)
            cols.append(per_plane)
            caps.append(cap)
            bases.append(base)
        rows = [unique[id(s)] for s in caches]
        ptrs = tuple(np.ascontiguousarray(np.asarray([c[p] for c in cols], dtype=np.uint64).T[:, rows])
                     for p in range(len(want)))
        cap = np.ascontiguousarray(np.asarray(caps, dtype=np.int32).T[:, rows])
        base = np.ascontiguousarray(np.asarray(bases, dtype=np.int32).T[:, rows])
        self._kv_key, self._kv_value = key, (ptrs, cap, base)
        return ptrs, cap, base

    def _workspace(self, rows: int) -> _Workspace:
        """Buffers for at least ``rows`` rows (the first ``rows`` rows of a larger one are the
        same C-contiguous layout, so one workspace serves every smaller batch)."""
        if self._ws is None or self._ws_rows < rows:
            self._ws_rows = max(rows, 2 * self._ws_rows if self._ws is not None else rows)
            self._ws = _Workspace(self._ws_rows, self.sizes)
        return self._ws

    def step(self, tokens: np.ndarray, caches, end_point: bool = True) -> np.ndarray:
        """One decode step for ``len(caches)`` sequences; returns float32 logits ``[N, vocab]``. ``end_point``:
        whether the rows end a transaction (``ForwardBatch.end_point``; False for a forward read at every position)."""
        return self._advance(np.asarray(tokens), list(caches), logits_from=0, end_point=end_point)

    def prefill(self, seq, tokens: np.ndarray) -> np.ndarray:
        """The next ``len(tokens)`` positions of one sequence as rows of one step (row i attends
        to the cache through its own position, whose K/V rows i' < i wrote just before it);
        returns the float32 logits ``[vocab]`` of the last token. For short chunks, where the
        MLX graph's fixed cost (60–100 ms a call on SmolLM2) dwarfs the arithmetic."""
        n = len(tokens)
        return self._advance(np.asarray(tokens), [seq] * n, logits_from=n - 1)[0]

    def step_with_prefill(self, tokens: np.ndarray, caches, seq, chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A decode-first mixed step as one pass over the weights: the ``len(chunk)`` prefill rows
        of ``seq`` first, then one decode row per sequence of ``caches`` (not ``seq``). Run apart,
        the decode would stream every weight once more beside the prefill; here the decode rows
        ride on the prefill's tiles. Returns (decode logits ``[N, vocab]``, the chunk's last
        logits ``[vocab]``) — row for row what ``step`` and ``prefill`` give."""
        if any(c is seq for c in caches):
            raise ValueError("a sequence cannot decode and prefill in one step")
        n = len(chunk)
        logits = self._advance(np.concatenate([np.asarray(chunk), np.asarray(tokens)]), [seq] * n + list(caches),
                               logits_from=n - 1)
        return logits[1:], logits[0]

    def _advance(self, tokens: np.ndarray, caches: list, logits_from: int, end_point: bool = True) -> np.ndarray:
        """Rows at the next positions of their sequences (a sequence's rows in order take its next
        positions one after another), the caches grown before and advanced after (a sliding-window
        sequence's reuse points noted as ``ForwardBatch.finish`` notes them); the logits of rows
        ``logits_from..``."""
        taken: dict[int, int] = {}
        pos = np.empty(len(caches), dtype=np.int64)
        for b, c in enumerate(caches):
            k = taken.get(id(c), 0)
            pos[b] = c.length + k
            taken[id(c)] = k + 1
        seqs = {id(c): c for c in caches}
        for key, c in seqs.items():
            c.reserve(c.length + taken[key])
        logits = self._rows(tokens, caches, pos, logits_from)
        for key, c in seqs.items():
            if c.window is not None:
                c.add_window_points(c.length, taken[key], end_point)
            c.advance(taken[key])
            if c.window is not None:
                c.published_points = c.reuse_points()
        return logits


class HostDecoder(HostRows):
    """The decode step of one dense decoder model, run on the host (see the module docstring)."""

    @property
    def keeps_windows(self) -> bool:
        """Whether the runner keeps sliding-window layers to their window (``kv_cache.SlidingWindow``) with this
        step: over a float cache (``attend_layer`` reads a window buffer from its base); the 8-bit cache's
        ``attend_q8`` addresses every position, so there every position stays."""
        return self.codec is None

    def __init__(self, model, codec=None):
        from hf2q.kernels.cpu_decode_ops import library

        self.ops = library()
        self.model = model
        #: the 8-bit cache's codec (None: float32 K/V); its rotation as a float32 numpy matrix
        self.codec = codec
        self.rotation = None if codec is None or not codec.rotated else hadamard(codec.head_dim).astype(np.float32)
        cfg = model.cfg
        self.cfg = cfg
        self.embed = HostEmbedding(model.embed)
        self.lm_head = HostProjection([model.lm_head])
        self.norm = _Vec(model.norm)
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.layers = []
        for layer in model.layers:
            a, f = layer.attn, layer.ffn
            entry = {
                "attn_norm": _Vec(layer.attn_norm), "ffn_norm": _Vec(layer.ffn_norm),
                "qkv": HostProjection([a.q, a.k, a.v]), "o": HostProjection([a.o]),
                "window": a.window or 0, "base": a.base, "scale": a.scale,
            }
            if isinstance(f, GatedMLP):
                entry.update(gate_up=HostProjection([f.gate, f.up]), down=HostProjection([f.down]),
                             act=0 if f.act is silu else 1)
            else:
                entry["moe"] = HostMoE(f, self.ops)
            if cfg.qk_norm:
                entry["q_norm"], entry["k_norm"] = _Vec(a.q_norm), _Vec(a.k_norm)
            if cfg.sandwich_norms:
                entry["post_attn"], entry["post_ffn"] = _Vec(layer.post_attn_norm), _Vec(layer.post_ffn_norm)
            self.layers.append(entry)
        dense = [layer.ffn for layer in model.layers if isinstance(layer.ffn, GatedMLP)]
        self.ffn = int(dense[0].gate.shape[0]) if dense else 0
        self.sizes = {"x": cfg.hidden, "h": cfg.hidden, "qkv": (H + 2 * Hkv) * D, "att": H * D,
                      "o": cfg.hidden, "gu": 2 * self.ffn, "a": self.ffn, "f": cfg.hidden}
        for L in self.layers:  # the kernels write a projection's full width into its buffer's row: check once
            for proj, buf in (("qkv", "qkv"), ("o", "o"), ("gate_up", "gu"), ("down", "f")):
                if proj in L and L[proj].out != self.sizes[buf]:
                    raise ValueError(f"host decode: the {proj} projection is {L[proj].out} wide, its buffer "
                                     f"{self.sizes[buf]}")

    @staticmethod
    def supported(model, codec=None) -> bool:
        if os.environ.get("HF2Q_NO_HOST_DECODE") or mx.default_device() != mx.cpu:
            return False
        if codec is not None and (codec.dtype != mx.float32 or codec.head_dim != getattr(model.cfg, "head_dim", None)):
            return False
        if getattr(model, "dtype", None) != mx.float32 or not hasattr(model, "layers"):
            return False
        if hasattr(model, "new_recurrent_state"):  # hybrid recurrent layers: the MLX graph only
            return False
        from hf2q.kernels.cpu_decode_ops import library

        if library() is None:
            return False
        c = model.cfg
        if c.rope_dims % 2 or c.rope_dims > c.head_dim or c.n_heads % c.n_kv_heads:
            return False
        widths = set()
        for layer in model.layers:
            f = layer.ffn
            lins = [layer.attn.q, layer.attn.k, layer.attn.v, layer.attn.o, model.lm_head]
            if isinstance(f, GatedMLP) and f.act in (silu, gelu_tanh):
                widths.add(f.gate.shape[0])
                lins += [f.gate, f.up, f.down]
            elif not HostMoE.takes(f):
                return False
            if len(widths) > 1:
                return False
            if not all(map(_host_readable, lins)):
                return False
        return True

    def _rope(self, x: np.ndarray, pos: np.ndarray, base: float) -> np.ndarray:
        """x [B, H, D] at positions pos [B]; same conventions as ``mx.fast.rope``."""
        c = self.cfg
        d = c.rope_dims
        scaled = base == c.rope_base  # rope scaling: layers on rope_base only (as the MLX graph)
        if scaled and c.rope_freqs is not None:  # custom periods (Llama 3 rope_freqs, YaRN)
            inv = 1.0 / np.asarray(c.rope_freqs, dtype=np.float64)
        else:
            inv = base ** (-np.arange(0, d // 2, dtype=np.float64) * 2.0 / d)
        ang = (pos.astype(np.float64)[:, None] * (c.rope_scale if scaled else 1.0)) * inv[None, :]  # [B, d/2]
        cos = np.cos(ang).astype(np.float32)[:, None, :]
        sin = np.sin(ang).astype(np.float32)[:, None, :]
        out = x.copy()
        if c.rope_traditional:
            x1, x2 = x[..., 0:d:2], x[..., 1:d:2]
            out[..., 0:d:2] = x1 * cos - x2 * sin
            out[..., 1:d:2] = x1 * sin + x2 * cos
        else:
            x1, x2 = x[..., : d // 2], x[..., d // 2:d]
            out[..., : d // 2] = x1 * cos - x2 * sin
            out[..., d // 2:d] = x1 * sin + x2 * cos
        return out

    def _rope_table(self, pos: np.ndarray, base: float) -> np.ndarray:
        """``[B, d]``: cos of each pair's angle, then its sin — read off :meth:`_rope` applied to
        the unit vector (1, 0) of every pair, so the C kernel rotates exactly as ``_rope`` does."""
        c = self.cfg
        d = c.rope_dims
        probe = np.zeros((len(pos), 1, c.head_dim), dtype=np.float32)
        first = probe[..., 0:d:2] if c.rope_traditional else probe[..., : d // 2]
        first[...] = 1.0
        out = self._rope(probe, pos, base)[:, 0, :]
        if c.rope_traditional:
            cos, sin = out[:, 0:d:2], out[:, 1:d:2]
        else:
            cos, sin = out[:, : d // 2], out[:, d // 2:d]
        return np.ascontiguousarray(np.concatenate([cos, sin], axis=1), dtype=np.float32)

    def _attend_q8(self, A, P, at, cap_ptr, cpos, L, B: int) -> None:
        """``attend_q8`` over the layer's 8-bit planes ``at`` (K codes, K scales, V codes, V scales),
        q, k and v rotated before it and the heads' outputs after it for ``q8-rotated``."""
        c = self.cfg
        H, Hkv, D = c.n_heads, c.n_kv_heads, c.head_dim
        if self.rotation is not None:
            qkv = A["qkv"][:B].reshape(B * (H + 2 * Hkv), D)
            qkv[...] = qkv @ self.rotation
        self.ops.attend_q8(P["qkv"], (H + 2 * Hkv) * D, *at, cap_ptr, cpos, L["window"], P["att"], B, H, Hkv, D,
                           self.codec.group, L["scale"])
        if self.rotation is not None:
            att = A["att"][:B].reshape(B * H, D)
            att[...] = att @ self.rotation

    def _rows(self, tokens: np.ndarray, caches: list, pos: np.ndarray, logits_from: int) -> np.ndarray:
        """The forward pass of ``B`` rows, row ``b`` being token ``tokens[b]`` at position
        ``pos[b]`` of ``caches[b]`` (whose K/V it writes); the logits of rows ``logits_from..B-1``."""
        c, ops = self.cfg, self.ops
        B = len(caches)
        ws = self._workspace(B)
        A, P = ws.arrays, ws.ptr
        x = A["x"][:B]
        self.embed(tokens.astype(np.intp), x)
        if c.embed_scale != 1.0:
            x *= np.float32(c.embed_scale)
        ptrs, cap, base = self._kv_addresses(caches, len(self.layers))
        planes, step = [p.ctypes.data for p in ptrs], B * 8
        cap_at, base_at = cap.ctypes.data, base.ctypes.data
        cpos_arr = np.ascontiguousarray(pos, dtype=np.int32)
        cpos = cpos_arr.ctypes.data
        H, Hkv, D, d = c.n_heads, c.n_kv_heads, c.head_dim, c.rope_dims
        hidden, eps, qs = c.hidden, c.norm_eps, (H + 2 * Hkv) * D
        tables = {base: self._rope_table(pos, base) for base in {L["base"] for L in self.layers}}
        table_ptr = {base: t.ctypes.data for base, t in tables.items()}
        ops.rms_norm(P["x"], hidden, self.layers[0]["attn_norm"].ptr, P["h"], hidden, B, 1, hidden, eps)
        for li, L in enumerate(self.layers):
            L["qkv"].run(A["h"], P["h"], A["qkv"], P["qkv"], B)
            if c.qk_norm:
                ops.rms_norm(P["qkv"], qs, L["q_norm"].ptr, P["qkv"], qs, B, H, D, eps)
                k_at = P["qkv"] + 4 * H * D
                ops.rms_norm(k_at, qs, L["k_norm"].ptr, k_at, qs, B, Hkv, D, eps)
            ops.rope(P["qkv"], qs, table_ptr[L["base"]], B, H + Hkv, D, d, int(c.rope_traditional))
            at = [p + li * step for p in planes]
            if self.codec is None:
                # attend_layer over one piece a head: attend's arithmetic, the window's buffer read from its base
                ops.attend_layer(P["qkv"], qs, *at, cap_at + li * B * 4, base_at + li * B * 4, cpos, L["window"],
                                 P["att"], B, H, Hkv, D, 1, 1, L["scale"])
            else:
                self._attend_q8(A, P, at, cap_at + li * B * 4, cpos, L, B)
            L["o"].run(A["att"], P["att"], A["o"], P["o"], B)
            if c.sandwich_norms:
                ops.rms_norm(P["o"], hidden, L["post_attn"].ptr, P["o"], hidden, B, 1, hidden, eps)
            ops.add_rms(P["x"], P["o"], B * hidden, L["ffn_norm"].ptr, P["h"], B, hidden, eps)
            if "moe" in L:
                L["moe"].run(A["h"][:B], A["f"][:B])
            else:
                L["gate_up"].run(A["h"], P["h"], A["gu"], P["gu"], B)
                ops.glu(P["gu"], P["a"], B, self.ffn, L["act"])
                L["down"].run(A["a"], P["a"], A["f"], P["f"], B)
            if c.sandwich_norms:
                ops.rms_norm(P["f"], hidden, L["post_ffn"].ptr, P["f"], hidden, B, 1, hidden, eps)
            nxt = self.layers[li + 1]["attn_norm"] if li + 1 < len(self.layers) else self.norm
            ops.add_rms(P["x"], P["f"], B * hidden, nxt.ptr, P["h"], B, hidden, eps)
        rows = B - logits_from
        logits = np.empty((rows, self.lm_head.out), dtype=np.float32)
        h_at = P["h"] + 4 * (B - rows) * c.hidden
        self.lm_head.run(A["h"][B - rows:B], h_at, logits, logits.ctypes.data, rows)
        if c.final_softcap:
            logits = (np.tanh(logits / c.final_softcap) * c.final_softcap).astype(np.float32)
        return logits
