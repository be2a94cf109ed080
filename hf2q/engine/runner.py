"""``MlxModelRunner``: the engine behind ``hf2q/engine/protocol.py``.

Stable contract (the serving runtime's GPU-owner thread calls exactly this, always from
one thread, because MLX streams are per thread):

* ``MlxModelRunner.load(path, ctx=None)`` — validate and load a GGUF.
* ``new_sequence()`` → a :class:`~hf2q.engine.kv_cache.SequenceCache` (``length``,
  ``nbytes``, ``trim(n)``).
* ``prefill(seq, tokens)`` → float32 logits ``[vocab]`` of the last token. One call is
  one bounded transaction; callers chunk long prompts (``--prefill-chunk``).
* ``decode(seqs, tokens)`` → float32 ``[N, vocab]``: every sequence advances one token
  in a single batched forward, whatever their lengths.
* ``verify(seq, tokens)`` → float32 ``[len(tokens), vocab]``: one sequence advances by several
  tokens in one forward with every position's logits (speculative decoding; trim back after).
* ``decode_async(seqs, tokens, samplers)`` → :class:`PendingTokens`: the same step with the
  next tokens sampled on the device (``hf2q.engine.sampling.device``) and evaluated
  asynchronously; ``tokens`` may be the previous step's ``PendingTokens``, so step *n+1* is
  built and queued while step *n* still runs (the host reads *n* with ``result()``).
* ``attach_vision(encoder, store)`` — an M-RoPE model (Qwen3-VL) then takes image tokens
  (``hf2q.engine.vision.prompt_images``) in ``prefill``: their features are encoded inside the call.
* ``embed(batch)`` → L2-normalised ``[N, dim]`` (embedding models only).
* ``export_kv(seq, start, end)`` / ``import_kv(seq, arrays, n)`` — host copies of KV
  positions, keys ``k.{layer}`` / ``v.{layer}``, float32 ``[kv_heads, n, head_dim]`` (an 8-bit cache: its
  uint8 codes, and their float32 scales under ``k.{layer}.scales`` / ``v.{layer}.scales``).

Errors a user can cause (prompt beyond the context, wrong model kind) are
``InputError``; everything else is a bug or an engine fault for the supervisor.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import numpy as np

from hf2q.engine.kv_cache import ForwardBatch, SequenceCache, SlidingWindow, StackedDecode
from hf2q.engine.memory_plan import kv_need
from hf2q.engine.models import build_model
from hf2q.engine.recurrent_policy import swa_full
from hf2q.engine.vision.prompt_images import chunk_positions, is_image_token, record_shift, shift_at
from hf2q.errors import InputError
from hf2q.formats.gguf_file import GGUFFile, open_gguf
from hf2q.formats.gguf_keys import Keys

#: Prefill chunks up to this many tokens run as rows of the CPU host step (``HostDecoder.prefill``):
#: the MLX graph costs ~60–100 ms a call before any arithmetic on SmolLM2, so a 13-token chat
#: suffix took ~100 ms there and ~25 ms as rows. Longer chunks keep the graph (two-thread BLAS
#: on dequantized weights, tiled attention): SmolLM2 Q4_0, rows vs graph, 64 tokens 99 vs 156 ms,
#: 128 tokens 194 vs 214 ms, 256 tokens 415 vs 324 ms.
HOST_PREFILL_ROWS = 128

END_OF_GENERATION_TEXTS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end|>",
                           "<|return|>", "<|end_of_text|>", "</s>", "<eos>")


def compute_dtype(arch: str):
    """float32 on CPU (BLAS-backed, no f16 kernels there); on GPU f16, bf16 for Gemma (f16 overflows)."""
    if mx.default_device() == mx.cpu:
        return mx.float32
    return mx.bfloat16 if arch.startswith("gemma") else mx.float16


def eos_ids(g: GGUFFile) -> frozenset[int]:
    ids = set()
    for key in (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID):
        v = g.get(key)
        if v is not None:
            ids.add(int(v))
    tokens = g.get(Keys.Tokenizer.LIST) or []
    for i, t in enumerate(tokens):
        if t in END_OF_GENERATION_TEXTS:
            ids.add(i)
    return frozenset(ids)


class PendingTokens:
    """The sampled tokens of a queued decode step; ``result()`` waits for them."""

    __slots__ = ("tokens", "logprobs", "_host")

    def __init__(self, tokens: mx.array, logprobs: mx.array):
        self.tokens, self.logprobs, self._host = tokens, logprobs, None

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """``(token ids [N] int64, logprobs [N] float32)`` on the host."""
        if self._host is None:
            self._host = (np.array(self.tokens).astype(np.int64), np.array(self.logprobs, dtype=np.float32))
        return self._host


class MlxModelRunner:
    def __init__(self, gguf: GGUFFile, model, dtype, ctx: int | None, kv_cache_type: str = "f16"):
        self.gguf = gguf
        self.model = model
        self.dtype = dtype
        self.arch = gguf.arch
        self.is_embedding_model = bool(getattr(model, "is_embedding_model", False))
        cfg = model.cfg
        self.vocab_size = int(cfg.vocab)
        self.n_ctx_train = int(cfg.n_ctx_train)
        self.n_ctx = int(ctx or cfg.n_ctx_train)
        self.eos_token_ids = eos_ids(gguf)
        #: how every sequence's K/V is stored (``--kv-cache-type``): None in ``dtype``, else 8-bit
        self.kv_cache_type = kv_cache_type
        self.kv_codec = None if self.is_embedding_model else _kv_codec(kv_cache_type, model, dtype, self.arch,
                                                                       gguf.hparams.value_length)
        self.stats = {"prefill_tokens": 0, "prefill_s": 0.0, "decode_steps": 0, "decode_s": 0.0}
        #: batched graph decodes keep their sequences' K/V stacked (kv_cache.StackedDecode) while
        #: the same sequences decode together; HF2Q_NO_STACKED_DECODE=1 keeps per-sequence buffers
        self.stack_decode = not os.environ.get("HF2Q_NO_STACKED_DECODE")
        self._stack: StackedDecode | None = None
        self.host_decoder = None
        if not self.is_embedding_model:
            from hf2q.engine.cpu_decode import HostDecoder
            from hf2q.engine.cpu_decode_gemma4 import HostGemma4

            if HostGemma4.supported(model, self.kv_codec):  # Gemma 4 over float32 K/V
                self.host_decoder = HostGemma4(model)
            elif HostDecoder.supported(model, self.kv_codec):  # float32 K/V, or an 8-bit cache of one head size
                self.host_decoder = HostDecoder(model, self.kv_codec)
        #: ``(window, layers)`` whose K/V each sequence keeps to the window (``kv_cache.SlidingWindow``); not
        #: with a CPU host decode step whose attention addresses every position (the dense step over an 8-bit
        #: cache: ``keeps_windows``), nor with ``HF2Q_SWA_FULL=1``
        self.window_layers = None
        if (self.host_decoder is None or getattr(self.host_decoder, "keeps_windows", False)) and not swa_full():
            self.window_layers = getattr(model, "sliding_window_layers", None)
        #: K/V one more token of context costs, and what a slot holds whatever its length (its
        #: sliding-window layers at their bound), as ``memory_plan.kv_need`` accounts them
        self.kv_bytes_per_token = self.kv_bytes_per_slot = 0
        #: the header the K/V plan is read from (a tensor-parallel rank's: its view, with its own heads)
        self.kv_hparams = gguf.hparams
        if not self.is_embedding_model:
            need = kv_need(gguf.hparams, dtype.size, on_cpu=self.host_decoder is not None, kv_type=kv_cache_type)
            self.kv_bytes_per_token, self.kv_bytes_per_slot = need.per_token, need.window_bytes()
        #: the vision encoder and the images its prompts name (``attach_vision``), None for text only
        self.vision = None
        self.images = None

    @classmethod
    def load(cls, gguf_path: str | Path | GGUFFile, ctx: int | None = None,
             kv_cache_type: str = "f16") -> "MlxModelRunner":
        g = gguf_path if isinstance(gguf_path, GGUFFile) else open_gguf(gguf_path)
        dtype = compute_dtype(g.arch)
        model = build_model(g, dtype)
        return cls(g, model, dtype, ctx, kv_cache_type)

    @property
    def kv_identity(self) -> str:
        """What this runner's KV values depend on besides the model file: the MLX backend and
        device kind and the KV dtype (CPU float32 and GPU float16/bfloat16 caches differ, so the
        persistent KV store keys them apart). Read it from the engine thread."""
        dev = mx.default_device().type.name  # "cpu" | "gpu"
        backend = "cuda" if mx.cuda.is_available() else "metal" if mx.metal.is_available() else "cpu"
        ident = f"mlx-{backend}-{dev}-{str(self.dtype).rsplit('.', 1)[-1]}"
        # an 8-bit cache exports its stored rows: blocks of another storage never mix with them
        ident = ident if self.kv_cache_type == "f16" else f"{ident}-kv-{self.kv_cache_type}"
        # a draft head's blocks carry its K/V layer too: they never share a name with blocks without it
        return f"{ident}-mtp" if self.drafts else ident

    @property
    def trims_prefix(self) -> bool:
        """Whether a sequence can be trimmed to any earlier position (prefix reuse); a hybrid model's
        recurrent state, and a sliding-window model's window layers, only at its reuse points
        (``seq.reuse_points()``)."""
        return (not hasattr(self.model, "new_recurrent_state") and not self.window_layers
                and getattr(self.model, "trims_prefix", True))

    @property
    def persists_kv(self) -> bool:
        """Whether the persistent KV store can keep this model's sequences: plain K/V, a hybrid model's
        (its blocks carry the recurrent state at their ends, and an MTP head's K/V layer and input row),
        DeepSeek-V4's compact cache (with an MTP head: its window layer and, at block ends, the trunk streams
        the head pairs with next) and a sliding-window model's (its blocks carry the window layers' rows at
        their ends) (docs/KVSTORE.md)."""
        return True

    @property
    def rolls_back_drafts(self) -> bool:
        """Whether a sequence can stop at any position inside a verify forward (speculative decoding in
        the server): a hybrid model's verify keeps the recurrent state after each token; a model with
        sliding-window layers does not drop drafts there yet."""
        return not self.window_layers

    @property
    def pipelines_decode(self) -> bool:
        """True when ``decode_async`` overlaps work (the MLX graph path); the CPU host decode step is
        synchronous, so pipelining it would only add the device sampler's cost."""
        return self.host_decoder is None and not self.is_embedding_model

    @property
    def takes_positions(self) -> bool:
        """Whether the model's forward takes explicit M-RoPE ``positions`` (Qwen3-VL)."""
        return hasattr(self.model, "sections")

    def attach_vision(self, encoder, store) -> None:
        """Serve images: ``encoder(patches, grid)`` gives features of the images ``store`` holds."""
        if not self.takes_positions:
            raise InputError(f"{self.gguf.path.name} ({self.arch}) is a text-only model; it takes no mmproj")
        self.vision, self.images = encoder, store

    def _shifted(self, seqs) -> bool:
        """Whether any of ``seqs`` has text positions behind its length (an image in its cache)."""
        return self.images is not None and any(shift_at(s) for s in seqs)

    def enable_mtp(self, draft_model=None) -> None:
        """Draft with the model's multi-token-prediction head (``--speculative mtp``): call before the
        first sequence. qwen35's head is in the model's own file; deepseek4's in the companion GGUF ``draft_model``
        (a path or an opened ``GGUFFile``: llama.cpp's ``--mtp`` export). ``InputError`` for a file without
        one. The head's K/V layer is stored as the main ones are (an 8-bit cache's too), and counted in
        ``kv_bytes_per_token``."""
        if not hasattr(self.model, "enable_mtp"):
            raise InputError(f"{self.gguf.path.name} ({self.arch}) has no multi-token-prediction head")
        if draft_model is None:
            self.model.enable_mtp()
        else:
            from hf2q.formats.gguf_file import GGUFFile, open_gguf

            self.model.enable_mtp(draft_model if isinstance(draft_model, GGUFFile) else open_gguf(draft_model))
        self.kv_bytes_per_token = kv_need(self.kv_hparams, self.dtype.size, on_cpu=self.host_decoder is not None,
                                          kv_type=self.kv_cache_type, mtp=True).per_token

    @property
    def drafts(self) -> bool:
        """Whether the model drafts for itself (:meth:`draft`)."""
        return getattr(self.model, "mtp", None) is not None

    def draft(self, seq: SequenceCache, pending: int, k: int) -> list[int]:
        """Up to ``k`` tokens the model's MTP head drafts after ``pending`` (sampled, not yet in ``seq``)."""
        return self.model.mtp.draft(seq, pending, k) if k > 0 else []

    def draft_logits(self, seq: SequenceCache, pending: int, k: int) -> tuple[list[int], np.ndarray]:
        """:meth:`draft` and the head's float32 logits ``[k, vocab]`` its tokens were read from."""
        return self.model.mtp.draft_logits(seq, pending, k)

    # ---- sequences -----------------------------------------------------------------

    def new_sequence(self) -> SequenceCache:
        if self.is_embedding_model:
            raise InputError(f"{self.gguf.path.name} is an embedding model; it cannot generate")
        if hasattr(self.model, "new_sequence_cache"):  # a cache of the family's own (deepseek4)
            return self.model.new_sequence_cache()
        n_layers, kv_heads, head_dim = self.model.kv_shape
        recurrent = self.model.new_recurrent_state() if hasattr(self.model, "new_recurrent_state") else None
        window = SlidingWindow(*self.window_layers) if self.window_layers else None
        if recurrent is not None and self.drafts:  # its persisted block ends carry the head's input row
            recurrent.feeds_head = True
        return SequenceCache(n_layers, kv_heads, head_dim, self.dtype, recurrent=recurrent, window=window,
                             codec=self.kv_codec)

    def _check_room(self, seq: SequenceCache, n_new: int) -> None:
        if seq.length + n_new > self.n_ctx:
            raise InputError(f"context length exceeded: {seq.length + n_new} tokens > context {self.n_ctx}")

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        bad = [t for t in tokens if not 0 <= int(t) < self.vocab_size
               and not (self.images is not None and is_image_token(int(t)))]
        if bad:
            raise InputError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")

    def prefill(self, seq: SequenceCache, tokens: Sequence[int]) -> np.ndarray:
        t0 = time.perf_counter()
        out = self._forward(seq, tokens, "prefill", every_position=False)
        self.stats["prefill_tokens"] += len(tokens)
        self.stats["prefill_s"] += time.perf_counter() - t0
        return out

    def verify(self, seq: SequenceCache, tokens: Sequence[int]) -> np.ndarray:
        """Append ``tokens`` (the last accepted token and a draft) to ``seq`` in one forward and return
        float32 logits ``[len(tokens), vocab]`` of every position, for speculative decoding.

        The caller then keeps the accepted length with ``seq.trim``; a hybrid-recurrent sequence can
        only go back to the length before this call (``hf2q.engine.speculative`` re-feeds from there).
        Counted as one decode step.
        """
        t0 = time.perf_counter()
        out = self._forward(seq, tokens, "verify", every_position=True)
        self.stats["decode_steps"] += 1
        self.stats["decode_s"] += time.perf_counter() - t0
        return out

    def _forward(self, seq: SequenceCache, tokens: Sequence[int], what: str, every_position: bool) -> np.ndarray:
        """``tokens`` appended to ``seq`` in one forward; the last position's logits ``[vocab]`` or
        every position's ``[len(tokens), vocab]``."""
        tokens = list(tokens)
        if not tokens:
            raise ValueError(f"{what} needs at least one token")
        self._check_room(seq, len(tokens))
        self._check_tokens(tokens)
        if self.images is not None and (self._shifted([seq]) or any(is_image_token(t) for t in tokens)):
            return self._forward_positions(seq, tokens, every_position)
        ids = np.asarray(tokens, dtype=np.int32)
        if self._host_rows(len(tokens)):
            if every_position:
                return self.host_decoder.step(ids, [seq] * len(ids), end_point=False)
            return self.host_decoder.prefill(seq, ids)
        fb = ForwardBatch([seq], len(tokens), end_point=not every_position)
        logits = self.model(mx.array(ids[None]), fb, last_only=not every_position)
        mx.eval(logits, fb.eval_state())
        fb.finish()
        return np.array(logits[0])

    def _forward_positions(self, seq: SequenceCache, tokens: list[int], every_position: bool) -> np.ndarray:
        """``_forward`` with explicit M-RoPE ids: image tokens become their encoded features (the encoder
        runs here, in this transaction, for an image not cached) and text follows an image's shift."""
        start = seq.length
        pos, ends, runs = chunk_positions(tokens, start, shift_at(seq), self.images)
        ids = np.asarray([t if not is_image_token(t) else 0 for t in tokens], dtype=np.int32)
        kw = {"positions": mx.array(pos[:, None, :].astype(np.int32))}
        if runs:
            x = self.model.embed.rows(mx.array(ids)).astype(self.dtype)
            rows = np.concatenate([r for _, _, r in runs])
            feats = [(self.images.features(key, self.vision), mx.array(idx.astype(np.int32))) for key, idx, _ in runs]
            x[mx.array(rows.astype(np.int32))] = mx.concatenate([f.merged[i] for f, i in feats]).astype(x.dtype)
            mask = np.zeros((1, len(tokens)), bool)
            mask[0, rows] = True
            layers = min(len(f.deepstack) for f, _ in feats)
            kw.update(embeddings=x[None], visual_mask=mx.array(mask),
                      deepstack=[mx.concatenate([f.deepstack[k][i] for f, i in feats]) for k in range(layers)])
        fb = ForwardBatch([seq], len(tokens), end_point=not every_position)
        logits = self.model(mx.array(ids[None]), fb, last_only=not every_position, **kw)
        mx.eval(logits, fb.eval_state())
        fb.finish()
        for length, shift in ends:
            record_shift(seq, length, shift)
        return np.array(logits[0])

    def _decode_positions(self, seqs: Sequence[SequenceCache]) -> dict:
        """The model keywords of a decode step over ``seqs``: their M-RoPE ids when any is shifted."""
        if not self._shifted(seqs):
            return {}
        ids = np.asarray([s.length + shift_at(s) for s in seqs], dtype=np.int32)
        return {"positions": mx.broadcast_to(mx.array(ids)[None, :, None], (3, len(seqs), 1))}

    def _host_rows(self, n_tokens: int) -> bool:
        """Whether a prefill chunk of ``n_tokens`` runs as rows of the CPU host step."""
        return self.host_decoder is not None and n_tokens <= HOST_PREFILL_ROWS

    def _check_decode(self, seqs: Sequence[SequenceCache], n_tokens: int) -> None:
        if len(seqs) != n_tokens or not seqs:
            raise ValueError("decode needs one token per sequence")
        if len({id(s) for s in seqs}) != len(seqs):
            raise ValueError("a sequence appears twice in one decode step")
        for s in seqs:
            self._check_room(s, 1)

    def _graph_step(self, seqs: Sequence[SequenceCache], ids: mx.array) -> tuple[mx.array, ForwardBatch]:
        """The decode step through the MLX graph: lazy float32 logits ``[N, vocab]``; caches advanced."""
        if self._stack is not None and (not self._stack.holds(seqs) or self._stack.windows_move()):
            self._stack.dissolve()  # the batch changed, or a window moves on: every row back to its sequence
            self._stack = None
        if self._stack is None and self.stack_decode and StackedDecode.fits(seqs):
            self._stack = StackedDecode(seqs)
        kw = self._decode_positions(seqs)  # before the batch: its offsets are the lengths now
        fb = ForwardBatch(seqs, 1, self._stack)
        logits = self.model(ids, fb, **kw)
        fb.finish()
        self.stats["decode_steps"] += 1
        return logits, fb

    def decode(self, seqs: Sequence[SequenceCache], tokens: Sequence[int]) -> np.ndarray:
        self._check_decode(seqs, len(tokens))
        self._check_tokens(tokens)
        t0 = time.perf_counter()
        if self.host_decoder is not None and not self._shifted(seqs):  # the host step has no M-RoPE shift
            out = self.host_decoder.step(np.asarray(tokens, dtype=np.int32), list(seqs))
            self.stats["decode_steps"] += 1
        else:
            logits, fb = self._graph_step(seqs, mx.array(np.asarray(tokens, dtype=np.int32)[:, None]))
            mx.eval(logits, fb.eval_state())
            out = np.array(logits)
        self.stats["decode_s"] += time.perf_counter() - t0
        return out

    def decode_with_prefill(self, seqs: Sequence[SequenceCache], tokens: Sequence[int], pseq: SequenceCache,
                            ptokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``decode(seqs, tokens)`` and ``prefill(pseq, ptokens)`` of one decode-first mixed step:
        one host step when the chunk is short enough for host rows (the decode rows then cost
        little more than the prefill alone), otherwise the two calls. Returns both logits."""
        ptokens = list(ptokens)
        if not seqs or not ptokens or not self._host_rows(len(ptokens)) or self._shifted([*seqs, pseq]) \
                or (self.images is not None and any(is_image_token(t) for t in ptokens)):
            return self.decode(seqs, tokens), self.prefill(pseq, ptokens)
        self._check_decode(seqs, len(tokens))
        self._check_room(pseq, len(ptokens))
        self._check_tokens(list(tokens) + ptokens)
        t0 = time.perf_counter()
        dec, pre = self.host_decoder.step_with_prefill(np.asarray(tokens, dtype=np.int32), list(seqs), pseq,
                                                       np.asarray(ptokens, dtype=np.int32))
        spent = time.perf_counter() - t0
        n, rows = len(ptokens), len(ptokens) + len(seqs)
        self.stats["decode_steps"] += 1
        self.stats["prefill_tokens"] += n
        self.stats["prefill_s"] += spent * n / rows  # one pass: its time shared out by rows
        self.stats["decode_s"] += spent * (rows - n) / rows
        return dec, pre

    def decode_async(self, seqs: Sequence[SequenceCache], tokens: "Sequence[int] | PendingTokens",
                     samplers) -> "PendingTokens":
        """One decode step whose next tokens are sampled on the device and not waited for.

        ``tokens`` is a list of ints or the ``PendingTokens`` of the previous step over the same
        sequences. The caches advance at once; if the caller stops early (a stop token read
        from the previous step), it trims the extra position with ``seq.trim``.
        """
        from hf2q.engine.sampling.device import sample_rows

        if len(seqs) != len(samplers):
            raise ValueError("decode_async needs one sampler per sequence")
        if self.host_decoder is not None:  # the host step is synchronous: nothing to overlap
            ints = tokens.result()[0] if isinstance(tokens, PendingTokens) else tokens
            logits = mx.array(self.decode(seqs, [int(t) for t in ints]))
        elif isinstance(tokens, PendingTokens):
            self._check_decode(seqs, len(tokens.tokens))
            logits, _ = self._graph_step(seqs, tokens.tokens[:, None])
        else:
            self._check_decode(seqs, len(tokens))
            self._check_tokens(tokens)
            logits, _ = self._graph_step(seqs, mx.array(np.asarray(tokens, dtype=np.int32)[:, None]))
        toks, logprobs = sample_rows(logits, samplers)
        mx.async_eval(toks, logprobs)
        return PendingTokens(toks, logprobs)

    # ---- embeddings ----------------------------------------------------------------

    def embed(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        if not self.is_embedding_model:
            raise InputError(f"{self.gguf.path.name} is not an embedding model")
        for toks in batch:
            if len(toks) > self.n_ctx:
                raise InputError(f"input of {len(toks)} tokens exceeds the context {self.n_ctx}")
            self._check_tokens(toks)
        out = self.model.embed([list(t) for t in batch])
        return np.array(out)

    # ---- KV transfer ---------------------------------------------------------------

    def export_kv(self, seq: SequenceCache, start: int, end: int) -> dict[str, np.ndarray]:
        if not 0 <= start <= end <= seq.length:
            raise ValueError(f"export range [{start}, {end}) outside 0..{seq.length}")
        return seq.export(start, end)

    def import_kv(self, seq: SequenceCache, arrays: dict[str, np.ndarray], n_tokens: int) -> None:
        self._check_room(seq, n_tokens)
        seq.import_(arrays, n_tokens)


def _kv_codec(kv_cache_type: str, model, dtype, arch: str, v_head_dim: int | None):
    """The 8-bit codec of ``kv_cache_type`` for ``model``'s caches, None for ``f16`` (a family that
    cannot hold one is refused in one line, ``kv_layout.check_kv_type``)."""
    from hf2q.engine.kv_quant import make_codec

    return make_codec(kv_cache_type, model.kv_shape[2], dtype, arch, v_head_dim=v_head_dim)


WARM_UP_PROMPT = 96  # tokens, prefilled in chunks of 64, 24 and 8 (the GPU's matmul row tiles)


def warm_up(runner) -> None:
    """Run one tiny request through every kernel a first request needs, then forget it.

    GPU backends compile kernels on first use (on an H200 the first chat request of a fresh
    tensor-parallel server waited 49.5 s for its first token), so ``hf2q serve`` pays that
    before it reports ready instead of in a user's time to first token. Counters are restored.
    """
    stats = dict(runner.stats)
    if runner.is_embedding_model:
        runner.embed([[1, 2, 3]])
    else:
        from hf2q.engine.sampling.device import DeviceSampler
        from hf2q.sched.contracts import SamplingParams

        seq, other = runner.new_sequence(), runner.new_sequence()
        n = max(3, min(WARM_UP_PROMPT, runner.n_ctx - 8))  # room for the decode steps below
        toks = [1 + i % max(1, runner.vocab_size - 1) for i in range(n)]
        # chunks of 2/3, 1/4 and 1/12 of the prompt (64, 24 and 8 rows of 96), each continuing the
        # last: mlx-cuda compiles its quantized matmul per row tile (16/32/64) on first use — after
        # a 16-token warm-up an H200 spent 48 s compiling in the first user's 59-token prefill
        cuts = sorted({0, n * 2 // 3, n * 11 // 12, n})
        for a, b in zip(cuts, cuts[1:]):
            logits = runner.prefill(seq, toks[a:b])
        first = int(np.argmax(logits))
        runner.decode([seq], [first])
        runner.prefill(other, toks[:5])
        runner.decode([seq, other], [first, first])  # a batched step (per-sequence masks)
        if getattr(runner, "drafts", False):
            runner.verify(seq, [first] + runner.draft(seq, first, 2))  # the MTP head's draft steps
        if getattr(runner, "pipelines_decode", False):
            for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9, seed=0)):
                pending = runner.decode_async([seq], [first], [DeviceSampler(params)])
                runner.decode_async([seq], pending, [DeviceSampler(params)]).result()
    runner.stats.clear()
    runner.stats.update(stats)
