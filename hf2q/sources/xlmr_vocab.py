"""``tokenizer.ggml.*`` for an XLM-R SentencePiece Unigram vocabulary (GGUF tokenizer model ``t5``).

Laid out as llama.cpp's converter does from ``sentencepiece.bpe.model``: every piece with its score
and type, padded to the config's vocab_size with ``[PADn]`` unused pieces, then realigned to the HF
ids (``<s> <pad> </s> <unk>`` first, each SentencePiece id moved up by one — fairseq's offset), and the
normaliser settings with the precompiled charsmap that :mod:`hf2q.text.ugm` reads back.
nomic-bert-moe's ``<mask>`` (absent from the SentencePiece model) is written at id 250001 as there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf

from hf2q.errors import InputError
from hf2q.formats.gguf_keys import Keys

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


def add_xlmr_vocab(md, src: Path, cfg: dict[str, Any], *, nomic_mask: bool) -> int:
    """Fill ``md`` with the vocabulary keys; the number of tokens."""
    path = src / SP_MODEL
    if not path.is_file():
        raise InputError(f"{src}: an XLM-R Unigram tokenizer needs {SP_MODEL} (tokenizer.json alone is not read)")
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
    md.string(Keys.Tokenizer.MODEL, "t5")
    md.string(Keys.Tokenizer.PRE, "default")
    md.array(Keys.Tokenizer.LIST, tokens, V.STRING)
    md.array(Keys.Tokenizer.SCORES, scores, V.FLOAT32)
    md.array(Keys.Tokenizer.TOKEN_TYPE, types, V.INT32)
    md.boolean(Keys.Tokenizer.ADD_PREFIX, norm.add_dummy_prefix)
    md.u32(Keys.Tokenizer.TOKEN_TYPE_COUNT, cfg.get("type_vocab_size", 1))
    md.boolean(Keys.Tokenizer.REMOVE_EXTRA_WS, norm.remove_extra_whitespaces)
    if norm.precompiled_charsmap:
        md.array(Keys.Tokenizer.PRECOMPILED_CHARSMAP, list(norm.precompiled_charsmap), V.UINT8)
    return len(tokens)
