"""Turn an untrusted JSON body into a typed request record, or a 400 naming the field.

Pure: no Quart, no runtime. The rules (docs/API.md): unknown fields are ignored; a known field
of the wrong type or out of range is ``400`` whose message and ``param`` name the field
(``messages[2].content``, ``tools[0].function.name``); ``n`` must be 1; ``tool_choice`` is
``auto|none|required`` or a named function that exists in ``tools``. JSON booleans are not
numbers here even though Python's ``bool`` is an ``int``.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import attrs

from hf2q.api.errors import ApiError, invalid

ROLES = ("system", "developer", "user", "assistant", "tool")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")

#: deeper JSON than any real request needs; deeper input would exhaust the recursion of the
#: JSON decoder, the template sandbox or the schema compiler
MAX_JSON_DEPTH = 64
#: the most a sampler could use (no vocabulary is this large); more is a client bug
MAX_TOP_K = 1 << 20
#: template variables the server itself passes; a request may not replace them
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")

_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"\s*(:?)|[\[\]{},]')


@attrs.frozen
class ChatRequest:
    model: str | None
    messages: tuple[dict, ...]  # normalised: content is str | None, tool_calls list, images flagged
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    tools: tuple[dict, ...] = ()
    tool_choice: str | dict = "auto"  # "auto" | "none" | "required" | {"type":"function","function":{"name"}}
    parallel_tool_calls: bool = True
    response_format: dict | None = None  # {"type": "json_object"} | {"type": "json_schema", "json_schema": {...}}
    reasoning_effort: str | None = None
    chat_template_kwargs: dict = attrs.field(factory=dict)
    #: ``(param, url)`` of each ``image_url`` part in prompt order; its place in the text is ``IMAGE_MARKER``
    images: tuple[tuple[str, str], ...] = ()

    @property
    def has_images(self) -> bool:
        return bool(self.images)

    @property
    def forced_tool(self) -> str | None:
        """The function name ``tool_choice`` forces, if any."""
        if isinstance(self.tool_choice, dict):
            return self.tool_choice["function"]["name"]
        return None

    @property
    def tools_active(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


@attrs.frozen
class EmbeddingsRequest:
    model: str | None
    inputs: tuple[str | tuple[int, ...], ...]
    encoding_format: str = "float"
    dimensions: int | None = None


# ---- the body as a whole ----------------------------------------------------------------

def decode_body(raw: bytes) -> Any:
    """The parsed JSON body, or a 400: malformed, nested deeper than ``MAX_JSON_DEPTH``
    (the message names where), or holding text that is not Unicode (a lone surrogate)."""
    if not raw:
        raise ApiError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _too_deep(_deep_path(raw)) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    check_json_shape(body)
    return body


def check_json_shape(body: Any) -> None:
    """Walk the parsed body once, without recursion: depth and text validity, naming the field."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if _not_unicode(value):
                raise invalid(path or "body", "contains a lone UTF-16 surrogate; text must be valid Unicode")
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise _too_deep(path)
        if isinstance(value, dict):
            for k, v in value.items():
                child = f"{path}.{k}" if path else k
                if _not_unicode(k):
                    raise invalid(path or "body", "has a key holding a lone UTF-16 surrogate")
                stack.append((v, child, depth + 1))
        else:
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))


def _not_unicode(text: str) -> bool:
    """A lone surrogate (JSON allows ``"\\ud800"``; nothing downstream can encode it)."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _too_deep(path: str) -> ApiError:
    where = _shorten(path)
    if not where:
        return ApiError(400, f"request body is nested more than {MAX_JSON_DEPTH} levels deep", code="invalid_json")
    return invalid(where, f"is nested more than {MAX_JSON_DEPTH} levels deep")


def _shorten(path: str) -> str:
    """The first three steps of a path (``a.b[0]``): enough to find the field, never kilobytes."""
    steps = re.findall(r"\[\d+\]|[^.\[]+", path)
    short = "".join(p if p.startswith("[") else "." + p for p in steps[:3]).removeprefix(".")
    return "body" + short if short.startswith("[") else short


def _deep_path(raw: bytes) -> str:
    """Where ``raw`` first nests past the limit, found by a flat scan (the decoder recursed too deep)."""
    stack: list[list] = []  # [kind, key-or-index]
    pending_key: str | None = None
    for m in _JSON_TOKEN.finditer(raw):
        tok = m.group(0)
        if tok[:1] == b'"':
            if m.group(1):
                pending_key = tok[1:tok.rindex(b'"')].decode("utf-8", "replace")
            continue
        if tok in (b"[", b"{"):
            if len(stack) >= MAX_JSON_DEPTH:
                break
            if stack and stack[-1][0] == "{":
                stack[-1][1] = pending_key
            stack.append([tok.decode(), 0 if tok == b"[" else None])
        elif tok in (b"]", b"}"):
            if stack:
                stack.pop()
        elif tok == b"," and stack and stack[-1][0] == "[":
            stack[-1][1] += 1
    parts = []
    for kind, key in stack[:-1]:
        parts.append(f"[{key}]" if kind == "[" else f".{key}")
    return "".join(parts).lstrip(".")


# ---- primitive checks -------------------------------------------------------------------

def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _number(body: dict, key: str, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_number(v):
        raise invalid(key, f"expected a number, got {_type_name(v)}", "invalid_type")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise invalid(key, f"must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise invalid(key, f"must be <= {hi}, got {v}")
    return float(v)


def _integer(body: dict, key: str, lo: int | None = None, hi: int | None = None, *,
             param: str | None = None) -> int | None:
    v = body.get(key)
    param = param or key
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise invalid(param, f"expected an integer, got {_type_name(v)}", "invalid_type")
    if lo is not None and v < lo:
        raise invalid(param, f"must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise invalid(param, f"must be <= {hi}, got {v}")
    return v


def _boolean(body: dict, key: str, default: bool, param: str | None = None) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(param or key, f"expected a boolean, got {_type_name(v)}", "invalid_type")
    return v


def _string(body: dict, key: str, param: str | None = None) -> str | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise invalid(param or key, f"expected a string, got {_type_name(v)}", "invalid_type")
    return v


def _object(body: dict, key: str, param: str | None = None) -> dict | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid(param or key, f"expected an object, got {_type_name(v)}", "invalid_type")
    return v


def _type_name(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(v), type(v).__name__)


# ---- messages ---------------------------------------------------------------------------

def _image_url(part: dict, p: str) -> str:
    """The URL of an ``image_url`` part (``{"url": …}`` as OpenAI sends it, or the bare string)."""
    field = "image_url" if "image_url" in part else "url"
    v = part.get(field)
    url = v.get("url") if isinstance(v, dict) else v
    if not isinstance(url, str) or not url:
        raise invalid(f"{p}.{field}", "expected an object with a url string", "invalid_type")
    return url


def _content(v: Any, param: str) -> tuple[str | None, list[tuple[str, str]]]:
    """Normalise message content to text, each image part's place marked by ``IMAGE_MARKER``;
    returns (text, [(param, url) of each image part])."""
    from hf2q.api.images import IMAGE_MARKER

    if v is None or isinstance(v, str):
        return v, []
    if not isinstance(v, list):
        raise invalid(param, f"expected a string or an array of content parts, got {_type_name(v)}",
                      "invalid_type")
    texts, images = [], []
    for i, part in enumerate(v):
        p = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise invalid(p, f"expected an object, got {_type_name(part)}", "invalid_type")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"{p}.text", "expected a string", "invalid_type")
            if IMAGE_MARKER in text:
                raise invalid(f"{p}.text", "holds U+E000, the character the server marks images with")
            texts.append(text)
        elif kind in ("image_url", "input_image"):
            images.append((p, _image_url(part, p)))
            texts.append(IMAGE_MARKER)
        else:
            raise invalid(f"{p}.type", f"unsupported content part type {kind!r} (text, image_url)")
    return "".join(texts), images


def _tool_calls(v: Any, param: str) -> list[dict]:
    if not isinstance(v, list):
        raise invalid(param, f"expected an array, got {_type_name(v)}", "invalid_type")
    out = []
    for i, call in enumerate(v):
        p = f"{param}[{i}]"
        if not isinstance(call, dict):
            raise invalid(p, "expected an object", "invalid_type")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise invalid(f"{p}.function", "expected an object", "invalid_type")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"{p}.function.name", "expected a non-empty string", "invalid_type")
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):  # lenient: some clients send parsed arguments
            import json

            args = json.dumps(args, ensure_ascii=False)
        if not isinstance(args, str):
            raise invalid(f"{p}.function.arguments", "expected a JSON string", "invalid_type")
        cid = call.get("id")
        if cid is not None and not isinstance(cid, str):
            raise invalid(f"{p}.id", "expected a string", "invalid_type")
        out.append({"id": cid or f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}})
    return out


def _messages(v: Any) -> tuple[tuple[dict, ...], tuple[tuple[str, str], ...]]:
    if v is None:
        raise invalid("messages", "is required", "missing_required_parameter")
    if not isinstance(v, list):
        raise invalid("messages", f"expected an array, got {_type_name(v)}", "invalid_type")
    if not v:
        raise invalid("messages", "must contain at least one message")
    from hf2q.api.images import MAX_IMAGES

    out, images = [], []
    for i, m in enumerate(v):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(p, f"expected an object, got {_type_name(m)}", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"{p}.role", f"expected one of {', '.join(ROLES)}, got {role!r}")
        text, image = _content(m.get("content"), f"{p}.content")
        images += image
        if len(images) > MAX_IMAGES:
            raise invalid(images[-1][0], f"more than {MAX_IMAGES} images in one request")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise invalid(f"{p}.tool_calls", "only assistant messages carry tool_calls")
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{p}.tool_calls")
        if role == "tool":
            tcid = _string(m, "tool_call_id", f"{p}.tool_call_id")
            if tcid is not None:
                msg["tool_call_id"] = tcid
            name = _string(m, "name", f"{p}.name")
            if name is not None:
                msg["name"] = name
        rc = _string(m, "reasoning_content", f"{p}.reasoning_content")
        if rc is not None:
            msg["reasoning_content"] = rc
        if text is None and role != "assistant":
            raise invalid(f"{p}.content", "is required for this role", "missing_required_parameter")
        out.append(msg)
    return tuple(out), tuple(images)


# ---- tools ------------------------------------------------------------------------------

def _tools(v: Any) -> tuple[dict, ...]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise invalid("tools", f"expected an array, got {_type_name(v)}", "invalid_type")
    out, names = [], set()
    for i, t in enumerate(v):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise invalid(p, "expected an object", "invalid_type")
        if t.get("type", "function") != "function":
            raise invalid(f"{p}.type", f"only 'function' tools are supported, got {t.get('type')!r}")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise invalid(f"{p}.function", "expected an object", "invalid_type")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"{p}.function.name", "expected a non-empty string", "invalid_type")
        if name in names:
            raise invalid(f"{p}.function.name", f"duplicate tool name {name!r}")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise invalid(f"{p}.function.parameters", "expected a JSON schema object", "invalid_type")
        desc = _string(fn, "description", f"{p}.function.description")
        clean = {"name": name}  # OpenAI's key order: templates print the tool as JSON, in this order
        if desc is not None:
            clean["description"] = desc
        clean["parameters"] = params
        out.append({"type": "function", "function": clean})
    return tuple(out)


def _tool_choice(v: Any, tools: tuple[dict, ...]) -> str | dict:
    if v is None:
        return "auto"
    if isinstance(v, str):
        if v not in ("auto", "none", "required"):
            raise invalid("tool_choice", f"expected auto, none, required or a function object, got {v!r}")
        if v == "required" and not tools:
            raise invalid("tool_choice", "'required' needs a non-empty tools list")
        return v
    if not isinstance(v, dict) or v.get("type") != "function" or not isinstance(v.get("function"), dict) \
            or not isinstance(v["function"].get("name"), str):
        raise invalid("tool_choice", "expected auto, none, required or "
                                     '{"type": "function", "function": {"name": ...}}')
    name = v["function"]["name"]
    if name not in {t["function"]["name"] for t in tools}:
        raise invalid("tool_choice", f"function {name!r} is not in tools")
    return {"type": "function", "function": {"name": name}}


def _response_format(v: Any) -> dict | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid("response_format", f"expected an object, got {_type_name(v)}", "invalid_type")
    kind = v.get("type")
    if kind not in RESPONSE_FORMATS:
        raise invalid("response_format.type", f"expected one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_schema":
        js = v.get("json_schema")
        if not isinstance(js, dict):
            raise invalid("response_format.json_schema", "expected an object", "invalid_type")
        schema = js.get("schema", {})
        if not isinstance(schema, dict):
            raise invalid("response_format.json_schema.schema", "expected an object", "invalid_type")
        return {"type": "json_schema", "json_schema": {"name": js.get("name", "response"), "schema": schema,
                                                      "strict": bool(js.get("strict", False))}}
    return {"type": "json_object"}


def _stop(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,) if v else ()
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise invalid("stop", "expected a string or an array of strings", "invalid_type")
    if len(v) > 16:
        raise invalid("stop", "at most 16 stop strings")
    return tuple(s for s in v if s)


def _logit_bias(v: Any) -> tuple[tuple[int, float], ...]:
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise invalid("logit_bias", "expected an object of token id → bias", "invalid_type")
    out = []
    for k, b in v.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise invalid("logit_bias", f"key {k!r} is not a token id") from None
        if tok < 0:
            raise invalid("logit_bias", f"token id {tok} is negative")
        if not _is_number(b) or not -100 <= b <= 100:
            raise invalid("logit_bias", f"bias for {k} must be a number in [-100, 100]")
        out.append((tok, float(b)))
    return tuple(out)


# ---- public -------------------------------------------------------------------------------

def parse_chat_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    model = _string(body, "model")
    messages, images = _messages(body.get("messages"))
    n = _integer(body, "n", lo=1)
    if n not in (None, 1):
        raise invalid("n", "only n=1 is supported")
    so = _object(body, "stream_options")
    include_usage = _boolean(so, "include_usage", False, "stream_options.include_usage") if so else False
    max_tokens = _integer(body, "max_completion_tokens", lo=1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", lo=1)
    tools = _tools(body.get("tools"))
    logprobs = _boolean(body, "logprobs", False)
    top_logprobs = _integer(body, "top_logprobs", lo=0, hi=20) or 0
    if top_logprobs and not logprobs:
        raise invalid("top_logprobs", "requires logprobs=true")
    reasoning_effort = _string(body, "reasoning_effort")
    if reasoning_effort is not None and reasoning_effort not in ("none", "minimal", "low", "medium", "high"):
        raise invalid("reasoning_effort", f"expected none, minimal, low, medium or high, got {reasoning_effort!r}")
    kwargs = _object(body, "chat_template_kwargs") or {}
    for name in RESERVED_TEMPLATE_VARIABLES:
        if name in kwargs:
            raise invalid(f"chat_template_kwargs.{name}", f"{name!r} is set by the server from the request "
                                                          f"itself and cannot be overridden")
    seed = _integer(body, "seed", lo=-1, hi=(1 << 64) - 1)
    return ChatRequest(
        model=model,
        messages=messages,
        stream=_boolean(body, "stream", False),
        include_usage=include_usage,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0, 2),
        top_p=_number(body, "top_p", 0, 1, lo_open=True),
        top_k=_integer(body, "top_k", lo=-1, hi=MAX_TOP_K),
        min_p=_number(body, "min_p", 0, 1),
        repetition_penalty=_number(body, "repetition_penalty", 0, lo_open=True),
        frequency_penalty=_number(body, "frequency_penalty", -2, 2) or 0.0,
        presence_penalty=_number(body, "presence_penalty", -2, 2) or 0.0,
        seed=None if seed == -1 else seed,  # -1: a fresh random seed, as in llama.cpp
        stop=_stop(body.get("stop")),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        logit_bias=_logit_bias(body.get("logit_bias")),
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=_boolean(body, "parallel_tool_calls", True),
        response_format=_response_format(body.get("response_format")),
        reasoning_effort=reasoning_effort,
        chat_template_kwargs=dict(kwargs),
        images=images,
    )


def parse_embeddings_request(body: Any) -> EmbeddingsRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    model = _string(body, "model")
    v = body.get("input")
    if v is None:
        raise invalid("input", "is required", "missing_required_parameter")
    items: list[str | tuple[int, ...]]
    if isinstance(v, str):
        items = [v]
    elif isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        items = [tuple(v)]  # one pre-tokenised input
    elif isinstance(v, list):
        items = []
        for i, x in enumerate(v):
            if isinstance(x, str):
                items.append(x)
            elif isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x):
                items.append(tuple(x))
            else:
                raise invalid(f"input[{i}]", "expected a string or an array of token ids", "invalid_type")
    else:
        raise invalid("input", f"expected a string or an array, got {_type_name(v)}", "invalid_type")
    if not items:
        raise invalid("input", "must not be empty")
    if len(items) > 2048:
        raise invalid("input", "at most 2048 inputs per request")
    fmt = _string(body, "encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise invalid("encoding_format", f"expected float or base64, got {fmt!r}")
    return EmbeddingsRequest(model=model, inputs=tuple(items), encoding_format=fmt,
                             dimensions=_integer(body, "dimensions", lo=1))
