"""Helpers shared by the engine tests: tiny checkpoints converted to F32 GGUF once per session."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hf2q.formats.gguf_file import open_gguf


_CONVERTED: dict[str, Path] = {}


def convert_f32(src: Path, out: Path) -> Path:
    """``hf2q convert SRC -q f32``; converted once per test session and shared across modules."""
    from hf2q.cli import main

    key = str(src)
    if key in _CONVERTED and _CONVERTED[key].exists():
        return _CONVERTED[key]
    if not out.exists():
        code = main(["convert", str(src), "-q", "f32", "-o", str(out), "--no-integrity"])
        assert code == 0, f"hf2q convert failed for {src}"
    _CONVERTED[key] = out
    return out


def tiny_runner(tiny_checkpoint, tmp_path_factory, family: str):
    """The runner of the tiny ``family`` checkpoint, converted to F32 once per session."""
    src = tiny_checkpoint(family)
    return load_runner(convert_f32(src, tmp_path_factory.mktemp(family) / "m.gguf"), src)


def layer_types_pattern(hf_dir: Path) -> list[bool] | None:
    """Per-layer 'is sliding' flags from a Gemma3 config (None when it has no layer_types)."""
    import json

    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    types = cfg.get("layer_types")
    return None if types is None else [t == "sliding_attention" for t in types]


def load_runner(gguf: Path, hf_dir: Path | None = None):
    """Load with MlxModelRunner; for Gemma3 make sure the sliding-window layout is the HF one.

    llama.cpp's Gemma3 default (5 local : 1 global) is right for real checkpoints; a tiny
    3-layer checkpoint has its own ``layer_types``, which a GGUF states with
    ``gemma3.attention.sliding_window_pattern`` (bool per layer). If the converter did not
    write it, the key is supplied here from the HF config so the graph under test is the
    one transformers runs.
    """
    from hf2q.engine.models import build_model
    from hf2q.engine.runner import MlxModelRunner, compute_dtype

    g = open_gguf(gguf)
    key = "gemma3.attention.sliding_window_pattern"
    if g.arch == "gemma3" and key not in g.metadata and hf_dir is not None:
        pattern = layer_types_pattern(hf_dir)
        if pattern is not None:
            g.metadata[key] = pattern
    dtype = compute_dtype(g.arch)
    return MlxModelRunner(g, build_model(g, dtype), dtype, None)


def prefill_each(runner, prompts) -> tuple[list, list[int]]:
    """A new sequence prefilled with each prompt, and each prompt's greedy next token."""
    seqs = [runner.new_sequence() for _ in prompts]
    return seqs, [int(np.argmax(runner.prefill(s, list(p)))) for s, p in zip(seqs, prompts)]


def random_tokens(n: int, low: int = 5, high: int = 1000, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(low, high, n)]


def speculative_greedy(runner, seq, first: int, context: list[int], n_new: int, k: int):
    """T=0 speculative decoding through the engine's own accept loop: from the pending token ``first`` after
    ``context``, draft ``k`` with the runner's head, verify, keep what stands; → (the ``n_new`` tokens, every
    drafted token, every verify's rows)."""
    from hf2q.engine.sampling import Sampler
    from hf2q.engine.speculative import accept_draft, keep_accepted
    from hf2q.sched.contracts import SamplingParams

    sampler = Sampler(SamplingParams(max_tokens=n_new, temperature=0.0))
    new, drafts, rows_seen = [first], [], []
    while len(new) < n_new:
        draft = runner.draft(seq, new[-1], k)
        start = seq.length
        rows = runner.verify(seq, [new[-1]] + draft)
        got = accept_draft(sampler, draft, rows, context + new)
        keep_accepted(runner, seq, start, [new[-1]] + got[:-1])
        drafts += draft
        rows_seen.append(rows)
        new += got
    return new[:n_new], drafts, rows_seen
