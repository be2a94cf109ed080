"""Draft tokens (prompt lookup, or the model's own MTP head) and the acceptance rule of speculative decoding.

Agentic work repeats its context: a model asked to rewrite a file emits long runs of that file.
The last few tokens generated then usually occur earlier in the context, and the tokens that
followed them there are a good guess at what comes next. :class:`NgramDrafter` proposes those
tokens; the engine feeds the last accepted token plus the draft to the target model in one
forward (``runner.verify``), and :func:`accept_draft` decides how much of the draft stands.

The rule keeps the target's output distribution exactly. The draft is deterministic (its
proposal puts probability 1 on one token), so standard speculative sampling reduces to: accept
draft token ``d`` with probability ``p(d)`` under the target's sampling distribution at that
position; on rejection draw from ``p`` with ``d`` removed and renormalised; when every draft
token stands, draw one more from the last row. At temperature 0, ``p`` is one-hot on the greedy
token, so this is "accept while the draft equals the greedy token, then take the greedy token":
the output is the one plain greedy decoding gives.

:class:`MtpDrafter` proposes with the model's multi-token-prediction head instead (``--speculative mtp``:
qwen35 files with a ``nextn`` block, ``engine/models/qwen35_mtp.py``; a deepseek4 trunk with its
``--model-draft`` companion, ``engine/models/deepseek4_mtp.py``): the same interface, drafting through
``runner.draft`` in the engine thread.

The rest is pure logic on token lists and numpy rows.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from hf2q.engine.sampling import plain_greedy

#: longest and shortest suffix the drafter looks up (longer matches are tried first)
MAX_NGRAM = 4
MIN_NGRAM = 1
#: draft tokens proposed per verify forward unless told otherwise
DEFAULT_DRAFT_TOKENS = 6
#: the same for MTP drafts: one head chained on its own output loses accuracy at every step
DEFAULT_MTP_DRAFT_TOKENS = 3
#: ``--speculative`` choices
MODES = ("ngram", "mtp", "off")


class NgramDrafter:
    """An index of every n-gram (``min_n..max_n``) of a growing token list to its latest start that
    has at least one token after it, so a lookup costs O(max_n) however long the context is."""

    def __init__(self, tokens: Sequence[int] = (), max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n (got {min_n}, {max_n})")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def append(self, token: int) -> None:
        # the n-grams ending just before the new token now have a follower: record where they start
        p = len(self.tokens)
        for n in range(self.min_n, min(self.max_n, p) + 1):
            self._latest[tuple(self.tokens[p - n:p])] = p - n
        self.tokens.append(int(token))

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(t)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest suffix of the context seen earlier in it
        (its latest occurrence); empty when no suffix of ``min_n`` or more tokens recurs."""
        if k <= 0:
            return []
        toks = self.tokens
        for n in range(min(self.max_n, len(toks) - 1), self.min_n - 1, -1):
            start = self._latest.get(tuple(toks[len(toks) - n:]))
            if start is not None:
                return toks[start + n:start + n + k]
        return []


class MtpDrafter:
    """Drafts for one sequence with the runner's MTP head (``runner.draft``), in the engine thread: the
    :class:`NgramDrafter` interface, where ``append`` only notes the pending token (the server's step
    loop, outside that thread, hands :meth:`draft` the runner instead)."""

    def __init__(self, runner, seq):
        self.runner, self.seq, self.pending = runner, seq, None

    def append(self, token: int) -> None:
        self.pending = int(token)

    def propose(self, k: int) -> list[int]:
        return self.draft(self.runner, k)

    def draft(self, runner, k: int) -> list[int]:
        return runner.draft(self.seq, self.pending, k) if self.pending is not None and k > 0 else []


def nextn_block(g) -> int | None:
    """The block index of a GGUF's multi-token-prediction head (the first after the main blocks), None
    without one (read from the header alone)."""
    hp = g.hparams
    i = hp.n_main_layers
    if hp.nextn_predict_layers < 1 or f"blk.{i}.nextn.eh_proj.weight" not in g.tensors:
        return None
    return i


def has_mtp_head(g) -> bool:
    """Whether ``--speculative mtp`` can draft with ``g``'s own head: a qwen35 / qwen35moe file with its
    ``nextn`` block (header only)."""
    return g.arch in ("qwen35", "qwen35moe") and nextn_block(g) is not None


def is_mtp_companion(g) -> bool:
    """Whether ``g`` is a deepseek4 MTP head alone (llama.cpp's ``--mtp`` export: its MTP block, no trunk blocks)."""
    return (g.arch == "deepseek4" and g.hparams.nextn_predict_layers >= 1
            and "blk.0.attn_norm.weight" not in g.tensors)


def companion_problem(trunk, g) -> str | None:
    """Why the GGUF ``g`` cannot be the MTP companion (llama.cpp's ``--mtp`` export) of the deepseek4 trunk
    ``trunk`` (None: it can), from the headers alone."""
    thp, hp = trunk.hparams, g.hparams
    n = thp.n_layers
    if g.arch != "deepseek4":
        return f"is a {g.arch} file, not a deepseek4 MTP head"
    if hp.nextn_predict_layers < 1 or f"blk.{n}.nextn.eh_proj.weight" not in g.tensors:
        return f"has no MTP block {n} (write it with `hf2q convert --mtp` from the trunk's checkpoint)"
    if hp.n_main_layers != n:
        return f"is the MTP head of a {hp.n_main_layers}-block trunk, not of this {n}-block one"
    if hp.hidden != thp.hidden or g.tensors["token_embd.weight"].shape != trunk.tensors["token_embd.weight"].shape:
        return "does not match the trunk's hidden size or vocabulary"
    return None


def draft_header(g, args):
    """The header of ``--model-draft`` (deepseek4's MTP companion) checked against the trunk ``g``, None
    without the flag (``InputError`` for a file that is not the trunk's head)."""
    from hf2q.errors import InputError
    from hf2q.formats.gguf_file import open_gguf

    path = getattr(args, "model_draft", None)
    if path is None:
        return None
    d = open_gguf(path)
    if problem := companion_problem(g, d):
        raise InputError(f"{d.path.name}: --model-draft {problem}")
    args.model_draft_header = d  # what the memory plan and the engine read next (:func:`draft_model`)
    return d


def draft_model(args):
    """What the memory plan and ``enable_mtp`` read for ``--model-draft``: the header :func:`check_speculative`
    opened and checked (opened once), else the path; None without the flag."""
    return getattr(args, "model_draft_header", None) or getattr(args, "model_draft", None)


def check_speculative(g, args) -> None:
    """``--speculative mtp``'s start-up check on the model's header: a qwen35 / qwen35moe file with a
    ``nextn`` block, or a deepseek4 trunk with its ``--model-draft`` companion (``InputError``; the flag
    elsewhere: ``UsageError``). Any ``--kv-cache-type`` (the head's K/V layer is stored like the main
    ones); any ``--tensor-parallel`` the model splits over (each head's block is split like the main ones:
    DeepSeek-V4's companion must split the same way, ``InputError``)."""
    from hf2q.errors import InputError, UsageError

    mtp = getattr(args, "speculative", "off") == "mtp"
    drafted = getattr(args, "model_draft", None) is not None
    if drafted and not (mtp and g.arch == "deepseek4"):
        raise UsageError("--model-draft needs --speculative mtp and a DeepSeek-V4 model (Qwen 3.5 / 3.6 keep "
                         "their head in the model's own file)")
    if not mtp:
        return
    name = getattr(g.path, "name", g.path)
    if g.arch == "deepseek4":
        if not drafted:
            raise InputError(f"{name}: --speculative mtp on DeepSeek-V4 needs its MTP head: --model-draft FILE "
                             "(`hf2q convert --mtp` of the same checkpoint), or use --speculative ngram")
        d = draft_header(g, args)
        if (size := getattr(args, "tensor_parallel", 1) or 1) > 1:
            from hf2q.engine.tensor_parallel import shard_gguf

            for r in range(size):  # views only: the head's block is cut like the trunk's, before a rank starts
                shard_gguf(d, r, size)
        return
    if not has_mtp_head(g):
        raise InputError(f"{name}: --speculative mtp needs a Qwen 3.5 / 3.6 GGUF with its multi-token-prediction "
                         "(nextn) block — convert without --no-mtp, or use --speculative ngram")


def accept_draft(sampler, draft: Sequence[int], rows: np.ndarray, history: Sequence[int]) -> list[int]:
    """The tokens a verify forward yields: the accepted prefix of ``draft`` and one token of the
    target's own (at the first rejection, or after the whole draft).

    ``rows [len(draft) + 1, vocab]`` are the target's logits at the last accepted token and at
    each draft token; ``history`` is what the sampler's penalties see before the first of them.
    ``sampler`` is the request's host :class:`~hf2q.engine.sampling.Sampler` (its RNG is drawn
    from only at temperature > 0).
    """
    if len(rows) != len(draft) + 1:
        raise ValueError(f"{len(draft)} draft tokens need {len(draft) + 1} rows of logits, got {len(rows)}")
    greedy = plain_greedy(sampler, None)
    hist = list(history)
    out: list[int] = []
    for i, d in enumerate(draft):
        if greedy:
            target = int(np.argmax(rows[i]))
        elif sampler.params.temperature == 0.0:
            target = sampler.sample(rows[i], hist)[0]
        else:
            target = _accept_or_resample(sampler, rows[i], hist, int(d))
        out.append(target)
        if target != d:
            return out
        hist.append(target)
    out.append(int(np.argmax(rows[-1])) if greedy else sampler.sample(rows[-1], hist)[0])
    return out


def keep_accepted(runner, seq, start: int, fed: list[int]) -> None:
    """Cut ``seq`` back to ``start + len(fed)`` after a verify forward from ``start``. A hybrid-recurrent
    sequence stops there through the state its verify kept after each token (``RecurrentState``'s
    verify states); a sequence that cannot stop inside the forward goes back to ``start`` (the state
    the forward began from) and the accepted tokens are fed again."""
    keep = start + len(fed)
    if keep == seq.length:
        return
    points = seq.reuse_points()
    if points is None or keep in points:
        seq.trim(keep)
        return
    seq.trim(start)
    runner.verify(seq, fed)  # not prefill: a re-feed is no transaction, so it keeps no reuse point


def _accept_or_resample(sampler, row: np.ndarray, history: Sequence[int], d: int) -> int:
    """``d`` with probability p(d); otherwise a draw from p without ``d``, renormalised."""
    p = sampler.truncated_probs(sampler.process(row, history))
    if sampler.rng.random() < p[d]:
        return d
    p[d] = 0.0
    ids = np.flatnonzero(p)  # not empty: p(d) < 1 when this line is reached
    cdf = np.cumsum(p[ids])
    return int(ids[min(int(np.searchsorted(cdf, sampler.rng.random() * cdf[-1], side="right")), ids.size - 1)])


def draft_tokens_arg(args) -> int:
    """The draft length the ``--speculative`` / ``--draft-tokens`` flags ask for (0: off)."""
    from hf2q.errors import UsageError

    mode = getattr(args, "speculative", "off") or "off"
    k = getattr(args, "draft_tokens", None)
    if mode == "off":
        if k is not None:
            raise UsageError("--draft-tokens needs --speculative ngram or mtp")
        return 0
    if k is None:
        return DEFAULT_MTP_DRAFT_TOKENS if mode == "mtp" else DEFAULT_DRAFT_TOKENS
    return k
