"""Restore planning: which stored blocks a slot should import, and how many cached tokens that gives."""

from __future__ import annotations

import hashlib

import numpy as np

from hf2q.kvstore import BLOCK_TOKENS, BlockStore, KVBlock
from hf2q.kvstore.hydrate import plan_restore

FP = hashlib.sha256(b"hydrate").hexdigest()
B = BLOCK_TOKENS


def stored(tmp_path, n_blocks, extra=0):
    toks = np.random.default_rng(n_blocks).integers(0, 50000, n_blocks * B + extra).tolist()
    store = BlockStore.open(tmp_path, FP)
    for s in store.missing_spans(toks):
        store.write(KVBlock.from_span(s, toks, {"k": np.full((1, B, 2), s.index, np.float16)}))
    return store, toks


def test_fresh_slot_restores_every_full_block_before_the_last_token(tmp_path):
    store, toks = stored(tmp_path, 3, extra=40)
    with store:
        plan = plan_restore(store, toks, 0)
        assert plan.keep_tokens == 0 and [i.n_tokens for i in plan.imports] == [B, B, B]
        assert plan.cached_tokens == 3 * B and plan.cached_tokens < len(toks)
        assert [store.read(i.meta)["k"][0, 0, 0] for i in plan.imports] == [0, 1, 2]  # in order


def test_prompt_ending_on_a_block_boundary_leaves_its_last_block_to_prefill(tmp_path):
    store, toks = stored(tmp_path, 2)
    with store:
        plan = plan_restore(store, toks, 0)  # the last token must be computed; blocks import whole
        assert [i.n_tokens for i in plan.imports] == [B]
        assert plan.cached_tokens == B
        assert plan_restore(store, toks + [7], 0).cached_tokens == 2 * B


def test_slot_prefix_is_kept_to_its_block_boundary_and_only_the_rest_imported(tmp_path):
    store, toks = stored(tmp_path, 4, extra=1)
    with store:
        plan = plan_restore(store, toks, B + 100)  # the slot holds 1.4 blocks of this prompt
        assert plan.keep_tokens == B and len(plan.imports) == 3
        assert plan.imports[0].meta.token_ids == tuple(toks[B:2 * B])
        assert plan.cached_tokens == 4 * B
        assert plan_restore(store, toks, 4 * B) is None  # the slot already has everything the disk has
        assert plan_restore(store, toks + [1] * 10, 4 * B + 5) is None


def test_divergent_or_short_prompts_get_no_plan(tmp_path):
    store, toks = stored(tmp_path, 2, extra=3)
    with store:
        other = list(toks)
        other[0] += 1
        assert plan_restore(store, other, 0) is None
        assert plan_restore(store, toks[:B - 1], 0) is None
        assert plan_restore(store, toks[:1], 0) is None
        assert plan_restore(store, [], 0) is None
