"""A tokenizer rebuilt from the ``tokenizer.ggml.*`` metadata of a GGUF file.

Encoding runs on the ``tokenizers`` library (Rust): we translate the GGUF description
into the equivalent HF pipeline so the hot path never loops in Python:

* ``gpt2`` — byte-level BPE with the GGUF merges and the word-splitting rule named by
  ``tokenizer.ggml.pre`` (see :mod:`hf2q.text.pretokenizers`);
* ``gemma4`` — SentencePiece-style BPE over raw UTF-8 (spaces as U+2581) with merges;
* ``llama`` — SentencePiece BPE: merges are not stored, the pair whose merged piece has
  the best score wins, so we derive a merge list ranked by score (byte fallback to
  ``<0xXX>`` pieces);
* ``bert`` — WordPiece; the GGUF marks word starts with U+2581 instead of marking
  continuations with ``##``, so we map the vocabulary back;
* ``t5`` — SentencePiece Unigram with the precompiled charsmap normaliser, encoded by
  :mod:`hf2q.text.ugm` (llama.cpp's own steps, which ``tokenizers`` does not reproduce).

Special tokens follow llama.cpp: control/unknown tokens are matched in the text only
when ``parse_special`` is set, user-defined tokens always are.

A long text is encoded in pieces cut where the word-splitting rule always cuts (before a
space that starts a word), for byte-level BPE vocabularies whose added tokens hold no space:
the ids are the same, and no single call holds the interpreter lock for long (freeing one
call's result for a whole book takes a noticeable pause, which a server thread cannot afford).

Decoding is ours: each id maps to the exact bytes it stands for (GPT-2 byte alphabet
undone, ``<0xXX>`` pieces as raw bytes, U+2581 back to a space), so ``decode`` and the
streaming :class:`IncrementalDetokenizer` agree byte for byte.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
)

from hf2q.errors import InputError
from hf2q.formats.gguf_keys import ExtraKeys, Keys
from hf2q.formats.gguf_parse import metadata_from
from hf2q.text.pretokenizers import PreTokenizerRule, rule_for
from hf2q.text.ugm import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED, UgmEncoder, ugm_encoder


SPIECE_SPACE = "\u2581"

# Tokens every runtime treats as end-of-generation by their text, whatever the metadata says.
_EOG_TEXTS = frozenset(
    ["<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>"]
)


def gpt2_byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_OF_CHAR = {c: b for b, c in gpt2_byte_alphabet().items()}


def _gpt2_piece_bytes(text: str) -> bytes:
    out = bytearray()
    for ch in text:
        b = _BYTE_OF_CHAR.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def _byte_token_value(text: str) -> int | None:
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


def _meta_int(meta: dict[str, Any], key: str) -> int | None:
    value = meta.get(key)
    return None if value is None else int(value)


def _spm_merges(vocab: dict[str, int], scores: np.ndarray, types: np.ndarray) -> list[tuple[str, str]]:
    """Rank every (left, right) → piece split by the merged piece's score, best first.

    SentencePiece BPE merges the adjacent pair whose concatenation is the best-scoring
    piece; ranking all such splits by that score gives ``tokenizers``' BPE the same choice.
    (Hot loop for 262k-piece vocabularies: plain lists and ``in`` tests, no per-item numpy.)
    """
    skip = {CONTROL, BYTE, UNUSED, UNKNOWN}
    score_of, type_of = scores.tolist(), types.tolist()
    ranked = []
    add = ranked.append
    for piece, pid in vocab.items():
        n = len(piece)
        if n < 2 or type_of[pid] in skip:
            continue
        key = -score_of[pid]
        for cut in range(1, n):
            left = piece[:cut]
            if left in vocab:
                right = piece[cut:]
                if right in vocab:
                    add((key, pid, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


class GGUFTokenizer:
    """Encode/decode with the vocabulary stored in a GGUF (see module docstring)."""

    def __init__(self, meta: dict[str, Any], *, source: str = "GGUF"):
        model = meta.get(Keys.Tokenizer.MODEL)
        raw_tokens = meta.get(Keys.Tokenizer.LIST)
        if model is None or raw_tokens is None:
            raise InputError(f"{source}: no tokenizer in the GGUF metadata")
        self.model_kind = str(model)
        self.pre = meta.get(Keys.Tokenizer.PRE)
        texts = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else str(t) for t in raw_tokens]
        n = len(texts)
        types = meta.get(Keys.Tokenizer.TOKEN_TYPE)
        self._types = np.asarray(types, dtype=np.int32) if types is not None else np.full(n, NORMAL, np.int32)
        if len(self._types) != n:
            raise InputError(f"{source}: tokenizer token_type has {len(self._types)} entries for {n} tokens")
        self._texts = texts
        self.vocab_size = n

        self.bos_id = _meta_int(meta, Keys.Tokenizer.BOS_ID)
        self.eos_id = _meta_int(meta, Keys.Tokenizer.EOS_ID)
        self.unk_id = _meta_int(meta, Keys.Tokenizer.UNK_ID)
        self.sep_id = _meta_int(meta, Keys.Tokenizer.SEP_ID)
        self.pad_id = _meta_int(meta, Keys.Tokenizer.PAD_ID)

        # extra end-of-generation ids: explicit eot/eom plus the well-known texts
        eog = {i for i in (self.eos_id, _meta_int(meta, Keys.Tokenizer.EOT_ID), _meta_int(meta, Keys.Tokenizer.EOM_ID)) if i is not None}
        for i, text in enumerate(texts):
            if text in _EOG_TEXTS:
                eog.add(i)
                if self._types[i] in (NORMAL, USER_DEFINED):
                    self._types[i] = CONTROL  # llama.cpp overrides these to control as well
        self.eos_ids = frozenset(i for i in eog if 0 <= i < n)

        self.add_space_prefix = bool(meta.get(Keys.Tokenizer.ADD_PREFIX, self.model_kind == "llama"))
        self._rule: PreTokenizerRule | None = None
        if self.model_kind == "gpt2":
            self._rule = rule_for(self.pre)
            if self._rule is None:
                raise InputError(f"{source}: unknown pre-tokenizer {self.pre!r} for a gpt2 BPE vocabulary")
            self.add_space_prefix = False
        elif self.model_kind == "gemma4":
            self._rule = rule_for("gemma4")
            self.add_space_prefix = False
        default_bos = {"llama": True, "bert": True}.get(self.model_kind, bool(self._rule and self._rule.default_add_bos))
        self.add_bos = bool(meta.get(Keys.Tokenizer.ADD_BOS, default_bos))
        if self.model_kind == "gemma4":
            self.add_bos = True
        self.add_eos = bool(meta.get(Keys.Tokenizer.ADD_EOS, self.model_kind in ("bert", "t5")))
        self._ugm: UgmEncoder | None = None
        if self.model_kind == "t5":
            self._ugm = ugm_encoder(meta, texts, self._types, source)
            self.unk_id, self.add_space_prefix = self._ugm.unk_id, self._ugm.add_space_prefix
        if self.model_kind == "bert":
            self.bos_id = _meta_int(meta, ExtraKeys.CLS_ID) if self.bos_id is None else self.bos_id
            self.eos_for_add = self.sep_id
        else:
            self.eos_for_add = self.eos_id

        self._hf = self._build(meta, texts, source)
        self._lock = threading.Lock()
        self._piece_bytes = self._build_piece_bytes()
        self.special_ids = frozenset(int(i) for i in np.flatnonzero((self._types == CONTROL) | (self._types == UNKNOWN)))
        self._piecewise = self.model_kind == "gpt2" and not any(
            " " in t for i, t in enumerate(texts) if self._types[i] in (CONTROL, UNKNOWN, USER_DEFINED))

    # ---- construction ----------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path_or_reader: Any) -> GGUFTokenizer:
        """From a GGUF path, a ``gguf.GGUFReader`` or an already-read metadata dict."""
        source = os.fspath(path_or_reader) if isinstance(path_or_reader, (str, os.PathLike)) else "GGUF"
        return cls(metadata_from(path_or_reader), source=source)

    def _vocab_dict(self, texts: Sequence[str]) -> dict[str, int]:
        vocab: dict[str, int] = {}
        for i, t in enumerate(texts):
            vocab.setdefault(t, i)  # first id wins for duplicated texts, as in llama.cpp
        return vocab

    def _build(self, meta: dict[str, Any], texts: list[str], source: str) -> Tokenizer | None:
        kind = self.model_kind
        if kind == "t5":
            return None  # encoded by hf2q.text.ugm
        if kind in ("gpt2", "gemma4"):
            raw_merges = meta.get(Keys.Tokenizer.MERGES)
            if raw_merges is None:
                raise InputError(f"{source}: BPE vocabulary without {Keys.Tokenizer.MERGES}")
            merges = []
            for m in raw_merges:
                s = m.decode("utf-8", errors="replace") if isinstance(m, bytes) else str(m)
                cut = s.find(" ", 1)
                if cut > 0:
                    merges.append((s[:cut], s[cut + 1 :]))
            rule = self._rule
            assert rule is not None
            bpe = models.BPE(
                vocab=self._vocab_dict(texts),
                merges=merges,
                ignore_merges=rule.ignore_merges or kind == "gemma4",
                byte_fallback=not rule.byte_encode,
            )
            tok = Tokenizer(bpe)
            if rule.escape_whitespace:
                tok.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
            steps = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in rule.patterns]
            if rule.byte_encode:
                steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
            tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        elif kind == "llama":
            scores = meta.get(Keys.Tokenizer.SCORES)
            if scores is None:
                raise InputError(f"{source}: SentencePiece vocabulary without {Keys.Tokenizer.SCORES}")
            vocab = self._vocab_dict(texts)
            merges = _spm_merges(vocab, np.asarray(scores, dtype=np.float32), self._types)
            unk = texts[self.unk_id] if self.unk_id is not None and 0 <= self.unk_id < len(texts) else None
            tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token=unk, fuse_unk=True))
            steps = [normalizers.Replace(" ", SPIECE_SPACE)]
            if self.add_space_prefix:
                steps.insert(0, normalizers.Prepend(" "))
            tok.normalizer = normalizers.Sequence(steps)
        elif kind == "bert":
            wp_vocab: dict[str, int] = {}
            for i, t in enumerate(texts):
                if t.startswith(SPIECE_SPACE):
                    key = t[1:]
                elif t.startswith("[") and t.endswith("]"):
                    key = t
                else:
                    key = "##" + t
                wp_vocab.setdefault(key, i)
            unk = texts[self.unk_id] if self.unk_id is not None else "[UNK]"
            tok = Tokenizer(models.WordPiece(vocab=wp_vocab, unk_token=unk, max_input_chars_per_word=100))
            tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=True, lowercase=True)
            tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        else:
            raise InputError(f"{source}: unsupported tokenizer model {kind!r} (supported: gpt2, llama, bert, gemma4, t5)")
        tok.decoder = decoders.ByteLevel()  # unused: decoding is ours, see decode()

        added = []
        for i, t in enumerate(texts):
            ty = self._types[i]
            if ty in (CONTROL, UNKNOWN) and t:
                added.append(AddedToken(t, special=True, normalized=False))
            elif ty == USER_DEFINED and t:
                added.append(AddedToken(t, special=False, normalized=False))
        if added:
            tok.add_tokens(added)
        return tok

    def _build_piece_bytes(self) -> list[bytes]:
        pieces: list[bytes] = []
        kind = self.model_kind
        byte_level = kind == "gpt2" and self._rule is not None and self._rule.byte_encode
        for i, t in enumerate(self._texts):
            ty = self._types[i]
            if ty == BYTE:
                value = _byte_token_value(t)
                if value is not None:
                    pieces.append(bytes([value]))
                    continue
            if ty in (CONTROL, UNKNOWN, USER_DEFINED):
                pieces.append(t.encode("utf-8"))
            elif ty == UNUSED and kind == "t5":
                pieces.append(b"")  # llama.cpp prints nothing for an unused Unigram piece
            elif byte_level:
                pieces.append(_gpt2_piece_bytes(t))
            elif kind == "bert":
                pieces.append((" " + t[1:]).encode() if t.startswith(SPIECE_SPACE) else t.encode())
            else:
                pieces.append(t.replace(SPIECE_SPACE, " ").encode("utf-8"))
        return pieces

    # ---- public API -------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special`` adds BOS/EOS as the model asks."""
        if not isinstance(text, str):
            raise InputError("tokenizer input must be a string")
        ids: list[int] = []
        if text and self._ugm is not None:
            ids = self._ugm.encode(text, parse_special)
        elif text:
            pieces = _word_aligned_pieces(text) if self._piecewise and len(text) > PIECE_CHARS else (text,)
            with self._lock:
                self._hf.encode_special_tokens = not parse_special
                for piece in pieces:
                    ids += self._hf.encode(piece, add_special_tokens=False).ids
        if add_special:
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_for_add is not None:
                ids.append(self.eos_for_add)
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        return self._piece_bytes[token_id]

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry as stored in the GGUF (e.g. ``Ġhello``, ``▁hello``, ``<0x0A>``)."""
        return self._texts[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        out = bytearray()
        first = True
        for tid in ids:
            tid = int(tid)
            if not 0 <= tid < self.vocab_size:
                raise InputError(f"token id {tid} is outside the vocabulary (size {self.vocab_size})")
            if skip_special and tid in self.special_ids:
                continue
            piece = self._piece_bytes[tid]
            if first and self._strip_leading_space and piece.startswith(b" ") and tid not in self.special_ids:
                piece = piece[1:]
            first = False
            out += piece
        return bytes(out)

    @property
    def _strip_leading_space(self) -> bool:
        return self.add_space_prefix or self.model_kind == "bert"

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def piece_bytes_table(self) -> list[bytes]:
        """Bytes of every token (special tokens as their text) — for constrained decoding."""
        return list(self._piece_bytes)

    @property
    def hf_tokenizer(self) -> Tokenizer | None:
        """The ``tokenizers`` pipeline (None for ``t5``, which :mod:`hf2q.text.ugm` encodes)."""
        return self._hf


def _utf8_incomplete_tail(buf: bytes | bytearray) -> int:
    """Length of a trailing, still-completable UTF-8 sequence start (0 if none)."""
    n = len(buf)
    for back in range(1, min(4, n) + 1):
        b = buf[n - back]
        if b & 0xC0 == 0x80:  # continuation byte: keep looking for the lead byte
            continue
        if b & 0xE0 == 0xC0:
            need = 2
        elif b & 0xF0 == 0xE0:
            need = 3
        elif b & 0xF8 == 0xF0:
            need = 4
        else:
            return 0
        return back if back < need else 0
    return 0


PIECE_CHARS = 1 << 13
#: a space that starts a word after a non-space: every byte-level BPE splitting rule cuts there
_WORD_START = re.compile(r"(?<=\S) (?=[^\W\d_])")


def _word_aligned_pieces(text: str) -> list[str]:
    """``text`` cut into pieces of about ``PIECE_CHARS`` at word starts (one piece if there are none)."""
    pieces, start = [], 0
    while len(text) - start > PIECE_CHARS:
        m = _WORD_START.search(text, start + PIECE_CHARS)
        if m is None:
            break
        pieces.append(text[start:m.start()])
        start = m.start()
    pieces.append(text[start:])
    return pieces


class IncrementalDetokenizer:
    """Turns a token stream into text deltas whose concatenation equals ``decode(all)``.

    Bytes that may still become part of a multi-byte character are held back until the
    next token completes them (or :meth:`flush` gives up on them).
    """

    def __init__(self, tokenizer: GGUFTokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._pending = bytearray()
        self._first = True

    def push(self, token_id: int) -> str:
        tok = self.tokenizer
        token_id = int(token_id)
        if self.skip_special and token_id in tok.special_ids:
            return ""
        piece = tok.decode_bytes([token_id]) if self._first else tok.token_bytes(token_id)
        self._first = False
        self._pending += piece
        keep = _utf8_incomplete_tail(self._pending)
        ready = bytes(self._pending[: len(self._pending) - keep])
        del self._pending[: len(self._pending) - keep]
        return ready.decode("utf-8", errors="replace")

    def flush(self) -> str:
        """Emit whatever is held back (an unfinished character becomes U+FFFD)."""
        text = bytes(self._pending).decode("utf-8", errors="replace")
        self._pending.clear()
        return text

    @property
    def holding(self) -> bool:
        return bool(self._pending)
