"""DeepSeek-V4 multi-token prediction: the MTP block of llama.cpp's ``--mtp`` companion GGUF as a draft head.

DeepSeek ships V4's MTP block (``mtp.0.*``) beside the trunk, and llama.cpp's converter writes it to a
file of its own (``hf2q convert --mtp`` does the same): block ``n`` of an ``n + 1``-block header, with
copies of the embedding, the output norm and the LM head, and the block's own hyper-connection head
as ``output_hc_*``. It was trained to take, for the token ``x_p`` at position ``p``, the trunk's
residual *streams* at ``p − 1`` (all ``hc`` of them, before the trunk's final collapse) and predict
``x_{p+1}``::

    u_s = eh_proj([enorm(embed(x_p)), hnorm(h_{p−1, s})])   # per stream s, 2·d → d
    v   = block(u)                                          # one V4 block: hyper-connections, window attention, MoE
    logits = lm_head(head_norm(hc_head(v)))                 # the file's own hc head, the trunk's LM head

(llama.cpp's ``graph_mtp`` in ``src/models/deepseek4.cpp``). The block's attention is a ratio-0
layer: raw shared-KV rows inside the sliding window, with sinks and the trunk's uncompressed RoPE.

**Its cache** is one more ratio-0 layer of the sequence's compact cache (``deepseek4_cache``), so it
is trimmed, rolled back to reuse points and batched with the trunk's layers. While MTP is on, every
trunk forward writes that layer's row of each of its tokens (paired with the streams of the token
before, as llama.cpp's MTP driver pairs them): only the pre-attention mix and the K=V projection run
there, not the block's attention or MoE. The streams the next forward and the drafts pair with stay
with the sequence (:attr:`Deepseek4Cache.mtp_hidden`): every row of a verify (it may stop at any of
its tokens), the last two of any other forward (the decode pipeline's one-position undo); with the
persistent store on, also those before each block end a prompt forward reaches, which its blocks carry
(``state.hidden``, cache kind ``deepseek4-mtp``).

**Drafting** chains the block on its own output streams (they stand in for the trunk's at the next
position), k lazy steps whose greedy tokens leave the device once. Its rows of the drafted positions
live only in the draft's own copy of the layer's rows: the cache is left as it was, and the verify
writes the real rows.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np

from hf2q.engine.kv_cache import ForwardBatch, row_before
from hf2q.engine.layers import Linear, float_array
from hf2q.engine.models.deepseek4_cache import LayerState, Rows
from hf2q.engine.models.deepseek4_hc import HyperHead
from hf2q.engine.speculative import companion_problem
from hf2q.errors import InputError
from hf2q.formats.gguf_file import GGUFFile


@attrs.define
class _DraftLane:
    """What a draft step's attention reads and stages in place of a sequence cache: the head's rows,
    extended by each drafted position and never committed."""

    raw: Rows

    def layer(self, i: int):
        return LayerState(self.raw), None, None

    def stage(self, i: int, state: LayerState, entries: int, index_entries: int, transaction: bool) -> None:
        self.raw = state.raw


@attrs.define
class _DraftBatch:
    """The one-row ``ForwardBatch`` view a draft step's attention reads."""

    caches: list
    offsets: list[int]
    end_point: bool = True


def check_head(g: GGUFFile, trunk, cfg) -> None:
    """``InputError`` unless ``g`` (its config ``cfg``, read as the trunk reads its own) is an MTP head this
    engine runs for the trunk model ``trunk``: llama.cpp's pairing checks, a window block (ratio 0), routed
    by score (not hashed), mixing as many streams."""
    if problem := companion_problem(trunk.gguf, g):
        raise InputError(f"{g.path.name}: {problem}")
    i = trunk.cfg.n_layers
    if cfg.compress_ratios[i] != 0:
        raise InputError(f"{g.path.name}: MTP block {i} has compress ratio {cfg.compress_ratios[i]}; "
                         "llama.cpp's deepseek4 runs it as a window layer (ratio 0)")
    if i < cfg.n_hash_layers or cfg.hc_count != trunk.cfg.hc_count:
        raise InputError(f"{g.path.name}: MTP block {i} is hash-routed or mixes another number of streams")


class Deepseek4MtpHead:
    """The companion file's MTP block over the trunk's embedding and LM head (``model`` is the trunk)."""

    def __init__(self, g: GGUFFile, model, cfg, block, dtype):
        """``cfg``: the companion's config (its block count includes the head: ratios and clamps reach it);
        ``block``: its block ``n`` (a ``Deepseek4Block``), built by the trunk like its own (``check_head`` first)."""
        i = model.cfg.n_layers
        p = f"blk.{i}.nextn."
        own = lambda name: name in g.tensors  # noqa: E731
        self.cfg, self.dtype, self.layer, self.block = cfg, dtype, i, block
        self.eh_proj = Linear(g.tensor(p + "eh_proj.weight"), dtype)
        self.enorm = float_array(g.tensor(p + "enorm.weight"), dtype)
        self.hnorm = float_array(g.tensor(p + "hnorm.weight"), dtype)
        self.head_norm = float_array(g.tensor(p + "shared_head_norm.weight"), dtype) \
            if own(p + "shared_head_norm.weight") else model.norm
        # the companion's embedding and LM head are copies of the trunk's: share those unless it has its own
        self.embed = Linear(g.tensor(p + "embed_tokens.weight"), dtype) if own(p + "embed_tokens.weight") \
            else model.embed
        #: whether the trunk's embedding rows of a forward are the head's too (``store`` then reuses them)
        self.shares_embed = self.embed is model.embed
        self.lm_head = Linear(g.tensor(p + "shared_head_head.weight"), dtype) if own(p + "shared_head_head.weight") \
            else model.lm_head
        self.head = HyperHead(g, cfg.hc_count, cfg.hc_eps, cfg.norm_eps)

    def linears(self):
        """The head's own matrices (the embedding and LM head it shares are the trunk's)."""
        return (self.eh_proj, *self.block.linears())

    # ---- the head's input and its cache rows -----------------------------------------------

    def fused(self, tokens: mx.array, hidden: mx.array, embedded: mx.array | None = None) -> mx.array:
        """The block's input streams ``[B, T, hc, d]`` of ``tokens [B, T]`` (their embedding rows ``embedded``
        where the caller has them) paired with trunk (or head) streams ``hidden [B, T, hc, d]``."""
        eps = self.cfg.norm_eps
        e = self.embed.rows(tokens) if embedded is None else embedded
        e = mx.fast.rms_norm(e.astype(self.dtype), self.enorm, eps)
        h = mx.fast.rms_norm(hidden.astype(self.dtype), self.hnorm, eps)
        e = mx.broadcast_to(e[:, :, None, :], h.shape)
        return self.eh_proj(mx.concatenate([e, h], axis=-1))

    def store(self, tokens: mx.array, streams: mx.array, fb: ForwardBatch, embedded: mx.array) -> None:
        """Stage the head's cache row of each of a trunk forward's ``tokens [B, T]`` (whose final streams
        are ``streams [B, T, hc, d]``; each token pairs with the streams before it; ``embedded``: the trunk's
        embedding rows of them) and keep the streams the next forward and the drafts read."""
        B, T = tokens.shape
        hc, d = streams.shape[-2:]
        before = mx.stack([previous_hidden(c, off, (hc, d), streams.dtype)
                           for c, off in zip(fb.caches, fb.offsets)])[:, None]
        rows = mx.concatenate([before, streams], axis=1)  # positions off − 1 … off + T − 1
        u = self.fused(tokens, rows[:, :-1], embedded if self.shares_embed else None)
        pre, _, _ = self.block.attn_hc.weights(u)
        x = mx.fast.rms_norm((pre[..., None] * u).sum(axis=2).astype(u.dtype), self.block.attn_norm, self.cfg.norm_eps)
        pos = mx.array(np.asarray(fb.offsets)[:, None] + np.arange(T)[None, :])
        kv = self.block.attn.kv_rows(x, pos)
        kept = rows if not fb.end_point else rows[:, -2:]
        for b, (c, off) in enumerate(zip(fb.caches, fb.offsets)):
            state = c.layer(self.layer)[0]
            c.stage(self.layer, LayerState(state.raw.extended(kv[b])), 0, 0, fb.end_point)
            c.mtp_hidden = (off - 1 if not fb.end_point else off + T - 2, kept[b])
            if fb.end_point and T > 1 and c.block_tokens:  # a prompt transaction: its block ends copy these
                c.prompt_rows = (off - 1, rows[b])

    # ---- drafting ----------------------------------------------------------------------------

    def draft(self, seq, pending: int, k: int) -> list[int]:
        """Up to ``k`` greedy draft tokens after ``pending`` (the sampled token not yet in ``seq``);
        ``seq`` is left as it was."""
        tokens, _ = self._chain(seq, pending, k)
        mx.eval(tokens)
        return np.array(tokens).astype(np.int64).tolist()

    def draft_logits(self, seq, pending: int, k: int) -> tuple[list[int], np.ndarray]:
        """:meth:`draft` and the head's float32 logits ``[k, vocab]`` the tokens were read from."""
        tokens, logits = self._chain(seq, pending, k)
        mx.eval(tokens, logits)
        return np.array(tokens).astype(np.int64).tolist(), np.array(logits)

    def _chain(self, seq, pending: int, k: int) -> tuple[mx.array, mx.array]:
        c = self.cfg
        if not k:
            return mx.zeros((0,), dtype=mx.int32), mx.zeros((0, c.vocab), dtype=mx.float32)
        start = seq.length
        lane = _DraftLane(seq.layer(self.layer)[0].raw)
        hidden = previous_hidden(seq, start, (c.hc_count, c.hidden), self.dtype)[None, None]
        token = mx.array([[pending]], dtype=mx.int32)
        toks, rows = [], []
        for i in range(k):
            hidden = self.block(self.fused(token, hidden), _DraftBatch([lane], [start + i]), token)
            h = mx.fast.rms_norm(self.head(hidden), self.head_norm, c.norm_eps)
            logits = self.lm_head(h).astype(mx.float32)[0, 0]
            token = mx.argmax(logits).astype(mx.int32).reshape(1, 1)
            toks.append(token[0, 0])
            rows.append(logits)
        return mx.stack(toks), mx.stack(rows)


def previous_hidden(seq, position: int, shape: tuple[int, int], dtype) -> mx.array:
    """The trunk's final streams ``[hc, d]`` at ``position − 1`` as the last forward left them; zeros
    where it kept none (the start of a sequence, or a return past its last forward's rows: a prefix
    reused from an earlier request)."""
    row = row_before(getattr(seq, "mtp_hidden", None), position)
    return row if row is not None else mx.zeros(shape, dtype=dtype)
