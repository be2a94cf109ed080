"""What a DeepSeek-V4 slot holds, as the header-only plan (``memory_plan.kv_need``, ``hf2q info``) counts
it, against the bytes a real slot of the tiny fixture allocates (``Deepseek4Cache.nbytes``).

The plan is the bound admission reserves: entries per token, plus the live rows (every layer's window and
unfinished blocks, and the entries buffers' room) and a copy of the rows per kept reuse point, each at
its largest. The slot measured here is driven to that bound: prompt chunks end one short of a heavily
compressed block (``p ≡ 127 mod 128``, so every copy keeps the most compressor rows; ``mod 4 = 3`` for
the sparse layers too), the reuse interval is out of reach (no interval point, whose copy is small),
and the decode step runs from such a length.
"""

from __future__ import annotations

import json

import pytest

from hf2q.engine.memory_plan import kv_need
from hf2q.engine.runner import MlxModelRunner
from tests.engine_support import random_tokens
from tests.test_engine_deepseek4 import deepseek4_gguf

#: chunk ends: 9 transactions, so 4 kept points and 2 aged-out prompt ends hold copies
ENDS = [127 + 128 * k for k in range(9)]


@pytest.fixture(scope="module")
def runner():
    return MlxModelRunner.load(deepseek4_gguf())


def test_a_slot_at_its_bound_allocates_what_the_plan_counts(runner):
    from hf2q.engine.models.deepseek4_cache import Deepseek4Cache
    from hf2q.engine.models.deepseek4_layout import compact_need, layer_rows

    geo = runner.model.geo
    seq = Deepseek4Cache(layer_rows(geo.head_dim, geo.index_dim, runner.model.cfg.compress_ratios), geo.window,
                         runner.dtype, interval=10**6)
    text = random_tokens(ENDS[-1] + 1, low=3, high=49152, seed=24)
    start = 0
    for end in ENDS:
        runner.prefill(seq, text[start:end])
        start = end
    runner.decode([seq], [text[-1]])
    assert len(seq.points) + len(seq.ends) == 6
    need = kv_need(runner.gguf.hparams, runner.dtype.size)
    plan = seq.length * need.per_token + need.window_bytes()
    assert (need.per_token, need.window_bytes()) == (runner.kv_bytes_per_token, runner.kv_bytes_per_slot)
    assert 0.97 * plan <= seq.nbytes <= plan
    # the bounded part alone: what the slot holds beyond its entries
    compact = compact_need(runner.gguf.hparams, runner.dtype.size)
    copies = sum(a.nbytes for rows in [seq.points[p][1] for p in seq.points] + list(seq.ends.values())
                 for st in rows for a in st.arrays())
    assert copies == compact.COPIES * compact.point_copy()  # every copy at its largest
    # live rows and the entries buffers' room: the heavily compressed layer's open block is at its
    # longest here, the sparse entries' room not quite (no length has both at their largest)
    fixed = seq.nbytes - copies - seq.length * need.per_token
    assert 0.9 * compact.fixed() <= fixed <= compact.fixed(), (fixed, compact.fixed())


def test_info_prints_the_compact_cache(cli):
    from hf2q.engine.models.deepseek4_layout import compact_need
    from hf2q.formats.gguf_file import open_gguf

    path = deepseek4_gguf()
    r = cli("info", "--json", path)
    assert r.code == 0, r.err
    info = json.loads(r.out)
    need = compact_need(open_gguf(path).hparams, info["kv_dtype_bytes"])
    assert info["kv_compact_fixed_bytes_per_slot"] == need.fixed()
    assert info["kv_compact_copy_bytes"] == need.point_copy() and info["kv_compact_copies_per_slot"] == 6
    assert info["kv_window_bytes_per_slot"] == need.fixed() + 6 * need.point_copy()
    assert info["kv_bytes_per_slot"] == info["ctx"] * need.per_token + info["kv_window_bytes_per_slot"]
    r = cli("info", path)
    assert r.code == 0, r.err
    line = next(x for x in r.out.splitlines() if x.startswith("KV compact:"))
    assert "up to 6 reuse-point copies" in line and "whatever the context" in line
