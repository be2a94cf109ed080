"""DeepSeek-V4 (``deepseek4``, V4-Flash): hyper-connection residual streams around compressed
attention and a routed mixture of experts.

* **Residual.** The hidden state is ``hyper_connection.count`` streams (:mod:`.deepseek4_hc`); each
  block's attention and feed-forward read a learnt mix of them and write back into all of them, and
  the head collapses them once more before the final norm and the output projection.
* **Attention** per layer by its ``attention.compress_ratios`` entry (:mod:`.deepseek4_attention`):
  sliding-window shared-KV attention, plus compressed keys (sparse, chosen by the lightning indexer,
  at ratio 4; dense at ratio 128).
* **Feed-forward.** A shared SwiGLU expert plus ``expert_used_count`` routed ones. Router scores are
  ``sqrt(softplus(logit))``; the first ``hash_layer_count`` layers pick their experts from the token
  id (``ffn_gate_tid2eid``), the others by top-k of score + ``exp_probs_b``; the chosen scores are
  renormalised and scaled by ``expert_weights_scale``. Gate and up pre-activations are clamped by the
  SwiGLU limits (gate from above, up on both sides) in routed and shared experts alike.

The routed experts arrive as MXFP4 (``block_mxfp4``); no quantized matmul of ours reads that format,
so they are dequantized at load to the compute type (as are the other weight types the affine
repacking does not take).
"""

from __future__ import annotations

import os
import types

import attrs
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T

from hf2q.engine.expert_route import ExpertRoute
from hf2q.engine.kv_cache import ForwardBatch
from hf2q.engine.layers import Linear, float_array, silu
from hf2q.engine.models.decoder import distinct_nbytes
from hf2q.engine.models.deepseek4_attention import AttnGeometry, Deepseek4Attention, default_inv_freq, yarn_inv_freq
from hf2q.engine.models.deepseek4_cache import Deepseek4Cache, EntryBatch, batch_entries
from hf2q.engine.models.deepseek4_layout import layer_rows
from hf2q.engine.models.deepseek4_hc import HyperConnection, HyperHead
from hf2q.engine.quant_repack import FLOAT_TYPES, QUANTIZED_TYPES
from hf2q.errors import InputError
from hf2q.formats.gguf_check_deepseek4 import ratios_problem
from hf2q.formats.gguf_file import GGUFFile, GGUFTensor
from hf2q.formats.gguf_keys import ExtraKeys, Keys

_A, _L, _R = Keys.Attention, Keys.LLM, Keys.Rope


@attrs.define
class Deepseek4Config:
    """What the runner reads off every model, plus the block-level scalars."""

    n_layers: int
    hidden: int
    vocab: int
    n_ctx_train: int
    norm_eps: float
    hc_count: int
    hc_iterations: int
    hc_eps: float
    compress_ratios: list[int]
    n_hash_layers: int
    top_k: int
    expert_scale: float
    clamp_experts: list[float]
    clamp_shared: list[float]


def _linear(t: GGUFTensor, dtype) -> Linear:
    """A ``Linear`` over ``t``, dequantized first when the affine repacking does not take its type."""
    if t.qtype in FLOAT_TYPES or t.qtype in QUANTIZED_TYPES:
        return Linear(t, dtype)
    from gguf import quants

    dense = quants.dequantize(np.asarray(t.data), t.qtype).reshape(t.shape).astype(np.float32)
    return Linear(types.SimpleNamespace(name=t.name, shape=t.shape, qtype=T.F32, data=dense), dtype)


def _clamped_swiglu(gate: mx.array, up: mx.array, limit: float) -> mx.array:
    if limit > 0:
        gate, up = mx.minimum(gate, limit), mx.clip(up, -limit, limit)
    return silu(gate) * up


class Deepseek4MoE:
    def __init__(self, cfg: Deepseek4Config, g: GGUFFile, i: int, dtype):
        p = f"blk.{i}."
        self.router = float_array(g.tensor(p + "ffn_gate_inp.weight"), mx.float32)  # [E, hidden]
        self.hashed = i < cfg.n_hash_layers
        if self.hashed:
            table = g.tensor(p + "ffn_gate_tid2eid.weight")
            self.tid2eid = mx.array(np.asarray(table.data).reshape(table.shape).astype(np.int32))  # [vocab, k]
            if self.tid2eid.shape[-1] != cfg.top_k:
                raise InputError(f"{g.path.name}: {p}ffn_gate_tid2eid.weight routes {self.tid2eid.shape[-1]} experts "
                                 f"per token, expected {cfg.top_k}")
        else:
            self.bias = float_array(g.tensor(p + "exp_probs_b.bias"), mx.float32).reshape(-1)
        self.gate_exps = _linear(g.tensor(p + "ffn_gate_exps.weight"), dtype)
        self.up_exps = _linear(g.tensor(p + "ffn_up_exps.weight"), dtype)
        self.down_exps = _linear(g.tensor(p + "ffn_down_exps.weight"), dtype)
        self.shared = tuple(_linear(g.tensor(p + f"ffn_{n}_shexp.weight"), dtype) for n in ("gate", "up", "down"))
        self.top_k, self.scale = cfg.top_k, cfg.expert_scale
        self.limit, self.shared_limit = cfg.clamp_experts[i], cfg.clamp_shared[i]

    def linears(self):
        return (self.gate_exps, self.up_exps, self.down_exps, *self.shared)

    def __call__(self, x: mx.array, tokens: mx.array) -> mx.array:
        flat = x.reshape(-1, x.shape[-1])
        return self.experts(flat, *self.route(flat, tokens)).reshape(x.shape)

    def route(self, flat: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """The experts ``[N, k]`` each token of ``flat [N, hidden]`` goes to, and their weights."""
        logits = flat.astype(mx.float32) @ self.router.T
        scores = mx.sqrt(mx.logaddexp(logits, mx.zeros_like(logits)))  # sqrt(softplus)
        k = self.top_k
        if self.hashed:
            idx = self.tid2eid[tokens.reshape(-1)]
        else:
            idx = mx.stop_gradient(mx.argpartition(-(scores + self.bias), kth=k - 1, axis=-1)[:, :k])
        weights = mx.take_along_axis(scores, idx, axis=-1)
        return idx, weights / (weights.sum(axis=-1, keepdims=True) + 1e-20) * self.scale

    def experts(self, flat: mx.array, idx: mx.array, weights: mx.array) -> mx.array:
        """The routed experts' weighted sum plus the shared expert, ``[N, hidden]``."""
        route = ExpertRoute.of(idx, self.gate_exps.shape[0])
        xe = route.inputs(flat)
        h = _clamped_swiglu(route.apply(self.gate_exps, xe), route.apply(self.up_exps, xe), self.limit)
        out = route.outputs(route.apply(self.down_exps, h))  # [N, k, hidden]
        routed = (out * weights[..., None].astype(out.dtype)).sum(axis=1)
        gate, up, down = self.shared
        return routed + down(_clamped_swiglu(gate(flat), up(flat), self.shared_limit))


class Deepseek4Block:
    def __init__(self, cfg: Deepseek4Config, geo: AttnGeometry, g: GGUFFile, i: int, dtype):
        p = f"blk.{i}."
        hc = (cfg.hc_count, cfg.hidden, cfg.hc_iterations, cfg.hc_eps, cfg.norm_eps)
        self.attn_hc = HyperConnection(g, p + "hc_attn_", *hc)
        self.ffn_hc = HyperConnection(g, p + "hc_ffn_", *hc)
        self.attn_norm = float_array(g.tensor(p + "attn_norm.weight"), dtype)
        self.ffn_norm = float_array(g.tensor(p + "ffn_norm.weight"), dtype)
        self.attn = Deepseek4Attention(geo, g, i, cfg.compress_ratios[i], dtype)
        self.moe = Deepseek4MoE(cfg, g, i, dtype)
        self.eps = cfg.norm_eps

    def linears(self):
        return (*self.attn.linears(), *self.moe.linears())

    def __call__(self, streams: mx.array, fb: ForwardBatch, tokens: mx.array) -> mx.array:
        eps = self.eps
        streams = self.attn_hc(streams, lambda h: self.attn(mx.fast.rms_norm(h, self.attn_norm, eps), fb))
        return self.ffn_hc(streams, lambda h: self.moe(mx.fast.rms_norm(h, self.ffn_norm, eps), tokens))


def _per_layer_floats(value, n: int, default: float) -> list[float]:
    if value is None:
        return [default] * n
    values = list(value) if isinstance(value, (list, tuple)) else [value] * n
    return [float(v) for v in values[:n]] + [default] * max(0, n - len(values))


def read_config(g: GGUFFile) -> tuple[Deepseek4Config, AttnGeometry]:
    hp, name = g.hparams, g.path.name

    def need(template: str):
        v = hp.stored(template)
        if v is None:
            raise InputError(f"{name}: missing GGUF metadata key {hp.key(template)!r}")
        return v

    n = hp.n_layers
    ratios = list(need(ExtraKeys.COMPRESS_RATIOS))
    if problem := ratios_problem(ratios, n):
        raise InputError(f"{name}: {hp.key(ExtraKeys.COMPRESS_RATIOS)} {problem}")
    ratios = [int(r) for r in ratios[:n]]
    n_heads = hp.n_heads
    if isinstance(n_heads, list):
        raise InputError(f"{name}: per-layer query head counts are not supported")
    embd = g.tensor("token_embd.weight")
    cfg = Deepseek4Config(
        n_layers=n, hidden=hp.hidden, vocab=int(embd.shape[0]), n_ctx_train=hp.n_ctx_train, norm_eps=hp.rms_eps,
        hc_count=int(need(ExtraKeys.HYPER_CONNECTION_COUNT)),
        hc_iterations=int(need(ExtraKeys.HYPER_CONNECTION_SINKHORN_ITERATIONS)),
        hc_eps=float(need(ExtraKeys.HYPER_CONNECTION_EPSILON)), compress_ratios=ratios,
        n_hash_layers=int(hp.stored(ExtraKeys.HASH_LAYER_COUNT) or 0), top_k=int(need(_L.EXPERT_USED_COUNT)),
        expert_scale=float(hp.stored(_L.EXPERT_WEIGHTS_SCALE) or 1.0),
        clamp_experts=_per_layer_floats(hp.stored(_L.SWIGLU_CLAMP_EXP), n, 0.0),
        clamp_shared=_per_layer_floats(hp.stored(_L.SWIGLU_CLAMP_SHEXP), n, 0.0))
    head_dim, rope_dims = int(need(_A.KEY_LENGTH)), int(hp.rope_dims)
    if rope_dims % 2 or rope_dims > head_dim:
        raise InputError(f"{name}: {rope_dims} rotary dims of a {head_dim}-wide head")
    compress_base = float(need(ExtraKeys.COMPRESS_ROPE_FREQ_BASE))
    compress_freq = default_inv_freq(compress_base, rope_dims)
    if hp.rope_scaling == "yarn" and (hp.rope_scaling_factor or 1.0) > 1.0:  # the compressed layers only
        compress_freq = yarn_inv_freq(compress_base, rope_dims, float(hp.rope_scaling_factor),
                                      int(need(_R.SCALING_ORIG_CTX_LEN)), hp.yarn_beta_fast, hp.yarn_beta_slow)
    elif hp.rope_scaling not in (None, "none"):
        raise InputError(f"{name}: rope scaling {hp.rope_scaling!r} is not supported for deepseek4 (only yarn)")
    geo = AttnGeometry(
        hidden=hp.hidden, n_heads=int(n_heads), head_dim=head_dim, rope_dims=rope_dims,
        q_lora=int(need(_A.Q_LORA_RANK)), groups=int(need(ExtraKeys.OUTPUT_GROUP_COUNT)),
        o_lora=int(need(ExtraKeys.OUTPUT_LORA_RANK)), window=int(need(_A.SLIDING_WINDOW)),
        index_heads=int(need(_A.Indexer.HEAD_COUNT)), index_dim=int(need(_A.Indexer.KEY_LENGTH)),
        index_top_k=int(need(_A.Indexer.TOP_K)), norm_eps=hp.rms_eps,
        main_inv_freq=default_inv_freq(float(hp.rope_base), rope_dims), compress_inv_freq=compress_freq)
    if (geo.n_heads * head_dim) % geo.groups:
        raise InputError(f"{name}: {geo.n_heads} heads of {head_dim} do not split into {geo.groups} output groups")
    return cfg, geo


class Deepseek4Model:
    """Embedding → ``n`` copies (the streams) → blocks → stream collapse → final norm → logits.

    The blocks are ``blocks``, not ``layers``: the host decode kernels (``engine.cpu_decode``) assume
    a plain decoder, so this model always runs on the MLX graph. Its slots hold the compact cache
    (:meth:`new_sequence_cache`), which returns only to its reuse points."""

    is_embedding_model = False
    trims_prefix = False
    #: over tensor-parallel ranks every rank holds the same whole compact cache (its K=V head, compressors
    #: and indexer are replicated, ``models/deepseek4_tp.py``): a persistent-store block is any rank's export
    same_cache_on_every_rank = True

    def __init__(self, g: GGUFFile, dtype):
        self.gguf = g
        self.cfg, self.geo = read_config(g)
        self.dtype = dtype
        self.embed = Linear(g.tensor("token_embd.weight"), dtype)
        self.blocks = [Deepseek4Block(self.cfg, self.geo, g, i, dtype) for i in range(self.cfg.n_layers)]
        c = self.cfg
        self.head = HyperHead(g, c.hc_count, c.hc_eps, c.norm_eps)
        self.norm = float_array(g.tensor("output_norm.weight"), dtype)
        self.lm_head = Linear(g.tensors["output.weight"], dtype) if "output.weight" in g.tensors else self.embed
        #: the sequences of the last batched decode, their entries in shared rows (``EntryBatch``);
        #: HF2Q_NO_STACKED_DECODE=1 keeps them in buffers of their own (stacked per step), as for the runner's K/V
        self._entry_batch: EntryBatch | None = None
        self.share_entries = not os.environ.get("HF2Q_NO_STACKED_DECODE")
        #: the multi-token-prediction draft head of a companion file, once enabled (``enable_mtp``)
        self.mtp = None

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        return self.cfg.n_layers, 1, self.geo.head_dim

    def enable_mtp(self, companion: GGUFFile | None = None) -> None:
        """Draft with the MTP block of ``companion`` (llama.cpp's ``--mtp`` file of the same checkpoint;
        ``models/deepseek4_mtp.py``): call before the first sequence, whose caches then hold its layer too. On a
        tensor-parallel shard (``tp_group``) the head's block takes this rank's share of the whole companion."""
        from hf2q.engine.models.deepseek4_mtp import Deepseek4MtpHead, check_head

        if companion is None:
            raise InputError("deepseek4 keeps its MTP head in a file of its own: pass it with --model-draft")
        if self.mtp is not None:
            return
        check_head(companion, self, read_config(companion)[0])
        group = getattr(self, "tp_group", None)  # a tensor-parallel shard: the head's block is cut like the trunk's
        if group is not None:
            from hf2q.engine.tensor_parallel import shard_gguf

            companion = shard_gguf(companion, group.rank(), group.size())
        cfg, geo = read_config(companion)
        block = Deepseek4Block(cfg, geo, companion, self.cfg.n_layers, self.dtype)
        if group is not None:
            from hf2q.engine.models.deepseek4_tp import parallelize_block

            parallelize_block(block, group)
        self.mtp = Deepseek4MtpHead(companion, self, cfg, block, self.dtype)

    def tp_parallelize(self, group) -> None:
        """Over tensor-parallel ranks (``tensor_parallel.parallelize``): each block's own split, two
        all-reduces a block (``models/deepseek4_tp.py``)."""
        from hf2q.engine.models.deepseek4_tp import parallelize

        parallelize(self, group)

    def new_sequence_cache(self) -> Deepseek4Cache:
        geo = self.geo
        ratios = self.cfg.compress_ratios + ([0] if self.mtp is not None else [])  # the MTP head's window layer
        streams = (self.cfg.hc_count, self.cfg.hidden) if self.mtp is not None else None
        return Deepseek4Cache(layer_rows(geo.head_dim, geo.index_dim, ratios), geo.window, self.dtype,
                              mtp_streams=streams)

    def weights_nbytes(self) -> int:
        head = list(self.mtp.linears()) if self.mtp is not None else []
        return distinct_nbytes([self.embed, self.lm_head] + [lin for b in self.blocks for lin in b.linears()] + head)

    def __call__(self, tokens: mx.array, fb: ForwardBatch, last_only: bool = True) -> mx.array:
        """``tokens [B, T]`` → float32 logits ``[B, vocab]`` of the last position (or all)."""
        x = self.embed.rows(tokens)
        B, T, D = x.shape
        if B > 1 and self.share_entries:  # a batched decode reads its rows' entries from shared buffers
            self._entry_batch = batch_entries(self._entry_batch, fb.caches)
        streams = mx.broadcast_to(x[:, :, None, :], (B, T, self.cfg.hc_count, D))
        for block in self.blocks:
            streams = block(streams, fb, tokens)
        if self.mtp is not None:  # the draft head's cache rows of these tokens, from every position's streams
            self.mtp.store(tokens, streams, fb, x)
        if last_only:
            streams = streams[:, -1:]
        h = mx.fast.rms_norm(self.head(streams), self.norm, self.cfg.norm_eps)
        logits = self.lm_head(h).astype(mx.float32)
        return logits[:, -1, :] if last_only else logits


def build(g: GGUFFile, dtype) -> Deepseek4Model:
    return Deepseek4Model(g, dtype)  # a tensor-parallel shard is a smaller model view (models/deepseek4_tp.py)
