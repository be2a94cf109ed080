"""Qwen 3.5 / 3.6 dense (``qwen35``): Gated DeltaNet linear-attention layers with a gated
full-attention layer every ``full_attention_interval`` blocks.

Every block is ``x + mixer(norm(x))`` then ``x + ffn(post_norm(x))``; the mixer is one of:

* **Linear attention** (:class:`GatedDeltaNet`): ``attn_qkv`` feeds a causal depthwise conv
  whose window continues the sequence's last ``K − 1`` inputs (the conv state), then SiLU; q and
  k are L2-normalised (q also by ``key_dim^-½``) and the gated delta rule runs over the
  per-sequence matrix ``S [value heads, value dim, key dim]``:
  ``S ← γ·S``, ``S ← S + β·(v − S k) kᵀ``, ``y = S q`` with ``β = σ(ssm_beta·x)`` and
  ``γ = exp(softplus(ssm_alpha·x + dt) · ssm_a)`` (the converter stores ``ssm_a = −e^{A_log}``).
  The output is ``RMSNorm(y) · SiLU(attn_gate·x)`` per value head, then ``ssm_out``.
* **Full attention** (:class:`GatedAttention`): ``attn_q`` yields query and gate interleaved per
  head (``[q_h, gate_h]``); q/k RMSNorm, RoPE on the first ``rope.dimension_count`` dims (NeoX
  half split; the ``dimension_sections`` of Qwen's multimodal RoPE all carry the same text position,
  which makes them plain RoPE), attention over the KV cache, output × σ(gate), ``attn_output``.

llama.cpp's converter reorders the value heads of a linear layer from grouped-by-key-head to
tiled (value head ``j·key_heads + g`` reads key head ``g``) whenever key heads ≠ value heads;
the key/query heads are therefore tiled (not repeated in place) to meet the value heads.

The recurrence runs in ``mx.fast.gated_delta_update`` (any chunk length, one call per layer), on
a CUDA device in :mod:`hf2q.kernels.cuda_gated_delta` (MLX's CUDA version works token by
token), and on the CPU in :mod:`hf2q.kernels.cpu_gated_delta` (MLX's CPU version is many times
slower); :func:`gated_delta_reference` is the same rule step by step in plain MLX, and
:mod:`hf2q.kernels.gated_delta_ref` the numpy reference all of them are tested against. The MTP
(``nextn``) block after the main ones runs only as a draft head, once :meth:`Qwen35Model.enable_mtp`
is called (``--speculative mtp``; :mod:`hf2q.engine.models.qwen35_mtp`).
"""

from __future__ import annotations

import attrs
import mlx.core as mx

from hf2q.engine.kv_cache import ForwardBatch, RecurrentState
from hf2q.engine.layers import Linear, float_array, rms_norm, silu
from hf2q.engine.models.decoder import Attention, DecoderConfig, _norm, distinct_nbytes
from hf2q.engine.models.llama import common_config, gated_mlp
from hf2q.engine.thread_compile import thread_compile
from hf2q.errors import InputError
from hf2q.kernels import cpu_gated_delta, cuda_gated_delta
from hf2q.formats.gguf_file import GGUFFile


@attrs.define
class DeltaNetShape:
    conv_kernel: int
    k_heads: int
    v_heads: int
    k_dim: int  # per head
    v_dim: int  # per head

    @property
    def conv_channels(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


def gated_delta_reference(q: mx.array, k: mx.array, v: mx.array, gamma: mx.array, beta: mx.array,
                          state: mx.array) -> tuple[mx.array, mx.array]:
    """The gated delta rule one token at a time, in plain MLX (the reference of the fused kernel).

    ``q, k [B, T, H, Dk]``, ``v [B, T, H, Dv]``, ``gamma, beta [B, T, H]``, ``state [B, H, Dv, Dk]``
    → ``(y [B, T, H, Dv], final state)``. Computed in float32.
    """
    q, k, v, gamma, beta, state = (a.astype(mx.float32) for a in (q, k, v, gamma, beta, state))
    ys = []
    for t in range(q.shape[1]):
        state = state * gamma[:, t, :, None, None]
        kt = k[:, t]
        remembered = (state * kt[:, :, None, :]).sum(-1)  # S k: [B, H, Dv]
        delta = (v[:, t] - remembered) * beta[:, t, :, None]
        state = state + delta[:, :, :, None] * kt[:, :, None, :]
        ys.append((state * q[:, t][:, :, None, :]).sum(-1))
    return mx.stack(ys, axis=1), state


def _l2_normalize(x: mx.array, eps: float) -> mx.array:
    x = x.astype(mx.float32)
    return x * mx.rsqrt((x * x).sum(-1, keepdims=True) + eps)


class GatedDeltaNet:
    def __init__(self, g: GGUFFile, i: int, shape: DeltaNetShape, index: int, eps: float, dtype):
        p = f"blk.{i}."
        self.shape, self.index, self.eps, self.dtype = shape, index, eps, dtype
        self.qkv = Linear(g.tensor(p + "attn_qkv.weight"), dtype)
        self.z = Linear(g.tensor(p + "attn_gate.weight"), dtype)
        self.beta = Linear(g.tensor(p + "ssm_beta.weight"), dtype)
        self.alpha = Linear(g.tensor(p + "ssm_alpha.weight"), dtype)
        self.out = Linear(g.tensor(p + "ssm_out.weight"), dtype)
        conv = float_array(g.tensor(p + "ssm_conv1d.weight"), mx.float32)  # [channels, K]
        if tuple(conv.shape) != (shape.conv_channels, shape.conv_kernel):
            raise InputError(f"{g.path.name}: {p}ssm_conv1d.weight has shape {tuple(conv.shape)}, expected "
                             f"{(shape.conv_channels, shape.conv_kernel)}")
        self.conv_w = conv.T.astype(dtype)  # [K, channels]
        self.dt_bias = float_array(g.tensor(p + "ssm_dt.bias"), mx.float32)
        self.a = float_array(g.tensor(p + "ssm_a"), mx.float32)  # −exp(A_log)
        self.norm = _norm(g, p + "ssm_norm.weight", dtype)
        #: the recurrence (and the traced preparation) on CUDA: our kernel takes these head shapes
        self.on_cuda = cuda_gated_delta.available() and cuda_gated_delta.takes(shape.k_dim, shape.k_heads,
                                                                               shape.v_heads)
        #: on the CPU, our C recurrence (which reads key head ``h mod Hk`` in place, as the CUDA kernel does)
        self.on_host = not self.on_cuda and cpu_gated_delta.available()

    def linears(self):
        return (self.qkv, self.z, self.beta, self.alpha, self.out)

    def __call__(self, x: mx.array, fb: ForwardBatch) -> mx.array:
        s = self.shape
        B, L, _ = x.shape
        conv_in, ssm_state = fb.recurrent_state(self.index)
        on_cuda = self.on_cuda
        prepare = _prepare_compiled if on_cuda else _prepare  # fused elementwise work where launches cost most
        q, k, v, gamma, beta, window = prepare(self.qkv(x), conv_in, self.conv_w, self.beta(x), self.alpha(x),
                                               self.dt_bias, self.a, s.k_heads, s.k_dim, s.v_heads, s.v_dim, self.eps)
        conv_state = window[:, L:, :]  # the conv inputs the next forward continues
        on_host = self.on_host
        if not (on_cuda or on_host) and s.v_heads != s.k_heads:  # tiled value heads: head j·k_heads + g reads g
            reps = (1, 1, s.v_heads // s.k_heads, 1)
            q, k = mx.tile(q, reps), mx.tile(k, reps)
        recurrence = cuda_gated_delta.gated_delta if on_cuda else (
            cpu_gated_delta.gated_delta if on_host else mx.fast.gated_delta_update)
        cuts = fb.recurrent_cuts()
        if cuts:  # reuse points inside this chunk: run the recurrence piecewise and hand each state in
            K, ys, start = s.conv_kernel, [], 0
            for end in (*cuts, L):
                part = slice(start, end)
                y_part, ssm_state = recurrence(q[:, part], k[:, part], v[:, part], gamma[:, part], beta[:, part],
                                               ssm_state)
                ys.append(y_part)
                if end < L:
                    fb.set_recurrent_point(self.index, end, window[:, end:end + K - 1, :], ssm_state)
                start = end
            y = mx.concatenate(ys, axis=1)
        else:
            y, ssm_state = recurrence(q, k, v, gamma, beta, ssm_state)
        fb.set_recurrent_state(self.index, conv_state, ssm_state)
        z = self.z(x).reshape(B, L, s.v_heads, s.v_dim)
        y = rms_norm(y.astype(self.dtype), self.norm, self.eps) * silu(z)
        return self.out(y.reshape(B, L, s.v_heads * s.v_dim))


def _prepare(qkv: mx.array, conv_state: mx.array, conv_w: mx.array, beta_raw: mx.array, alpha_raw: mx.array,
             dt_bias: mx.array, a: mx.array, k_heads: int, k_dim: int, v_heads: int, v_dim: int, eps: float):
    """Everything between the input projections and the recurrence: the causal depthwise conv of
    ``qkv [B, L, C]`` continuing ``conv_state [B, K − 1, C]`` (then SiLU), the q/k/v split with
    L2-normalised q (also scaled by ``k_dim^-½``) and k, and the per-head rates β and decays γ.
    Returns ``(q, k, v, gamma, beta, window)``: q/k keep the key heads; ``window [B, K − 1 + L, C]`` is
    the conv input (the state, then ``qkv``), whose last ``K − 1`` rows are the next conv state."""
    B, L, _ = qkv.shape
    K = conv_w.shape[0]
    window = mx.concatenate([conv_state.astype(qkv.dtype), qkv], axis=1)  # [B, K − 1 + L, C]
    mixed = window[:, 0:L, :] * conv_w[0]
    for j in range(1, K):
        mixed = mixed + window[:, j:j + L, :] * conv_w[j]
    mixed = silu(mixed)
    kd = k_heads * k_dim
    q = _l2_normalize(mixed[..., :kd].reshape(B, L, k_heads, k_dim), eps) * (k_dim ** -0.5)
    k = _l2_normalize(mixed[..., kd:2 * kd].reshape(B, L, k_heads, k_dim), eps)
    v = mixed[..., 2 * kd:].reshape(B, L, v_heads, v_dim).astype(mx.float32)
    beta = mx.sigmoid(beta_raw.astype(mx.float32))
    gamma = mx.exp(_softplus(alpha_raw.astype(mx.float32) + dt_bias) * a)
    return q, k, v, gamma, beta, window


#: :func:`_prepare` traced once per shape into fused kernels (the head counts and eps are constants of a layer)
_prepare_compiled = thread_compile(_prepare)


def _softplus(x: mx.array) -> mx.array:
    return mx.logaddexp(x, mx.zeros_like(x))


class GatedAttention(Attention):
    """Full attention whose query projection also yields a per-head output gate."""

    def __init__(self, cfg: DecoderConfig, g: GGUFFile, i: int, kv_index: int, dtype):
        super().__init__(cfg, g, i, dtype)
        self.layer = kv_index  # the sequence cache holds K/V for the full-attention layers only

    def __call__(self, x: mx.array, fb: ForwardBatch) -> mx.array:
        c = self.cfg
        B, L, _ = x.shape
        qg = self.q(x).reshape(B, L, c.n_heads, 2 * c.head_dim)
        q, gate = qg[..., :c.head_dim], qg[..., c.head_dim:]
        out = self.attend(q, x, fb)
        return self.o(out * mx.sigmoid(gate.reshape(B, L, -1)))


class Qwen35Block:
    def __init__(self, mixer, ffn, g: GGUFFile, i: int, eps: float, dtype):
        p = f"blk.{i}."
        self.mixer, self.ffn, self.eps = mixer, ffn, eps
        self.attn_norm = _norm(g, p + "attn_norm.weight", dtype)
        self.post_norm = _norm(g, p + "post_attention_norm.weight", dtype)

    def linears(self):
        m, f = self.mixer, self.ffn
        mixer = m.linears() if isinstance(m, GatedDeltaNet) else (m.q, m.k, m.v, m.o)
        return (*mixer, *(f.linears() if hasattr(f, "linears") else (f.gate, f.up, f.down)))

    def __call__(self, x: mx.array, fb: ForwardBatch) -> mx.array:
        x = x + self.mixer(rms_norm(x, self.attn_norm, self.eps), fb)
        return x + self.ffn(rms_norm(x, self.post_norm, self.eps))


class Qwen35Model:
    """Embedding → hybrid blocks → final norm → logits; K/V for the full-attention blocks, a
    :class:`~hf2q.engine.kv_cache.RecurrentState` for the linear ones (``new_recurrent_state``)."""

    is_embedding_model = False

    def __init__(self, g: GGUFFile, dtype, make_ffn=None):
        """``make_ffn(i)``: block ``i``'s feed-forward (default the dense SwiGLU)."""
        make_ffn = make_ffn or (lambda i: gated_mlp(g, i, dtype))
        self._gguf, self._make_ffn = g, make_ffn
        #: the multi-token-prediction draft head, once enabled (``enable_mtp``)
        self.mtp = None
        hp = g.hparams
        cfg = common_config(g, traditional=False)
        cfg.qk_norm = True
        cfg.n_layers = hp.n_main_layers
        self.cfg, self.dtype = cfg, dtype
        self.recurrent_flags = hp.recurrent_layers
        inner, v_heads = hp.ssm_inner_size, hp.ssm_time_step_rank
        if not v_heads or inner % v_heads or v_heads % hp.ssm_group_count:
            raise InputError(f"{g.path.name}: linear attention with {v_heads} value heads, {hp.ssm_group_count} key "
                             f"heads and inner size {inner} is not a valid layout")
        self.delta = DeltaNetShape(hp.ssm_conv_kernel, hp.ssm_group_count, v_heads, hp.ssm_state_size,
                                   inner // v_heads)
        self.embed = Linear(g.tensor("token_embd.weight"), dtype)
        self.layers = []
        n_rec = n_attn = 0
        for i, recurrent in enumerate(self.recurrent_flags):
            if recurrent:
                mixer = GatedDeltaNet(g, i, self.delta, n_rec, cfg.norm_eps, dtype)
                n_rec += 1
            else:
                mixer = GatedAttention(cfg, g, i, n_attn, dtype)
                n_attn += 1
            self.layers.append(Qwen35Block(mixer, make_ffn(i), g, i, cfg.norm_eps, dtype))
        self.n_recurrent, self.n_attention = n_rec, n_attn
        self.norm = _norm(g, "output_norm.weight", dtype)
        self.lm_head = Linear(g.tensors["output.weight"], dtype) if "output.weight" in g.tensors else self.embed

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """Attention layers with a K/V cache: the main ones, and the MTP head's once it is on."""
        return self.n_attention + (self.mtp is not None), self.cfg.n_kv_heads, self.cfg.head_dim

    def enable_mtp(self) -> None:
        """Load the ``nextn`` block as a draft head; from now on every forward also writes its K/V rows
        (call before the first sequence: they hold one more attention layer). ``InputError`` when the
        file has no such block."""
        from hf2q.engine.models.qwen35_mtp import MtpHead
        from hf2q.engine.speculative import nextn_block

        if self.mtp is not None:
            return
        g, i = self._gguf, nextn_block(self._gguf)
        if i is None:
            raise InputError(f"{g.path.name} has no multi-token-prediction (nextn) block; convert it without "
                             "--no-mtp, or use --speculative ngram")
        block = Qwen35Block(GatedAttention(self.cfg, g, i, self.n_attention, self.dtype), self._make_ffn(i), g, i,
                            self.cfg.norm_eps, self.dtype)
        group = getattr(self, "tp_group", None)  # a tensor-parallel shard: the head's block is split like the others
        if group is not None:
            from hf2q.engine.tensor_parallel import parallelize_block

            parallelize_block(block, group)
        self.mtp = MtpHead(g, self.cfg, i, block, self.n_attention, self.embed, self.lm_head, self.norm, self.dtype)

    def new_recurrent_state(self) -> RecurrentState:
        d = self.delta
        return RecurrentState(self.n_recurrent, (d.conv_kernel - 1, d.conv_channels),
                              (d.v_heads, d.v_dim, d.k_dim), self.dtype)

    def weights_nbytes(self) -> int:
        head = list(self.mtp.linears()) if self.mtp is not None else []
        return distinct_nbytes([self.embed, self.lm_head] + [lin for block in self.layers for lin in block.linears()]
                               + head)

    def __call__(self, tokens: mx.array, fb: ForwardBatch, last_only: bool = True) -> mx.array:
        """``tokens [B, T]`` → float32 logits ``[B, vocab]`` of the last position (or all)."""
        x = self.embed.rows(tokens)
        for block in self.layers:
            x = block(x, fb)
        if self.mtp is not None:  # the draft head's K/V rows of these tokens, from every hidden row
            x = rms_norm(x, self.norm, self.cfg.norm_eps)
            self.mtp.store(tokens, x, fb)
            x = x[:, -1:, :] if last_only else x
            logits = self.lm_head(x).astype(mx.float32)
            return logits[:, -1, :] if last_only else logits
        if last_only:
            x = x[:, -1:, :]
        logits = self.lm_head(rms_norm(x, self.norm, self.cfg.norm_eps)).astype(mx.float32)
        return logits[:, -1, :] if last_only else logits


def build(g: GGUFFile, dtype) -> Qwen35Model:
    return Qwen35Model(g, dtype)
