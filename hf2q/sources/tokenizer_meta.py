"""``tokenizer.ggml.*`` metadata from an HF directory's tokenizer files.

Three vocabulary kinds, each laid out the way llama.cpp's tokenizer reads it:

* **BPE** (GPT-2 style, ``tokenizer.ggml.model = gpt2``): tokens in id order, token types
  (normal / control / user-defined / unused padding), merges, and ``tokenizer.ggml.pre`` —
  the pre-tokenizer name llama.cpp selects its regexes by. Like llama.cpp's converter we
  identify it by hashing the token ids of a fixed probe text (``PROBE_TEXT``); unknown
  hashes fall back to the family's usual pre-tokenizer.
* **SPM** (``llama``): pieces, scores and types from ``tokenizer.model`` (sentencepiece).
* **XLM-R Unigram** (``t5``): ``sentencepiece.bpe.model`` with its charsmap (``xlmr_vocab.py``).
* **WordPiece** (``bert``): BERT vocab rewritten into llama.cpp's "phantom space" form
  (``▁word`` for word starts, ``##piece`` → ``piece``).
* **Gemma 4** (``gemma4``): the BPE over ▁-pieces of ``tokenizer.json`` with merges and byte
  fallback; every score is -1000 (llama.cpp's placeholder), the tokens transformers counts as
  special are control tokens, and the tool/channel markers a chat parser must see are
  user-defined (``GEMMA4_VISIBLE``).

Special ids, add_bos/add_eos, merges and the chat template are read in the same order and with
the same precedence as llama.cpp's converter (``SpecialTokens``), so they match its output.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import gguf

from hf2q.errors import InputError
from hf2q.formats.gguf_keys import ExtraKeys, Keys
from hf2q.sources.xlmr_vocab import add_xlmr_vocab, padded_pieces

log = logging.getLogger("hf2q.tokenizer")
TT = gguf.TokenType
V = gguf.GGUFValueType

# llama.cpp's probe text for identifying BPE pre-tokenizers (convert_hf_to_gguf_update.py)
PROBE_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ "
    "🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
    "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)

# sha256(str(token ids of PROBE_TEXT)) → llama.cpp pre-tokenizer name (the common ones)
KNOWN_PRE_TOKENIZERS = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
    "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4": "qwen35",
    "1444df51289cfa8063b96f0e62b1125440111bc79a52003ea14b6eac7016fd5f": "qwen35",
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "d353350c764d8c3b39c763113960e4fb4919bea5fbf208a0e3b22e8469dc7406": "llama4",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "0fe1cf6eda062318a1af7270f3331a85c539a01778ff948e24388e949c5282f4": "gpt-2",
    "0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f": "jina-v2-en",
    "8e62295832751ca1e8f92f2226f403dea30dc5165e448b5bfa05af5340c64ec7": "bert-bge-large",
    "846deafc5b0fa786186fa4ae6c7b49903cf2f1d1895bdb80b9120d60be135252": "gemma4",
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": "deepseek-llm",
    "877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5": "deepseek-v3",
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",
    "35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34": "starcoder",
    "fcace8b9cac38ce847670c970cd5892031a753a1ef381abd1d9af00f713da085": "phi-2",
    "b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166": "olmo",
    "9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e": "falcon3",
    "ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e": "gpt-4o",
    # Gemma 3's tokenizer.json (no tokenizer.model); llama.cpp registered it for granite-embedding
    "789696f5946cc0fc59371f39f6097cafed196b3acded6140432f26bbb1ae1669": "granite-embed-multi-311m",
}


def _load_json(path: Path, tokenizer_json: bool = False) -> Any:
    """Parsed JSON, shared between callers (do not mutate it); big tokenizer files are parsed once.
    ``tokenizer_json``: the parse is also checked as a ``tokenizer.json`` (once per parse, as it is cached)."""
    try:
        st = path.stat()
        return _parse_json(str(path), st.st_mtime_ns, st.st_size, tokenizer_json)
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: cannot read tokenizer file ({e})") from None


@functools.lru_cache(maxsize=8)
def _parse_json(path: str, mtime_ns: int, size: int, tokenizer_json: bool) -> Any:
    parsed = json.loads(Path(path).read_text(encoding="utf-8"))
    if tokenizer_json:  # a failed check raises, and lru_cache keeps nothing of it
        _check_tokenizer_json(Path(path), parsed)
    return parsed


def _hf_tokenizer(src: Path):
    from tokenizers import Tokenizer

    path = src / "tokenizer.json"
    if not path.is_file():
        raise InputError(f"{src}: missing tokenizer.json (needed for the GGUF vocabulary)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 — the tokenizers library raises plain Exception
        raise InputError(f"{path}: invalid tokenizer.json ({e})") from None
    tok.no_truncation()
    tok.no_padding()
    return tok


def pre_tokenizer_name(src: Path, fallback: str) -> str:
    ids = _hf_tokenizer(src).encode(PROBE_TEXT).ids
    digest = hashlib.sha256(str(ids).encode()).hexdigest()
    name = KNOWN_PRE_TOKENIZERS.get(digest)
    if name is None:
        log.warning("unrecognised BPE pre-tokenizer (hash %s); using %r", digest[:16], fallback)
        return fallback
    return name


def _looks_special(token: str) -> bool:
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or token.startswith("<|") and token.endswith("|>")
            or token.startswith("<｜") and token.endswith("｜>")
            or token.startswith("<unused") and token.endswith(">"))


def release_tokenizer_cache() -> None:
    """Drop parsed tokenizer files (hundreds of MB of Python objects for a 262k vocabulary)."""
    _parse_json.cache_clear()


def load_tokenizer_json(src: Path) -> dict:
    """``tokenizer.json``, its shape checked (model, vocab, added tokens, merges) so that a malformed
    file is one line naming it, not a ``TypeError`` deep in the vocabulary code."""
    return _load_json(src / "tokenizer.json", tokenizer_json=True)


def _check_tokenizer_json(path: Path, tj: Any) -> None:
    if not isinstance(tj, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(tj).__name__}")
    model = tj.get("model")
    if not isinstance(model, dict):
        raise InputError(f"{path}: 'model' is {'missing' if model is None else type(model).__name__}; "
                         "expected an object with the vocabulary")
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in vocab.values()):
            raise InputError(f"{path}: model.vocab must map token strings to non-negative integer ids")
    elif isinstance(vocab, list):  # unigram: [[piece, score], …]
        if not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in vocab):
            raise InputError(f"{path}: model.vocab is a list but not of [piece, score] pairs")
    elif vocab is not None:
        raise InputError(f"{path}: model.vocab is {type(vocab).__name__}; expected an object or a list")
    added = tj.get("added_tokens", [])
    if not isinstance(added, list) or not all(
            isinstance(a, dict) and isinstance(a.get("content"), str) and isinstance(a.get("id"), int)
            and not isinstance(a["id"], bool) and a["id"] >= 0 for a in added):
        raise InputError(f"{path}: added_tokens must be a list of {{id, content}} objects")
    merges = model.get("merges")
    if merges is not None and not (isinstance(merges, list) and all(
            isinstance(m, str) or isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m)
            for m in merges)):
        raise InputError(f"{path}: model.merges must be a list of \"a b\" strings or [a, b] pairs")


def _tokenizer_config(src: Path) -> dict | None:
    path = src / "tokenizer_config.json"
    if not path.is_file():
        return None
    tc = _load_json(path)
    if not isinstance(tc, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(tc).__name__}")
    return dict(tc)


def vocab_from_tokenizer_json(src: Path, cfg: dict[str, Any]) -> tuple[list[str], list[int]]:
    """Tokens in id order + llama.cpp token types, as llama.cpp's ``get_vocab_base`` lays them out."""
    tj = load_tokenizer_json(src)
    model = tj["model"]
    vocab = model.get("vocab")
    if isinstance(vocab, list):  # unigram: [[piece, score], …]
        vocab = {p[0]: i for i, p in enumerate(vocab)}
    if not isinstance(vocab, dict):
        raise InputError(f"{src / 'tokenizer.json'}: no vocabulary in model.vocab")
    added = {a["content"]: a for a in tj.get("added_tokens", []) if isinstance(a, dict) and "content" in a}
    reverse = {i: t for t, i in vocab.items()}
    for content, a in added.items():
        reverse[a["id"]] = content
    size = int(cfg["vocab_size"]) if cfg.get("vocab_size") is not None else len(reverse)
    if reverse and max(reverse) >= size:
        raise InputError(f"tokenizer has token id {max(reverse)} but config.json vocab_size is {size}")
    tokens, types = [], []
    for i in range(size):
        tok = reverse.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(TT.UNUSED)
        elif tok in added:
            if added[tok].get("special") or _looks_special(tok):
                types.append(TT.CONTROL)
            else:
                tok = tok.replace("\u2581", " ")
                types.append(TT.USER_DEFINED)
            tokens.append(tok)
        else:
            tokens.append(tok)
            types.append(TT.NORMAL)
    return tokens, [int(t) for t in types]


def spm_vocab(src: Path, cfg: dict[str, Any]) -> tuple[list[bytes], list[float], list[int]]:
    """Pieces, scores and types from ``tokenizer.model`` (+ added tokens), padded to vocab_size."""
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor()
    try:
        sp.LoadFromFile(str(src / "tokenizer.model"))
    except (OSError, RuntimeError) as e:
        raise InputError(f"{src / 'tokenizer.model'}: invalid sentencepiece model ({e})") from None
    tokens, scores, types = padded_pieces(sp, int(cfg.get("vocab_size") or sp.vocab_size()))
    size = len(tokens)
    if (src / "added_tokens.json").is_file():
        added = _load_json(src / "added_tokens.json")
        if not isinstance(added, dict) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                  for i in added.values()):
            raise InputError(f"{src / 'added_tokens.json'}: expected an object of token → non-negative id")
        for text, i in added.items():
            if i < size:
                tokens[i], scores[i], types[i] = text.encode("utf-8"), -1000.0, int(TT.USER_DEFINED)
    if (tc := _tokenizer_config(src)) is not None:
        decoder = tc.get("added_tokens_decoder") or {}
        if not isinstance(decoder, dict) or not all(
                k.isdigit() and isinstance(d, dict) and isinstance(d.get("content"), str) for k, d in decoder.items()):
            raise InputError(f"{src / 'tokenizer_config.json'}: added_tokens_decoder must map ids to "
                             "{content, …} objects")
        for key, data in decoder.items():
            i, text = int(key), data["content"]
            if i >= size:
                continue
            if data.get("special") or _looks_special(text):
                types[i] = int(TT.CONTROL)
            else:
                text = text.replace("\u2581", " ")
                types[i] = int(TT.USER_DEFINED)
            scores[i], tokens[i] = -1000.0, text.encode("utf-8")
    return tokens, scores, types


# Gemma 4 markers llama.cpp keeps printable (user-defined) so that its chat parser reads them
GEMMA4_VISIBLE = frozenset({"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                            "<tool_response|>", '<|"|>'})
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# the named special tokens of a transformers tokenizer, with GemmaTokenizer's defaults
_NAMED_SPECIALS = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "sep_token": None,
                   "pad_token": "<pad>", "cls_token": None, "mask_token": "<mask>"}


def _token_content(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def transformers_special_tokens(src: Path) -> list[str]:
    """The texts transformers lists in ``all_special_tokens`` for a Gemma-style tokenizer folder.

    Named tokens (bos/eos/unk/sep/pad/cls/mask, GemmaTokenizer's defaults where the config is
    silent), every other ``*_token`` entry of tokenizer_config.json (Gemma 4 names its turn,
    channel, tool and media markers that way), then ``extra_special_tokens`` /
    ``additional_special_tokens``.
    """
    def read(name: str) -> dict:
        data = _load_json(src / name) if (src / name).is_file() else {}
        return data if isinstance(data, dict) else {}

    tc = dict(read("tokenizer_config.json"))
    # transformers reads the legacy special_tokens_map.json (whose entries win) only without added_tokens_decoder
    if "added_tokens_decoder" not in tc:
        tc.update(read("special_tokens_map.json"))
    out = []
    for key, default in _NAMED_SPECIALS.items():
        text = _token_content(tc[key]) if key in tc else default
        if text is not None:
            out.append(text)
    for key, value in tc.items():
        if key.endswith("_token") and key not in _NAMED_SPECIALS and (text := _token_content(value)) is not None:
            out.append(text)
    extra = tc.get("extra_special_tokens") or tc.get("additional_special_tokens") or []
    for value in (extra.values() if isinstance(extra, dict) else extra):
        if (text := _token_content(value)) is not None:
            out.append(text)
    return list(dict.fromkeys(out))


def gemma4_vocab(src: Path) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types of a Gemma 4 ``tokenizer.json``, as llama.cpp's converter lays them out."""
    tj = load_tokenizer_json(src)
    model = tj["model"]
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or not isinstance(vocab, dict) or not model.get("byte_fallback"):
        raise InputError(f"{src / 'tokenizer.json'}: Gemma 4 needs a BPE model with byte_fallback")
    reverse = {i: t for t, i in vocab.items()}
    n_base = max(reverse) + 1 if reverse else 0
    if len(reverse) != n_base:
        raise InputError(f"{src / 'tokenizer.json'}: vocabulary ids are not contiguous")
    specials = transformers_special_tokens(src)
    special_ids = {vocab[t] for t in specials if t in vocab}
    if any(t not in vocab for t in specials) and "<unk>" in vocab:
        special_ids.add(vocab["<unk>"])  # an unknown special text resolves to the unknown token
    tokens, types = [], []
    for i in range(n_base):
        t = reverse[i]
        tokens.append(t)
        if _BYTE_PIECE.fullmatch(t):
            types.append(int(TT.BYTE))
        else:
            types.append(int(TT.CONTROL if i in special_ids else TT.NORMAL))
    beyond = sorted((a["id"], a["content"]) for a in tj.get("added_tokens", [])
                    if isinstance(a, dict) and isinstance(a.get("id"), int) and a["id"] >= n_base)
    for i, text in beyond:
        if i != len(tokens):
            raise InputError(f"{src / 'tokenizer.json'}: added token {text!r} has id {i}, expected {len(tokens)}")
        tokens.append(text)
        types.append(int(TT.CONTROL if text in specials else TT.USER_DEFINED))
    types = [int(TT.USER_DEFINED) if t in GEMMA4_VISIBLE else k for t, k in zip(tokens, types)]
    return tokens, [-1000.0] * len(tokens), types


def _phantom(tok: str, kind: int) -> str:
    if kind == TT.CONTROL:
        return tok
    return tok[2:] if tok.startswith("##") else "\u2581" + tok


def add_tokenizer(md, src: Path, cfg: dict[str, Any], kind: str, pre_fallback: str = "default") -> None:
    """Fill ``md`` (an ``hf2q.arch.base.Metadata``) with the ``tokenizer.*`` keys."""
    if kind == "auto":
        kind = "spm" if (src / "tokenizer.model").is_file() else "bpe"
    n_vocab = None
    if kind == "spm":
        tokens, scores, types = spm_vocab(src, cfg)
        md.string(Keys.Tokenizer.MODEL, "llama")
        md.string(Keys.Tokenizer.PRE, "default")
        md.array(Keys.Tokenizer.LIST, tokens, V.STRING)
        md.array(Keys.Tokenizer.SCORES, scores, V.FLOAT32)
        md.array(Keys.Tokenizer.TOKEN_TYPE, types, V.INT32)
        n_vocab, merges = len(tokens), False
    elif kind == "bpe":
        tokens, types = vocab_from_tokenizer_json(src, cfg)
        md.string(Keys.Tokenizer.MODEL, "gpt2")
        md.string(Keys.Tokenizer.PRE, pre_tokenizer_name(src, pre_fallback))
        md.array(Keys.Tokenizer.LIST, tokens, V.STRING)
        md.array(Keys.Tokenizer.TOKEN_TYPE, types, V.INT32)
        merges = True
    elif kind == "gemma4":
        tokens, scores, types = gemma4_vocab(src)
        md.string(Keys.Tokenizer.MODEL, "gemma4")
        md.array(Keys.Tokenizer.LIST, tokens, V.STRING)
        md.array(Keys.Tokenizer.SCORES, scores, V.FLOAT32)
        md.array(Keys.Tokenizer.TOKEN_TYPE, types, V.INT32)
        merges = True
    elif kind == "xlmr":
        nomic = md.get(Keys.General.ARCHITECTURE) == gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.NOMIC_BERT_MOE]
        n_vocab, merges = add_xlmr_vocab(md, src, cfg, nomic_mask=nomic), False
    elif kind == "wordpiece":
        tokens, types = vocab_from_tokenizer_json(src, cfg)
        md.u32(Keys.Tokenizer.TOKEN_TYPE_COUNT, cfg.get("type_vocab_size", 1))
        md.string(Keys.Tokenizer.MODEL, "bert")
        md.string(Keys.Tokenizer.PRE, pre_tokenizer_name(src, "default"))
        md.array(Keys.Tokenizer.LIST, [_phantom(t, k) for t, k in zip(tokens, types)], V.STRING)
        md.array(Keys.Tokenizer.TOKEN_TYPE, types, V.INT32)
        n_vocab, merges = len(tokens), False
    else:
        raise InputError(f"unknown tokenizer kind {kind!r}")
    add_special(md, src, merges, n_vocab)


# --------------------------------------------------------------------------- special tokens
_ID_KEYS = {"bos": Keys.Tokenizer.BOS_ID, "eos": Keys.Tokenizer.EOS_ID, "unk": Keys.Tokenizer.UNK_ID,
            "sep": Keys.Tokenizer.SEP_ID, "pad": Keys.Tokenizer.PAD_ID, "mask": Keys.Tokenizer.MASK_ID,
            "eot": Keys.Tokenizer.EOT_ID, "eom": Keys.Tokenizer.EOM_ID}
_ADD_KEYS = {"bos": Keys.Tokenizer.ADD_BOS, "eos": Keys.Tokenizer.ADD_EOS, "sep": Keys.Tokenizer.ADD_SEP}


class SpecialTokens:
    """Special ids, add_* flags, merges, normalizer flags and chat template of an HF tokenizer.

    Follows llama.cpp's reading order (its gguf-py ``SpecialVocab`` of the 0.3.36 sdist):
    tokenizer.json's post-processor decides add_bos/add_eos/add_sep first, tokenizer_config.json
    fills what is left and names the special tokens, config.json's ``*_token_id`` come last.
    """

    def __init__(self, src: Path, load_merges: bool, n_vocab: int | None):
        self.n_vocab = n_vocab
        self.types: list[str] = ["bos", "eos", "unk", "sep", "pad", "cls", "mask"]
        self.ids: dict[str, int] = {}
        self.add: dict[str, bool] = {}
        self.merges: list[str] = []
        self.lowercase: bool | None = None
        self.strip_accents: bool | None = None
        self.chat_template: str | list | None = None
        tj = load_tokenizer_json(src) if (src / "tokenizer.json").is_file() else None
        tc = _tokenizer_config(src)
        added = (tj or {}).get("added_tokens", [])
        if tj is not None:
            if load_merges:
                self.merges = _merges(tj)
            if isinstance(tj.get("normalizer"), dict):
                self._normalizer(tj["normalizer"])
            self._post_processor(tj.get("post_processor"), tc)
        if tc:
            self.chat_template = _chat_template(src, tc)
            for typ in list(self.types):
                flag = tc.get(f"add_{typ}_token")
                if isinstance(flag, bool) and typ not in self.add:
                    self.add[typ] = flag
                entry = tc.get(f"{typ}_token")
                content = entry.get("content") if isinstance(entry, dict) else entry
                if isinstance(content, str):
                    self._set(typ, next((a.get("id") for a in added if a.get("content") == content), None))
        cfg_path = src / "config.json"
        if cfg_path.is_file():
            cfg = _load_json(cfg_path)
            for typ in self.types:
                tid = cfg.get(f"{typ}_token_id")
                if tid is None and isinstance(cfg.get("text_config"), dict):
                    tid = cfg["text_config"].get(f"{typ}_token_id")
                self._set(typ, tid)

    def _set(self, typ: str, tid) -> None:
        if not isinstance(tid, int) or isinstance(tid, bool) or tid < 0 or typ in self.ids:
            return
        if self.n_vocab is None or tid < self.n_vocab:
            self.ids[typ] = tid

    def _normalizer(self, n: dict) -> None:
        kind = n.get("type")
        if kind == "Lowercase":
            self.lowercase = True
        elif kind == "StripAccents":
            self.strip_accents = True
        elif kind == "BertNormalizer":
            if "lowercase" in n:
                self.lowercase = n["lowercase"]
            if "strip_accents" in n:
                self.strip_accents = n["strip_accents"]
        elif kind == "Sequence":
            for sub in n.get("normalizers", []):
                self._normalizer(sub)

    def _post_processor(self, pp, tc: dict | None) -> None:
        if not isinstance(pp, dict):
            return
        tc = tc if tc is not None else None
        get = (lambda k: tc.get(k)) if tc else (lambda k: None)
        bos, cls, eos, sep = get("bos_token"), get("cls_token"), get("eos_token"), get("sep_token")
        if not bos and cls and tc:
            tc["bos_token"] = bos = cls
        if not eos and sep and tc:
            tc["eos_token"] = eos = sep
        for proc in pp.get("processors", [pp]):
            kind = proc.get("type")
            if kind == "ByteLevel":
                self.add.setdefault("bos", False)
                self.add.setdefault("eos", False)
            elif kind == "RobertaProcessing":
                self.add.update(bos=True, eos=True, sep=True)
                if not cls and tc:
                    tc["cls_token"] = cls = proc.get("cls", [bos])[0]
                if not sep and tc:
                    tc["sep_token"] = sep = proc.get("sep", [eos])[0]
            elif kind == "TemplateProcessing":
                bos, cls, eos, sep = self._template(proc, tc, bos, cls, eos, sep)

    def _template(self, proc: dict, tc, bos, cls, eos, sep):
        single, pair = proc.get("single", []), proc.get("pair", [])
        first = last = None
        if len(single) > 1:
            if first := single[0].get("SpecialToken", {}).get("id"):
                if not tc:
                    bos = first
                elif first not in (bos, cls):
                    if not bos:
                        tc["bos_token"] = bos = first
                    if not cls:
                        tc["cls_token"] = cls = first
                self.add["bos"] = first in (bos, cls)
            if last := single[-1].get("SpecialToken", {}).get("id"):
                if not tc:
                    eos = last
                elif last != eos:
                    for extra in ("eot", "eom"):  # the old EOS survives as end-of-turn / end-of-message
                        if extra not in self.types:
                            self.types.append(extra)
                            tc[f"{extra}_token"] = eos
                            break
                    tc["eos_token"] = eos = last
                self.add["eos"] = last == eos
        if pair:
            start = 1 if first and pair[0].get("SpecialToken", {}).get("id") == first else 0
            stop = -1 if last and pair[-1].get("SpecialToken", {}).get("id") == last else None
            middle = pair[slice(start, stop)]
            if middle and middle[0].get("Sequence", {}).get("id") == "A" \
                    and middle[-1].get("Sequence", {}).get("id") == "B" and (middle := middle[1:-1]):
                add_sep = False
                entry = middle[0].get("SpecialToken", {}).get("id")
                if entry in (sep, eos) and entry and not last:
                    add_sep = True
                if len(middle) == 2 and (entry2 := middle[1].get("SpecialToken", {}).get("id")) in (sep, eos) \
                        and entry2:
                    add_sep = True
                self.add["sep"] = add_sep
                if add_sep and not sep and tc:
                    tc["sep_token"] = eos
        return bos, cls, eos, sep


def _merges(tj: dict) -> list[str]:
    merges = (tj.get("model") or {}).get("merges")
    if not isinstance(merges, list) or not merges:
        return []
    if isinstance(merges[0], str):
        return merges
    if isinstance(merges[0], list) and len(merges[0]) == 2:
        # pair format (transformers ≥ 4.45): spaces inside a part are stored as U+0120 like llama.cpp
        return [" ".join(part.replace(" ", "\u0120") for part in pair) for pair in merges]
    raise InputError("tokenizer.json: unknown merges format")


def _chat_template(src: Path, tc: dict):
    alt = None
    if (src / "chat_template.jinja").is_file():
        alt = (src / "chat_template.jinja").read_text(encoding="utf-8")
        extra = sorted((src / "additional_chat_templates").glob("*.jinja"))
        if extra:
            alt = [{"name": "default", "template": alt}] + [
                {"name": p.stem, "template": p.read_text(encoding="utf-8")} for p in extra]
    elif (src / "chat_template.json").is_file():
        data = _load_json(src / "chat_template.json")
        alt = data.get("chat_template") if isinstance(data, dict) else None
    tmpl = tc.get("chat_template", alt)
    return tmpl if tmpl is None or isinstance(tmpl, (str, list)) else None


def add_special(md, src: Path, merges: bool, n_vocab: int | None) -> None:
    """Merges, special ids, add_* flags, normalizer flags and chat template."""
    sv = SpecialTokens(src, merges, n_vocab)
    if sv.merges:
        md.array(Keys.Tokenizer.MERGES, sv.merges, V.STRING)
    for typ, tid in sv.ids.items():
        if typ in _ID_KEYS:
            md.u32(_ID_KEYS[typ], tid)
    for typ, value in sv.add.items():
        if typ in _ADD_KEYS:
            md.boolean(_ADD_KEYS[typ], value)
    if sv.lowercase is not None:
        md.boolean(ExtraKeys.NORMALIZER_LOWERCASE, sv.lowercase)
    if sv.strip_accents is not None:
        md.boolean(ExtraKeys.NORMALIZER_STRIP_ACCENTS, sv.strip_accents)
    tmpl = sv.chat_template
    if isinstance(tmpl, str):
        md.string(Keys.Tokenizer.CHAT_TEMPLATE, tmpl)
    elif isinstance(tmpl, list):
        for entry in tmpl:
            name, text = entry.get("name"), entry.get("template")
            if name == "default":
                md.string(Keys.Tokenizer.CHAT_TEMPLATE, text)
            elif name and text:
                md.string(Keys.Tokenizer.CHAT_TEMPLATE_N.format(name=name), text)
