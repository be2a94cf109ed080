"""A host (numpy + C kernel) decode step for decoder models on the CPU backend.

On MLX's CPU backend every small op costs 25–300 µs of dispatch (``rms_norm`` on 576
values: ~110–290 µs), so a SmolLM2 decode step spent about two thirds of its time outside
the matvecs. For decode (a few rows) this module runs the same graph in numpy, with the
quantized matvecs in ``hf2q.kernels.cpu_qmatvec`` and the KV written straight into the
MLX cache buffers through writable zero-copy views. Prefill stays on MLX (large, BLAS
bound). It covers dense families (llama, qwen3, gemma3); anything it does not know
(MoE, non-float activations) reports ``supported() == False`` and the MLX path runs.
Tests compare both paths token for token.
"""

from __future__ import annotations

import math
import os

import mlx.core as mx
import numpy as np

from hf2q.engine.layers import GatedMLP, Linear, gelu_tanh, silu


def _np(a: mx.array) -> np.ndarray:
    mx.eval(a)
    v = np.asarray(memoryview(a))
    if v.shape != tuple(a.shape):
        raise ValueError("non-contiguous MLX buffer")
    return v


class HostLinear:
    def __init__(self, lin: Linear):
        self.lin = lin
        self.float_w = None if lin.quantized else _np(lin.weight)
        self.bias = None if lin.bias is None else _np(lin.bias)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.float_w is not None:
            y = x @ self.float_w.T
        else:
            from hf2q.kernels.cpu_qmatvec import qmatvec

            packed, sc, bi, bits = self.lin._host
            y = qmatvec(packed, sc, bi, x, bits)
        return y + self.bias if self.bias is not None else y


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * w


class HostDecoder:
    def __init__(self, model):
        self.model = model
        cfg = model.cfg
        self.cfg = cfg
        self.embed = model.embed
        self.lm_head = HostLinear(model.lm_head)
        self.norm = _np(model.norm)
        self.layers = []
        for layer in model.layers:
            a, f = layer.attn, layer.ffn
            entry = {
                "attn_norm": _np(layer.attn_norm), "ffn_norm": _np(layer.ffn_norm),
                "q": HostLinear(a.q), "k": HostLinear(a.k), "v": HostLinear(a.v), "o": HostLinear(a.o),
                "gate": HostLinear(f.gate), "up": HostLinear(f.up), "down": HostLinear(f.down),
                "act": f.act, "window": a.window, "base": a.base, "scale": a.scale,
            }
            if cfg.qk_norm:
                entry["q_norm"], entry["k_norm"] = _np(a.q_norm), _np(a.k_norm)
            if cfg.sandwich_norms:
                entry["post_attn"], entry["post_ffn"] = _np(layer.post_attn_norm), _np(layer.post_ffn_norm)
            self.layers.append(entry)

    @staticmethod
    def supported(model) -> bool:
        if os.environ.get("HF2Q_NO_HOST_DECODE") or mx.default_device() != mx.cpu:
            return False
        if getattr(model, "dtype", None) != mx.float32 or not hasattr(model, "layers"):
            return False
        for layer in model.layers:
            f = layer.ffn
            if not isinstance(f, GatedMLP) or f.act not in (silu, gelu_tanh):
                return False
            lins = [layer.attn.q, layer.attn.k, layer.attn.v, layer.attn.o, f.gate, f.up, f.down, model.lm_head]
            # wrapped layers (e.g. tensor-parallel RowParallel with an all_sum) keep the MLX graph
            if any(not isinstance(lin, Linear) or (lin.quantized and lin._host is None) for lin in lins):
                return False
        return True

    def _rope(self, x: np.ndarray, pos: np.ndarray, base: float) -> np.ndarray:
        """x [B, H, D] at positions pos [B]; same conventions as ``mx.fast.rope``."""
        c = self.cfg
        d = c.rope_dims
        inv = base ** (-np.arange(0, d // 2, dtype=np.float64) * 2.0 / d)
        ang = (pos.astype(np.float64)[:, None] * c.rope_scale) * inv[None, :]  # [B, d/2]
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

    def step(self, tokens: np.ndarray, caches) -> np.ndarray:
        """One decode step for ``len(caches)`` sequences; returns float32 logits ``[N, vocab]``."""
        c = self.cfg
        B = len(caches)
        pos = np.array([s.length for s in caches])
        for s, p in zip(caches, pos):
            s.reserve(int(p) + 1)
        x = np.array(self.embed.rows(mx.array(tokens.astype(np.int32))), dtype=np.float32).reshape(B, -1)
        if c.embed_scale != 1.0:
            x *= np.float32(c.embed_scale)
        H, Hkv, D = c.n_heads, c.n_kv_heads, c.head_dim
        rep = H // Hkv
        eps = c.norm_eps
        for li, L in enumerate(self.layers):
            h = _rms(x, L["attn_norm"], eps)
            q = L["q"](h).reshape(B, H, D)
            k = L["k"](h).reshape(B, Hkv, D)
            v = L["v"](h).reshape(B, Hkv, D)
            if c.qk_norm:
                q = _rms(q, L["q_norm"], eps)
                k = _rms(k, L["k_norm"], eps)
            q = self._rope(q, pos, L["base"])
            k = self._rope(k, pos, L["base"])
            att = np.empty((B, H, D), dtype=np.float32)
            for b, s in enumerate(caches):
                p = int(pos[b])
                K = _np(s.keys[li])
                V = _np(s.values[li])
                K[:, p, :] = k[b]
                V[:, p, :] = v[b]
                lo = 0 if L["window"] is None else max(0, p + 1 - L["window"])
                Kb, Vb = K[:, lo:p + 1, :], V[:, lo:p + 1, :]  # [Hkv, n, D]
                qb = q[b].reshape(Hkv, rep, D) * np.float32(L["scale"])
                sc = np.matmul(qb, Kb.transpose(0, 2, 1))  # [Hkv, rep, n]
                sc -= sc.max(axis=-1, keepdims=True)
                np.exp(sc, out=sc)
                sc /= sc.sum(axis=-1, keepdims=True)
                att[b] = np.matmul(sc, Vb).reshape(H, D)
            o = L["o"](att.reshape(B, H * D))
            if c.sandwich_norms:
                o = _rms(o, L["post_attn"], eps)
            x = x + o
            h = _rms(x, L["ffn_norm"], eps)
            g, u = L["gate"](h), L["up"](h)
            if L["act"] is silu:
                a = g / (1.0 + np.exp(-g)) * u
            else:
                a = 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g * g * g))) * u
            f = L["down"](a.astype(np.float32))
            if c.sandwich_norms:
                f = _rms(f, L["post_ffn"], eps)
            x = x + f
        logits = self.lm_head(_rms(x, self.norm, eps).astype(np.float32))
        if c.final_softcap:
            logits = np.tanh(logits / c.final_softcap) * c.final_softcap
        for s in caches:
            s.advance(1)
        return logits.astype(np.float32)
