"""DeepSeek-V4 attention: one shared K=V head, a sliding window, and compressed long-range keys.

Every layer attends with low-rank queries (``attn_q_a`` → RMSNorm → ``attn_q_b``, then a weightless
RMSNorm per head) over one shared key-value head (``attn_kv`` → RMSNorm; the same vector is key and
value), with RoPE on the *last* ``rope_dims`` channels of each head in the interleaved-pair layout, a
learnt sink logit per head, and a grouped low-rank output (``attn_output_a`` per head group, then
``attn_output_b``). Because the values carry RoPE too, the output's rope channels are rotated back by
the query's own angle. Layers differ by their compression ratio ``m``:

* ``m = 0``: the sliding window only (the last ``sliding_window`` positions), RoPE base ``freq_base``.
* ``m = 4`` (compressed sparse attention): a compressor pools every ``m`` tokens into one extra key
  from two projected series — window ``w``'s entry is a softmax-gated sum over the ``b`` half of
  window ``w`` and the ``a`` half of window ``w − 1`` (overlapping windows of ``2m`` rows, the gate
  logits plus a learnt per-slot bias ``ape``), RMS-normalised and rotated at position ``w·m``. A
  lightning indexer (its own smaller compressor and query heads) scores ``Σ_h w_h·ReLU(q_h·k)`` and
  each query keeps only its ``top_k`` best compressed keys.
* ``m = 128`` (heavily compressed attention): the same pooling without overlap or indexer.

A query at position ``p`` may use compressed entry ``w`` once its window has closed: ``(w + 1)·m ≤ p + 1``.
The compressed layers use the ``compress_rope_freq_base`` RoPE for queries, keys and entries.

**Cache.** A slot keeps each layer's raw rows of the window, the compressor's (and indexer's) rows of
the unfinished block, and the compressed entries appended as blocks close (``models/deepseek4_cache.py``):
a forward extends them by its own tokens only, pooling just the blocks it closes, so prefill chunks split
anywhere (mid-block too) and one-token decode steps give one forward's logits.
"""

from __future__ import annotations

import math

import attrs
import mlx.core as mx
import numpy as np

from hf2q.engine.kv_cache import ForwardBatch
from hf2q.engine.layers import Linear, float_array, rms_norm
from hf2q.engine.models.deepseek4_cache import LayerState
from hf2q.errors import InputError
from hf2q.formats.gguf_file import GGUFFile

NEG_INF = float("-inf")


@attrs.define
class AttnGeometry:
    """What every layer shares."""

    hidden: int
    n_heads: int
    head_dim: int
    rope_dims: int
    q_lora: int
    groups: int
    o_lora: int
    window: int
    index_heads: int
    index_dim: int
    index_top_k: int
    norm_eps: float
    main_inv_freq: np.ndarray  # RoPE per-pair frequencies of the sliding-only layers
    compress_inv_freq: np.ndarray  # ... of the compressed layers (their queries, keys and entries)


def rope_tail(x: mx.array, pos: mx.array, inv_freq: mx.array, rope_dims: int, sign: float = 1.0) -> mx.array:
    """Rotate the last ``rope_dims`` channels of ``x [B, H, L, D]`` by ``sign·pos·inv_freq`` in the
    interleaved-pair layout (channels ``2i, 2i+1`` form pair ``i``); ``pos [B, L]``."""
    angles = pos.astype(mx.float32)[:, None, :, None] * inv_freq  # [B, 1, L, r/2]
    cos, sin = mx.cos(angles), mx.sin(angles) * sign
    nope, rope = x[..., :-rope_dims], x[..., -rope_dims:].astype(mx.float32)
    pairs = rope.reshape(*rope.shape[:-1], rope_dims // 2, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(rope.shape).astype(x.dtype)
    return mx.concatenate([nope, rotated], axis=-1) if nope.shape[-1] else rotated


class Compressor:
    """Pools every ``ratio`` positions' projected rows into one compressed entry (see the module doc)."""

    def __init__(self, g: GGUFFile, prefix: str, ratio: int, dim: int, overlap: bool, dtype):
        self.kv = Linear(g.tensor(prefix + "kv.weight"), dtype)
        self.gate = Linear(g.tensor(prefix + "gate.weight"), dtype)
        self.ape = float_array(g.tensor(prefix + "ape.weight"), mx.float32)  # [ratio, width]
        self.norm = float_array(g.tensor(prefix + "norm.weight"), dtype)
        width = (2 if overlap else 1) * dim
        if tuple(self.ape.shape) != (ratio, width) or self.kv.shape[0] != width:
            raise InputError(f"{g.path.name}: {prefix}ape.weight has shape {tuple(self.ape.shape)}, expected "
                             f"{(ratio, width)} (compression ratio {ratio})")
        self.ratio, self.dim, self.overlap, self.width = ratio, dim, overlap, width

    def linears(self):
        return (self.kv, self.gate)

    def pool(self, kv: mx.array, gate: mx.array, first: int, prev: tuple[mx.array, mx.array] | None, eps: float,
             inv_freq: mx.array, rope_dims: int) -> mx.array:
        """Rows ``kv, gate [B, n·ratio, width]`` of blocks ``first …`` → their entries ``[B, n, dim]``
        (normalised and rotated at each block's first position). ``prev``: block ``first − 1``'s rows
        ``[B, ratio, width]`` where windows overlap (None before block 0)."""
        m, d = self.ratio, self.dim
        B, P, _ = kv.shape
        n = P // m
        kv = kv.reshape(B, n, m, self.width).astype(mx.float32)
        logits = gate.reshape(B, n, m, self.width).astype(mx.float32) + self.ape
        if self.overlap:  # window w: the a half of window w − 1 (none before window 0), then its own b half
            if prev is None:
                prev_kv, prev_logits = mx.zeros((B, 1, m, d)), mx.full((B, 1, m, d), NEG_INF)
            else:
                prev_kv = prev[0].reshape(B, 1, m, self.width)[..., :d].astype(mx.float32)
                prev_logits = (prev[1].reshape(B, 1, m, self.width).astype(mx.float32) + self.ape)[..., :d]
            prev_kv = mx.concatenate([prev_kv, kv[:, :-1, :, :d]], axis=1)
            prev_logits = mx.concatenate([prev_logits, logits[:, :-1, :, :d]], axis=1)
            kv = mx.concatenate([prev_kv, kv[..., d:]], axis=2)
            logits = mx.concatenate([prev_logits, logits[..., d:]], axis=2)
        weights = mx.softmax(logits, axis=2, precise=True)
        pooled = rms_norm((kv * weights).sum(axis=2), self.norm.astype(mx.float32), eps)  # [B, n, d]
        pos = mx.broadcast_to(((first + mx.arange(n)) * m)[None], (B, n))
        return rope_tail(pooled[:, None], pos, inv_freq, rope_dims)[:, 0]

    def closed(self, rows, start: int, n_new: int, eps: float, inv_freq: mx.array, rope_dims: int):
        """The entries of the blocks a forward of ``n_new`` tokens from ``start`` closes, from one
        sequence's rows (``deepseek4_cache.Rows`` of ``[kv | gate]``, holding what they need); None
        when it closes none."""
        m, w = self.ratio, self.width
        first, end = start // m, (start + n_new) // m
        if end == first:
            return None
        block = rows.span(first * m, end * m)[None]
        prev = None
        if self.overlap and first:
            before = rows.span((first - 1) * m, first * m)[None]
            prev = (before[..., :w], before[..., w:])
        return self.pool(block[..., :w], block[..., w:], first, prev, eps, inv_freq, rope_dims)[0]


def _padded_rows(rows: list[mx.array]) -> mx.array:
    """Per-sequence rows ``[n_b, w]`` → ``[B, max n_b, w]`` (the padding is masked: it lies past each
    row's positions)."""
    if len(rows) == 1:
        return rows[0][None]
    n = max(a.shape[0] for a in rows)
    return mx.stack([a if a.shape[0] == n else mx.concatenate([a, mx.zeros((n - a.shape[0], a.shape[1]), a.dtype)])
                     for a in rows])


def entry_visible(q_pos: np.ndarray, n_entries: int, ratio: int) -> np.ndarray:
    """``[B, T, E]``: whether the query at ``q_pos [B, T]`` may use compressed entry ``e`` (closed window)."""
    return np.arange(n_entries)[None, None, :] < ((q_pos + 1) // ratio)[:, :, None]


class Deepseek4Attention:
    def __init__(self, geo: AttnGeometry, g: GGUFFile, i: int, ratio: int, dtype):
        p = f"blk.{i}."
        self.geo, self.ratio, self.layer, self.dtype = geo, ratio, i, dtype
        self.q_a = Linear(g.tensor(p + "attn_q_a.weight"), dtype)
        self.q_a_norm = float_array(g.tensor(p + "attn_q_a_norm.weight"), dtype)
        self.q_b = Linear(g.tensor(p + "attn_q_b.weight"), dtype)
        self.kv = Linear(g.tensor(p + "attn_kv.weight"), dtype)
        self.kv_norm = float_array(g.tensor(p + "attn_kv_a_norm.weight"), dtype)
        in_group = geo.n_heads * geo.head_dim // geo.groups
        o_a = float_array(g.tensor(p + "attn_output_a.weight"), dtype)
        if tuple(o_a.shape) != (geo.groups * geo.o_lora, in_group):
            raise InputError(f"{g.path.name}: {p}attn_output_a.weight has shape {tuple(o_a.shape)}, expected "
                             f"{(geo.groups * geo.o_lora, in_group)}")
        self.o_a = o_a.reshape(geo.groups, geo.o_lora, in_group).transpose(0, 2, 1)  # [G, in, o_lora]
        self.o_b = Linear(g.tensor(p + "attn_output_b.weight"), dtype)
        self.sinks = float_array(g.tensor(p + "attn_sinks.weight"), mx.float32).reshape(-1)
        self.compressor = self.indexer = None
        if ratio:
            csa = ratio == 4
            self.compressor = Compressor(g, p + "attn_compressor_", ratio, geo.head_dim, csa, dtype)
            if csa:
                self.indexer = Compressor(g, p + "indexer_compressor_", ratio, geo.index_dim, True, dtype)
                self.index_q = Linear(g.tensor(p + "indexer.attn_q_b.weight"), dtype)
                self.index_w = Linear(g.tensor(p + "indexer.proj.weight"), dtype)
        self.inv_freq = mx.array(geo.compress_inv_freq if ratio else geo.main_inv_freq)

    def linears(self):
        own = (self.q_a, self.q_b, self.kv, self.o_b)
        extra = self.compressor.linears() if self.compressor is not None else ()
        if self.indexer is not None:
            extra += (*self.indexer.linears(), self.index_q, self.index_w)
        return own + extra

    def __call__(self, x: mx.array, fb: ForwardBatch) -> mx.array:
        geo, dtype = self.geo, self.dtype
        B, T, _ = x.shape
        H, D, r, eps = geo.n_heads, geo.head_dim, geo.rope_dims, geo.norm_eps
        offsets = np.asarray(fb.offsets)
        q_pos_np = offsets[:, None] + np.arange(T)[None, :]
        q_pos = mx.array(q_pos_np)
        q_res = rms_norm(self.q_a(x), self.q_a_norm, eps)
        q = self.q_b(q_res).reshape(B, T, H, D).transpose(0, 2, 1, 3)
        q = rope_tail(rms_norm(q, None, eps), q_pos, self.inv_freq, r)
        kv = self.kv_rows(x, q_pos)

        held = [c.layer(self.layer) for c in fb.caches]  # (rows, entries, indexer keys) as of the last commit
        raw = [st.raw.extended(kv[b]) for b, (st, _, _) in enumerate(held)]
        keys, starts = _padded_rows([rw.data for rw in raw]), np.array([rw.start for rw in raw])
        # the raw window: each row's kept positions, causal and within the window
        k_pos = starts[:, None, None] + np.arange(keys.shape[1])[None, None, :]
        allowed = (k_pos <= q_pos_np[:, :, None]) & (k_pos > q_pos_np[:, :, None] - geo.window)
        keys, masks = [keys], [mx.array(allowed)]
        comp = index = [None] * B
        counts = index_counts = [0] * B
        if self.compressor is not None:
            comp, entries, counts = self._extend(self.compressor, held, 1, x, offsets, T)
            if max(counts):
                visible = mx.array(entry_visible(q_pos_np, max(counts), self.ratio))
                if self.indexer is not None:
                    index, index_keys, index_counts = self._extend(self.indexer, held, 2, x, offsets, T)
                    visible = self._indexed(x, q_res, q_pos, index_keys, visible)
                keys.append(entries)
                masks.append(visible)
            elif self.indexer is not None:
                index, _, index_counts = self._extend(self.indexer, held, 2, x, offsets, T)
        for b, c in enumerate(fb.caches):
            c.stage(self.layer, LayerState(raw[b], comp[b], index[b]), counts[b], index_counts[b], fb.end_point)
        keys = mx.concatenate(keys, axis=1) if len(keys) > 1 else keys[0]
        mask = mx.concatenate(masks, axis=-1)[:, None]
        out = self._attend(q, keys, mask)  # [B, H, T, D]
        out = rope_tail(out, q_pos, self.inv_freq, r, sign=-1.0)
        grouped = out.transpose(0, 2, 1, 3).reshape(B * T, geo.groups, -1).transpose(1, 0, 2)  # [G, BT, in]
        low = (grouped @ self.o_a).transpose(1, 0, 2).reshape(B, T, -1)
        return self.o_b(low)

    def kv_rows(self, x: mx.array, pos: mx.array) -> mx.array:
        """The shared K=V rows ``[B, T, D]`` of normed inputs ``x [B, T, hidden]`` at positions ``pos [B, T]``
        (what the cache keeps; an MTP head's store writes them without running the attention)."""
        return rope_tail(rms_norm(self.kv(x), self.kv_norm, self.geo.norm_eps)[:, None], pos, self.inv_freq,
                         self.geo.rope_dims)[:, 0]

    def _extend(self, comp: "Compressor", held, part: int, x: mx.array, offsets: np.ndarray, T: int):
        """One compressor's rows extended by this forward's, the entries of every row ``[B, E, dim]``
        (padded to the most; the closed blocks pooled and written after the committed ones) and each
        row's entry count."""
        new = mx.concatenate([comp.kv(x), comp.gate(x)], axis=-1)  # [B, T, 2·width]
        rows, stores, counts = [], [], []
        for b, (st, *ents) in enumerate(held):
            rw = (st.comp if part == 1 else st.index).extended(new[b])
            store = ents[part - 1]
            counts.append(store.write(comp.closed(rw, int(offsets[b]), T, self.geo.norm_eps, self.inv_freq,
                                                  self.geo.rope_dims)))
            rows.append(rw)
            stores.append(store)
        shared = stores[0].rows
        if len(stores) > 1 and shared.n_rows == len(stores) \
                and all(e.rows is shared and e.row == b for b, e in enumerate(stores)):
            entries = shared.head(max(counts))  # a batch's rows (deepseek4_cache.EntryBatch): one slice
        else:
            entries = _padded_rows([e.view(n) for e, n in zip(stores, counts)])
        return rows, entries.astype(self.dtype), counts

    def _indexed(self, x, q_res, q_pos, entries: mx.array, visible: mx.array) -> mx.array:
        """``[B, T, E]``: the visible compressed entries the lightning indexer keeps for each query (its
        top ``index_top_k`` by score, over its own keys ``entries [B, E, I]``; all of them when there are
        no more)."""
        geo = self.geo
        B, T = q_pos.shape
        iq = self.index_q(q_res).reshape(B, T, geo.index_heads, geo.index_dim).transpose(0, 2, 1, 3)
        iq = rope_tail(iq, q_pos, self.inv_freq, geo.rope_dims).astype(mx.float32)  # [B, Hi, T, I]
        scores = mx.maximum(iq @ entries.astype(mx.float32)[:, None].swapaxes(-1, -2), 0.0) * geo.index_dim ** -0.5
        head_w = self.index_w(x).astype(mx.float32) * geo.index_heads ** -0.5  # [B, T, Hi]
        total = (scores * head_w.transpose(0, 2, 1)[..., None]).sum(axis=1)  # [B, T, E]
        E = total.shape[-1]
        k = min(geo.index_top_k, E)
        if k == E:
            return visible
        total = mx.where(visible, total, NEG_INF)
        kth = mx.topk(total, k, axis=-1).min(axis=-1, keepdims=True)  # the k-th best score of each query
        return visible & (total >= kth)

    def _attend(self, q: mx.array, keys: mx.array, mask: mx.array) -> mx.array:
        """Softmax attention of ``q [B, H, T, D]`` over the shared head ``keys [B, K, D]`` (also the
        values), each head with its sink logit in the normaliser."""
        qf, kf = q.astype(mx.float32), keys.astype(mx.float32)
        logits = (qf @ kf[:, None].swapaxes(-1, -2)) * (self.geo.head_dim ** -0.5)  # [B, H, T, K]
        logits = mx.where(mask, logits, NEG_INF)
        B, H, T, _ = logits.shape
        sinks = mx.broadcast_to(self.sinks[None, :, None, None], (B, H, T, 1))
        probs = mx.softmax(mx.concatenate([logits, sinks], axis=-1), axis=-1, precise=True)[..., :-1]
        return (probs @ kf[:, None]).astype(q.dtype)


def default_inv_freq(base: float, rope_dims: int) -> np.ndarray:
    return (1.0 / base ** (np.arange(0, rope_dims, 2, dtype=np.float64) / rope_dims)).astype(np.float32)


def yarn_inv_freq(base: float, rope_dims: int, factor: float, orig_ctx: int, beta_fast: float,
                  beta_slow: float) -> np.ndarray:
    """YaRN's per-pair frequencies (NTK-by-parts): pairs rotating faster than ``beta_fast`` turns over
    the original context keep their frequency, slower than ``beta_slow`` are divided by ``factor``,
    a linear ramp between. No attention-factor scaling (the compressed branch does not apply one)."""
    def correction(turns: float) -> float:
        return rope_dims * math.log(orig_ctx / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction(beta_fast)), 0)
    high = min(math.ceil(correction(beta_slow)), rope_dims - 1)
    if low == high:
        high += 0.001
    plain = default_inv_freq(base, rope_dims).astype(np.float64)
    ramp = np.clip((np.arange(rope_dims // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return (plain / factor * (1 - keep) + plain * keep).astype(np.float32)
