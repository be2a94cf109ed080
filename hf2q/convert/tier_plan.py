"""A tier's per-tensor types for one checkpoint: measure (``sensitivity``), then plan (``tiers``).

This is the only part of tier planning that reads tensor data; it runs inside ``build_plan``,
before the output file is opened, so ``--dry-run`` shows exactly the plan a conversion writes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs
import gguf
import numpy as np

from hf2q.arch.base import PlannedTensor
from hf2q.convert import tiers
from hf2q.convert.policy import ModelFacts, TensorFacts, allows_quantization, export_type, fallback_type, plan_types
from hf2q.convert.quant_names import GGUF_QUANTS, QuantName
from hf2q.convert.sensitivity import relative_errors, sample_row_ranges
from hf2q.progress import progress_bar
from hf2q.sources.imatrix import ImatrixFile, weights_for_tensor

log = logging.getLogger("hf2q.convert")
T = gguf.GGMLQuantizationType


@attrs.frozen
class TierEntry:
    name: str
    qtype: T
    role: str
    band: str
    n_elements: int
    importance: float | None = None  # dynamic tiers only
    errors: dict[T, float] | None = None  # measured relative error per candidate (dynamic tiers)


@attrs.frozen
class TierPlan:
    tier: str
    kind: str  # "dynamic" / "apex"
    reference: str | None  # the llama.cpp mix whose bytes bound the tier (None: an APEX table's own, smaller)
    budget_bytes: int | None
    imatrix_weighted: bool
    entries: tuple[TierEntry, ...]  # the planned (quantizable) tensors

    def descriptions(self) -> dict[str, str]:
        """Per planned tensor, the dry-run's short why: role/band, and for a dynamic tier the
        tensor's weight and its measured error at the chosen type."""
        out = {}
        for e in self.entries:
            err = e.errors.get(e.qtype) if e.errors else None
            out[e.name] = (f"{e.role}/{e.band}" if err is None
                           else f"{e.role}/{e.band} w={e.importance:.3g} err={err:.3g}")
        return out

    def planned_bytes(self) -> int:
        """Bytes of the tensors the allocation chose types for (those outside it, F16 for want of a block, excluded)."""
        return sum(tiers.tensor_bytes(e.qtype, e.n_elements) for e in self.entries if e.errors is not None)

    def report(self) -> dict:
        return {"tier": self.tier, "kind": self.kind, "reference_mix": self.reference,
                "budget_bytes": self.budget_bytes, "imatrix_weighted": self.imatrix_weighted,
                "tensors": [{"name": e.name, "type": e.qtype.name, "role": e.role, "band": e.band,
                             **({"importance": e.importance,
                                 "errors": {q.name: v for q, v in e.errors.items()}} if e.errors else {})}
                            for e in self.entries]}


def reference_mix(quant: QuantName) -> QuantName:
    """The fixed llama.cpp mix a tier is sized against: the one with its file type."""
    for q in GGUF_QUANTS.values():
        if q.ftype == quant.ftype and not q.needs_imatrix:
            return q
    raise ValueError(f"no reference mix for {quant.name}")  # pragma: no cover — table invariant


def plan_tier(quant: QuantName, facts: ModelFacts, tensors: Sequence[PlannedTensor], checkpoint,
              imatrix: ImatrixFile | None) -> tuple[list[T], TierPlan]:
    """GGML type per tensor (in ``tensors`` order) and the plan record for the report."""
    tfacts = [TensorFacts(t.name, t.ne, t.f32_only) for t in tensors]
    types = [export_type(quant, f) for f in tfacts]
    planned = [i for i, f in enumerate(tfacts) if allows_quantization(f)]
    tied = all(t.name != "output.weight" for t in tensors)
    ref = reference_mix(quant)
    ref_types = plan_types(ref, facts, tfacts, has_imatrix=imatrix is not None)
    mix_bytes = sum(tiers.tensor_bytes(ref_types[i], tensors[i].n_elements) for i in planned)
    ref_name: str | None = ref.name
    table_types: dict[int, T] = {}
    if quant.tier == "apex":
        tiers.check_apex_model(quant.name, facts.arch, facts.n_expert)
        table = tiers.APEX_TABLES[tiers.apex_level(quant.name)]
        table_types = {i: fallback_type(int(tensors[i].ne[0]),
                                        tiers.apex_type(table, tensors[i].name, facts.n_layer, tied))
                       for i in planned}
        table_bytes = sum(tiers.tensor_bytes(table_types[i], tensors[i].n_elements) for i in planned)
        # at most the llama.cpp mix of the tier's size class, so a comparison with it is at equal size;
        # the table is the starting point and the budget only where it is the smaller of the two
        budget = min(table_bytes, mix_bytes)
        if table_bytes < mix_bytes:
            ref_name = None

        def cands_of(i: int, t: PlannedTensor) -> tuple[T, ...]:
            return tiers.apex_candidates(table_types[i], t.name, int(t.ne[0]), tied)
    else:
        budget = mix_bytes

        def cands_of(i: int, t: PlannedTensor) -> tuple[T, ...]:
            return tiers.candidates(t.name, int(t.ne[0]), tied)

    choices, chosen = [], []
    n_elem = sum(tensors[i].n_elements for i in planned)
    with progress_bar(f"measure → {quant.name}", n_elem) as bar:
        for i in planned:
            t = tensors[i]
            cands = cands_of(i, t)
            if len(cands) == 1:  # no block fits the row (F16), or nothing to choose: outside the search
                types[i] = cands[0]
                budget -= tiers.tensor_bytes(cands[0], t.n_elements)
            else:
                errors = measure(t, checkpoint, cands, imatrix)
                choices.append(tiers.Choice(t.name, t.n_elements, tiers.importance(t.name, facts.n_layer, tied),
                                            errors))
                chosen.append(i)
            bar.advance(t.n_elements)
    picks = tiers.allocate(choices, budget)
    if table_types:  # where the table itself fits the budget, the search must not end up worse than it
        table_picks = [table_types[i] for i in chosen]
        if (sum(map(tiers.Choice.cost, choices, table_picks)) <= budget
                and sum(map(tiers.Choice.distortion, choices, table_picks))
                < sum(map(tiers.Choice.distortion, choices, picks))):
            picks = table_picks
    for i, q in zip(chosen, picks):
        types[i] = q
    by_index = dict(zip(chosen, choices))
    entries = tuple(TierEntry(tensors[i].name, types[i], tiers.role(tensors[i].name),
                              tiers.position_band(tiers.layer_of(tensors[i].name), facts.n_layer),
                              tensors[i].n_elements, by_index[i].importance if i in by_index else None,
                              dict(by_index[i].errors) if i in by_index else None) for i in planned)
    spent = sum(tiers.tensor_bytes(types[i], tensors[i].n_elements) for i in chosen)
    against = ref_name or "its APEX table"
    log.info("%s: %d tensors planned in %d bytes (budget %d, %s's)", quant.name, len(chosen), spent, budget, against)
    if spent > budget:  # even the smallest candidates do not fit
        log.warning("%s: the smallest types this model's rows allow take %d bytes, over the %d of %s",
                    quant.name, spent, budget, against)
    return types, TierPlan(quant.name, quant.tier, ref_name, budget, imatrix is not None, entries)


def measure(t: PlannedTensor, checkpoint, cands: Sequence[T], imatrix: ImatrixFile | None) -> dict[T, float]:
    """Relative error of ``t`` at each candidate over a row sample, imatrix-weighted when one is given."""
    n_rows, ncols = t.source.n_rows, int(t.ne[0])
    weights = weights_for_tensor(imatrix.weights, t.name, [int(v) for v in t.ne]) if imatrix else None
    ranges = sample_row_ranges(n_rows, ncols)
    rows = np.concatenate([t.source.rows(checkpoint, lo, hi) for lo, hi in ranges], axis=0)
    ids = np.concatenate([np.arange(lo, hi) for lo, hi in ranges])
    rows_per_expert = n_rows // weights.shape[0] if weights is not None else 0
    return relative_errors(rows, ids, cands, weights, rows_per_expert)
