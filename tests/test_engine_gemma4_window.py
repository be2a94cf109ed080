"""Gemma 4's sliding layers keep only their window (``kv_cache.SlidingWindow``), and nothing a user can
see changes: logits against transformers' ``Gemma4ForCausalLM`` on prompts many windows long, chunked
prefill against one-shot, a reused prefix against a cold prompt, batched decode against single decodes,
and the window's K/V bounded as the context grows (the engine's own accounting, ``seq.window_nbytes``,
against the static figure ``hf2q info`` and the memory plan use).

The tiny checkpoints (``tests/models/tiny.py``) have a 16-token window; the prompts are 1,400 tokens, so
the window buffers move their first position several times (``window.base`` > 0 is asserted).
"""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import numpy as np
import pytest

from hf2q.engine.kv_cache import PrefixNotReusable
from hf2q.engine.memory_plan import kv_need
from hf2q.engine.recurrent_policy import CHECKPOINT_INTERVAL, window_positions
from hf2q.engine.runner import MlxModelRunner
from hf2q.sched.ledger import reusable_prefix
from tests.engine_support import convert_f32, random_tokens

TOL_F32 = 1e-3
PROMPT = 1400
DECODE = 10
CHUNK = 256

pytestmark = pytest.mark.slow  # each module fixture converts a checkpoint and runs transformers (~20 s)


def _reference(src, tokens: list[int]) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


SHAPES = [(family, path) for family in ("gemma4", "gemma4_e2b") for path in ("host", "graph")]


@pytest.fixture(scope="module", params=SHAPES, ids=[f"{f}-{p}" for f, p in SHAPES])
def shape(request, tiny_checkpoint, tmp_path_factory):
    """(runner, checkpoint folder) of the dense and the E2B-style tiny model, decoding (and prefilling short
    chunks) on the CPU's host step or, as on a GPU, through the MLX graph (``HF2Q_NO_HOST_DECODE=1``): both
    read and write the same window buffers."""
    family, path = request.param
    src = tiny_checkpoint(family)
    gguf = convert_f32(src, tmp_path_factory.mktemp(family) / "f32.gguf")
    with pytest.MonkeyPatch.context() as mp:
        if path == "graph":
            mp.setenv("HF2Q_NO_HOST_DECODE", "1")
        runner = MlxModelRunner.load(gguf)
    assert (runner.host_decoder is not None) == (path == "host")
    return runner, src


def _same(runner) -> float:
    """How close two logits of one runner must be: the MLX graph's chunks agree to 1e-4. On the host step, short
    chunks and decode rows run on the host and long chunks on the graph, which round differently (2–4e-4 apart at
    700–1,400 tokens), and a prompt cut at other positions mixes them elsewhere; a few rows of this random model
    amplify that (one row of a reused 1,405-token prefix: 1.8e-3, where the graph from the same cache is 2.1e-3
    from transformers): twice the transformers tolerance, the greedy tokens equal."""
    return 1e-4 if runner.host_decoder is None else 2 * TOL_F32


def _window_bound(runner, seq, new_tokens: int) -> int:
    return len(seq.window.layers) * window_positions(seq.window.size, new_tokens) * seq.position_bytes


def test_logits_match_transformers_with_the_window_only(shape):
    """Prefill in 256-token transactions, then decode: every step's logits within 1e-3 of transformers
    while the window layers never hold more than their bound and have let go of the oldest positions."""
    runner, src = shape
    tokens = random_tokens(PROMPT + DECODE, seed=11)
    seq, ends, out, held = runner.new_sequence(), [], [], []
    assert seq.window is not None and seq.window.size == 16 < PROMPT
    for first in range(0, PROMPT, CHUNK):
        piece = tokens[first:min(first + CHUNK, PROMPT)]
        out.append(runner.prefill(seq, piece))
        ends.append(first + len(piece) - 1)
        held.append(seq.window_nbytes)
    for pos in range(PROMPT, len(tokens)):
        out.append(runner.decode([seq], [tokens[pos]])[0])
        ends.append(pos)
        held.append(seq.window_nbytes)
    assert seq.window.base >= 512  # the buffers moved: positions before it are gone
    assert max(held) <= _window_bound(runner, seq, CHUNK)
    ref = _reference(src, tokens)
    assert float(np.std(ref)) > 0.5
    assert float(np.abs(np.stack(out) - ref[ends]).max()) < TOL_F32


def test_window_kv_stays_bounded_as_the_context_grows(shape):
    """Prefill then decode far past the window: the global layers' K/V grows with the length, the
    window layers' stays under the static per-slot figure the runner, ``info`` and the memory plan
    count (plus the transaction in flight while a prefill runs)."""
    runner = shape[0]
    seq = runner.new_sequence()
    prefilling, decoding = [], []
    for piece in np.array_split(random_tokens(3300, seed=3), 3300 // CHUNK + 1):
        runner.prefill(seq, [int(t) for t in piece])
        prefilling.append(seq.window_nbytes)
    token = 7
    for _ in range(100):
        token = int(np.argmax(runner.decode([seq], [token])[0]))
        decoding.append(seq.window_nbytes)
    assert seq.capacity >= seq.length == 3400  # the global layers keep every position
    assert max(prefilling) <= _window_bound(runner, seq, CHUNK) and max(decoding) <= runner.kv_bytes_per_slot
    every_position = len(seq.window.layers) * seq.length * seq.position_bytes  # what keeping them all would take
    assert decoding[-1] * 2 < every_position and seq.window.base >= 1536
    need = kv_need(runner.gguf.hparams, seq.dtype.size)
    assert (need.per_token, need.window_bytes()) == (runner.kv_bytes_per_token, runner.kv_bytes_per_slot)
    assert runner.kv_bytes_per_token == seq.bytes_per_token
    assert runner.kv_bytes_per_slot == _window_bound(runner, seq, 1)


def _greedy(runner, seq, logits, n: int = 8) -> tuple[list[int], np.ndarray]:
    ids, rows = [], [logits]
    for _ in range(n):
        ids.append(int(np.argmax(rows[-1])))
        rows.append(runner.decode([seq], [ids[-1]])[0])
    return ids, np.stack(rows)


def _prefill(runner, seq, tokens, chunk=CHUNK) -> np.ndarray:
    for first in range(0, len(tokens), chunk):
        logits = runner.prefill(seq, tokens[first:first + chunk])
    return logits


def test_chunked_prefill_equals_one_shot_token_for_token(shape):
    runner = shape[0]
    tokens = random_tokens(PROMPT, seed=12)
    one = runner.new_sequence()
    want_ids, want = _greedy(runner, one, runner.prefill(one, tokens))
    for chunk in (100, 333):
        seq = runner.new_sequence()
        ids, got = _greedy(runner, seq, _prefill(runner, seq, tokens, chunk))
        assert ids == want_ids
        np.testing.assert_allclose(got, want, atol=_same(runner), rtol=0)


def _continues_like_a_cold_prompt(runner, slot, prompt: list[int], reuse: int) -> None:
    """``slot`` trimmed to ``reuse`` and fed the rest of ``prompt`` gives a cold sequence's greedy tokens
    and logits."""
    got_ids, got = _greedy(runner, slot, _prefill(runner, slot, prompt[reuse:]))
    cold = runner.new_sequence()
    want_ids, want = _greedy(runner, cold, _prefill(runner, cold, prompt))
    assert got_ids == want_ids
    np.testing.assert_allclose(got, want, atol=_same(runner), rtol=0)


@pytest.mark.parametrize("diverge", [1100, 1400 + 5])
def test_reused_prefix_equals_a_cold_prompt(shape, diverge):
    """A slot holding a 1,400-token prompt and its 20-token answer; a new prompt shares its first
    ``diverge`` tokens (inside the prompt, or inside the answer). The ledger picks the longest reuse
    point the slot published within that prefix; continuing from there gives the cold prompt's greedy
    tokens and logits."""
    runner = shape[0]
    first = random_tokens(PROMPT, seed=13)
    slot = runner.new_sequence()
    answer, _ = _greedy(runner, slot, _prefill(runner, slot, first), n=20)
    held = first + answer  # _greedy feeds every token it samples
    assert slot.length == len(held)
    prompt = held[:diverge] + random_tokens(300, seed=14)
    reuse = reusable_prefix(held, prompt, points=slot.published_points)
    assert diverge - CHECKPOINT_INTERVAL < reuse <= diverge and reuse in slot.reuse_points()
    slot.trim(reuse)
    _continues_like_a_cold_prompt(runner, slot, prompt, reuse)


def test_trim_before_the_kept_window_is_refused(shape):
    runner = shape[0]
    seq = runner.new_sequence()
    _prefill(runner, seq, random_tokens(PROMPT, seed=15))
    assert seq.window.base > 0 and 100 not in seq.reuse_points()
    with pytest.raises(PrefixNotReusable, match="keep positions from"):
        seq.trim(100)
    # a block before the kept window still exports its full layers, but not the window rows its end needs
    assert not any(name.startswith("state.") for name in runner.export_kv(seq, 0, 16))
    seq.trim(0)  # back to empty is always possible
    assert seq.length == 0 and seq.window_nbytes == 0 and seq.reuse_points() == (0,)


def test_batched_decode_of_windows_at_different_positions(shape):
    """Rows whose window buffers start at different positions (one inside its first window, two past
    several moves) decode as one batch exactly as alone."""
    runner = shape[0]
    prompts = [random_tokens(n, seed=n) for n in (9, 1500, 2600)]
    batch = [runner.new_sequence() for _ in prompts]
    fed = [[int(np.argmax(_prefill(runner, s, p))) for s, p in zip(batch, prompts)]]
    assert len({s.window.base for s in batch}) == 3
    rows = []
    for _ in range(6):
        rows.append(runner.decode(batch, fed[-1]))
        fed.append([int(t) for t in np.argmax(rows[-1], -1)])
    for i, prompt in enumerate(prompts):
        seq = runner.new_sequence()
        _prefill(runner, seq, prompt)
        alone = np.stack([runner.decode([seq], [fed[j][i]])[0] for j in range(6)])
        np.testing.assert_allclose(alone, np.stack([r[i] for r in rows]), atol=1e-4, rtol=0)


def _tight_sequence(runner, interval: int, keep: int):
    """A sequence like ``runner.new_sequence()`` whose window keeps points every ``interval`` tokens, the
    newest ``keep``: the same engine code, reaching the ageing of points in fewer decode steps."""
    from hf2q.engine.kv_cache import SequenceCache, SlidingWindow

    n_layers, heads, dim = runner.model.kv_shape
    window, layers = runner.model.sliding_window_layers
    return SequenceCache(n_layers, heads, dim, runner.dtype,
                         window=SlidingWindow(window, layers, interval=interval, keep=keep))


def test_a_long_answer_keeps_its_prompt_end_as_a_snapshot(shape):
    """An answer long enough to push the prompt's end out of the kept points (and its window out of the
    buffer); the prompt end stays a reuse point as a snapshot of its window, so a next prompt that drops
    the answer (a template that strips reasoning) reuses the whole first prompt and continues exactly
    like a cold one."""
    runner = shape[0]
    first = random_tokens(PROMPT, seed=16)
    slot = _tight_sequence(runner, interval=32, keep=2)
    answer, _ = _greedy(runner, slot, _prefill(runner, slot, first), n=220)
    w = slot.window
    assert PROMPT not in w.points and PROMPT in w.snapshots and not w.reachable(PROMPT)
    prompt = first + random_tokens(200, seed=17)
    reuse = reusable_prefix(first + answer, prompt, points=slot.published_points)
    assert reuse == PROMPT
    slot.trim(reuse)
    assert w.base == PROMPT - w.size + 1 and list(w.snapshots) == [1280]  # an older prompt-chunk end stays
    _continues_like_a_cold_prompt(runner, slot, prompt, reuse)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[1] == "graph"], indirect=True,
                         ids=[f"{f}-{p}" for f, p in SHAPES if p == "graph"])
def test_stacked_batch_decode_across_window_moves(shape):
    """Three rows decoded together for 90 steps hold their K/V in one stacked batch (``StackedDecode``),
    which is rebuilt whenever a row's window moves on: the windows stay bounded and every row's greedy
    tokens and logits are those it decodes alone."""
    runner = shape[0]
    STEPS = 90  # the longest row's window moves at step 74
    assert runner.stack_decode
    prompts = [random_tokens(n, seed=n) for n in (700, 820, 950)]  # close enough to stack (MAX_PADDING)
    batch = [runner.new_sequence() for _ in prompts]
    fed = [[int(np.argmax(_prefill(runner, s, p))) for s, p in zip(batch, prompts)]]
    rows, stacked, held = [], 0, 0
    before = [s.window.base for s in batch]
    for _ in range(STEPS):
        rows.append(runner.decode(batch, fed[-1]))
        fed.append([int(t) for t in np.argmax(rows[-1], -1)])
        stacked += runner._stack is not None
        held = max(held, *(s.window_nbytes for s in batch))
    assert stacked > STEPS - 20 and held <= runner.kv_bytes_per_slot
    assert [s.window.base for s in batch] != before  # windows moved on while the rows decoded together
    for i, prompt in enumerate(prompts):
        seq = runner.new_sequence()
        _prefill(runner, seq, prompt)
        alone = np.stack([runner.decode([seq], [fed[j][i]])[0] for j in range(STEPS)])
        np.testing.assert_allclose(alone, np.stack([r[i] for r in rows]), atol=1e-4, rtol=0)
