"""Tensor-parallel sharding of a GGUF decoder: which slice of every weight a rank loads.

Megatron-style split over ``size`` ranks, done *before* the weights are loaded, so
each rank reads (from the memory-mapped GGUF) and holds only its share:

* attention: rank ``r`` owns a contiguous range of query heads and the KV heads they
  attend with. ``attn_q/k/v`` are column-parallel (their output rows are sliced by
  head), ``attn_output`` is row-parallel (its input columns are sliced the same way)
  and ends in one ``mx.distributed.all_sum``.
* gated MLP: ``ffn_gate``/``ffn_up`` column-parallel over the intermediate size,
  ``ffn_down`` row-parallel + one ``all_sum``. A decoder block therefore costs two
  all-reduces (attention, MLP), the minimum for a sequential residual stream.
* MoE (``*_exps`` tensors ``[experts, out, in]``): experts split by expert index; the
  router stays replicated, so every rank computes the same top-k and only the experts it
  owns contribute before the ``all_sum`` (:class:`ExpertParallelMoE`; gemma4's experts beside
  the dense MLP reduce with its partial sum, ``Gemma4Block.tp_experts``).
* hybrid models (Qwen 3.5's Gated DeltaNet layers): split by value head, each with the key head it
  reads (:class:`DeltaNetPlan`), so a rank's conv and delta-rule state hold its heads only;
  ``ssm_out`` is row-parallel like ``attn_output``.
* DeepSeek-V4 (low-rank queries over one shared K=V head, a grouped low-rank output): the query heads,
  their sinks and the output groups are cut, the K=V head, compressors and indexer replicated
  (``models/deepseek4_tp.py``).
* embeddings, norms and the LM head stay replicated: after each all-reduce every rank
  holds the same hidden state, so every rank can produce the logits.

Quantized weights are sliced in their GGUF block form: a row slice is a byte slice of
whole rows (any type), a column slice must start and end on a quant block (32 elements,
256 for K-quants), which is checked. The KV cache of a rank holds only its KV heads.

When a model has fewer KV heads than ranks (Gemma 3: one KV head) each KV head is
replicated on the ``size / n_kv`` ranks whose query heads use it.
"""

from __future__ import annotations

from typing import Any

import attrs

from hf2q.engine.tp_shards import RowParallel, gather_ranges, own_experts, slice_tensor
from hf2q.errors import InputError
from hf2q.formats.gguf_file import GGUFFile
from hf2q.formats.gguf_keys import ExtraKeys, Keys


@attrs.frozen
class HeadPlan:
    """The attention heads rank ``rank`` owns: query heads ``[q_start, q_start+q_count)``, KV likewise."""

    rank: int
    size: int
    n_heads: int
    n_kv_heads: int
    q_start: int
    q_count: int
    kv_start: int
    kv_count: int

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold each KV head (1 unless KV heads are fewer than ranks)."""
        return max(1, self.size // self.n_kv_heads)


def head_plan(n_heads: int, n_kv_heads: int, size: int, rank: int, what: str = "model") -> HeadPlan:
    """Split ``n_heads`` query / ``n_kv_heads`` KV heads over ``size`` ranks, or say why it cannot."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside 0..{size - 1}")
    if n_heads % size:
        raise InputError(f"{what}: {n_heads} attention heads do not split over {size} ranks "
                         f"(--tensor-parallel must divide the head count)")
    q_count = n_heads // size
    if n_kv_heads % size == 0:
        kv_count = n_kv_heads // size
        kv_start = rank * kv_count
    elif size % n_kv_heads == 0:  # fewer KV heads than ranks: replicate each over size / n_kv ranks
        kv_count = 1
        kv_start = rank // (size // n_kv_heads)
    else:
        raise InputError(f"{what}: {n_kv_heads} KV heads do not split over {size} ranks "
                         f"(--tensor-parallel must divide the KV head count, or be a multiple of it)")
    return HeadPlan(rank, size, n_heads, n_kv_heads, rank * q_count, q_count, kv_start, kv_count)


def _runs(heads: list[int], width: int) -> list[tuple[int, int]]:
    """Element ranges ``[h·width, (h+1)·width)`` of ``heads``, consecutive heads merged into one range."""
    out: list[tuple[int, int]] = []
    for h in heads:
        if out and out[-1][1] == h * width:
            out[-1] = (out[-1][0], (h + 1) * width)
        else:
            out.append((h * width, (h + 1) * width))
    return out


@attrs.frozen
class DeltaNetPlan:
    """The linear-attention (Gated DeltaNet) heads rank ``rank`` owns, in the order its shard holds them.

    Value head ``j`` reads key head ``j mod k_heads`` (the converter tiles the value heads), and a shard
    keeps that rule locally: with key heads split ``k_heads / size`` per rank, rank ``r`` takes key heads
    ``K_r`` and the value heads ``t·k_heads + g`` (``g`` in ``K_r``, every ``t``) in ``(t, g)`` order; when
    the key heads do not split, every rank keeps all of them and a contiguous share of value heads. The
    conv and delta-rule state of a head lives with it, so each rank's recurrent state is its share."""

    key_heads: tuple[int, ...]
    value_heads: tuple[int, ...]


def deltanet_plan(k_heads: int, v_heads: int, size: int, rank: int, what: str = "model") -> DeltaNetPlan:
    if v_heads % size:
        raise InputError(f"{what}: {v_heads} linear-attention value heads do not split over {size} ranks")
    per_key = v_heads // k_heads
    if k_heads % size == 0:
        kl = k_heads // size
        keys = tuple(range(rank * kl, (rank + 1) * kl))
        return DeltaNetPlan(keys, tuple(t * k_heads + g for t in range(per_key) for g in keys))
    share = v_heads // size
    if share % k_heads:
        raise InputError(f"{what}: {k_heads} linear-attention key heads with {v_heads} value heads do not split "
                         f"over {size} ranks")
    return DeltaNetPlan(tuple(range(k_heads)), tuple(range(rank * share, (rank + 1) * share)))


def _shard_deltanet(g: GGUFFile, rank: int, size: int, meta: dict, tensors: dict) -> None:
    """Cut every linear-attention layer's tensors to this rank's heads (:class:`DeltaNetPlan`):
    ``attn_qkv`` / ``ssm_conv1d`` by channel (q and k rows of its key heads, v rows of its value heads),
    ``attn_gate``, ``ssm_beta/alpha``, ``ssm_a``, ``ssm_dt`` by value head, ``ssm_out`` by input
    column (row-parallel, its ``all_sum`` added by :func:`parallelize`)."""
    hp = g.hparams
    k_heads, v_heads, k_dim = hp.ssm_group_count, hp.ssm_time_step_rank, hp.ssm_state_size
    v_dim = hp.ssm_inner_size // v_heads
    plan = deltanet_plan(k_heads, v_heads, size, rank, g.path.name)
    kd = k_heads * k_dim
    key_rows = _runs(list(plan.key_heads), k_dim)
    channels = key_rows + [(kd + a, kd + b) for a, b in key_rows] + \
        [(2 * kd + a, 2 * kd + b) for a, b in _runs(list(plan.value_heads), v_dim)]
    per_value = _runs(list(plan.value_heads), v_dim)
    heads = _runs(list(plan.value_heads), 1)
    rules = {"attn_qkv.weight": (-2, channels), "ssm_conv1d.weight": (-2, channels),
             "attn_gate.weight": (-2, per_value), "ssm_out.weight": (-1, per_value),
             "ssm_beta.weight": (-2, heads), "ssm_alpha.weight": (-2, heads),
             "ssm_a": (0, heads), "ssm_dt.bias": (0, heads)}
    for i, recurrent in enumerate(hp.recurrent_layers):
        if not recurrent:
            continue
        for suffix, (axis, ranges) in rules.items():
            name = f"blk.{i}.{suffix}"
            if name in tensors:
                tensors[name] = gather_ranges(g.tensors[name], axis, ranges)
    meta[hp.key(Keys.SSM.GROUP_COUNT)] = len(plan.key_heads)
    meta[hp.key(Keys.SSM.TIME_STEP_RANK)] = len(plan.value_heads)
    meta[hp.key(Keys.SSM.INNER_SIZE)] = len(plan.value_heads) * v_dim


def _even_range(n: int, size: int, rank: int, what: str) -> tuple[int, int]:
    if n % size:
        raise InputError(f"{what} of {n} does not split over {size} ranks")
    k = n // size
    return rank * k, (rank + 1) * k


def shard_gguf(g: GGUFFile, rank: int, size: int) -> GGUFFile:
    """A view of ``g`` holding only rank ``rank``'s share; metadata reports the per-rank head counts.

    The engine's family builders read this view as if it were a smaller model, so no
    family file needs to know about tensor parallelism; :func:`parallelize` then adds the
    all-reduces.
    """
    if size == 1:
        return g
    name, hp = g.path.name, g.hparams
    n_heads, layers = attention_geometry(g)
    plans = [head_plan(n_heads, n_kv, size, rank, name) for n_kv, _, _ in layers]
    meta = dict(g.metadata)
    meta[hp.key(Keys.Attention.HEAD_COUNT)] = plans[0].q_count
    kv_counts = [p.kv_count for p in plans]
    meta[hp.key(Keys.Attention.HEAD_COUNT_KV)] = kv_counts if isinstance(hp.n_kv_heads, list) else kv_counts[0]
    if g.arch != "gemma4":  # one head size: the shard's hidden / heads no longer gives it (gemma4 stores both)
        meta[hp.key(Keys.Attention.KEY_LENGTH)] = layers[0][1]
        meta[hp.key(Keys.Attention.VALUE_LENGTH)] = layers[0][2]
    meta[ExtraKeys.TENSOR_PARALLEL] = [rank, size]
    q_per_head = _query_heads_factor(g, n_heads, layers)  # 2: query + output gate (qwen35)

    def rules_of(i: int) -> dict[str, tuple[int, tuple[int, int]]]:
        """Layer ``i``'s attention cuts: tensor suffix → (axis, range)."""
        plan, (_, head_dim, v_dim) = plans[i], layers[i]
        q_rows = (plan.q_start * q_per_head * head_dim, (plan.q_start + plan.q_count) * q_per_head * head_dim)
        k_rows = (plan.kv_start * head_dim, (plan.kv_start + plan.kv_count) * head_dim)
        v_rows = (plan.kv_start * v_dim, (plan.kv_start + plan.kv_count) * v_dim)
        o_cols = (plan.q_start * v_dim, (plan.q_start + plan.q_count) * v_dim)
        return {"attn_q.weight": (-2, q_rows), "attn_q.bias": (0, q_rows),
                "attn_k.weight": (-2, k_rows), "attn_k.bias": (0, k_rows),
                "attn_v.weight": (-2, v_rows), "attn_v.bias": (0, v_rows),
                "attn_output.weight": (-1, o_cols)}
    layer_rules = [rules_of(i) for i in range(len(layers))]
    ff = hp.feed_forward_length
    tensors = dict(g.tensors)
    for tname, t in g.tensors.items():
        if not tname.startswith("blk."):
            continue
        _, index, suffix = tname.split(".", 2)
        rules = layer_rules[min(int(index), len(layer_rules) - 1)]
        if suffix in rules:
            axis, (a, b) = rules[suffix]
            tensors[tname] = slice_tensor(t, axis, a, b)
        elif suffix in ("ffn_gate.weight", "ffn_up.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight"):
            tensors[tname] = slice_tensor(t, -2, *_even_range(t.shape[-2], size, rank, f"{tname} rows"))
        elif suffix in ("ffn_down.weight", "ffn_down_shexp.weight"):
            tensors[tname] = slice_tensor(t, -1, *_even_range(t.shape[-1], size, rank, f"{tname} columns"))
        elif suffix in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
                        "ffn_gate_up_exps.weight"):  # gate_up: gemma4's fused [gate; up] experts
            tensors[tname] = slice_tensor(t, 0, *_even_range(t.shape[0], size, rank, f"{tname} experts"))
    if isinstance(ff, int):
        meta[hp.key(Keys.LLM.FEED_FORWARD_LENGTH)] = ff // size
    if any(hp.recurrent_layers):
        _shard_deltanet(g, rank, size, meta, tensors)
    if g.arch == "deepseek4":  # low-rank queries, one shared K=V head, grouped low-rank output
        from hf2q.engine.models.deepseek4_tp import shard_attention

        shard_attention(g, plans[0], meta, tensors)
    return GGUFFile(g.path, meta, tensors, g.file_bytes)


def attention_geometry(g: GGUFFile) -> tuple[int, list[tuple[int, int, int]]]:
    """``(query heads, [(KV heads, key head size, value head size) per layer])``: one shape for most
    families, Gemma 4's own per layer (sliding and global layers differ in KV heads and head size)."""
    hp = g.hparams
    if g.arch == "gemma4":
        from hf2q.engine.models.gemma4 import layer_shapes

        n_heads = hp.n_heads
        if isinstance(n_heads, list):
            raise InputError(f"{g.path.name}: per-layer query head counts are not supported with tensor parallelism")
        return int(n_heads), [(s.n_kv, s.head_dim, s.head_dim) for s in layer_shapes(g)]
    n_heads, n_kv = hp.uniform_heads(" with tensor parallelism")
    return n_heads, [(n_kv, hp.key_length, hp.value_length)] * max(1, hp.n_layers)


def rank_plan(g: GGUFFile, size: int, rank: int) -> HeadPlan:
    """Rank ``rank``'s heads of the layer with the most KV heads: the KV export/import split. Where layers
    differ (Gemma 4's global layers have fewer KV heads than its sliding ones), that layer's replicas are the
    fewest, so a gathered block drops only ranks that are copies in every layer, never a rank's own rows."""
    n_heads, layers = attention_geometry(g)
    return head_plan(n_heads, max(n_kv for n_kv, _, _ in layers), size, rank, g.path.name)


def _query_heads_factor(g: GGUFFile, n_heads: int, layers: list[tuple[int, int, int]]) -> int:
    """``attn_q`` rows per query head, in head sizes: 1, or 2 where each head's output gate follows its
    query rows (Qwen 3.5's gated attention)."""
    for i, (_, head_dim, _) in enumerate(layers):
        t = g.tensors.get(f"blk.{i}.attn_q.weight")
        if t is not None:
            return 2 if t.shape[-2] == 2 * n_heads * head_dim else 1
    return 1


class ExpertParallelMoE:
    """A routed MoE feed-forward whose experts are split by expert index over the ranks.

    Built around the engine's ``MoEFeedForward`` (``router``, ``gate_exps``/``up_exps``/
    ``down_exps`` ``Linear``s holding this rank's ``E / size`` experts, ``top_k``,
    ``normalize``). The router is replicated, so every rank picks the same top-k experts
    and weights for a token; each rank applies only the chosen experts it owns (the others
    get weight 0) and one ``all_sum`` adds the ranks' shares — unless ``reduce`` is False (a block that
    adds other partials first and reduces them together: :class:`SharedExpertParallelMoE`).
    """

    def __init__(self, ffn, rank: int, size: int, group, reduce: bool = True):
        import mlx.core as mx

        self.ffn = ffn
        self.router, self.gate_exps, self.up_exps, self.down_exps = ffn.router, ffn.gate_exps, ffn.up_exps, ffn.down_exps
        self.group = group
        self.reduce = reduce
        self.n_local = int(ffn.gate_exps.shape[0])
        self.first = rank * self.n_local
        self._mx = mx

    @property
    def nbytes(self) -> int:
        return sum(lin.nbytes for lin in (self.ffn.router, self.ffn.gate_exps, self.ffn.up_exps, self.ffn.down_exps))

    def __call__(self, x):
        y = self.local(x)
        return self._mx.distributed.all_sum(y, group=self.group) if self.reduce else y

    def local(self, x):
        """This rank's share of the output (its experts' weighted sum), before the ``all_sum``."""
        from hf2q.engine.expert_route import ExpertRoute
        from hf2q.engine.layers import silu

        mx, f = self._mx, self.ffn
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = mx.softmax(f.router(flat).astype(mx.float32), axis=-1, precise=True)
        k = f.top_k
        idx = mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k]
        weights = mx.take_along_axis(probs, idx, axis=-1)
        if f.normalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        local, weights = own_experts(idx, weights, self.first, self.n_local)
        route = ExpertRoute.of(local, f.gate_exps.shape[0])
        return route.glu(flat, [f.gate_exps, f.up_exps], f.down_exps, silu, weights).reshape(shape)


class SharedExpertParallelMoE:
    """Qwen 3.5's ``SharedExpertMoE`` run by its own ``__call__`` on this rank's shares, reduced once.

    Its routed experts become this rank's expert share (:class:`ExpertParallelMoE`, not reduced); its
    shared gated MLP already holds this rank's ``gate``/``up`` rows and ``down`` columns (``shard_gguf``),
    and the replicated per-token gate σ(shared_gate·x) scales a sum, so it scales each rank's partial
    alike. The model's own formula over a rank's shares is therefore that rank's partial of the whole
    block, and one ``all_sum`` adds the ranks' partials.
    """

    def __init__(self, ffn, rank: int, size: int, group):
        import mlx.core as mx

        ffn.routed = ExpertParallelMoE(ffn.routed, rank, size, group, reduce=False)
        self.ffn = ffn
        self.group = group
        self._mx = mx

    def linears(self):
        return self.ffn.linears()

    def __call__(self, x):
        return self._mx.distributed.all_sum(self.ffn(x), group=self.group)


def parallelize(model, group) -> Any:
    """Make a model built from a :func:`shard_gguf` view compute the full model across ``group``.

    Every ``attn.o`` and dense ``ffn.down`` becomes :class:`RowParallel`; a routed MoE
    feed-forward becomes :class:`ExpertParallelMoE` (:func:`parallelize_block`); a model with a
    ``tp_parallelize(group)`` of its own does its blocks itself. Any other feed-forward is refused
    rather than silently computing a wrong sum. The model keeps the group (``tp_group``) for a block
    it builds later (Qwen 3.5's MTP draft head).
    """
    if group.size() == 1:
        return model
    if getattr(model, "is_embedding_model", False):
        raise InputError("tensor parallelism serves decoder (chat) models only")
    own = getattr(model, "tp_parallelize", None)  # a family whose blocks split their own way (DeepSeek-V4)
    if own is not None:
        own(group)
    else:
        for layer in getattr(model, "layers", None) or model.blocks:  # blocks: gemma4
            parallelize_block(layer, group)
    model.tp_group = group
    return model


def parallelize_block(layer, group) -> None:
    """One decoder block of a shard computing the full block: its mixer's output and its feed-forward's
    down projection end in an all-reduce."""
    mixer = getattr(layer, "attn", None) or getattr(layer, "mixer", None)  # mixer: a hybrid model's block
    if hasattr(mixer, "o"):
        mixer.o = RowParallel(mixer.o, group)  # attention (gated or not)
    elif hasattr(mixer, "out") and hasattr(mixer, "qkv"):
        mixer.out = RowParallel(mixer.out, group)  # Gated DeltaNet: its value heads are split
    else:
        raise InputError(f"tensor parallelism does not support the layer {type(layer).__name__} yet")
    if getattr(layer, "experts", None) is not None:  # gemma4's experts beside the MLP, each half with its post-norm:
        layer.tp_experts(group)  # the block reduces both partial sums at once
        return
    ffn = layer.ffn
    if hasattr(ffn, "down") and hasattr(ffn, "gate"):
        ffn.down = RowParallel(ffn.down, group)
    elif all(hasattr(ffn, a) for a in ("router", "gate_exps", "up_exps", "down_exps", "top_k")):
        layer.ffn = ExpertParallelMoE(ffn, group.rank(), group.size(), group)
    elif all(hasattr(ffn, a) for a in ("routed", "shared", "shared_gate")):
        layer.ffn = SharedExpertParallelMoE(ffn, group.rank(), group.size(), group)
    else:
        raise InputError(f"tensor parallelism does not support the feed-forward layer "
                         f"{type(ffn).__name__} yet")
