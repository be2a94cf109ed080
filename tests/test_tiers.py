"""The mixed-bit tier planner (``hf2q/convert/tiers.py``) and its measurements (``sensitivity.py``).

The allocation is checked against exhaustive search on small problems (hypothesis), the
measured errors against gguf-py's independent quantizers, and the name rules through the CLI.
"""

from __future__ import annotations

import itertools

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf2q.convert import tiers
from hf2q.convert.quant_names import TIER_QUANTS, parse_gguf_quant
from hf2q.convert.sensitivity import relative_errors, sample_row_ranges
from hf2q.errors import InputError

T = gguf.GGMLQuantizationType
TYPES = (T.Q4_0, T.Q5_0, T.Q8_0)  # bytes per 32 values: 18, 22, 34


def _choice(name: str, n_blocks: int, imp: float, errs) -> tiers.Choice:
    return tiers.Choice(name, 32 * n_blocks, imp, dict(zip(TYPES, errs)))


def _size(choices, plan) -> int:
    return sum(c.cost(q) for c, q in zip(choices, plan))


def _distortion(choices, plan) -> float:
    return sum(c.distortion(q) for c, q in zip(choices, plan))


_problem = st.lists(st.tuples(st.integers(1, 40), st.floats(0.1, 10.0),
                              st.lists(st.floats(1e-6, 1.0), min_size=3, max_size=3)), min_size=1, max_size=5)


def _case(problem, frac):
    """Choices with errors falling as bits rise, and a budget ``frac`` of the way from all-Q4_0 to all-Q8_0."""
    choices = [_choice(f"t{i}", n, imp, sorted(e, reverse=True)) for i, (n, imp, e) in enumerate(problem)]
    lo = _size(choices, [T.Q4_0] * len(choices))
    hi = _size(choices, [T.Q8_0] * len(choices))
    return choices, int(lo + frac * (hi - lo))


@settings(max_examples=60, deadline=None)
@given(_problem, st.floats(0.0, 1.0))
def test_allocation_fits_the_budget_and_no_upgrade_left_would_fit(problem, frac):
    choices, budget = _case(problem, frac)
    plan = tiers.allocate(choices, budget)
    assert _size(choices, plan) <= budget
    left = budget - _size(choices, plan)
    for c, q in zip(choices, plan):  # greedy fill leaves no affordable improvement behind
        for r in TYPES:
            assert not (0 < c.cost(r) - c.cost(q) <= left and c.distortion(r) < c.distortion(q))


@settings(max_examples=40, deadline=None)
@given(_problem, st.floats(0.0, 1.0))
def test_allocation_is_close_to_the_exhaustive_optimum(problem, frac):
    choices, budget = _case(problem, frac)
    best = min(_distortion(choices, p) for p in itertools.product(TYPES, repeat=len(choices))
               if _size(choices, p) <= budget)
    got = _distortion(choices, tiers.allocate(choices, budget))
    # the Lagrangian optimum is exact at its own size; the greedy fill can miss by at most one
    # tensor's step, bounded here by the largest single distortion
    assert got <= best + max(c.distortion(T.Q4_0) for c in choices) + 1e-12


def test_bits_go_where_they_buy_most():
    # same size, same errors: the tensor that matters 10× more is the one upgraded
    a, b = _choice("a", 8, 1.0, (1e-2, 3e-3, 1e-5)), _choice("b", 8, 10.0, (1e-2, 3e-3, 1e-5))
    budget = a.cost(T.Q4_0) + b.cost(T.Q8_0)
    assert tiers.allocate([a, b], budget) == [T.Q4_0, T.Q8_0]
    # an unbounded budget takes the least-error candidate everywhere; too small a budget, the smallest
    assert tiers.allocate([a, b], 10**9) == [T.Q8_0, T.Q8_0]
    assert tiers.allocate([a, b], 1) == [T.Q4_0, T.Q4_0]


def test_a_bigger_and_worse_candidate_is_never_chosen():
    c = tiers.Choice("x", 64, 1.0, {T.Q4_0: 1e-3, T.Q5_0: 2e-3, T.Q8_0: 1e-5})
    assert T.Q5_0 not in c.options()
    assert tiers.allocate([c], c.cost(T.Q5_0)) == [T.Q4_0]


def test_candidates_follow_the_row_length_rules():
    assert tiers.candidates("blk.0.attn_q.weight", 576, tied_output=False) == tiers.BLOCK32_CANDIDATES
    assert set(tiers.candidates("blk.0.ffn_down.weight", 1536, False)) >= {T.Q2_K, T.Q3_K, T.Q6_K, T.Q4_0}
    assert tiers.candidates("blk.0.ffn_down.weight", 100, False) == (T.F16,)
    out = tiers.candidates("output.weight", 1024, False)
    assert out and all(tiers.bits_per_weight(q) >= tiers.OUTPUT_MIN_BPW for q in out)
    # a tied embedding is the logits matrix too; an untied one is not
    assert T.Q2_K not in tiers.candidates("token_embd.weight", 1024, True)
    assert T.Q2_K in tiers.candidates("token_embd.weight", 1024, False)


def test_roles_bands_and_importance():
    assert tiers.role("blk.3.ffn_up_exps.weight") == "expert"
    assert tiers.role("blk.3.ffn_down_shexp.weight") == "shared"
    assert tiers.role("blk.3.attn_v.weight") == "attn_v"
    assert tiers.role("blk.3.ssm_out.weight") == "ssm"
    assert [tiers.position_band(i, 16) for i in (0, 1, 2, 3, 4, 8, 12, 13, 14, 15)] == \
        ["edge", "edge", "near", "near", "middle", "middle", "near", "near", "edge", "edge"]
    assert tiers.position_band(0, 2) == tiers.position_band(1, 2) == "edge"
    n = 24
    mid, edge = tiers.importance("blk.12.ffn_down.weight", n, False), tiers.importance("blk.0.ffn_down.weight", n, False)
    assert edge > mid > tiers.importance("blk.12.attn_k.weight", n, False)
    assert tiers.importance("output.weight", n, False) > edge
    assert tiers.importance("token_embd.weight", n, True) == tiers.importance("output.weight", n, False)


def test_apex_tables_separate_experts_shared_attention():
    for level, table in tiers.APEX_TABLES.items():
        n = 16
        mid = tiers.apex_type(table, "blk.8.ffn_up_exps.weight", n)
        edge = tiers.apex_type(table, "blk.0.ffn_up_exps.weight", n)
        shared = tiers.apex_type(table, "blk.8.ffn_up_shexp.weight", n)
        attn = tiers.apex_type(table, "blk.8.attn_q.weight", n)
        bpw = tiers.bits_per_weight
        assert bpw(edge) >= bpw(mid) and bpw(shared) > bpw(mid) and bpw(attn) > bpw(mid), level
    q, b, c = (tiers.APEX_TABLES[k] for k in ("quality", "balanced", "compact"))
    for band in ("edge", "near", "middle"):
        assert tiers.bits_per_weight(q.expert[band]) >= tiers.bits_per_weight(b.expert[band]) \
            >= tiers.bits_per_weight(c.expert[band])
    with pytest.raises(InputError, match="mixture-of-experts"):
        tiers.check_apex_model("apex-compact", "llama", 0)


# ------------------------------------------------------------------------ measurements
def test_sample_ranges_are_spread_and_bounded():
    r = sample_row_ranges(10_000, 576)
    assert r[0][0] == 0 and r[-1][1] == 10_000
    assert all(a[1] <= b[0] for a, b in zip(r, r[1:]))
    assert sum(h - lo for lo, h in r) * 576 <= 2 * (1 << 16)
    assert sample_row_ranges(3, 64) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0])
def test_measured_error_matches_gguf_py_quantizer(qtype):
    rng = np.random.default_rng(1)
    x = (rng.standard_t(4, (48, 256)) * 0.02).astype(np.float32)
    xh = x.astype(np.float16).astype(np.float32)
    y = gguf.quants.dequantize(gguf.quants.quantize(xh, qtype), qtype).reshape(xh.shape)
    want = float(((xh.astype(np.float64) - y) ** 2).sum() / (xh.astype(np.float64) ** 2).sum())
    got = relative_errors(x, np.arange(48), [qtype])[qtype]
    assert got == pytest.approx(want, rel=1e-6)


def test_imatrix_weighting_counts_each_expert_with_its_own_row():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((8, 64)) * 0.05).astype(np.float32)
    w = np.ones((2, 64), dtype=np.float32)
    w[1, :32] = 100.0  # expert 1 cares about its first half only
    from hf2q.ggml import codec
    xh = x.astype(np.float16).astype(np.float32)
    num = den = 0.0
    for e in (0, 1):
        xs = xh[4 * e:4 * e + 4]
        y = codec.dequantize(codec.quantize(xs, T.Q4_0, imatrix=w[e]), T.Q4_0, xs.shape)
        num += float((((xs - y) ** 2) * w[e]).sum())
        den += float(((xs ** 2) * w[e]).sum())
    got = relative_errors(x, np.arange(8), [T.Q4_0], w, rows_per_expert=4)[T.Q4_0]
    assert got == pytest.approx(num / den, rel=1e-6)  # float32 vs float64 sums
    assert got != pytest.approx(relative_errors(x, np.arange(8), [T.Q4_0])[T.Q4_0], rel=1e-3)


# ------------------------------------------------------------------------------- names
def test_tier_names_parse():
    for name, q in TIER_QUANTS.items():
        assert parse_gguf_quant(name.upper()) is q and q.tier in ("dynamic", "apex")
    assert parse_gguf_quant("apex-i-compact").needs_imatrix
    assert not parse_gguf_quant("dynamic-q3").needs_imatrix


@pytest.mark.parametrize("name, hint", [("apex", "apex-quality"), ("dwq", "dwq-4"), ("tq1_0", "ternary"),
                                        ("tq2_0", "ternary")])
def test_refused_names_are_bad_input_with_a_hint(name, hint, cli, tiny_checkpoint):
    r = cli("convert", tiny_checkpoint("llama"), "--quant", name, "--dry-run")
    assert r.code == 3 and hint in r.err and "Traceback" not in r.err


def test_apex_i_without_imatrix_is_bad_input(cli, tiny_checkpoint, tmp_path):
    r = cli("convert", tiny_checkpoint("qwen3_moe"), "--quant", "apex-i-balanced", "-o", tmp_path / "x.gguf")
    assert r.code == 3 and "--imatrix" in r.err and "apex-balanced" in r.err


def test_apex_on_a_dense_model_is_bad_input(cli, tiny_checkpoint):
    r = cli("convert", tiny_checkpoint("llama"), "--quant", "apex-quality", "--dry-run")
    assert r.code == 3 and "mixture-of-experts" in r.err
