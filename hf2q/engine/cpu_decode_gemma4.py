"""Gemma 4's decode step on the host (C kernels over numpy buffers), beside :mod:`hf2q.engine.cpu_decode`'s.

The dense families' host step assumes one head shape, one MLP width and a cache that keeps every position;
Gemma 4 has none of these: its sliding and global layers differ in head size, KV heads and RoPE (the global
layers' proportional RoPE with per-pair periods), E2B/E4B widen the MLP of their KV-shared layers, those layers
attend over an earlier layer's cache, and the sliding layers' buffers hold only the window
(``kv_cache.SlidingWindow``: positions from ``window.base``). So each layer here keeps its own geometry, its
buffers are views of the widest layer's, and its attention is ``cpu_decode_ops.attend_layer`` over the cache as
the MLX graph stores it (each head in cache-sized pieces, a window buffer from its base), which keeps the
window's memory bound and the graph path's prefix reuse and persistence: both paths read and write the same
buffers. Per-layer embeddings (E2B/E4B) and the 26B-A4B experts beside the dense MLP (``expert_route.host_glu``)
run here too. The step follows ``models/gemma4.py`` op for op; tests hold the two together token for token.
"""

from __future__ import annotations

import math
import os

import mlx.core as mx
import numpy as np

from hf2q.engine.cpu_decode import (HostEmbedding, HostProjection, HostRouter, HostRows, _host_readable, _np,
                                    _Vec)
from hf2q.engine.layers import Linear, gelu_tanh


def _ones(n: int) -> _Vec:
    return _Vec(mx.ones((n,), mx.float32))


def _rope_kind(s) -> str:
    """A layer's RoPE: the sliding layers' base, or the global layers' per-pair periods."""
    return "swa" if s.rope_base is not None else "full"


def _view(ws, name: str, B: int, width: int) -> tuple[np.ndarray, int]:
    """A C-contiguous ``[B, width]`` view at the start of work buffer ``name`` and its address."""
    return ws.arrays[name].reshape(-1)[:B * width].reshape(B, width), ws.ptr[name]


class _Experts:
    """26B-A4B's routed experts of one layer: the router over the weightless-normed residual, softmax, top-k
    renormalised and scaled per expert, then the pairs through ``host_glu`` (GeGLU-tanh) — ``Gemma4Experts``."""

    def __init__(self, e, ops, hidden: int):
        self.ops = ops
        self.router = HostRouter(e.router, e.top_k, normalize=True)
        #: the router's input norm: weightless, then × ``ffn_gate_inp.scale`` × hidden^-½, as one weight
        self.router_norm = _Vec(e.router_scale.astype(mx.float32) * (hidden ** -0.5))
        self.pre_norm = _Vec(e.pre_norm)
        self.expert_scale = _np(e.expert_scale).astype(np.float32).reshape(-1)
        self.gate_up, self.down = e.gate_up_exps.expert_stack(), e.down_exps.expert_stack()
        self.eps, self.n_experts = e.eps, int(e.gate_up_exps.shape[0])

    @staticmethod
    def takes(e) -> bool:
        return (e is not None and e.share is None and _host_readable(e.router)
                and e.gate_up_exps.expert_stack() is not None and e.down_exps.expert_stack() is not None)

    def run(self, x: np.ndarray) -> np.ndarray:
        """The experts' weighted sum ``[B, hidden]`` for the residual rows ``x [B, hidden]``."""
        from hf2q.engine.expert_route import HostSort, host_glu

        B, hidden = x.shape
        ops = self.ops
        routed = np.empty_like(x)
        ops.rms_norm(x.ctypes.data, hidden, self.router_norm.ptr, routed.ctypes.data, hidden, B, 1, hidden, self.eps)
        idx, weights = self.router(routed)
        weights = weights * self.expert_scale[idx]
        normed = np.empty_like(x)
        ops.rms_norm(x.ctypes.data, hidden, self.pre_norm.ptr, normed.ctypes.data, hidden, B, 1, hidden, self.eps)
        return host_glu(normed, HostSort.of(idx, self.n_experts), self.router.top_k, weights, self.gate_up, self.down,
                        ops, 1)


class HostGemma4(HostRows):
    """Gemma 4's decode step on the host (see the module docstring)."""

    #: the runner keeps the sliding layers' K/V to the window with this step (the dense one addresses every position)
    keeps_windows = True

    def __init__(self, model):
        from hf2q.kernels.cpu_decode_ops import library

        self.ops = library()
        self.model = model
        c = self.cfg = model.cfg
        self.embed = HostEmbedding(model.embed)
        self.lm_head = HostProjection([model.lm_head])
        self.norm = _Vec(model.norm)
        self.layers = []
        ones: dict[int, _Vec] = {}
        for i, (block, s) in enumerate(zip(model.blocks, model.shapes)):
            a, f = block.attn, block.ffn
            L = {"attn_norm": _Vec(block.attn_norm), "post_attn": _Vec(block.post_attn_norm),
                 "ffn_norm": _Vec(block.ffn_norm), "post_ffn": _Vec(block.post_ffn_norm), "q_norm": _Vec(a.q_norm),
                 "D": s.head_dim, "n_kv": s.n_kv, "rot": s.rope_dims, "window": s.window or 0, "src": s.kv_source,
                 "owns": a.owns_kv, "pieces": a.pieces, "rope": _rope_kind(s),
                 "o": HostProjection([a.o]), "gate_up": HostProjection([f.gate, f.up]),
                 "down": HostProjection([f.down]), "F": int(f.gate.shape[0]),
                 "scale": None if block.out_scale is None else float(_np(block.out_scale).reshape(-1)[0])}
            if a.owns_kv:
                L["proj"] = HostProjection([a.q, a.k] + ([a.v] if a.v is not None else []))
                L["k_norm"], L["k_as_v"] = _Vec(a.k_norm), a.v is None
                L["v_norm"] = ones.setdefault(s.head_dim, _ones(s.head_dim))
            else:
                L["proj"] = HostProjection([a.q])
            if block.experts is not None:
                L["experts"] = _Experts(block.experts, self.ops, c.hidden)
                L["post_mlp"], L["post_experts"] = _Vec(block.post_mlp_norm), _Vec(block.post_experts_norm)
            if block.ple_gate is not None:
                L["ple_gate"], L["ple_proj"] = HostProjection([block.ple_gate]), HostProjection([block.ple_proj])
                L["ple_norm"] = _Vec(block.ple_norm)
            self.layers.append(L)
        #: per RoPE kind, each rotated pair's angle per position (float64): base^(-2i/d) for the sliding layers,
        #: 1 / the per-pair periods of ``rope_freqs`` for the global ones
        self.ropes = {_rope_kind(s): (
            s.rope_base ** (-np.arange(0, s.rope_dims // 2, dtype=np.float64) * 2.0 / s.rope_dims)
            if s.rope_base is not None else 1.0 / np.asarray(s.rope_periods, dtype=np.float64)) for s in model.shapes}
        H = c.n_heads
        self.ple = None
        if c.ple_dim:
            self.ple = (HostEmbedding(model.ple_embed), HostProjection([model.ple_model_proj]),
                        _Vec(model.ple_proj_norm))
        qkv = max((H + 2 * L["n_kv"]) * L["D"] for L in self.layers)
        ffn = max(L["F"] for L in self.layers)
        self.sizes = {"x": c.hidden, "h": c.hidden, "qkv": qkv, "part": qkv, "att": max(H * L["D"] for L in self.layers),
                      "o": c.hidden, "gu": 2 * ffn, "a": ffn, "f": c.hidden}
        if c.ple_dim:
            self.sizes.update(ple=c.n_layers * c.ple_dim, ple_own=c.n_layers * c.ple_dim, pgu=2 * c.ple_dim,
                              pa=c.ple_dim)
        for L in self.layers:  # a projection writes its full width into a view of this width: check once
            kv_rows = (1 if L["k_as_v"] else 2) if L["owns"] else 0  # k and v, k alone, none (KV-shared)
            want = (H + kv_rows * L["n_kv"]) * L["D"]
            if L["proj"].out != want or L["gate_up"].out != 2 * L["F"] or L["o"].out != c.hidden:
                raise ValueError("host decode: a Gemma 4 layer's projections do not match its shape")

    @staticmethod
    def supported(model, codec=None) -> bool:
        from hf2q.engine.models.gemma4 import Gemma4Model

        if type(model) is not Gemma4Model or codec is not None:
            return False
        if os.environ.get("HF2Q_NO_HOST_DECODE") or mx.default_device() != mx.cpu or model.dtype != mx.float32:
            return False
        from hf2q.kernels.cpu_decode_ops import library

        if library() is None:
            return False
        c = model.cfg
        for block, s in zip(model.blocks, model.shapes):
            a, f = block.attn, block.ffn
            if s.rope_dims % 2 or s.rope_dims > s.head_dim or c.n_heads % s.n_kv or f.act is not gelu_tanh:
                return False
            lins = [*a.linears(), f.gate, f.up, f.down, model.lm_head]
            if block.ple_gate is not None:
                lins += [block.ple_gate, block.ple_proj]
            if block.experts is not None and not _Experts.takes(block.experts):
                return False
            if block.tp_group is not None or not all(map(_host_readable, lins)):
                return False
        return not c.ple_dim or _host_readable(model.ple_model_proj)

    def _tables(self, pos: np.ndarray) -> dict[str, tuple[np.ndarray, int]]:
        """Per RoPE kind, ``[B, d]`` cos then sin of each pair's angle at ``pos`` (NeoX pairs ``(i, i + d/2)``)."""
        out = {}
        for kind, inv in self.ropes.items():
            ang = pos.astype(np.float64)[:, None] * inv[None, :]
            t = np.ascontiguousarray(np.concatenate([np.cos(ang), np.sin(ang)], axis=1), dtype=np.float32)
            out[kind] = (t, t.ctypes.data)
        return out

    def _rows(self, tokens: np.ndarray, caches: list, pos: np.ndarray, logits_from: int) -> np.ndarray:
        c, ops = self.cfg, self.ops
        B, H, hidden, eps = len(caches), c.n_heads, c.hidden, c.norm_eps
        ws = self._workspace(B)
        A, P = ws.arrays, ws.ptr
        x, h = A["x"][:B], A["h"][:B]
        self.embed(tokens.astype(np.intp), x)
        x *= np.float32(math.sqrt(hidden))
        ple = None
        if self.ple is not None:
            ple = self._ple_inputs(tokens, x, ws, B)
        ptrs, cap, base = self._kv_addresses(caches, c.n_kv_layers)
        kv_at = [p.ctypes.data for p in ptrs] + [cap.ctypes.data, base.ctypes.data]
        tables = self._tables(pos)
        cpos_arr = np.ascontiguousarray(pos, dtype=np.int32)
        cpos = cpos_arr.ctypes.data
        o, f = A["o"][:B], A["f"][:B]
        for i, L in enumerate(self.layers):
            D, n_kv = L["D"], L["n_kv"]
            qs = (H + 2 * n_kv) * D if L["owns"] else H * D  # a KV-shared layer's row holds q alone
            qkv, qkv_p = _view(ws, "qkv", B, qs)
            att, att_p = _view(ws, "att", B, H * D)
            ops.rms_norm(P["x"], hidden, L["attn_norm"].ptr, P["h"], hidden, B, 1, hidden, eps)
            if L["owns"]:
                width = L["proj"].out
                if width == qs:
                    L["proj"].run(h, P["h"], qkv, qkv_p, B)
                else:  # K as V: q|k into the row, the raw k copied to the v slot before its norm
                    part, part_p = _view(ws, "part", B, width)
                    L["proj"].run(h, P["h"], part, part_p, B)
                    qkv[:, :width] = part
                    qkv[:, width:] = part[:, H * D:]
                k_at, v_at = qkv_p + 4 * H * D, qkv_p + 4 * (H + n_kv) * D
                ops.rms_norm(k_at, qs, L["k_norm"].ptr, k_at, qs, B, n_kv, D, eps)
                ops.rms_norm(v_at, qs, L["v_norm"].ptr, v_at, qs, B, n_kv, D, eps)
            else:
                L["proj"].run(h, P["h"], qkv, qkv_p, B)
            ops.rms_norm(qkv_p, qs, L["q_norm"].ptr, qkv_p, qs, B, H, D, eps)
            table, table_p = tables[L["rope"]]
            ops.rope(qkv_p, qs, table_p, B, H + (n_kv if L["owns"] else 0), D, L["rot"], 0)
            kp, vp, cap_at, base_at = (a + L["src"] * B * w for a, w in zip(kv_at, (8, 8, 4, 4)))  # the source's row
            ops.attend_layer(qkv_p, qs, kp, vp, cap_at, base_at, cpos, L["window"], att_p, B, H, n_kv, D, L["pieces"],
                             int(L["owns"]), 1.0)
            L["o"].run(att, att_p, o, P["o"], B)
            ops.rms_norm(P["o"], hidden, L["post_attn"].ptr, P["o"], hidden, B, 1, hidden, eps)
            ops.add_rms(P["x"], P["o"], B * hidden, L["ffn_norm"].ptr, P["h"], B, hidden, eps)
            F = L["F"]
            gu, gu_p = _view(ws, "gu", B, 2 * F)
            a, a_p = _view(ws, "a", B, F)
            L["gate_up"].run(h, P["h"], gu, gu_p, B)
            ops.glu(gu_p, a_p, B, F, 1)
            L["down"].run(a, a_p, f, P["f"], B)
            if "experts" in L:
                e = L["experts"].run(x)
                ops.rms_norm(P["f"], hidden, L["post_mlp"].ptr, P["f"], hidden, B, 1, hidden, eps)
                ops.rms_norm(e.ctypes.data, hidden, L["post_experts"].ptr, e.ctypes.data, hidden, B, 1, hidden, eps)
                f += e
            ops.rms_norm(P["f"], hidden, L["post_ffn"].ptr, P["f"], hidden, B, 1, hidden, eps)
            x += f
            if ple is not None:
                self._ple_block(L, ple[:, i], ws, B)
            if L["scale"] is not None:
                x *= np.float32(L["scale"])
        rows = B - logits_from
        ops.rms_norm(P["x"] + 4 * (B - rows) * hidden, hidden, self.norm.ptr, P["h"], hidden, rows, 1, hidden, eps)
        logits = np.empty((rows, self.lm_head.out), dtype=np.float32)
        self.lm_head.run(A["h"][:rows], P["h"], logits, logits.ctypes.data, rows)
        if c.final_softcap:
            logits = (np.tanh(logits / c.final_softcap) * c.final_softcap).astype(np.float32)
        return logits

    def _ple_inputs(self, tokens: np.ndarray, x: np.ndarray, ws, B: int) -> np.ndarray:
        """E2B/E4B's per-layer inputs ``[B, layers, ple_dim]`` (``Gemma4Model.per_layer_inputs``)."""
        c, ops = self.cfg, self.ops
        embed, proj, norm = self.ple
        n = c.n_layers * c.ple_dim
        own = ws.arrays["ple_own"][:B]
        embed(tokens.astype(np.intp), own)
        own *= np.float32(math.sqrt(c.ple_dim))
        p, p_ptr = ws.arrays["ple"][:B], ws.ptr["ple"]
        proj.run(x, x.ctypes.data, p, p_ptr, B)
        p *= np.float32(c.hidden ** -0.5)
        ops.rms_norm(p_ptr, n, norm.ptr, p_ptr, n, B, c.n_layers, c.ple_dim, c.norm_eps)
        p += own
        p *= np.float32(2 ** -0.5)
        return p.reshape(B, c.n_layers, c.ple_dim)

    def _ple_block(self, L: dict, inp: np.ndarray, ws, B: int) -> None:
        """``x += norm(proj(gelu(gate·x) · inp))``: the block's per-layer-input tail."""
        c, ops = self.cfg, self.ops
        d, A, P = c.ple_dim, ws.arrays, ws.ptr
        gu, gu_p = _view(ws, "pgu", B, 2 * d)
        a, a_p = _view(ws, "pa", B, d)
        g, g_p = _view(ws, "pa", B, d)
        L["ple_gate"].run(A["x"][:B], P["x"], g, g_p, B)
        gu[:, :d] = g
        gu[:, d:] = inp
        ops.glu(gu_p, a_p, B, d, 1)
        L["ple_proj"].run(a, a_p, A["o"][:B], P["o"], B)
        ops.rms_norm(P["o"], c.hidden, L["ple_norm"].ptr, P["o"], c.hidden, B, 1, c.hidden, c.norm_eps)
        A["x"][:B] += A["o"][:B]
