"""DeepSeek-V4 over tensor-parallel ranks: which share of its attention a rank holds, and where its
block's two all-reduces go.

The attention's only per-head parts are the query heads (rows of ``attn_q_b``), their sink logits and
the grouped low-rank output, so those are what a rank cuts:

* ``attn_q_a`` and its norm stay whole: the low-rank query residual is small, every head reads it, and
  the lightning indexer's queries are built from it too;
* the single shared K=V head (``attn_kv``), the compressors and the whole indexer stay whole: the
  indexer's top-k must rank the *summed* score of all its heads, so a split indexer would cost an extra
  all-reduce before every top-k, and a replicated one costs only its own (small) compute; each rank
  therefore holds the same compact cache as one rank (its windowed rows, entries and compressor
  state), and no cache row is split;
* the output ``attn_output_a`` is grouped: group ``g`` mixes the outputs of heads
  ``[g·H/G, (g+1)·H/G)`` down to ``o_lora`` values. A rank whose heads are whole groups keeps those
  groups' rows; a rank whose heads lie inside one group keeps that group's rows and the input columns
  of its heads (the group's low-rank sum then splits over ranks). Either way ``attn_output_b`` keeps the
  columns of the rank's groups, and since both steps are linear the ranks' ``attn_output_b`` outputs sum
  to the model's: one all-reduce.

The feed-forward is cut as for other MoE families (``engine/tensor_parallel.py``): routed experts by
expert index with the router, its bias and the hash table replicated, the shared expert like a dense
MLP; the routed share and the shared-expert partial are added before one all-reduce.
"""

from __future__ import annotations

import attrs

from hf2q.errors import InputError
from hf2q.formats.gguf_keys import ExtraKeys


@attrs.frozen
class OutputGroupPlan:
    """A rank's share of the grouped output: groups ``[group_start, group_start + group_count)`` and, of
    each group's input (its heads' outputs side by side), columns ``[col_start, col_stop)``."""

    group_start: int
    group_count: int
    col_start: int
    col_stop: int


def output_group_plan(n_heads: int, groups: int, head_dim: int, q_start: int, q_count: int,
                      what: str = "model") -> OutputGroupPlan:
    """The output groups the query heads ``[q_start, q_start + q_count)`` feed, or why they cannot be cut."""
    if groups <= 0 or n_heads % groups:
        raise InputError(f"{what}: {n_heads} attention heads do not split into {groups} output groups")
    per_group = n_heads // groups
    if q_count % per_group == 0 and q_start % per_group == 0:  # whole groups
        return OutputGroupPlan(q_start // per_group, q_count // per_group, 0, per_group * head_dim)
    first = q_start // per_group
    if (q_start + q_count - 1) // per_group == first:  # inside one group
        offset = q_start - first * per_group
        return OutputGroupPlan(first, 1, offset * head_dim, (offset + q_count) * head_dim)
    raise InputError(f"{what}: {q_count} heads per rank straddle its {groups} output groups of {per_group} "
                     f"heads (--tensor-parallel must divide the group count or be a multiple of it)")


def shard_attention(g, plan, meta: dict, tensors: dict) -> None:
    """Cut every layer's attention tensors of ``tensors`` to rank ``plan``'s heads (``HeadPlan``), and
    record the rank's output group count in ``meta`` (the view's model reads it as its own)."""
    from hf2q.engine.tp_shards import slice_tensor

    hp = g.hparams
    head_dim, groups, o_lora = hp.key_length, int(hp.require(ExtraKeys.OUTPUT_GROUP_COUNT)), \
        int(hp.require(ExtraKeys.OUTPUT_LORA_RANK))
    out = output_group_plan(plan.n_heads, groups, head_dim, plan.q_start, plan.q_count, g.path.name)
    heads = (plan.q_start, plan.q_start + plan.q_count)
    group_rows = (out.group_start * o_lora, (out.group_start + out.group_count) * o_lora)
    cuts = {"attn_q_b.weight": [(-2, (heads[0] * head_dim, heads[1] * head_dim))], "attn_sinks.weight": [(0, heads)],
            "attn_output_a.weight": [(-2, group_rows), (-1, (out.col_start, out.col_stop))],
            "attn_output_b.weight": [(-1, group_rows)]}
    for name, t in g.tensors.items():
        rule = cuts.get(name.split(".", 2)[-1]) if name.startswith("blk.") else None
        if rule is None:
            continue
        for axis, (a, b) in rule:
            if b - a < t.shape[axis]:  # a whole axis stays as it is
                t = slice_tensor(t, axis, a, b)
        tensors[name] = t
    meta[hp.key(ExtraKeys.OUTPUT_GROUP_COUNT)] = out.group_count


class ExpertShareMoE:
    """A ``Deepseek4MoE`` applying only this rank's experts and its share of the shared expert, then
    one all-reduce.

    Routing runs whole on every rank (the router, its bias and the hash table are replicated), so the
    ranks agree on every token's experts and weights; a chosen expert another rank holds gets weight 0
    here, and the shared expert's rows and columns are this rank's, so the ranks' outputs sum to the
    model's."""

    def __init__(self, moe, rank: int, group):
        import mlx.core as mx

        self.moe, self.group, self._mx = moe, group, mx
        self.n_local = int(moe.gate_exps.shape[0])
        self.first = rank * self.n_local

    def linears(self):
        return self.moe.linears()

    def __call__(self, x, tokens):
        from hf2q.engine.tp_shards import own_experts

        flat = x.reshape(-1, x.shape[-1])
        idx, weights = self.moe.route(flat, tokens)
        y = self.moe.experts(flat, *own_experts(idx, weights, self.first, self.n_local))
        return self._mx.distributed.all_sum(y, group=self.group).reshape(x.shape)


def parallelize(model, group) -> None:
    for block in model.blocks:
        parallelize_block(block, group)


def parallelize_block(block, group) -> None:
    """A ``Deepseek4Block`` built from a shard computing the whole block: ``attn_output_b`` row-parallel and
    the MoE reduced once (two all-reduces a block)."""
    from hf2q.engine.tp_shards import RowParallel

    block.attn.o_b = RowParallel(block.attn.o_b, group)
    block.moe = ExpertShareMoE(block.moe, group.rank(), group)
