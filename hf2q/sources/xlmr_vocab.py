"""``tokenizer.ggml.*`` for an XLM-R SentencePiece Unigram vocabulary (GGUF tokenizer model ``t5``).

Laid out as llama.cpp's converter does from ``sentencepiece.bpe.model``: every piece with its score
and type, padded to the config's vocab_size with ``[PADn]`` unused pieces, then realigned to the HF
ids (``<s> <pad> </s> <unk>`` first, each SentencePiece id moved up by one — fairseq's offset), and the
normaliser settings with the precompiled charsmap that :mod:`hf2q.text.ugm` reads back.
nomic-bert-moe's ``<mask>`` (absent from the SentencePiece model) is written at id 250001 as there.

Without the SentencePiece model, the converter reads ``tokenizer.json`` the way llama.cpp's does through
transformers: pieces and scores already in HF id order (no realignment, no ``<mask>`` move), token types
from the named and extra special tokens and the added tokens, ``add_prefix_space`` and
``clean_up_tokenization_spaces`` of ``tokenizer_config.json`` (transformers' defaults ``True``/``False``)
as the two normaliser flags, and the charsmap of a top-level ``Precompiled`` normaliser; any other
normaliser is refused, as that converter cannot read it either.
"""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path
from typing import Any

import gguf

from hf2q.errors import InputError
from hf2q.formats.gguf_keys import Keys
from hf2q.sources.hf_config import read_json_object

TT = gguf.TokenType
V = gguf.GGUFValueType
SP_MODEL = "sentencepiece.bpe.model"
_UNIGRAM = 1  # sentencepiece TrainerSpec.ModelType
#: nomic-embed-text-v2-moe's mask id (XLM-R's last HF id)
NOMIC_MASK_ID = 250001


def _model(path: Path):
    os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")
    from sentencepiece import SentencePieceProcessor
    from sentencepiece import sentencepiece_model_pb2

    try:
        data = path.read_bytes()
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(data)
        sp = SentencePieceProcessor()
        sp.LoadFromSerializedProto(data)
    except Exception as e:  # noqa: BLE001 — protobuf and sentencepiece raise their own types
        raise InputError(f"{path}: invalid sentencepiece model ({e})") from None
    if proto.trainer_spec.model_type != _UNIGRAM:
        raise InputError(f"{path}: expected a Unigram sentencepiece model, found model type "
                         f"{proto.trainer_spec.model_type}")
    return proto, sp


def padded_pieces(sp, size: int) -> tuple[list[bytes], list[float], list[int]]:
    """A SentencePiece model's first ``size`` pieces, scores and GGUF token types, padded to ``size`` with
    unused ``[PADn]`` pieces (llama.cpp's converter layout for both SentencePiece kinds)."""
    tokens = [f"[PAD{i}]".encode() for i in range(size)]
    scores = [-10000.0] * size
    types = [int(TT.UNUSED)] * size
    for i in range(min(size, sp.vocab_size())):
        kind = TT.NORMAL
        if sp.IsUnknown(i):
            kind = TT.UNKNOWN
        elif sp.IsControl(i):
            kind = TT.CONTROL
        elif sp.IsUnused(i):
            kind = TT.UNUSED
        elif sp.IsByte(i):
            kind = TT.BYTE
        tokens[i], scores[i], types[i] = sp.IdToPiece(i).encode("utf-8"), sp.GetScore(i), int(kind)
    return tokens, scores, types


#: XLMRobertaTokenizer's named special tokens and their defaults (transformers)
_NAMED_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "sep_token": "</s>",
                   "pad_token": "<pad>", "cls_token": "<s>", "mask_token": "<mask>"}


class XlmrVocab:
    """The vocabulary keys of one checkpoint, whichever file they came from."""

    def __init__(self, tokens: list[bytes], scores: list[float], types: list[int], *, add_prefix: bool,
                 remove_extra_whitespaces: bool, charsmap: bytes):
        self.tokens, self.scores, self.types = tokens, scores, types
        self.add_prefix, self.remove_extra_whitespaces, self.charsmap = add_prefix, remove_extra_whitespaces, charsmap


def _from_sentencepiece(path: Path, cfg: dict[str, Any], nomic_mask: bool) -> XlmrVocab:
    proto, sp = _model(path)
    tokens, scores, types = padded_pieces(sp, max(int(cfg.get("vocab_size") or 0), sp.vocab_size()))
    size = len(tokens)
    tokens = [b"<s>", b"<pad>", b"</s>", b"<unk>"] + tokens[3:-1]
    scores = [0.0] * 4 + scores[3:-1]
    types = [int(TT.CONTROL)] * 3 + [int(TT.UNKNOWN)] + types[3:-1]
    if nomic_mask:
        if size <= NOMIC_MASK_ID:
            raise InputError(f"config.json: vocab_size {size} leaves no room for <mask> at id {NOMIC_MASK_ID}")
        tokens[NOMIC_MASK_ID], scores[NOMIC_MASK_ID], types[NOMIC_MASK_ID] = b"<mask>", 0.0, int(TT.CONTROL)
    norm = proto.normalizer_spec
    return XlmrVocab(tokens, scores, types, add_prefix=norm.add_dummy_prefix,
                     remove_extra_whitespaces=norm.remove_extra_whitespaces, charsmap=norm.precompiled_charsmap)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json names it: a string or a serialised AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _unigram_pieces(path: Path, tj: dict) -> list[tuple[str, float]]:
    model = tj.get("model")
    if not isinstance(model, dict) or model.get("type") != "Unigram":
        kind = model.get("type") if isinstance(model, dict) else None
        raise InputError(f"{path}: an XLM-R tokenizer needs a Unigram model, found {kind!r}")
    vocab = model.get("vocab")
    if not isinstance(vocab, list) or not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
            and isinstance(p[1], (int, float)) and not isinstance(p[1], bool) for p in vocab):
        raise InputError(f"{path}: model.vocab must be a list of [piece, score] pairs")
    return [(p[0], float(p[1])) for p in vocab]


def _precompiled_charsmap(path: Path, tj: dict) -> bytes:
    norm = tj.get("normalizer")
    kind = norm.get("type") if isinstance(norm, dict) else None
    if kind != "Precompiled" or not isinstance(norm.get("precompiled_charsmap"), str):
        raise InputError(f"{path}: the normalizer is {kind or 'missing'}, not a top-level Precompiled charsmap "
                         f"(the only form read without {SP_MODEL}, as llama.cpp's converter reads it); "
                         f"add the checkpoint's {SP_MODEL}")
    try:
        return base64.b64decode(norm["precompiled_charsmap"], validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"{path}: normalizer.precompiled_charsmap is not base64") from None


def _from_tokenizer_json(src: Path, cfg: dict[str, Any]) -> XlmrVocab:
    path = src / "tokenizer.json"
    tj = read_json_object(path)
    pieces = _unigram_pieces(path, tj)
    charsmap = _precompiled_charsmap(path, tj)
    tc = read_json_object(src / "tokenizer_config.json") if (src / "tokenizer_config.json").is_file() else {}
    added = {a["content"]: a["id"] for a in tj.get("added_tokens") or []
             if isinstance(a, dict) and isinstance(a.get("content"), str) and isinstance(a.get("id"), int)}

    by_piece: dict[str, int] = {}
    for i, (piece, _) in enumerate(pieces):
        by_piece.setdefault(piece, i)

    def token_id(text: str) -> int | None:
        return added.get(text, by_piece.get(text))

    specials = [_token_text(tc.get(name, default)) for name, default in _NAMED_SPECIALS.items()]
    extra = tc.get("extra_special_tokens", tc.get("additional_special_tokens")) or []
    specials += [_token_text(t) for t in extra] if isinstance(extra, list) else []
    control = {i for t in specials if t is not None and (i := token_id(t)) is not None}
    unk = added.get(_token_text(tc.get("unk_token")) or "", tj["model"].get("unk_id", 3))
    size = max(int(cfg.get("vocab_size") or 0), len(pieces))
    tokens = [f"[PAD{i}]".encode() for i in range(size)]
    scores = [-10000.0] * size
    types = [int(TT.UNUSED)] * size
    user = set(added.values())
    for i, (piece, score) in enumerate(pieces):
        kind = (TT.UNKNOWN if i == unk else TT.CONTROL if i in control
                else TT.USER_DEFINED if i in user else TT.NORMAL)
        tokens[i], scores[i], types[i] = piece.encode("utf-8"), score, int(kind)
    return XlmrVocab(tokens, scores, types, add_prefix=tc.get("add_prefix_space", True) is True,
                     remove_extra_whitespaces=tc.get("clean_up_tokenization_spaces", False) is True,
                     charsmap=charsmap)


def add_xlmr_vocab(md, src: Path, cfg: dict[str, Any], *, nomic_mask: bool) -> int:
    """Fill ``md`` with the vocabulary keys; the number of tokens."""
    if (src / SP_MODEL).is_file():
        vocab = _from_sentencepiece(src / SP_MODEL, cfg, nomic_mask)
    elif (src / "tokenizer.json").is_file():
        vocab = _from_tokenizer_json(src, cfg)
    else:
        raise InputError(f"{src}: an XLM-R Unigram tokenizer needs {SP_MODEL} or tokenizer.json")
    md.string(Keys.Tokenizer.MODEL, "t5")
    md.string(Keys.Tokenizer.PRE, "default")
    md.array(Keys.Tokenizer.LIST, vocab.tokens, V.STRING)
    md.array(Keys.Tokenizer.SCORES, vocab.scores, V.FLOAT32)
    md.array(Keys.Tokenizer.TOKEN_TYPE, vocab.types, V.INT32)
    md.boolean(Keys.Tokenizer.ADD_PREFIX, vocab.add_prefix)
    md.u32(Keys.Tokenizer.TOKEN_TYPE_COUNT, cfg.get("type_vocab_size", 1))
    md.boolean(Keys.Tokenizer.REMOVE_EXTRA_WS, vocab.remove_extra_whitespaces)
    if vocab.charsmap:
        md.array(Keys.Tokenizer.PRECOMPILED_CHARSMAP, list(vocab.charsmap), V.UINT8)
    return len(vocab.tokens)
