"""Constrained decoding: token masks that keep a completion inside a grammar.

Used for ``response_format`` (``json_object`` / ``json_schema``) and for ``tool_choice``
``required`` / a named function. Built on **llguidance** (Microsoft's guidance engine, on
PyPI as a small abi3 wheel with no torch dependency) rather than our own automaton:

* it computes a mask over the whole vocabulary in well under a millisecond with a
  token trie + lazy lexer, so it keeps up with decoding on CPU;
* it works from raw token bytes, which we already have exactly (the same bytes our
  detokenizer emits), so there is no second tokenizer to keep in sync, and SentencePiece
  byte-fallback and GPT-2 byte-level vocabularies behave the same;
* it compiles JSON Schema (the subset OpenAI's ``strict`` mode allows and more) and
  Lark grammars, and is what llama.cpp, vLLM and SGLang use for the same job.

(xgrammar and outlines-core need torch or HF tokenizer objects for their vocab setup;
llguidance needed neither.)

A constraint object is stateful per request: ``allowed_mask()`` → ``bool[vocab]`` for the
next token, ``advance(token_id)`` after sampling, ``is_accepting()`` when the text so
far is complete (then the mask also allows end-of-generation tokens).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hf2q.errors import InputError
from hf2q.text.bounded_schema import JSON_LAYOUT, bounded, string_budget, with_layout

_FACTORIES_LOCK = threading.Lock()


def _load_llguidance():
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - dependency missing
        raise InputError("constrained decoding needs the 'llguidance' package (pip install llguidance)") from exc
    return llguidance


class _TokenSource:
    """What llguidance's ``TokenizerWrapper`` reads: token bytes, EOS, a text encoder."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.tokens = tokenizer.piece_bytes_table()
        eos = sorted(tokenizer.eos_ids) or [0]
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else eos[0]
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = sorted(tokenizer.special_ids)

    def __call__(self, text):
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special=False, parse_special=False)


def ll_tokenizer_for(tokenizer):
    """The llguidance tokenizer for a :class:`GGUFTokenizer` (built once, ~1 s, cached on it)."""
    with _FACTORIES_LOCK:
        cached = getattr(tokenizer, "_llguidance_tokenizer", None)
        if cached is not None:
            return cached
        llg = _load_llguidance()
        source = _TokenSource(tokenizer)
        ll = llg.LLTokenizer(llg.TokenizerWrapper(source), n_vocab=tokenizer.vocab_size, eos_token=sorted(tokenizer.eos_ids) or None)
        tokenizer._llguidance_tokenizer = ll
        return ll


class GrammarConstraint:
    """A per-request matcher over one llguidance grammar."""

    def __init__(self, tokenizer, grammar: str, *, description: str = "grammar"):
        llg = _load_llguidance()
        self.tokenizer = tokenizer
        self.description = description
        self._ll = ll_tokenizer_for(tokenizer)
        error = llg.LLMatcher.validate_grammar(grammar, self._ll)
        if error and not error.startswith("WARNING"):
            raise InputError(f"cannot constrain output to this {description}: {error.splitlines()[0]}")
        self._matcher = llg.LLMatcher(self._ll, grammar, log_level=0)
        if self._matcher.is_error():
            raise InputError(f"cannot constrain output to this {description}: {self._matcher.get_error()}")
        self.vocab_size = tokenizer.vocab_size

    def allowed_mask(self) -> np.ndarray | None:
        """Tokens allowed next (None = no constraint left: the grammar has ended)."""
        m = self._matcher
        if m.is_error():
            raise InputError(f"constrained decoding failed: {m.get_error()}")
        bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        return mask

    def allowed(self, tokens_so_far: Sequence[int] | None = None) -> np.ndarray | None:
        """Alias kept for ``SamplingParams.constraint`` users (state is tracked via advance)."""
        return self.allowed_mask()

    def advance(self, token_id: int) -> None:
        if not self._matcher.consume_token(int(token_id)):
            raise InputError(f"constrained decoding: token {token_id} is not allowed here ({self._matcher.get_error()})")

    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()

    def is_finished(self) -> bool:
        """Nothing but end-of-generation can follow."""
        return self._matcher.is_stopped()

    def forced_text(self) -> bytes:
        """Bytes the grammar forces next (useful to skip sampling)."""
        return self._matcher.compute_ff_bytes()


# ---------------------------------------------------------------------------- grammars

def json_schema_grammar(schema: Mapping[str, Any] | bool) -> str:
    llg = _load_llguidance()
    try:
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_LAYOUT)
    except (ValueError, TypeError) as exc:
        raise InputError(f"invalid JSON schema: {exc}") from None


def for_response_format(tokenizer, response_format: Mapping[str, Any] | None) -> GrammarConstraint | None:
    """The constraint for an OpenAI ``response_format`` (None for ``text``)."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarConstraint(tokenizer, json_schema_grammar({"type": "object"}), description="JSON object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or "schema" not in spec and "name" not in spec:
            raise InputError("response_format.json_schema must be an object with a 'schema'")
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, (Mapping, bool)):
            raise InputError("response_format.json_schema.schema must be a JSON schema object")
        return GrammarConstraint(tokenizer, json_schema_grammar(schema), description="JSON schema")
    raise InputError(f"unsupported response_format type {kind!r} (use text, json_object or json_schema)")


def _call_schema(tools: Sequence[Mapping], args_key: str) -> dict:
    """One JSON call object (``{"name": …, args_key: {…}}``) per tool, in the compact layout."""
    variants = []
    for tool in tools:
        fn = tool.get("function", tool)
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, args_key: fn["parameters"]},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    return with_layout(variants[0] if len(variants) == 1 else {"anyOf": variants})


def _json_value(schema: Mapping) -> str:
    """A Lark ``%json`` item for one (already bounded) value schema."""
    return "%json " + json.dumps(with_layout(schema), ensure_ascii=False)


def _bounded_tools(tools: Sequence[Mapping], max_tokens: int | None, free: str | None = None) -> list[dict]:
    """The tools' functions with finite argument schemas (:mod:`hf2q.text.bounded_schema`)."""
    out = []
    for tool in tools:
        fn = dict(tool.get("function", tool))
        fn["parameters"] = bounded(fn.get("parameters"), max_tokens, free)
        out.append(fn)
    return out


def _selected_tools(tools: Sequence[Mapping], tool_choice: Any) -> list[Mapping]:
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name")
        chosen = [t for t in tools if t.get("function", t).get("name") == name]
        if not chosen:
            raise InputError(f"tool_choice names {name!r}, which is not in tools")
        return chosen
    return list(tools)


def for_tool_choice(tokenizer, syntax: str, tools: Sequence[Mapping], tool_choice: Any, parallel: bool = True,
                    max_tokens: int | None = None, opening: str = "") -> GrammarConstraint | None:
    """Force a tool call for ``tool_choice`` ``required`` or ``{"type": "function", ...}``.

    The grammar writes the call in the model's own syntax (see :mod:`hf2q.text.toolcalls`):
    JSON bodies for ``qwen``/``generic``/``llama3``, the XML-ish markup of ``qwen_xml`` and
    ``deepseek``, Gemma 4's ``call:NAME{…}``. Returns None for ``auto``/``none``.

    Every value is finite (:func:`hf2q.text.bounded_schema.bounded`, sized by ``max_tokens``)
    and JSON is compact, so a call closes as soon as its schema allows. Only ``required`` with
    ``parallel`` lets further calls follow; a further call that repeats an earlier one is the
    reply decoder's to cut (a grammar cannot compare two calls). ``opening``: text written
    before the call (see :func:`for_request`).
    """
    if tool_choice in (None, "auto", "none"):
        return None
    if not tools:
        raise InputError("tool_choice requires a non-empty tools list")
    free = "string" if syntax in _MARKUP_GRAMMARS else None  # markup writes shapeless values verbatim
    chosen = _bounded_tools(_selected_tools(tools, tool_choice), max_tokens, free)
    many = parallel and not isinstance(tool_choice, Mapping)
    if syntax in ("qwen", "generic"):
        schema = json.dumps(_call_schema(chosen, "arguments"), ensure_ascii=False)
        lark = (
            f"start: {_calls('call', many, _MAY_NEWLINE)}\n"
            f'call: "<tool_call>" "\\n"? body "\\n"? "</tool_call>"\n'
            f"body: %json {schema}\n"
        )
    elif syntax == "llama3":
        if not opening:
            return GrammarConstraint(tokenizer, json_schema_grammar(_call_schema(chosen, "parameters")),
                                     description="tool call")
        lark = f"start: {_json_value(_call_schema(chosen, 'parameters'))}\n"
    elif syntax in _MARKUP_GRAMMARS:
        lark = _MARKUP_GRAMMARS[syntax](chosen, many, string_budget(max_tokens))
    else:
        raise InputError(f"tool_choice {tool_choice!r} is not supported for the {syntax} tool-call syntax; use auto")
    lark = _opened_by(opening, lark)
    llg = _load_llguidance()
    if _vocabulary_has_excluded_markup(tokenizer, lark):
        lark = _without_exclusions(lark)
    return GrammarConstraint(tokenizer, llg.LLMatcher.grammar_from_lark(lark), description="tool call")


_EXCLUSION = re.compile(r"~/\(\.\|\\n\)\*\((.+?)\)\(\.\|\\n\)\*/")


def _vocabulary_has_excluded_markup(tokenizer, lark: str) -> bool:
    """Whether the vocabulary has a token that is one of the markup strings ``lark``'s free text excludes."""
    excluded = {re.sub(r"\\(.)", r"\1", alt).encode() for m in _EXCLUSION.finditer(lark)
                for alt in re.split(r"(?<!\\)\|", m.group(1))}
    if not excluded:
        return False
    with _FACTORIES_LOCK:
        pieces = getattr(tokenizer, "_piece_set", None)
        if pieces is None:
            pieces = tokenizer._piece_set = frozenset(tokenizer.piece_bytes_table())
    return not excluded.isdisjoint(pieces)


#: bounds up to this keep the markup exclusion on every vocabulary (:func:`_without_exclusions`)
EXACT_COUNT_LIMIT = 32
#: a free-text rule as :func:`_text_without` writes it with a length bound, and its exclusion
_COUNTED_TEXT = re.compile(r"(\[suffix=\"(?:[^\"\\]|\\.)*\"\]: /\(\.\|\\n\)\{\d+,(\d+)\}/) & ~/[^\n]*?\)\(\.\|\\n\)\*/")


def _without_exclusions(lark: str) -> str:
    """``lark`` with the markup exclusion dropped from free-text values longer than a few dozen characters.

    A counted repetition intersected with the exclusion is exact, but on a vocabulary that has
    the markup as tokens (Qwen's ``</tool_call>``) llguidance's lexer runs out of fuel once the
    bound passes a few dozen characters, and every forced call would fail. The count alone
    compiles at any size; the value still ends at its closing marker (the rule's ``suffix``), but
    may then hold the other closing markup (``</function>``), which the whole-block reader would
    see as the call's end: the fallback for those vocabularies only.
    """
    return _COUNTED_TEXT.sub(lambda m: m.group(0) if int(m.group(2)) <= EXACT_COUNT_LIMIT else m.group(1), lark)


def _opened_by(opening: str, lark: str) -> str:
    """``lark`` whose text must follow ``opening``: its start rule renamed and preceded by the literal."""
    if not opening:
        return lark
    renamed = re.sub(r"^start:", "constrained:", lark, count=1, flags=re.MULTILINE)
    return f"start: {_lit(opening)} constrained\n{renamed}"


# ---- call grammars for the markup syntaxes (Lark, as llguidance reads it) ----------------------
#
# Free-text string values are "lazy" rules that end at their closing markup (llguidance's
# ``suffix=``); typed values are inline JSON schemas. Required parameters come first, then
# each optional one at most once, in schema order: no parameter can be written twice. Each
# builder takes the tools, whether several calls may follow one another, and the string
# budget (Gemma's nested strings use it; schema strings carry their own ``maxLength``).

_MAY_NEWLINE = '"\\n"?'

def _calls(item: str, many: bool, sep: str = "") -> str:
    """One ``item``, or (parallel calls) one or more with ``sep`` between: never a trailing extra."""
    return f"{item} ({sep + ' ' if sep else ''}{item})*" if many else item


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _text_without(forbidden: Sequence[str], min_len: int = 0, max_len: int | None = None) -> str:
    """A Lark token expression: text of the given length that contains none of ``forbidden``.

    Free-text values must not contain the markup that closes the enclosing call, or the
    parser (and any other reader of the format) would end the call early.
    """
    alts = "|".join(re.escape(f).replace("/", "\\/") for f in forbidden)
    count = "*" if not min_len and max_len is None else f"{{{min_len},{'' if max_len is None else max_len}}}"
    return f"/(.|\\n){count}/ & ~/(.|\\n)*({alts})(.|\\n)*/"


def _string_value(rules: list[str], rule: str, schema: Mapping, closing: str, forbidden: Sequence[str]) -> str:
    """Grammar for a string parameter written verbatim and ended by ``closing``.

    ``enum``/``const`` become literal choices; ``minLength``/``maxLength`` bound the text.
    Returns the expression to use in the parameter's rule.
    """
    choices = schema.get("enum") if "enum" in schema else ([schema["const"]] if "const" in schema else None)
    if choices is not None:
        texts = [c for c in choices if isinstance(c, str)]
        return "(" + " | ".join(_lit(t) for t in texts) + ") " + _lit(closing) if texts else _lit(closing)
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    rules.append(f"{rule}[suffix={_lit(closing)}]: " + _text_without(forbidden, int(lo or 0), None if hi is None else int(hi)))
    return rule


def _params(fn: Mapping) -> list[tuple[str, dict]]:
    props = ((fn.get("parameters") or {}).get("properties")) or {}
    return [(str(k), dict(v) if isinstance(v, Mapping) else {}) for k, v in props.items()]


def _required(fn: Mapping) -> list[str]:
    return [str(r) for r in ((fn.get("parameters") or {}).get("required") or [])]


def _param_sequence(fn: Mapping, rule_of: dict[str, str], sep: str = "") -> str:
    """Required parameters first (in ``required`` order), then each optional one at most once."""
    required = [rule_of[r] for r in _required(fn) if r in rule_of]
    optional = [rule for name, rule in rule_of.items() if name not in _required(fn)]
    lead = f"{sep} " if sep else ""
    joiner = f" {lead}"
    if required:
        return " ".join([joiner.join(required)] + [f"({lead}{o})?" for o in optional])
    if not optional:
        return ""
    # no required parameter: the first one written takes no separator
    firsts = [" ".join([o] + [f"({lead}{p})?" for p in optional[k + 1 :]]) for k, o in enumerate(optional)]
    return "(" + " | ".join(f"({f})" for f in firsts) + ")?"


def _is_string(schema: Mapping) -> bool:
    """Written verbatim (as the parsers read it back: :func:`hf2q.text.call_formats.typed_value`)."""
    t = schema.get("type")
    return t == "string" or (isinstance(t, list) and "string" in t) or (
        t is None and "enum" not in schema and "const" not in schema)


def _qwen_xml_grammar(tools: Sequence[Mapping], many: bool, budget: int) -> str:
    rules = [f"start: {_calls('call', many, _MAY_NEWLINE)}"]
    forbidden = ("</parameter>", "</function>", "</tool_call>")
    calls = []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool)
        rule_of = {}
        for j, (name, schema) in enumerate(_params(fn)):
            head = _lit(f"<parameter={name}>\n")
            if _is_string(schema):
                value = _string_value(rules, f"s{i}_{j}", schema, "\n</parameter>\n", forbidden)
                rules.append(f"p{i}_{j}: {head} {value}")
            else:
                rules.append(f'p{i}_{j}: {head} {_json_value(schema)} "\\n</parameter>\\n"')
            rule_of[name] = f"p{i}_{j}"
        body = _param_sequence(fn, rule_of)
        rules.append(f'c{i}: {_lit("<tool_call>" + chr(10) + "<function=" + fn["name"] + ">" + chr(10))} {body} '
                     f'"</function>\\n</tool_call>"')
        calls.append(f"c{i}")
    rules.append(f"call: {' | '.join(calls)}")
    return "\n".join(rules) + "\n"


_DSML = "\uff5cDSML\uff5c"


def _dsml(tag: str) -> str:
    return "<" + _DSML + tag + ">"


#: what DeepSeek-V4's template writes between an assistant turn's content and its DSML block
_DSML_SEPARATOR = "\n\n"


def _deepseek_grammar(tools: Sequence[Mapping], many: bool, budget: int) -> str:
    """The block as DeepSeek-V4's template renders a past call, byte for byte (the separator before it
    included, an empty argument list as one blank line), so the turn the model wrote is the text the
    next request's history repeats and its cached KV stays reusable."""
    end_param = _dsml("/parameter").replace("<" + _DSML + "/", "</" + _DSML) + "\n"
    opening = _lit(_DSML_SEPARATOR + _dsml("tool_calls") + "\n")
    rules = [f"start: {opening} {_calls('invoke', many)} {_lit('</' + _DSML + 'tool_calls>')}"]
    forbidden = (end_param.strip(), "</" + _DSML + "invoke>", "</" + _DSML + "tool_calls>")
    invokes = []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool)
        rule_of = {}
        for j, (name, schema) in enumerate(_params(fn)):
            as_string = _is_string(schema)
            head = _lit(_dsml(f'parameter name="{name}" string="{"true" if as_string else "false"}"'))
            if as_string:
                value = _string_value(rules, f"s{i}_{j}", schema, end_param, forbidden)
            else:
                value = f"{_json_value(schema)} {_lit(end_param)}"
            rules.append(f"p{i}_{j}: {head} {value}")
            rule_of[name] = f"p{i}_{j}"
        body = _param_sequence(fn, rule_of)
        if not any(r in rule_of for r in _required(fn)):  # no argument written: the template's blank line
            body = f"({body.removesuffix('?')} | {_lit(chr(10))})" if body else _lit(chr(10))
        head = _lit(_dsml(f'invoke name="{fn["name"]}"') + "\n")
        rules.append(f"v{i}: {head} {body} {_lit('</' + _DSML + 'invoke>' + chr(10))}")
        invokes.append(f"v{i}")
    rules.append(f"invoke: {' | '.join(invokes)}")
    return "\n".join(rules) + "\n"


def _gemma4_grammar(tools: Sequence[Mapping], many: bool, budget: int) -> str:
    q = '<|"|>'
    number = _json_value(bounded({"type": "number"}, None))
    rules = [
        f"start: {_calls('call', many)}",
        f"gstr: {_lit(q)} sval",
        f"sval[suffix={_lit(q)}]: " + _text_without((q, "<tool_call|>"), 0, budget),
        # Gemma's own notation for nested values: unquoted keys, <|"|>-quoted strings
        f'gval: gstr | {number} | "true" | "false" | gobj | garr',
        'gobj: "{" (GKEY ":" gval ("," GKEY ":" gval)*)? "}"',
        'garr: "[" (gval ("," gval)*)? "]"',
        "GKEY: /[A-Za-z_][A-Za-z0-9_]*/",
    ]
    calls = []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool)
        rule_of = {}
        for j, (name, schema) in enumerate(_params(fn)):
            t = schema.get("type")
            if _is_string(schema):
                value = f"{_lit(q)} " + _string_value(rules, f"s{i}_{j}", schema, q, (q, "<tool_call|>"))
            elif t in ("integer", "number"):
                value = _json_value(schema)
            elif t == "boolean":
                value = '("true" | "false")'
            else:
                value = "gval"
            rules.append(f"p{i}_{j}: {_lit(name + ':')} {value}")
            rule_of[name] = f"p{i}_{j}"
        args = _param_sequence(fn, rule_of, sep='","')
        rules.append(f"c{i}: {_lit('<|tool_call>call:' + fn['name'] + '{')} {args} {_lit('}<tool_call|>')}")
        calls.append(f"c{i}")
    rules.append(f"call: {' | '.join(calls)}")
    return "\n".join(rules) + "\n"


_MARKUP_GRAMMARS = {"qwen_xml": _qwen_xml_grammar, "deepseek": _deepseek_grammar, "gemma4": _gemma4_grammar}


def for_request(
    tokenizer,
    *,
    response_format: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping] | None = None,
    tool_choice: Any = None,
    syntax: str | None = None,
    parallel: bool = True,
    max_tokens: int | None = None,
    opening: str = "",
    fence: tuple[str, str] = ("", ""),
) -> GrammarConstraint | None:
    """The one constraint an OpenAI chat request needs, or None.

    A forced tool call (``tool_choice`` ``required`` / named) wins over ``response_format``
    because the reply is then a call, not a message. ``parallel`` is the request's
    ``parallel_tool_calls`` and ``max_tokens`` its budget, which sizes the call's value bounds.
    ``opening`` is text the reply must write before the constrained part: a prompt that leaves
    a reasoning block open (Qwen3.5 with thinking on) has it closed first, or the call or JSON
    would be written inside the reasoning and never reach the answer. ``fence``: text the JSON of a
    ``response_format`` is written between (DeepSeek-V4's fenced json block).
    """
    forced = bool(tools) and tool_choice not in (None, "auto", "none")
    if forced and syntax is not None:
        return for_tool_choice(tokenizer, syntax, tools, tool_choice, parallel=parallel, max_tokens=max_tokens,
                               opening=opening)
    constraint = for_response_format(tokenizer, response_format)
    if constraint is None or not (opening or any(fence)):
        return constraint
    kind = response_format.get("type")
    schema = response_format["json_schema"].get("schema", {"type": "object"}) if kind == "json_schema" else {
        "type": "object"}
    parts = [_lit(opening + fence[0])] if opening + fence[0] else []
    parts += [_json_value(schema)] + ([_lit(fence[1])] if fence[1] else [])
    lark = f"start: {' '.join(parts)}\n"
    return GrammarConstraint(tokenizer, _load_llguidance().LLMatcher.grammar_from_lark(lark),
                             description=constraint.description)
