"""Constrained decoding: a random-logits "model" decoded greedily under the mask.

Whatever the logits, every finished output must be valid JSON (``json.loads``), valid
against the schema (``jsonschema``), or a well-formed tool call that our parser reads
back and whose arguments satisfy the tool's schema. The random model is nudged towards
structural characters so outputs finish in a few hundred tokens; the nudging only
changes which valid output comes out, never whether the mask lets invalid text through.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from hf2q.engine.sampling import Sampler
from hf2q.errors import InputError
from hf2q.sched.contracts import SamplingParams
from hf2q.text import constrained
from hf2q.text.tokenizer import GGUFTokenizer
from hf2q.text.toolcalls import parse_complete

try:  # test dependency (pyproject [test] extra); without it the schema checks are skipped, loudly
    import jsonschema
except ImportError:  # pragma: no cover
    jsonschema = None

MAX_STEPS = 400


def _validate(instance, schema):
    if jsonschema is None:
        pytest.skip("jsonschema is not installed (test dependency)")
    jsonschema.validate(instance, schema)


@pytest.fixture(scope="module")
def smollm2():
    from hf2q.fetch import SMOLLM2, fetch

    return GGUFTokenizer.from_gguf(fetch(SMOLLM2))


def _structural_bias(tok) -> np.ndarray:
    bias = np.zeros(tok.vocab_size)
    for i in range(tok.vocab_size):
        piece = tok.token_bytes(i)
        if any(c in piece for c in b'"}],0123456789') and len(piece) <= 3:
            bias[i] = 4.0
    for e in tok.eos_ids:
        bias[e] = 6.0
    return bias


def _decode(tok, constraint, seed, bias, sampler=None, steer=None):
    rng = np.random.default_rng(seed)
    sampler = sampler or Sampler(SamplingParams(temperature=0.0))
    out = []
    for _ in range(MAX_STEPS):
        logits = rng.normal(0, 1, tok.vocab_size) + bias
        if steer is not None and rng.random() < 0.4:
            logits += steer(tok.decode_bytes(out))
        token, _, _ = sampler.sample(logits, out, mask=constraint.allowed_mask())
        if token in tok.eos_ids:
            assert constraint.is_accepting()
            return tok.decode(out)
        constraint.advance(token)
        out.append(token)
    raise AssertionError(f"did not finish in {MAX_STEPS} tokens: {tok.decode(out)!r}")


@pytest.mark.parametrize("seed", range(6))
def test_json_object_always_valid(smollm2, seed):
    bias = _structural_bias(smollm2)
    c = constrained.for_response_format(smollm2, {"type": "json_object"})
    assert isinstance(json.loads(_decode(smollm2, c, seed, bias)), dict)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_always_valid(smollm2, seed):
    bias = _structural_bias(smollm2)
    c = constrained.for_response_format(smollm2, {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    _validate(json.loads(_decode(smollm2, c, seed, bias)), SCHEMA)


def test_sampling_with_temperature_stays_valid(smollm2):
    bias = _structural_bias(smollm2)
    c = constrained.for_response_format(smollm2, {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=4))
    _validate(json.loads(_decode(smollm2, c, 99, bias, sampler)), SCHEMA)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
        "additionalProperties": False}}},
]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
@pytest.mark.parametrize("seed", range(3))
def test_tool_choice_forces_a_valid_call(smollm2, choice, seed):
    bias = _structural_bias(smollm2)
    c = constrained.for_tool_choice(smollm2, "generic", TOOLS, choice)
    text = _decode(smollm2, c, seed, bias)
    content, calls, truncated = parse_complete("generic", text, TOOLS)
    assert calls and not truncated and content.strip() == ""
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        name = call["function"]["name"]
        if isinstance(choice, dict):
            assert name == "add"
        _validate(json.loads(call["function"]["arguments"]), by_name[name])


def test_llama3_tool_choice_is_bare_json(smollm2):
    c = constrained.for_tool_choice(smollm2, "llama3", TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    text = _decode(smollm2, c, 1, _structural_bias(smollm2))
    obj = json.loads(text)
    assert obj["name"] == "get_weather" and set(obj["parameters"]) == {"city"}


def test_mask_forbids_and_allows_as_expected(smollm2):
    c = constrained.for_response_format(smollm2, {"type": "json_object"})
    mask = c.allowed_mask()
    assert mask.shape == (smollm2.vocab_size,)
    brace = smollm2.encode("{", add_special=False)[0]
    letter = smollm2.encode("a", add_special=False)[0]
    assert mask[brace] and not mask[letter]
    assert not any(mask[e] for e in smollm2.eos_ids)  # an empty output is not a JSON object
    with pytest.raises(InputError):
        c.advance(letter)


def test_bad_requests_are_input_errors(smollm2):
    assert constrained.for_response_format(smollm2, {"type": "text"}) is None
    assert constrained.for_tool_choice(smollm2, "qwen", TOOLS, "auto") is None
    with pytest.raises(InputError, match="unsupported response_format"):
        constrained.for_response_format(smollm2, {"type": "yaml"})
    with pytest.raises(InputError, match="not in tools"):
        constrained.for_tool_choice(smollm2, "qwen", TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(InputError):
        constrained.for_response_format(smollm2, {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})


def test_for_request_picks_the_right_constraint(smollm2):
    rf = {"type": "json_object"}
    assert constrained.for_request(smollm2) is None
    assert constrained.for_request(smollm2, response_format=rf).description == "JSON object"
    forced = constrained.for_request(smollm2, response_format=rf, tools=TOOLS, tool_choice="required", syntax="generic")
    assert forced.description == "tool call"
    assert constrained.for_request(smollm2, tools=TOOLS, tool_choice="auto", syntax="qwen") is None
    for syntax in ("qwen", "qwen_xml", "llama3", "gemma4", "deepseek"):
        assert constrained.for_request(smollm2, tools=TOOLS, tool_choice="required", syntax=syntax) is not None


# ---------------------------------------------------------------------------- markup call syntaxes

MARKUP_CASES = {
    # syntax: (vocabulary from the llama.cpp sdist, closing markup the random model is drawn to)
    "qwen_xml": ("qwen35", ["\n</parameter>\n", "</function>\n</tool_call>"]),
    "deepseek": ("qwen35", ["</｜DSML｜parameter>\n", "</｜DSML｜invoke>\n", "</｜DSML｜tool_calls>"]),
    "gemma4": ("gemma-4", ['<|"|>', "}<tool_call|>", ","]),
}


class _Closer:
    """Part of the random model: now and then it leans towards finishing a closing marker."""

    def __init__(self, tok, markers):
        self.tok = tok
        self.markers = [m.encode() for m in markers]
        self.ids_of: dict[bytes, list[int]] = {}
        for i in range(tok.vocab_size):
            self.ids_of.setdefault(tok.token_bytes(i), []).append(i)

    def __call__(self, text: bytes) -> np.ndarray:
        bias = np.zeros(self.tok.vocab_size)
        for m in self.markers:
            k = next((k for k in range(min(len(m) - 1, len(text)), 0, -1) if text.endswith(m[:k])), 0)
            rest = m[k:]
            for n in range(1, len(rest) + 1):
                for i in self.ids_of.get(rest[:n], ()):
                    bias[i] = max(bias[i], 3.0 + n)
        return bias


def _markup_bias(tok, markers) -> np.ndarray:
    bias = np.zeros(tok.vocab_size)
    for i in range(tok.vocab_size):
        piece = tok.token_bytes(i)
        if piece and any(piece in m.encode() for m in markers):
            bias[i] = 5.0
    for e in tok.eos_ids:
        bias[e] = 8.0
    return bias


@pytest.mark.parametrize("syntax", sorted(MARKUP_CASES))
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_markup_tool_choice_yields_parseable_valid_calls(syntax, choice):
    from hf2q.fetch import LLAMA_CPP_SDIST, fetch

    vocab, markers = MARKUP_CASES[syntax]
    tok = _vocab_tokenizer(fetch(LLAMA_CPP_SDIST) / "models" / f"ggml-vocab-{vocab}.gguf")
    bias = _markup_bias(tok, markers)
    closer = _Closer(tok, markers)
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(3):
        c = constrained.for_tool_choice(tok, syntax, TOOLS, choice)
        text = _decode(tok, c, seed, bias, steer=closer)
        content, calls, truncated = parse_complete(syntax, text, TOOLS)
        assert calls and not truncated and content.strip() == "", text
        for call in calls:
            args = json.loads(call["function"]["arguments"])
            if isinstance(choice, dict):
                assert call["function"]["name"] == "add"
            # names, required parameters and declared types are all enforced by the grammar
            _validate(args, by_name[call["function"]["name"]])


_VOCABS: dict = {}


def _vocab_tokenizer(path):
    if path not in _VOCABS:
        _VOCABS[path] = GGUFTokenizer.from_gguf(path)
    return _VOCABS[path]


# ---------------------------------------------------------------------------- calls that always finish
#
# Texts written by hand in each syntax's own form, fed token by token: the grammar must take a
# well-formed call and refuse what would let a small model go on forever.

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
_DS = "\uff5cDSML\uff5c"
CALL_TEXT = {  # syntax → one call with {city} for the value (and {extra} for one more property's text)
    "generic": '<tool_call>{{"name": "get_weather", "arguments": {{"city": "{city}"{extra}}}}}</tool_call>',
    "qwen": '<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"{extra}}}}}\n</tool_call>',
    "llama3": '{{"name": "get_weather", "parameters": {{"city": "{city}"{extra}}}}}',
    "qwen_xml": ("<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n{extra}"
                 "</function>\n</tool_call>"),
    "deepseek": (f'\n\n<{_DS}tool_calls>\n<{_DS}invoke name="get_weather">\n<{_DS}parameter name="city" string="true">'
                 f"{{city}}</{_DS}parameter>\n{{extra}}</{_DS}invoke>\n</{_DS}tool_calls>"),
    "gemma4": '<|tool_call>call:get_weather{{city:<|"|>{city}<|"|>{extra}}}<tool_call|>',
}
EXTRA = {"generic": ', "unit": "C"', "qwen": ', "unit": "C"', "llama3": ', "unit": "C"',
         "qwen_xml": "<parameter=unit>\nC\n</parameter>\n",
         "deepseek": f'<{_DS}parameter name="unit" string="true">C</{_DS}parameter>\n',
         "gemma4": ',unit:<|"|>C<|"|>'}


def _call(syntax: str, city: str = "Paris", extra: str = "") -> str:
    return CALL_TEXT[syntax].format(city=city, extra=extra)


def _accepts(tok, constraint, text: str) -> bool:
    """Whether the grammar takes ``text`` (token by token) as a finished output."""
    for t in tok.encode(text, add_special=False, parse_special=False):
        try:
            constraint.advance(t)
        except InputError:
            return False
    return constraint.is_accepting()


def _forced(tok, syntax, tools=WEATHER, choice=NAMED, **kw):
    return constrained.for_tool_choice(tok, syntax, tools, choice, **kw)


@pytest.mark.parametrize("syntax", sorted(CALL_TEXT))
def test_a_call_is_taken_in_every_syntax(smollm2, syntax):
    assert _accepts(smollm2, _forced(smollm2, syntax), _call(syntax))
    assert _accepts(smollm2, _forced(smollm2, syntax, choice="required"), _call(syntax))


@pytest.mark.parametrize("syntax", sorted(CALL_TEXT))
def test_a_string_with_no_max_length_is_bounded_by_max_tokens(smollm2, syntax):
    from hf2q.text.bounded_schema import string_budget

    limit = string_budget(64)  # the only string of the call gets the whole budget
    assert _accepts(smollm2, _forced(smollm2, syntax, max_tokens=64), _call(syntax, "x" * limit))
    assert not _accepts(smollm2, _forced(smollm2, syntax, max_tokens=64), _call(syntax, "x" * (limit + 1)))
    # the schema's own bound wins
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 3}}, "required": ["city"]}}}]
    assert not _accepts(smollm2, _forced(smollm2, syntax, tools=tools, max_tokens=64), _call(syntax, "Rome"))


@pytest.mark.parametrize("syntax", ["generic", "qwen", "llama3"])
def test_json_bodies_refuse_whitespace_runs(smollm2, syntax):
    good = _call(syntax)
    assert _accepts(smollm2, _forced(smollm2, syntax), good)
    args_key = "parameters" if syntax == "llama3" else "arguments"
    body = '{"name": "get_weather", "%s": {"city": "Paris"}}' % args_key
    start = good.index(body)
    for loose in (body.replace(": ", ":  "), body.replace(", ", ",\n  "), body.replace("{", "{\n", 1),
                  body.replace('"}}', '" }}'), body.replace(": ", ":")):
        assert not _accepts(smollm2, _forced(smollm2, syntax), good[:start] + loose + good[start + len(body):]), loose


@pytest.mark.parametrize("syntax", sorted(CALL_TEXT))
def test_undeclared_properties_are_refused_unless_the_schema_allows_them(smollm2, syntax):
    assert not _accepts(smollm2, _forced(smollm2, syntax), _call(syntax, extra=EXTRA[syntax]))
    if syntax in ("generic", "qwen", "llama3"):  # JSON bodies can take properties the schema leaves open
        open_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            **WEATHER[0]["function"]["parameters"], "additionalProperties": {"type": "string"}}}}]
        assert _accepts(smollm2, _forced(smollm2, syntax, tools=open_tools), _call(syntax, extra=EXTRA[syntax]))


@pytest.mark.parametrize("syntax", ["generic", "qwen", "qwen_xml", "deepseek", "gemma4"])
def test_a_second_call_follows_only_when_parallel_calls_are_allowed(smollm2, syntax):
    if syntax == "deepseek":  # one DSML block holds the reply's invokes
        one = _call(syntax)
        head, tail = one.split(f'<{_DS}invoke name="get_weather">', 1)
        invoke = f'<{_DS}invoke name="get_weather">' + tail[: tail.index(f"</{_DS}tool_calls>")]
        two = head + invoke + invoke.replace("Paris", "Rome") + f"</{_DS}tool_calls>"
    else:
        two = _call(syntax) + _call(syntax, "Rome")
    assert _accepts(smollm2, _forced(smollm2, syntax, choice="required", parallel=True), two)
    single = _forced(smollm2, syntax, choice="required", parallel=False)
    assert not _accepts(smollm2, single, two)
    single = _forced(smollm2, syntax, choice="required", parallel=False)
    assert _accepts(smollm2, single, _call(syntax)) and single.is_finished()  # nothing but the end may follow


def test_optional_markup_parameters_are_written_at_most_once(smollm2):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        "required": ["city"]}}}]
    once = _call("qwen_xml", extra=EXTRA["qwen_xml"])
    twice = _call("qwen_xml", extra=EXTRA["qwen_xml"] * 2)
    assert _accepts(smollm2, _forced(smollm2, "qwen_xml", tools=tools), once)
    assert not _accepts(smollm2, _forced(smollm2, "qwen_xml", tools=tools), twice)


def test_a_tool_schema_with_defs_still_compiles_inside_the_call(smollm2):
    tools = [{"type": "function", "function": {"name": "move", "parameters": {
        "type": "object",
        "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
        "properties": {"to": {"$ref": "#/$defs/pt"}}, "required": ["to"]}}}]
    text = '<tool_call>{"name": "move", "arguments": {"to": {"x": 3}}}</tool_call>'
    assert _accepts(smollm2, constrained.for_tool_choice(smollm2, "generic", tools, "required"), text)
    assert not _accepts(smollm2, constrained.for_tool_choice(smollm2, "generic", tools, "required"),
                        text.replace('{"x": 3}', '{"x": 3, "y": 4}'))
