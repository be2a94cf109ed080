"""Every tier's plan fits in the bytes of llama.cpp's mix of its size class (docs/QUALITY.md, "Mixed-bit tiers").

The mix's size is what llama.cpp's own type policy spends on the same checkpoint (``policy.py``
reproduces ``llama-quantize``'s choices byte for byte, checked against it in the parity tests); the
tier's is what its plan writes. Planner only: no file is written and no llama.cpp tool runs.
"""

from __future__ import annotations

import numpy as np
import pytest

from hf2q.convert import tiers
from hf2q.convert.pipeline import build_plan
from hf2q.convert.policy import TensorFacts, allows_quantization, fallback_type
from hf2q.convert.quant_names import TIER_QUANTS
from hf2q.convert.tier_plan import reference_mix
from hf2q.sources.imatrix import ImatrixFile

DENSE = ("dynamic-q2", "dynamic-q3", "dynamic-q4")
APEX = ("apex-compact", "apex-balanced", "apex-quality", "apex-i-compact")  # apex-i-*: one stands for all three


def _synthetic_imatrix(plan) -> ImatrixFile:
    """Positive per-column weights of a few orders of magnitude for every planned tensor (each expert its
    own row), seeded: the budget must hold whatever the weights make the measured errors."""
    rng = np.random.default_rng(15)
    weights = {}
    for t in plan.tensors:
        if allows_quantization(TensorFacts(t.name, t.ne, t.f32_only)) and not t.name.startswith("token_embd"):
            n_expert = int(t.ne[2]) if len(t.ne) > 2 else 1
            weights[t.name] = rng.lognormal(0.0, 1.5, int(t.ne[0]) * n_expert).astype(np.float32)
    return ImatrixFile(weights, legacy=False)


@pytest.fixture(scope="module")
def planned(tiny_checkpoint):
    """``planned(family, tier)`` → (the tier's plan, its mix's plan), each built once per module."""
    cache: dict = {}

    def get(family: str, name: str):
        if (family, name) not in cache:
            src = tiny_checkpoint(family)
            mix = build_plan(src, reference_mix(TIER_QUANTS[name]))
            mix.checkpoint.close()
            imatrix = _synthetic_imatrix(mix) if TIER_QUANTS[name].needs_imatrix else None
            plan = build_plan(src, TIER_QUANTS[name], imatrix=imatrix)
            plan.checkpoint.close()
            cache[family, name] = plan, mix
        return cache[family, name]

    return get


@pytest.mark.parametrize("family, name", [("llama", n) for n in DENSE] + [("qwen3_moe", n) for n in APEX])
def test_tier_plan_is_no_larger_than_its_mix(planned, family, name):
    plan, mix = planned(family, name)
    assert plan.total_bytes <= mix.total_bytes
    assert plan.tier.planned_bytes() <= plan.tier.budget_bytes


@pytest.mark.parametrize("level", ["compact", "quality"])
def test_an_apex_table_larger_than_its_mix_is_cut_to_the_mix(planned, level):
    # on this model both tables spend more than their mix: the budget, and so the plan, is the mix's
    plan, mix = planned("qwen3_moe", f"apex-{level}")
    n_layer = mix.family.block_count
    tied = all(t.name != "output.weight" for t in mix.tensors)
    table = tiers.APEX_TABLES[level]
    table_bytes = mix.total_bytes  # everything the table does not plan is as in the mix
    for t, lay in zip(mix.tensors, mix.layouts):
        if allows_quantization(TensorFacts(t.name, t.ne, t.f32_only)):
            want = fallback_type(int(t.ne[0]), tiers.apex_type(table, t.name, n_layer, tied))
            table_bytes += tiers.tensor_bytes(want, t.n_elements) - lay.nbytes
    assert table_bytes > mix.total_bytes
    assert plan.tier.reference == mix.quant.name
    assert plan.total_bytes <= mix.total_bytes
