"""The served model's text side on the real SmolLM2 GGUF, checked against transformers.

``GGUFChatModel.prepare`` must produce exactly the prompt ids transformers' own chat
template + tokenizer (loaded from the same GGUF) produce; ``ChatOutputDecoder`` must
stream text whose concatenation is the tokenizer's decode, cut exactly before the first
stop string however the tokens split it.
"""

from __future__ import annotations

import functools

import pytest

from hf2q.api.shapes import ContentDelta, MessageAssembler
from hf2q.api.validation import parse_chat_request


@functools.lru_cache(maxsize=1)
def smollm2():
    from hf2q.api.textbridge import GGUFChatModel
    from hf2q.fetch import SMOLLM2, fetch

    path = fetch(SMOLLM2)
    return path, GGUFChatModel.from_gguf(path, "smollm2")


@functools.lru_cache(maxsize=1)
def hf_tokenizer():
    from transformers import AutoTokenizer

    path, _ = smollm2()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Ünïcødé ✓ and code: `def f(x): return {x: [1, 2]}`"},
            {"role": "assistant", "content": "Sure."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow  # transformers parses the 98 MB GGUF in Python
def test_prompt_ids_match_transformers():
    _, model = smollm2()
    req = parse_chat_request({"messages": MESSAGES, "temperature": 0, "max_tokens": 7, "stop": ["\n\n"]})
    prepared = model.prepare(req, 2048)
    hf = hf_tokenizer()
    expected = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):  # BatchEncoding in newer transformers
        expected = expected["input_ids"]
    assert list(prepared.prompt_tokens) == list(expected)
    p = prepared.params
    assert p.max_tokens == 7 and p.temperature == 0
    eos = hf.convert_tokens_to_ids("<|im_end|>")
    assert eos in p.stop_token_ids


def test_context_overflow_is_400_before_submitting():
    from hf2q.api.errors import ApiError

    _, model = smollm2()
    req = parse_chat_request({"messages": [{"role": "user", "content": "word " * 600}]})
    with pytest.raises(ApiError) as e:
        model.prepare(req, 256)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"


@pytest.mark.parametrize("stops", [["capital"], ["Paris."], ["\n"], ["zzz-never"]])
def test_decoder_stream_equals_decode_and_cuts_at_stop(stops):
    _, model = smollm2()
    text = "The capital of France is Paris.\nIt is ✓ Ünïcødé: 東京 too."
    ids = model.tokenizer.encode(text, add_special=False)
    assert model.tokenizer.decode(ids) == text
    req = parse_chat_request({"messages": [{"role": "user", "content": "x"}], "stop": stops})
    decoder = model.prepare(req, 2048).new_decoder()
    asm = MessageAssembler()
    for t in ids:
        for d in decoder.feed(t):
            assert isinstance(d, ContentDelta)
            asm.add(d)
        if decoder.stop_hit:
            break
    for d in decoder.finish():
        asm.add(d)
    got = "".join(asm.content)
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    assert got == (text[:cut] if cut >= 0 else text)
    assert decoder.stop_hit == (cut >= 0)
