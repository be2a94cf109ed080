"""A numpy nomic-bert-moe encoder written from llama.cpp's graph (src/models/bert.cpp, build_moe_ffn).

Independent of the engine: the raw tensor bytes decoded by gguf-py's dequantizer, every step in
float64. Token-type row 0 added to the token embeddings, LayerNorm; per block fused QKV (+ bias),
NeoX rotary Q/K, softmax attention, output projection (+ bias), residual and LayerNorm, then the
MLP — blocks ``i % moe_every == 1``: softmax router probabilities, the top ``expert_used_count``
experts ``down(gelu(up·x))`` summed by their probabilities; the others ``down(gelu(up·x + b)) + b``
(tanh GELU, ggml_gelu's) — residual and LayerNorm; mean over the tokens, L2 norm.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np


def _weights(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    from hf2q.formats.gguf_file import open_gguf  # the file parser only (gguf-py's reader is slow on 250k pieces)

    g = open_gguf(path)
    w = {name: gguf.quants.dequantize(np.asarray(t.data), t.qtype).reshape(t.shape).astype(np.float64)
         for name, t in g.tensors.items()}
    return w, g.metadata


def _norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _gelu(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _rope_neox(x, base):  # x [L, H, hd]
    L, _, hd = x.shape
    half = hd // 2
    theta = np.arange(L)[:, None] * base ** (-np.arange(half) * 2.0 / hd)[None, :]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


class NomicMoeReference:
    def __init__(self, path: Path):
        self.w, meta = _weights(path)
        K, a = gguf.Keys, meta[gguf.Keys.General.ARCHITECTURE]
        self.n_layer = meta[K.LLM.BLOCK_COUNT.format(arch=a)]
        self.n_head = meta[K.Attention.HEAD_COUNT.format(arch=a)]
        self.eps = meta[K.Attention.LAYERNORM_EPS.format(arch=a)]
        self.base = meta[K.Rope.FREQ_BASE.format(arch=a)]
        self.top_k = meta[K.LLM.EXPERT_USED_COUNT.format(arch=a)]
        self.every = meta[K.LLM.MOE_EVERY_N_LAYERS.format(arch=a)]

    def embed(self, ids: list[int]) -> np.ndarray:
        w, eps = self.w, self.eps
        types = w["token_types.weight"].reshape(-1, w["token_embd.weight"].shape[1])
        x = _norm(w["token_embd.weight"][ids] + types[0], w["token_embd_norm.weight"], w["token_embd_norm.bias"], eps)
        L, D = x.shape
        hd = D // self.n_head
        for i in range(self.n_layer):
            p = f"blk.{i}."
            qkv = x @ w[p + "attn_qkv.weight"].T + w[p + "attn_qkv.bias"]
            q, k, v = (qkv[:, j * D:(j + 1) * D].reshape(L, self.n_head, hd) for j in range(3))
            q, k = _rope_neox(q, self.base), _rope_neox(k, self.base)
            s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
            s = np.exp(s - s.max(-1, keepdims=True))
            att = np.einsum("hqk,khd->qhd", s / s.sum(-1, keepdims=True), v).reshape(L, D)
            x = _norm(x + att @ w[p + "attn_output.weight"].T + w[p + "attn_output.bias"],
                      w[p + "attn_output_norm.weight"], w[p + "attn_output_norm.bias"], eps)
            if self.every and i % self.every == 1:
                logits = x @ w[p + "ffn_gate_inp.weight"].T
                probs = np.exp(logits - logits.max(-1, keepdims=True))
                probs /= probs.sum(-1, keepdims=True)
                ffn = np.zeros_like(x)
                for t in range(L):
                    for e in np.argsort(-probs[t], kind="stable")[:self.top_k]:
                        h = _gelu(w[p + "ffn_up_exps.weight"][e] @ x[t])
                        ffn[t] += probs[t, e] * (w[p + "ffn_down_exps.weight"][e] @ h)
            else:
                h = _gelu(x @ w[p + "ffn_up.weight"].T + w[p + "ffn_up.bias"])
                ffn = h @ w[p + "ffn_down.weight"].T + w[p + "ffn_down.bias"]
            x = _norm(x + ffn, w[p + "layer_output_norm.weight"], w[p + "layer_output_norm.bias"], eps)
        pooled = x.mean(0)
        return pooled / np.linalg.norm(pooled)
