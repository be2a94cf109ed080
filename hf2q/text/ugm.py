"""SentencePiece Unigram ("UGM", GGUF ``tokenizer.ggml.model = t5``) encoding, as llama.cpp does it.

XLM-R style vocabularies (nomic-embed-text v2, T5, …) are a Unigram model over text normalised by
SentencePiece's *precompiled charsmap*: a byte trie (an XOR-compressed compact double array) whose
leaves name a replacement string. llama.cpp's tokenizer is the reference, so this module follows its
steps exactly rather than the ``tokenizers`` library's (which normalises grapheme by grapheme and
ties differently):

1. the text is cut at special tokens, longest text first (``split_specials``); ``<mask>`` of the
   nomic-bert-moe / jina vocabularies eats the whitespace before it;
2. each remaining fragment is normalised: at every position a user-defined token is kept as it is,
   else the longest charsmap key is replaced, else one UTF-8 character passes; spaces become
   U+2581, one is put before the first word (or before every word when extra whitespace is
   removed, which also drops the other spaces);
3. a Viterbi pass over the normalised bytes picks, for every prefix, the best sum of piece scores
   (double precision, user-defined pieces scoring 0, ties to the first candidate found); a
   character no piece covers costs the lowest normal score minus 10 as the unknown token, and
   runs of unknown tokens are merged into one.
"""

from __future__ import annotations

import bisect
import functools
import struct
from collections.abc import Sequence

import numpy as np

from hf2q.errors import InputError
from hf2q.formats.gguf_keys import Keys

#: vocabularies whose ``<mask>`` llama.cpp strips the whitespace before (by architecture / pre-tokenizer)
_MASK_LSTRIP_ARCHS = ("nomic-bert-moe", "jina-bert-v3")
_MASK_LSTRIP_PRES = ("jina-v2-de", "jina-v2-es", "jina-v2-code")

# GGUF token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_ESCAPED_SPACE = "\u2581".encode()
_UNKNOWN_PENALTY = np.float32(10.0)
#: C's isspace() for the bytes a special token's strip removes
_C_SPACES = " \t\n\v\f\r"
#: UTF-8 sequence length by the lead byte's high nibble (llama.cpp's unicode_len_utf8)
_UTF8_LEN = (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)


class Charsmap:
    """SentencePiece's precompiled normaliser: the XCDA trie and its NUL-terminated replacements."""

    def __init__(self, blob: bytes):
        if len(blob) < 4:
            raise InputError("precompiled_charsmap is too small for its header")
        (size,) = struct.unpack_from("<I", blob, 0)
        if size + 4 >= len(blob) or size % 4:
            raise InputError("precompiled_charsmap: its trie overruns the blob")
        self._units = np.frombuffer(blob, dtype="<u4", count=size // 4, offset=4).tolist()
        self._replacements = blob[4 + size:]

    def _unit(self, i: int) -> int:
        if i >= len(self._units):
            raise InputError("precompiled_charsmap: trie index out of bounds")
        return self._units[i]

    def _base(self, i: int) -> int:
        u = self._unit(i)
        return (u >> 10) << ((u & (1 << 9)) >> 6)

    def longest(self, data: bytes, start: int) -> tuple[int, bytes]:
        """(bytes matched, replacement) of the longest key at ``data[start:]``; (0, b"") for none."""
        node = self._base(0)
        best_len, best_at = 0, 0
        for pos in range(start, len(data)):
            c = data[pos]
            if c == 0:
                break
            node ^= c
            u = self._unit(node)
            if u & ((1 << 31) | 0xFF) != c:
                break
            leaf = (u >> 8) & 1
            node ^= self._base(node)
            if leaf:
                best_len, best_at = pos - start + 1, self._unit(node) & ((1 << 31) - 1)
        if not best_len:
            return 0, b""
        if best_at >= len(self._replacements):
            raise InputError("precompiled_charsmap: replacement index out of bounds")
        end = self._replacements.find(b"\0", best_at)
        if end < 0:
            raise InputError("precompiled_charsmap: unterminated replacement string")
        return best_len, self._replacements[best_at:end]


class _PrefixIndex:
    """Byte strings with a 'does any of them start with this' test (sorted + bisect).

    Answers are remembered: a document repeats its words, so most of a Viterbi pass's questions were
    asked before, and a dictionary answers them faster than a search of 250k sorted pieces. The memory
    is a least-recently-used cache of ``memo_limit`` answers, so a stream of distinct text cannot grow it."""

    def __init__(self, keys: Sequence[bytes], memo_limit: int = 1 << 18):
        self._sorted = sorted(set(keys))
        #: the test, remembered (one cache per index: it answers for this index's keys only)
        self.extends = functools.lru_cache(maxsize=memo_limit)(self._search)

    def _search(self, prefix: bytes) -> bool:
        i = bisect.bisect_left(self._sorted, prefix)
        return i < len(self._sorted) and self._sorted[i].startswith(prefix)


class UgmEncoder:
    """Token ids of text for one Unigram vocabulary (see the module docstring for the steps)."""

    def __init__(self, texts: Sequence[str], scores: Sequence[float], types: Sequence[int], *,
                 unk_id: int | None, charsmap: bytes | None, add_space_prefix: bool,
                 remove_extra_whitespaces: bool, lstrip_texts: frozenset[str] = frozenset()):
        if len(scores) != len(texts):
            raise InputError(f"tokenizer scores has {len(scores)} entries for {len(texts)} tokens")
        self.unk_id = -1 if unk_id is None else int(unk_id)
        self._charsmap = Charsmap(charsmap) if charsmap else None
        self.add_space_prefix = bool(add_space_prefix)
        self._prepend, self._merge = self.add_space_prefix, bool(remove_extra_whitespaces)
        self._pieces: dict[bytes, tuple[int, float]] = {}
        user: list[bytes] = []
        normal = np.asarray(scores, dtype=np.float32)[np.asarray(types) == NORMAL]
        lowest = normal.min() if normal.size else np.float32(np.finfo(np.float32).max)
        self._unk_score = float(np.float32(lowest - _UNKNOWN_PENALTY))
        for i, (text, score, kind) in enumerate(zip(texts, scores, types)):
            raw = text.encode("utf-8")
            if not raw:
                continue
            if kind in (NORMAL, USER_DEFINED, UNUSED):
                self._pieces[raw] = (i, 0.0 if kind == USER_DEFINED else float(np.float32(score)))  # last id wins
            if kind == USER_DEFINED:
                user.append(raw)
        self._index = _PrefixIndex(list(self._pieces))
        self._user = sorted(set(user), key=len, reverse=True)
        # special tokens, longest first, as llama.cpp partitions the text
        self._specials = sorted(((t, i, k) for i, (t, k) in enumerate(zip(texts, types))
                                 if t and k in (CONTROL, USER_DEFINED, UNKNOWN)), key=lambda s: -len(s[0].encode()))
        self._lstrip = lstrip_texts

    # ---- special tokens ------------------------------------------------------------------
    def split_specials(self, text: str, parse_special: bool) -> list[str | int]:
        """``text`` as raw fragments (str) and special token ids (int), llama.cpp's partition."""
        parts: list[str | int] = [text]
        for special, tid, kind in self._specials:
            if not parse_special and kind in (CONTROL, UNKNOWN):
                continue  # user-defined tokens are split out whatever parse_special says
            out: list[str | int] = []
            for part in parts:
                if isinstance(part, int) or special not in part:
                    out.append(part)
                    continue
                start = 0  # searched from an offset: cutting the rest off each time is quadratic in the matches
                while (at := part.find(special, start)) >= 0:
                    left = part[start:at]
                    if special in self._lstrip:
                        left = left.rstrip(_C_SPACES)
                    if left:
                        out.append(left)
                    out.append(tid)
                    start = at + len(special)
                if start < len(part):
                    out.append(part[start:])
            parts = out
        return parts

    # ---- normalisation -------------------------------------------------------------------
    def _normalize_prefix(self, data: bytes, pos: int) -> tuple[bytes, int]:
        for user in self._user:
            if data.startswith(user, pos):
                return user, len(user)
        if self._charsmap is not None:
            n, repl = self._charsmap.longest(data, pos)
            if n:
                return repl, n
        n = min(_UTF8_LEN[data[pos] >> 4], len(data) - pos)
        return data[pos:pos + n], n

    def normalize(self, text: str) -> bytes:
        """llama.cpp's UGM normaliser output (escaped spaces) for one raw fragment."""
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            raise InputError("tokenizer input is not valid Unicode (a lone UTF-16 surrogate)") from None
        out = bytearray()
        prepended = in_word = False
        pos = 0
        while pos < len(data):
            repl, used = self._normalize_prefix(data, pos)
            for c in repl:
                if c != 0x20:
                    if not in_word:
                        in_word = True
                        if (self._prepend and not prepended) or self._merge:
                            out += _ESCAPED_SPACE
                            prepended = True
                    out.append(c)
                else:
                    in_word = False
                    if not self._merge:
                        out += _ESCAPED_SPACE
            pos += used
        return bytes(out)

    # ---- Viterbi -------------------------------------------------------------------------
    def encode_fragment(self, text: str) -> list[int]:
        data = self.normalize(text)
        n = len(data)
        if not n:
            return []
        # per end offset: (token id, start offset, score sum)
        best: list[tuple[int, int, float]] = [(self.unk_id, 0, -np.inf)] * (n + 1)
        best[0] = (self.unk_id, 0, 0.0)
        pieces, extends = self._pieces, self._index.extends
        pos = 0
        while pos < n:
            width = min(_UTF8_LEN[data[pos] >> 4], n - pos)
            base = best[pos][2]
            whole_char = False
            end = pos + 1
            while end <= n:
                piece = data[pos:end]
                hit = pieces.get(piece)
                if hit is not None:
                    if end - pos == width:
                        whole_char = True
                    score = base + hit[1]
                    if score > best[end][2]:
                        best[end] = (hit[0], pos, score)
                if end == n or not extends(data[pos:end + 1]):
                    break
                end += 1
            if not whole_char:
                score = base + self._unk_score
                if score > best[pos + width][2]:
                    best[pos + width] = (self.unk_id, pos, score)
            pos += width
        ids: list[int] = []
        at, prev_unknown = n, False
        while True:
            tid, start, _ = best[at]
            unknown = tid == self.unk_id
            if not (prev_unknown and unknown):
                ids.append(tid)
            if start == 0:
                break
            prev_unknown, at = unknown, start
        ids.reverse()
        return ids

    def encode(self, text: str, parse_special: bool) -> list[int]:
        """Ids of ``text`` without BOS/EOS (the caller adds those)."""
        ids: list[int] = []
        for part in self.split_specials(text, parse_special):
            if isinstance(part, int):
                ids.append(part)
            else:
                ids += self.encode_fragment(part)
        return ids


def ugm_encoder(meta: dict, texts: Sequence[str], types: Sequence[int], source: str) -> UgmEncoder:
    """The encoder a GGUF's ``tokenizer.ggml.*`` keys describe (llama.cpp's defaults where they are silent)."""
    scores = meta.get(Keys.Tokenizer.SCORES)
    if scores is None:
        raise InputError(f"{source}: Unigram vocabulary without {Keys.Tokenizer.SCORES}")
    charsmap = meta.get(Keys.Tokenizer.PRECOMPILED_CHARSMAP)
    blob = bytes(np.asarray(charsmap, dtype=np.uint8)) if charsmap is not None and len(charsmap) else None
    unk = meta.get(Keys.Tokenizer.UNK_ID, 2)
    arch, pre = str(meta.get(Keys.General.ARCHITECTURE, "")), str(meta.get(Keys.Tokenizer.PRE, ""))
    lstrip = any(a in arch for a in _MASK_LSTRIP_ARCHS) or any(p in pre for p in _MASK_LSTRIP_PRES)
    try:
        return UgmEncoder(texts, scores, types, unk_id=unk, charsmap=blob,
                          add_space_prefix=bool(meta.get(Keys.Tokenizer.ADD_PREFIX, False)),
                          remove_extra_whitespaces=bool(meta.get(Keys.Tokenizer.REMOVE_EXTRA_WS, False)),
                          lstrip_texts=frozenset({"<mask>"}) if lstrip else frozenset())
    except InputError as e:
        raise InputError(f"{source}: {e}") from None
