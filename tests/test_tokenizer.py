"""GGUF tokenizer against llama.cpp's own test vectors and against HF tokenizers.

* every ``models/ggml-vocab-*.gguf`` of the llama.cpp sdist that ships ``.inp/.out``
  vectors: encoded exactly as llama.cpp's ``test-tokenizer-0`` does (no BOS/EOS, special
  tokens not parsed), 100 % of the vectors must match;
* the real SmolLM2 (gpt2 BPE) and Gemma 3 (SentencePiece) GGUFs: ids and decoded text
  must equal the HF tokenizers that transformers builds from the same GGUFs.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest

from hf2q.errors import InputError
from hf2q.text.tokenizer import GGUFTokenizer, IncrementalDetokenizer

VECTOR_SEPARATOR = "\n__ggml_vocab_test__\n"


def _models_dir() -> Path:
    from hf2q.fetch import LLAMA_CPP_SDIST, fetch

    return fetch(LLAMA_CPP_SDIST) / "models"


@functools.cache
def _vocab_tokenizer(name: str) -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf(_models_dir() / f"ggml-vocab-{name}.gguf")


def _vector_vocabs() -> list[str]:
    return sorted(p.name[len("ggml-vocab-") : -len(".gguf.inp")] for p in _models_dir().glob("ggml-vocab-*.gguf.inp"))


def read_vectors(gguf_path: Path) -> list[tuple[str, list[int]]]:
    """Parse llama.cpp's ``.inp`` / ``.out`` pair the way tests/test-tokenizer-0.cpp does."""
    raw = gguf_path.with_name(gguf_path.name + ".inp").read_text(encoding="utf-8")
    inputs = raw.split(VECTOR_SEPARATOR)
    if raw.endswith(VECTOR_SEPARATOR):
        inputs = inputs[:-1]
    outputs = gguf_path.with_name(gguf_path.name + ".out").read_text(encoding="utf-8").split("\n")
    if outputs and outputs[-1] == "":
        outputs = outputs[:-1]
    assert len(inputs) == len(outputs), f"{gguf_path.name}: {len(inputs)} inputs vs {len(outputs)} outputs"
    return [(text, [int(t) for t in line.split()]) for text, line in zip(inputs, outputs)]


def test_every_vocab_with_vectors_is_covered():
    names = _vector_vocabs()
    # the sdist ships these; a silently shrinking list would hide regressions
    assert {"llama-spm", "llama-bpe", "qwen2", "qwen35", "gemma-4", "bert-bge", "gpt-2", "phi-3"} <= set(names)


@pytest.mark.parametrize("name", _vector_vocabs())
def test_llama_cpp_vectors(name):
    path = _models_dir() / f"ggml-vocab-{name}.gguf"
    tok = _vocab_tokenizer(name)
    vectors = read_vectors(path)
    failures = []
    for text, expected in vectors:
        got = tok.encode(text, add_special=False, parse_special=False)
        if got != expected:
            failures.append((text, expected, got))
    assert not failures, f"{len(failures)}/{len(vectors)} vectors differ, first: {failures[0]!r}"


@pytest.mark.parametrize("name", ["llama-bpe", "llama-spm", "qwen35", "gemma-4", "phi-3"])
def test_vectors_round_trip_through_decode(name):
    """Decoding the expected ids gives back the input text (whitespace-exact for these vocabs)."""
    path = _models_dir() / f"ggml-vocab-{name}.gguf"
    tok = _vocab_tokenizer(name)
    for text, expected in read_vectors(path):
        decoded = tok.decode(expected)
        if tok.add_space_prefix and text.startswith(" "):
            # SentencePiece adds a space and removes one: a leading space survives
            assert decoded in (text, text[1:])
        else:
            assert decoded == text


# ---------------------------------------------------------------------------- real models

SAMPLES = [
    "Hello world",
    " Hello  world!\n\n\tTabs and    spaces   ",
    "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "Äpfel 🦙.cpp нещо на Български 日本語のテキスト 3333333 'll I'M",
    "",
    "   ",
    "a\n\n\nb   c\r\n",
    '{"name": "get_weather", "arguments": {"city": "Zürich\\n"}}',
    "def f(x):\n    return x ** 2  # ok\n",
]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def real_pair(request):
    """(ours, HF ``tokenizers.Tokenizer``, HF tokenizer_config) for a real GGUF."""
    import json

    from tokenizers import Tokenizer, pre_tokenizers

    from hf2q.fetch import GEMMA3_270M, SMOLLM2, fetch
    from tests.models.tokenizer_files import tokenizer_dir

    gguf_path = fetch({"smollm2": SMOLLM2, "gemma3": GEMMA3_270M}[request.param])
    folder = tokenizer_dir(request.param)
    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if request.param == "smollm2":
        # transformers' GGUF importer drops SmolLM2's digit splitting; the published
        # tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) split digits first.
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    return GGUFTokenizer.from_gguf(gguf_path), hf, config


def _token_id(hf, config, key):
    value = config.get(key)
    text = value.get("content") if isinstance(value, dict) else value
    return hf.token_to_id(text) if text else None


@pytest.mark.slow
def test_real_gguf_matches_hf(real_pair):
    ours, hf, config = real_pair
    rng = random.Random(0)
    texts = list(SAMPLES)
    alphabet = "ab Z\n\t.,'é日🦙0123<|>_"
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(40)]
    for text in texts:
        expected = hf.encode(text, add_special_tokens=True).ids
        assert ours.encode(text) == expected, text
        assert ours.decode(expected, skip_special=True) == hf.decode(expected, skip_special_tokens=True), text
    assert ours.vocab_size == hf.get_vocab_size(with_added_tokens=True)
    assert ours.bos_id == _token_id(hf, config, "bos_token")
    assert _token_id(hf, config, "eos_token") in ours.eos_ids


@pytest.mark.slow
def test_real_gguf_special_tokens(real_pair):
    ours, hf, _ = real_pair
    for text in SAMPLES[2:4]:
        parsed = ours.encode(text, add_special=False, parse_special=True)
        literal = ours.encode(text, add_special=False, parse_special=False)
        assert parsed == hf.encode(text, add_special_tokens=False).ids
        # unparsed, markup is plain text: no control token appears and it still decodes back
        assert not set(literal) & ours.special_ids
        assert ours.decode(literal) == text


def test_smollm2_metadata():
    from hf2q.fetch import SMOLLM2, fetch

    tok = GGUFTokenizer.from_gguf(fetch(SMOLLM2))
    assert tok.vocab_size == 49152
    assert tok.token_text(tok.eos_id) == "<|im_end|>"
    assert {tok.eos_id, 0} <= tok.eos_ids  # <|im_end|> and <|endoftext|>
    assert tok.encode("hi", add_special=True) == tok.encode("hi", add_special=False)  # add_bos_token false
    im_start = tok.encode("<|im_start|>", add_special=False)
    assert len(im_start) == 1 and im_start[0] in tok.special_ids
    assert tok.decode(im_start) == "<|im_start|>"
    assert tok.decode(im_start, skip_special=True) == ""


# ---------------------------------------------------------------------------- streaming

@pytest.mark.parametrize("name", ["llama-bpe", "llama-spm", "gemma-4"])
def test_incremental_detokenizer_concatenates_to_decode(name):
    path = _models_dir() / f"ggml-vocab-{name}.gguf"
    tok = _vocab_tokenizer(name)
    for text, ids in read_vectors(path):
        detok = IncrementalDetokenizer(tok)
        deltas = [detok.push(t) for t in ids]
        tail = detok.flush()
        assert "".join(deltas) + tail == tok.decode(ids)
        # nothing half-decoded ever leaks out mid-stream
        assert all("\ufffd" not in d for d in deltas) or "\ufffd" in tok.decode(ids)


def test_incremental_detokenizer_holds_back_split_characters():
    tok = _vocab_tokenizer("llama-spm")
    ids = tok.encode("🦙", add_special=False)
    assert all(tok.token_text(i).startswith("<0x") for i in ids[-4:])  # byte fallback: 4 pieces
    detok = IncrementalDetokenizer(tok)
    out = [detok.push(i) for i in ids]
    assert out[-4:] == ["", "", "", "🦙"]
    assert "".join(out) == tok.decode(ids) == "🦙"


def test_random_ids_stream_equals_decode():
    from hf2q.fetch import SMOLLM2, fetch

    tok = GGUFTokenizer.from_gguf(fetch(SMOLLM2))
    rng = random.Random(1)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(tok, skip_special=True)
        text = "".join(detok.push(i) for i in ids) + detok.flush()
        assert text == tok.decode(ids, skip_special=True)


# ---------------------------------------------------------------------------- bad input

def test_not_a_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all, definitely")
    with pytest.raises(InputError, match="not a GGUF"):
        GGUFTokenizer.from_gguf(bad)


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="cannot read"):
        GGUFTokenizer.from_gguf(tmp_path / "missing.gguf")


def test_out_of_range_id():
    tok = _vocab_tokenizer("gpt-2")
    with pytest.raises(InputError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_unknown_pre_tokenizer_is_input_error():
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "no-such-pre", "tokenizer.ggml.tokens": [b"a"],
            "tokenizer.ggml.merges": []}
    with pytest.raises(InputError, match="no-such-pre"):
        GGUFTokenizer(meta)


@pytest.mark.parametrize("name", ["aquila", "baichuan", "gpt-neox"])
def test_vocabs_without_vectors_round_trip(name):
    """The sdist's vocabularies that ship no vectors still load and round-trip text."""
    tok = _vocab_tokenizer(name)
    for text in ("Hello world", "  a\n\tb  ", "Äpfel 🦙 日本語 3333"):
        ids = tok.encode(text, add_special=False)
        assert ids and tok.decode(ids) == text


def test_unsupported_tokenizer_model_is_input_error():
    from hf2q.formats.gguf_keys import Keys

    with pytest.raises(InputError, match="unsupported tokenizer model 'rwkv'"):
        GGUFTokenizer({Keys.Tokenizer.MODEL: "rwkv", Keys.Tokenizer.LIST: ["a", "b"]})


def test_from_gguf_reader_equals_from_path():
    import gguf

    path = _models_dir() / "ggml-vocab-phi-3.gguf"
    from_reader = GGUFTokenizer.from_gguf(gguf.GGUFReader(str(path)))
    from_path = _vocab_tokenizer("phi-3")
    text = "<|user|>\nHello  wörld 🦙<|end|>"
    assert from_reader.encode(text) == from_path.encode(text)
    assert from_reader.eos_ids == from_path.eos_ids and from_reader.special_ids == from_path.special_ids


def test_user_defined_tokens_always_split_control_only_when_parsed():
    """llama.cpp's rule: user-defined pieces are matched in any text, control tokens only on request."""
    tok = _vocab_tokenizer("gemma-4")
    tool_call = tok.encode("<|tool_call>", add_special=False)
    turn = tok.encode("<|turn>", add_special=False, parse_special=True)
    assert len(tool_call) == 1 and len(turn) == 1 and turn[0] in tok.special_ids
    text = "a<|tool_call>b<|turn>"
    literal = tok.encode(text, add_special=False, parse_special=False)
    parsed = tok.encode(text, add_special=False, parse_special=True)
    assert tool_call[0] in literal and turn[0] not in literal
    assert tool_call[0] in parsed and parsed[-1] == turn[0]
    assert tok.decode(literal) == tok.decode(parsed) == text


@pytest.mark.parametrize("name", ["llama-bpe", "qwen2", "qwen35", "gpt-2", "deepseek-coder"])
def test_long_text_in_pieces_encodes_as_one_call(name, monkeypatch):
    """A long text is encoded in word-aligned pieces (a server thread must not hold the
    interpreter lock for seconds); the ids equal one call over the whole text, which the
    llama.cpp vectors check, on a text made of those vectors (code, CJK, digits, odd spaces)."""
    import hf2q.text.tokenizer as tokenizer_mod

    path = _models_dir() / f"ggml-vocab-{name}.gguf"
    if not path.exists():
        pytest.skip(f"{path.name} not in the sdist")
    tok = _vocab_tokenizer(name)
    assert tok._piecewise
    texts = [t for t, _ in read_vectors(path)]
    long_text = " ".join(random.Random(7).choice(texts) for _ in range(3000))
    monkeypatch.setattr(tokenizer_mod, "PIECE_CHARS", 1 << 40)
    whole = tok.encode(long_text, add_special=False, parse_special=False)
    monkeypatch.setattr(tokenizer_mod, "PIECE_CHARS", 512)
    assert len(tokenizer_mod._word_aligned_pieces(long_text)) > 20
    assert tok.encode(long_text, add_special=False, parse_special=False) == whole
