"""Qwen 3.5 / 3.6 multi-token prediction: the ``nextn`` block as a draft head for speculative decoding.

The converter writes the checkpoint's ``mtp.*`` head as block ``n_main`` (the first block after the
main ones): ``nextn.enorm`` / ``nextn.hnorm`` / ``nextn.eh_proj``, one gated full-attention decoder
block, and ``nextn.shared_head_norm`` (optionally its own embedding and LM head). It was trained to
take, for the token ``x_p`` at position ``p``, the main model's final-normed hidden row ``h_{p−1}``
(the row whose logits chose ``x_p``) and predict ``x_{p+1}``::

    u = eh_proj([enorm(embed(x_p)), hnorm(h_{p−1})])     # concatenated, 2·d → d
    g = shared_head_norm(block(u))                       # attention over its own K/V rows 0..p
    logits = lm_head(g)

Its attention has a K/V row per position like any attention layer, and a draft attends over the
whole context, so the head keeps them for every token the main model reads: while MTP is on, each
main forward also writes the head's K/V row of each of its tokens (paired with the hidden row of the
token before it, as llama.cpp's MTP driver pairs them) into one more attention layer of the
sequence cache — trimmed, grown and stacked with the others. Only the K/V projections run there
(what MLX evaluates), not the head's attention or FFN.

Drafting chains the head (:meth:`MtpHead.draft`): from the pending token (sampled, not yet fed) and
the main model's hidden row before it, the head gives draft 1 and its own output row ``g``, which
stands in for the main model's hidden row at the next position; k drafts take k small forwards of
the head alone, one lazy graph whose tokens never leave the device until the last. Their K/V rows go
into the head's cache layer past the sequence's length, in place and in the cache's storage (float or
8-bit), where the verify forward writes the real ones over them.
For the persistent KV store a prompt's forward also hands its hidden rows to the sequence's recurrent state,
whose block-end capture keeps the row before each block end it reaches (``kv_cache.BlockEnd``); that block's
export carries it (``state.hidden``), so a restored sequence's head continues as a cold one's.
Drafts are the head's greedy tokens: the acceptance rule (``speculative.accept_draft``) keeps the
target's distribution for any deterministic draft.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from hf2q.engine.kv_cache import ForwardBatch, SequenceCache
from hf2q.engine.layers import Linear, rms_norm
from hf2q.engine.models.decoder import DecoderConfig, _norm
from hf2q.formats.gguf_file import GGUFFile


class MtpHead:
    """The ``nextn`` block of a qwen35 / qwen35moe file over the main model's embedding and LM head."""

    def __init__(self, g: GGUFFile, cfg: DecoderConfig, i: int, block, kv_index: int, embed: Linear, lm_head: Linear,
                 output_norm: mx.array, dtype):
        """``block``: the head's decoder block ``i`` (a ``Qwen35Block`` over a ``GatedAttention`` whose cache
        layer is ``kv_index``), built by the model like its own blocks."""
        p = f"blk.{i}.nextn."
        self.cfg, self.dtype, self.block, self.kv_index = cfg, dtype, block, kv_index
        self.eh_proj = Linear(g.tensor(p + "eh_proj.weight"), dtype)
        self.enorm = _norm(g, p + "enorm.weight", dtype)
        self.hnorm = _norm(g, p + "hnorm.weight", dtype)
        own = lambda name: name in g.tensors  # noqa: E731
        self.head_norm = _norm(g, p + "shared_head_norm.weight", dtype) if own(p + "shared_head_norm.weight") \
            else output_norm
        self.embed = Linear(g.tensor(p + "embed_tokens.weight"), dtype) if own(p + "embed_tokens.weight") else embed
        self.lm_head = Linear(g.tensor(p + "shared_head_head.weight"), dtype) if own(p + "shared_head_head.weight") \
            else lm_head

    def linears(self):
        return (self.eh_proj, *self.block.linears())

    # ---- the head's input and its K/V rows ------------------------------------------------

    def _fused(self, tokens: mx.array, hidden: mx.array) -> mx.array:
        """``eh_proj([enorm(embed(tokens)), hnorm(hidden)])``: ``tokens [B, T]``, ``hidden [B, T, d]``."""
        eps = self.cfg.norm_eps
        e = rms_norm(self.embed.rows(tokens).astype(self.dtype), self.enorm, eps)
        h = rms_norm(hidden.astype(self.dtype), self.hnorm, eps)
        return self.eh_proj(mx.concatenate([e, h], axis=-1))

    def _kv(self, u: mx.array, offset) -> tuple[mx.array, mx.array]:
        """The head's rotated keys and values ``[B, kv_heads, T, head_dim]`` of fused inputs ``u``."""
        c, attn = self.cfg, self.block.mixer
        B, T, _ = u.shape
        x = rms_norm(u, self.block.attn_norm, c.norm_eps)
        k = rms_norm(attn.k(x).reshape(B, T, c.n_kv_heads, c.head_dim), attn.k_norm, c.norm_eps)
        v = attn.v(x).reshape(B, T, c.n_kv_heads, c.head_dim)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        return mx.fast.rope(k, c.rope_dims, offset=offset, **attn._rope), v  # the main model's own RoPE

    def store(self, tokens: mx.array, hidden: mx.array, fb: ForwardBatch) -> None:
        """Write the head's K/V rows of a main forward's ``tokens [B, T]`` whose final-normed hidden rows
        are ``hidden [B, T, d]`` (each token pairs with the row before it), and keep those rows with
        each sequence for the next forward and for drafting."""
        before = mx.stack([previous_hidden(c, off, hidden.shape[-1], hidden.dtype)
                           for c, off in zip(fb.caches, fb.offsets)])[:, None, :]
        rows = mx.concatenate([before, hidden], axis=1)  # positions off − 1 … off + T − 1
        k, v = self._kv(self._fused(tokens, rows[:, :-1]), fb.offset)
        fb.update(self.kv_index, k, v)
        T = tokens.shape[1]
        # a verify may stop at any of its tokens; any other forward only at its end, or one before
        # (the decode pipeline's one-position rollback): the last two rows are enough there
        kept = rows if not fb.end_point else rows[:, -2:]
        for b, (c, off) in enumerate(zip(fb.caches, fb.offsets)):
            c.recurrent.hidden = (off - 1 if not fb.end_point else off + T - 2, kept[b])
            if fb.end_point and T > 1:  # a prompt's forward: its block-end captures take their rows from these
                c.recurrent.prompt_rows = (off - 1, rows[b])

    # ---- drafting -------------------------------------------------------------------------

    def draft(self, seq: SequenceCache, pending: int, k: int) -> list[int]:
        """Up to ``k`` greedy draft tokens after ``pending`` (the sampled token not yet in ``seq``); ``seq``
        keeps its length (the draft's K/V rows sit past it, where the verify forward writes the real ones)."""
        tokens, _ = self._chain(seq, pending, k)
        mx.eval(tokens)
        return np.array(tokens).astype(np.int64).tolist()

    def draft_logits(self, seq: SequenceCache, pending: int, k: int) -> tuple[list[int], np.ndarray]:
        """:meth:`draft` and the head's float32 logits ``[k, vocab]`` the tokens were read from."""
        tokens, logits = self._chain(seq, pending, k)
        mx.eval(tokens, logits)
        return np.array(tokens).astype(np.int64).tolist(), np.array(logits)

    def _chain(self, seq: SequenceCache, pending: int, k: int) -> tuple[mx.array, mx.array]:
        """The lazy graph of ``k`` chained head steps: tokens ``[k]`` and logits ``[k, vocab]``, every step's
        token an argmax on the device that feeds the next step. Each step writes its K/V row in place into
        the head's cache layer (position ``length + i``) and attends over that layer's rows up to it, as
        the main layers attend over their preallocated buffers."""
        c, attn = self.cfg, self.block.mixer
        start = seq.length
        seq.reserve(start + k)
        hidden = previous_hidden(seq, start, c.hidden, self.dtype)[None, None, :]
        token = mx.array([[pending]], dtype=mx.int32)
        codec, toks, rows = seq.codec, [], []
        for i in range(k):
            u = self._fused(token, hidden)
            x = rms_norm(u, self.block.attn_norm, c.norm_eps)
            kn, vn = self._kv(u, start + i)
            seq.write_ahead(self.kv_index, start + i, kn[0], vn[0])
            upto = lambda a: a[None, :, :start + i + 1, :]  # noqa: E731
            keys, values = _rows(upto, seq.keys[self.kv_index]), _rows(upto, seq.values[self.kv_index])
            qg = attn.q(x).reshape(1, 1, c.n_heads, 2 * c.head_dim)
            q, gate = qg[..., :c.head_dim], qg[..., c.head_dim:]
            q = mx.fast.rope(rms_norm(q, attn.q_norm, c.norm_eps).transpose(0, 2, 1, 3), c.rope_dims, offset=start + i,
                             **attn._rope)
            if codec is not None:  # the 8-bit layer, read as stored (kv_quant); one query sees every row
                o = codec.attend(q, keys, values, attn.scale, None)
            else:
                o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale)
            o = o.transpose(0, 2, 1, 3).reshape(1, 1, -1)
            u = u + attn.o(o * mx.sigmoid(gate.reshape(1, 1, -1)))
            u = u + self.block.ffn(rms_norm(u, self.block.post_norm, c.norm_eps))
            hidden = rms_norm(u, self.head_norm, c.norm_eps)
            logits = self.lm_head(hidden).astype(mx.float32)[0, 0]
            token = mx.argmax(logits).astype(mx.int32).reshape(1, 1)
            toks.append(token[0, 0])
            rows.append(logits)
        if not k:
            return mx.zeros((0,), dtype=mx.int32), mx.zeros((0, c.vocab), dtype=mx.float32)
        return mx.stack(toks), mx.stack(rows)


def _rows(take, buf):
    """``take`` applied to a cache layer's buffer: the array, or each plane of an 8-bit one (codes, scales)."""
    return tuple(take(a) for a in buf) if isinstance(buf, tuple) else take(buf)


def previous_hidden(seq: SequenceCache, position: int, width: int, dtype) -> mx.array:
    """The main model's final-normed hidden row at ``position − 1`` as the last forward left it (or as a
    restored block or a captured block end holds it), zeros when there is none (the start of a sequence,
    or a sequence trimmed back past its last forward's rows: a prefix reused from an earlier request)."""
    row = seq.recurrent.hidden_at(position) if seq.recurrent is not None and position > 0 else None
    return row if row is not None else mx.zeros((width,), dtype=dtype)

