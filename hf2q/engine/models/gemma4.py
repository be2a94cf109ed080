"""Gemma 4 text (``gemma4``: dense 31B-style, E2B/E4B, 26B-A4B MoE): Gemma 3's sandwich-norm decoder
with layers of two shapes.

What differs from Gemma 3 (``models/gemma3.py``):

* **Two layer kinds.** ``attention.sliding_window_pattern`` (one flag per layer) marks the sliding
  layers: their own head size (``key_length_swa``), KV heads (the per-layer ``head_count_kv``
  array), rope base (``freq_base_swa``) and rotary dims (``dimension_count_swa``). The global
  layers use ``key_length``, ``freq_base`` and proportional RoPE: all ``key_length`` dims in the
  NeoX layout with the per-pair divisors of ``rope_freqs.weight`` (1 for the rotated pairs, a huge
  number that freezes the rest), as llama.cpp applies them.
* **K as V.** A layer without ``attn_v`` uses its key projection as the values (``attention_k_eq_v``).
* **Norms.** q/k RMSNorm with weights, V normalised without a weight; the converter stores every
  norm weight as the multiplier itself, so the plain RMSNorm applies. Attention scale is 1.0 (the
  q/k norms set the logit scale).
* **Layer output scale.** Each block's output is multiplied by ``layer_output_scale``.
* √hidden embedding scale, GeGLU-tanh MLP (per-layer widths: E2B's double-wide MLP), final norm,
  final logit soft-cap, tied output.
* **KV-shared layers** (E2B/E4B: the last ``attention.shared_kv_layers``) have no K/V of their own: they
  attend over this forward's keys/values of the last earlier layer of their kind, so the cache holds
  K/V for the other layers only.
* **Per-layer embeddings** (E2B/E4B): a per-layer input per token from ``per_layer_token_embd`` and a
  projection of the embedding (:meth:`Gemma4Model.per_layer_inputs`); each block ends with
  ``x + norm(proj(gelu(inp_gate·x) · input))`` before its output scale.

The slot KV cache is one ``[kv_heads, capacity, head_dim]`` layout for every layer; layers of
different shapes are stored in it by splitting each head into ``head_dim``-sized pieces (the smallest
head size of the model) and padding the piece count to the largest layer's. The sliding layers keep
only their window (``kv_cache.SlidingWindow``, :attr:`Gemma4Model.sliding_window_layers`): a slot's K/V
for them stays bounded however long its context, and prefix reuse returns to the reuse points the
window buffer still covers (docs/ENGINE.md, "Sliding-window layers").

* **Experts** (26B-A4B): :class:`Gemma4Experts` beside the dense MLP, each with its own post-norm,
  summed before the block's feed-forward post-norm (at tensor parallel: split by expert, both halves'
  partial sums reduced together before their norms, :meth:`Gemma4Block.tp_experts`).
"""

from __future__ import annotations

import math

import attrs
import mlx.core as mx
import numpy as np

from hf2q.engine.expert_route import ExpertRoute
from hf2q.engine.kv_cache import ForwardBatch
from hf2q.engine.layers import Linear, float_array, gelu_tanh, rms_norm
from hf2q.engine.models.decoder import _norm, distinct_nbytes
from hf2q.engine.models.llama import gated_mlp
from hf2q.engine.tp_shards import own_experts
from hf2q.errors import InputError
from hf2q.formats.gguf_file import GGUFFile
from hf2q.formats.gguf_keys import Keys
from hf2q.kernels import cpu_ops

_A, _L, _R = Keys.Attention, Keys.LLM, Keys.Rope


@attrs.define
class Gemma4Config:
    """What the runner reads off every model (``vocab``, ``n_ctx_train``) plus the shared scalars."""

    n_layers: int
    hidden: int
    n_heads: int
    vocab: int
    n_ctx_train: int
    norm_eps: float
    final_softcap: float | None
    cache_heads: int  # the KV cache layout every layer is stored in
    cache_dim: int
    n_kv_layers: int = 0  # layers that own K/V (the KV-shared ones come last and hold none)
    ple_dim: int = 0  # per-layer embedding width (E2B/E4B), 0 without


@attrs.define
class LayerShape:
    """One layer's attention geometry and RoPE."""

    sliding: bool
    n_kv: int
    head_dim: int
    rope_dims: int
    rope_base: float | None  # None when ``rope_periods`` holds the custom per-pair periods
    rope_periods: mx.array | None
    window: int | None
    kv_source: int  # the layer whose K/V this one attends over (itself, or an earlier one when KV-shared)


def _per_layer(value, n: int, what: str, name: str) -> list[int]:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * n
    if len(values) != n:
        raise InputError(f"{name}: {what} has {len(values)} entries for {n} layers")
    return [int(v) for v in values]


def layer_shapes(g: GGUFFile) -> list[LayerShape]:
    hp, name = g.hparams, g.path.name
    n = hp.n_layers
    pattern = hp.stored(_A.SLIDING_WINDOW_PATTERN)
    if not isinstance(pattern, list) or len(pattern) != n:
        raise InputError(f"{name}: {hp.key(_A.SLIDING_WINDOW_PATTERN)} must hold one flag per layer ({n})")
    kv = _per_layer(hp.n_kv_heads, n, hp.key(_A.HEAD_COUNT_KV), name)
    full_dim, swa_dim = int(hp.require(_A.KEY_LENGTH)), int(hp.require(_A.KEY_LENGTH_SWA))
    full_rot = int(hp.stored(_R.DIMENSION_COUNT) or full_dim)
    swa_rot = int(hp.stored(_R.DIMENSION_COUNT_SWA) or swa_dim)
    full_base, swa_base = float(hp.rope_base), float(hp.rope_base_swa)
    periods = None
    if not all(pattern):
        divisors = np.ones(full_rot // 2)
        if "rope_freqs.weight" in g.tensors:
            divisors = np.asarray(float_array(g.tensor("rope_freqs.weight"), mx.float32), np.float64).reshape(-1)
        exponents = np.arange(full_rot // 2, dtype=np.float64) * 2.0 / full_rot
        periods = mx.array((full_base ** exponents * divisors).astype(np.float32))
    window = hp.sliding_window
    first_shared = n - int(hp.stored(_A.SHARED_KV_LAYERS) or 0)
    sources = [i if i < first_shared else _kv_source(pattern, first_shared, i, name) for i in range(n)]
    return [LayerShape(True, kv[i], swa_dim, swa_rot, swa_base, None, window, sources[i]) if pattern[i]
            else LayerShape(False, kv[i], full_dim, full_rot, None, periods, None, sources[i]) for i in range(n)]


def _kv_source(pattern: list[bool], first_shared: int, i: int, name: str) -> int:
    """A KV-shared layer reads the last layer of its own kind before the shared ones."""
    for j in range(first_shared - 1, -1, -1):
        if pattern[j] == pattern[i]:
            return j
    raise InputError(f"{name}: KV-shared layer {i} has no earlier {'sliding' if pattern[i] else 'global'} layer "
                     "to read K/V from")


def cache_layout(shapes: list[LayerShape], name: str) -> tuple[int, int]:
    """``(heads, head_dim)`` of a cache every layer fits in: pieces of the smallest head size."""
    piece = min(s.head_dim for s in shapes)
    if any(s.head_dim % piece for s in shapes):
        raise InputError(f"{name}: head sizes {sorted({s.head_dim for s in shapes})} are not multiples of "
                         f"the smallest")
    return max(s.n_kv * s.head_dim // piece for s in shapes), piece


class Gemma4Attention:
    def __init__(self, cfg: Gemma4Config, shape: LayerShape, g: GGUFFile, i: int, dtype):
        p = f"blk.{i}."
        self.cfg, self.shape, self.layer = cfg, shape, i
        self.q = Linear(g.tensor(p + "attn_q.weight"), dtype)
        self.o = Linear(g.tensor(p + "attn_output.weight"), dtype)
        self.q_norm = _norm(g, p + "attn_q_norm.weight", dtype)
        self.owns_kv = shape.kv_source == i
        self.k = self.v = None
        if self.owns_kv:
            self.k = Linear(g.tensor(p + "attn_k.weight"), dtype)
            self.v = Linear(g.tensor(p + "attn_v.weight"), dtype) if p + "attn_v.weight" in g.tensors else None
            self.k_norm = _norm(g, p + "attn_k_norm.weight", dtype)
        self.pieces = shape.head_dim // cfg.cache_dim  # cache heads per KV head

    def linears(self):
        return tuple(lin for lin in (self.q, self.k, self.v, self.o) if lin is not None)

    def _rope(self, x: mx.array, offset) -> mx.array:
        s = self.shape
        return mx.fast.rope(x, s.rope_dims, traditional=False, base=s.rope_base, scale=1.0, offset=offset,
                            freqs=s.rope_periods)

    def _to_cache(self, x: mx.array) -> mx.array:
        """``[B, n_kv, T, d]`` → the cache layout ``[B, cache_heads, T, cache_dim]``."""
        B, H, T, D = x.shape
        c, m = self.cfg, self.pieces
        if m > 1:
            x = x.reshape(B, H, T, m, c.cache_dim).transpose(0, 1, 3, 2, 4).reshape(B, H * m, T, c.cache_dim)
        if H * m < c.cache_heads:
            x = mx.concatenate([x, mx.zeros((B, c.cache_heads - H * m, T, c.cache_dim), dtype=x.dtype)], axis=1)
        return x

    def _from_cache(self, x):
        """The cache layout back to ``[B, n_kv, T, ·]`` (each plane of an 8-bit cache on its own: a
        head's pieces of codes and of scales lie side by side, so its row is the pieces' rows joined)."""
        if isinstance(x, tuple):
            return tuple(self._from_cache(plane) for plane in x)
        s, m = self.shape, self.pieces
        B, _, L, D = x.shape
        x = x[:, :s.n_kv * m]
        if m > 1:
            x = x.reshape(B, s.n_kv, m, L, D).transpose(0, 1, 3, 2, 4).reshape(B, s.n_kv, L, m * D)
        return x

    def __call__(self, x: mx.array, fb: ForwardBatch, kv: dict[int, tuple[mx.array, mx.array]]) -> mx.array:
        """``kv``: this forward's keys/values per layer that owns them (a KV-shared layer reads its source's)."""
        c, s = self.cfg, self.shape
        B, L, _ = x.shape
        eps = c.norm_eps
        q = rms_norm(self.q(x).reshape(B, L, c.n_heads, s.head_dim), self.q_norm, eps)
        q = self._rope(q.transpose(0, 2, 1, 3), fb.offset)
        if self.owns_kv:
            k = self.k(x).reshape(B, L, s.n_kv, s.head_dim)
            v = self.v(x).reshape(B, L, s.n_kv, s.head_dim) if self.v is not None else k
            k = rms_norm(k, self.k_norm, eps)
            v = mx.fast.rms_norm(v, None, eps)
            k, v = self._rope(k.transpose(0, 2, 1, 3), fb.offset), v.transpose(0, 2, 1, 3)
            keys, values = fb.update(self.layer, self._to_cache(k), self._to_cache(v))
            kv[self.layer] = self._from_cache(keys), self._from_cache(values)
        keys, values = kv[s.kv_source]
        if fb.codec is not None:  # 8-bit planes (docs/ENGINE.md, "8-bit KV cache")
            out = fb.codec.attention(q, keys, values, 1.0, fb, s.window)
        elif cpu_ops.attention_on_host(q, keys.shape[2]):
            out = cpu_ops.attention(q, keys, values, 1.0, fb.mask_np(s.window))
        else:
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=1.0, mask=fb.mask(s.window))
        return self.o(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Gemma4Experts:
    """26B-A4B's routed experts beside the dense MLP.

    The router reads the block's residual ``x`` through a weightless RMSNorm, × ``ffn_gate_inp.scale``
    × hidden^-½; softmax over the experts, the top ``expert_used_count`` renormalised to sum to one and
    each multiplied by its expert's ``ffn_down_exps.scale``. The experts (GeGLU-tanh, gate and up fused
    in ``ffn_gate_up_exps`` as ``[gate; up]`` rows) read ``pre_ffw_norm_2(x)``; one ``gather_mm`` /
    ``gather_qmm`` per projection.

    Over tensor-parallel ranks (:meth:`Gemma4Block.tp_experts`) the expert tensors hold this rank's
    ``share`` ``(first, count)`` of the experts; routing stays whole (router and scales replicated), and a
    chosen expert another rank holds weighs 0 here, so the ranks' outputs sum to the model's."""

    share: tuple[int, int] | None = None

    def __init__(self, g: GGUFFile, i: int, dtype, top_k: int, eps: float):
        p = f"blk.{i}."
        self.router = Linear(g.tensor(p + "ffn_gate_inp.weight"), dtype)
        self.router_scale = _norm(g, p + "ffn_gate_inp.scale", dtype)
        self.expert_scale = _norm(g, p + "ffn_down_exps.scale", mx.float32)
        self.gate_up_exps = Linear(g.tensor(p + "ffn_gate_up_exps.weight"), dtype)
        self.down_exps = Linear(g.tensor(p + "ffn_down_exps.weight"), dtype)
        self.pre_norm = _norm(g, p + "pre_ffw_norm_2.weight", dtype)
        self.top_k, self.eps = top_k, eps

    def linears(self):
        return (self.router, self.gate_up_exps, self.down_exps)

    def __call__(self, x: mx.array) -> mx.array:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routed = mx.fast.rms_norm(flat, None, self.eps) * self.router_scale * (shape[-1] ** -0.5)
        probs = mx.softmax(self.router(routed).astype(mx.float32), axis=-1, precise=True)
        k = self.top_k
        idx = mx.stop_gradient(mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k])
        weights = mx.take_along_axis(probs, idx, axis=-1)
        weights = weights / weights.sum(axis=-1, keepdims=True) * self.expert_scale[idx]
        if self.share is not None:
            idx, weights = own_experts(idx, weights, *self.share)
        route = ExpertRoute.of(idx, self.gate_up_exps.shape[0])
        normed = rms_norm(flat, self.pre_norm, self.eps)
        return route.glu(normed, [self.gate_up_exps], self.down_exps, gelu_tanh, weights).reshape(shape)


class Gemma4Block:
    tp_group = None  # the tensor-parallel group a block with experts reduces its feed-forward over

    def __init__(self, cfg: Gemma4Config, shape: LayerShape, g: GGUFFile, i: int, dtype):
        p = f"blk.{i}."
        self.eps = cfg.norm_eps
        self.attn_norm = _norm(g, p + "attn_norm.weight", dtype)
        self.attn = Gemma4Attention(cfg, shape, g, i, dtype)
        self.post_attn_norm = _norm(g, p + "post_attention_norm.weight", dtype)
        self.ffn_norm = _norm(g, p + "ffn_norm.weight", dtype)
        self.ffn = gated_mlp(g, i, dtype, act=gelu_tanh)
        self.post_ffn_norm = _norm(g, p + "post_ffw_norm.weight", dtype)
        self.experts = None
        if p + "ffn_gate_inp.weight" in g.tensors:  # 26B-A4B: routed experts beside the dense MLP
            self.experts = Gemma4Experts(g, i, dtype, g.hparams.expert_used_count, cfg.norm_eps)
            self.post_mlp_norm = _norm(g, p + "post_ffw_norm_1.weight", dtype)
            self.post_experts_norm = _norm(g, p + "post_ffw_norm_2.weight", dtype)
        scale = p + "layer_output_scale.weight"
        self.out_scale = _norm(g, scale, dtype) if scale in g.tensors else None
        self.ple_gate = self.ple_proj = None
        if cfg.ple_dim:  # per-layer embeddings (E2B/E4B)
            self.ple_gate = Linear(g.tensor(p + "inp_gate.weight"), dtype)
            self.ple_proj = Linear(g.tensor(p + "proj.weight"), dtype)
            self.ple_norm = _norm(g, p + "post_norm.weight", dtype)

    def linears(self):
        ple = (self.ple_gate, self.ple_proj) if self.ple_gate is not None else ()
        experts = self.experts.linears() if self.experts is not None else ()
        return (*self.attn.linears(), self.ffn.gate, self.ffn.up, self.ffn.down, *ple, *experts)

    def tp_experts(self, group) -> None:
        """Over tensor-parallel ranks (``tensor_parallel.parallelize_block``): the shard's dense MLP (its
        ``ffn_down`` columns) and experts (this rank's, ``ffn_*_exps`` cut by expert) give partial sums, and
        each half has its own post-norm, so :meth:`feed_forward` reduces both in one ``all_sum`` before the
        norms: two all-reduces a block, as without experts."""
        n_local = int(self.experts.gate_up_exps.shape[0])
        self.experts.share = (group.rank() * n_local, n_local)
        self.tp_group = group

    def feed_forward(self, x: mx.array) -> mx.array:
        eps = self.eps
        h = self.ffn(rms_norm(x, self.ffn_norm, eps))
        if self.experts is not None:
            e = self.experts(x)
            if self.tp_group is not None:  # both partial sums side by side, one all-reduce
                both = mx.distributed.all_sum(mx.concatenate([h, e], axis=-1), group=self.tp_group)
                h, e = both[..., :h.shape[-1]], both[..., h.shape[-1]:]
            h = rms_norm(h, self.post_mlp_norm, eps) + rms_norm(e, self.post_experts_norm, eps)
        return rms_norm(h, self.post_ffn_norm, eps)

    def __call__(self, x: mx.array, fb: ForwardBatch, kv: dict, ple: mx.array | None) -> mx.array:
        """``ple``: this layer's per-layer input ``[B, T, ple_dim]`` (None without per-layer embeddings)."""
        eps = self.eps
        x = x + rms_norm(self.attn(rms_norm(x, self.attn_norm, eps), fb, kv), self.post_attn_norm, eps)
        x = x + self.feed_forward(x)
        if ple is not None:
            x = x + rms_norm(self.ple_proj(gelu_tanh(self.ple_gate(x)) * ple), self.ple_norm, eps)
        return x * self.out_scale if self.out_scale is not None else x


class Gemma4Model:
    """Embedding (× √hidden) → blocks → final norm → tied logits → soft-cap.

    The blocks are ``blocks``, not ``layers``: the dense families' host decode step (``engine.cpu_decode``)
    assumes one head shape for every layer; on the CPU this model decodes through its own host step
    (``engine.cpu_decode_gemma4``), elsewhere on the MLX graph."""

    is_embedding_model = False

    def __init__(self, g: GGUFFile, dtype):
        hp, name = g.hparams, g.path.name
        shapes = layer_shapes(g)
        heads, piece = cache_layout(shapes, name)
        n_heads = hp.n_heads
        if isinstance(n_heads, list):
            raise InputError(f"{name}: per-layer query head counts are not supported")
        embd = g.tensor("token_embd.weight")
        self.cfg = Gemma4Config(n_layers=hp.n_layers, hidden=hp.hidden, n_heads=int(n_heads), vocab=int(embd.shape[0]),
                                n_ctx_train=hp.n_ctx_train, norm_eps=hp.rms_eps,
                                final_softcap=hp.final_logit_softcap, cache_heads=heads, cache_dim=piece,
                                n_kv_layers=sum(s.kv_source == i for i, s in enumerate(shapes)),
                                ple_dim=int(hp.stored(_L.EMBD_LENGTH_PER_LAYER_INP) or 0))
        self.dtype = dtype
        self.shapes = shapes
        self.embed = Linear(embd, dtype)
        self.embed_scale = math.sqrt(self.cfg.hidden)
        self.blocks = [Gemma4Block(self.cfg, shapes[i], g, i, dtype) for i in range(self.cfg.n_layers)]
        self.norm = _norm(g, "output_norm.weight", dtype)
        self.lm_head = Linear(g.tensors["output.weight"], dtype) if "output.weight" in g.tensors else self.embed
        self.ple_embed = self.ple_model_proj = None
        if self.cfg.ple_dim:
            self.ple_embed = Linear(g.tensor("per_layer_token_embd.weight"), dtype)
            self.ple_model_proj = Linear(g.tensor("per_layer_model_proj.weight"), dtype)
            self.ple_proj_norm = _norm(g, "per_layer_proj_norm.weight", dtype)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        return self.cfg.n_kv_layers, self.cfg.cache_heads, self.cfg.cache_dim

    @property
    def sliding_window_layers(self) -> tuple[int, frozenset[int]] | None:
        """``(window, layers)``: the cache layers that keep only the window (``kv_cache.SlidingWindow``),
        the sliding layers that own K/V; None without a window."""
        layers = frozenset(i for i, s in enumerate(self.shapes) if s.sliding and s.kv_source == i)
        window = self.shapes[min(layers)].window if layers else None
        return (window, layers) if window else None

    def weights_nbytes(self) -> int:
        extra = [self.ple_embed, self.ple_model_proj] if self.ple_embed is not None else []
        return distinct_nbytes([self.embed, self.lm_head, *extra] + [lin for b in self.blocks for lin in b.linears()])

    def per_layer_inputs(self, tokens: mx.array, x: mx.array) -> mx.array:
        """E2B/E4B's per-layer inputs ``[B, T, layers, ple_dim]``: the token's own per-layer embedding
        (× √ple_dim) and a normalised projection of the scaled embedding ``x`` (× hidden^-½), averaged
        with the factor 2^-½ as llama.cpp and transformers do."""
        c = self.cfg
        B, T = tokens.shape
        own = self.ple_embed.rows(tokens).reshape(B, T, c.n_layers, c.ple_dim) * math.sqrt(c.ple_dim)
        proj = (self.ple_model_proj(x) * (c.hidden ** -0.5)).reshape(B, T, c.n_layers, c.ple_dim)
        return (rms_norm(proj, self.ple_proj_norm, c.norm_eps) + own) * (2 ** -0.5)

    def __call__(self, tokens: mx.array, fb: ForwardBatch, last_only: bool = True) -> mx.array:
        """``tokens [B, T]`` → float32 logits ``[B, vocab]`` of the last position (or all)."""
        x = self.embed.rows(tokens)
        x = x * mx.array(self.embed_scale, dtype=x.dtype)
        ple = self.per_layer_inputs(tokens, x) if self.ple_embed is not None else None
        kv: dict[int, tuple[mx.array, mx.array]] = {}
        for i, block in enumerate(self.blocks):
            x = block(x, fb, kv, None if ple is None else ple[:, :, i, :])
        if last_only:
            x = x[:, -1:, :]
        logits = self.lm_head(rms_norm(x, self.norm, self.cfg.norm_eps)).astype(mx.float32)
        cap = self.cfg.final_softcap
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits[:, -1, :] if last_only else logits


def build(g: GGUFFile, dtype) -> Gemma4Model:
    return Gemma4Model(g, dtype)
