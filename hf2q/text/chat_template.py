"""Chat templates: the model's own Jinja program that turns messages into a prompt.

Templates are untrusted code from model files, so they run in jinja2's
``ImmutableSandboxedEnvironment``. Everything else mirrors what transformers'
``apply_chat_template`` gives a template, because that is what model authors test
against: ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson``
filter that does not HTML-escape (``json.dumps`` with ``ensure_ascii=False``),
``raise_exception``, ``strftime_now``, a ``namespace`` that refuses underscore names, the
special-token strings as variables, and reasoning text visible under all of its usual
names (``reasoning_content``, ``thinking``, ``reasoning``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hf2q.errors import InputError
from hf2q.formats.gguf_keys import Keys
from hf2q.formats.gguf_parse import metadata_from

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _SafeNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore attributes (no path to interpreter internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        values = dict(*args, **kwargs)
        for key in values:
            _SafeNamespace._check(key)
        jinja2.utils.Namespace.__init__(self, values)

    def __setitem__(self, key, value):
        _SafeNamespace._check(key)
        jinja2.utils.Namespace.__setitem__(self, key, value)

    @staticmethod
    def _check(key):
        if isinstance(key, str) and key.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {key!r}")


class _DictFactory:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters["from_json"] = json.loads  # DeepSeek-V4 templates parse string arguments with it
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    env.globals["dict"] = _DictFactory()
    return env


def plain(value: Any) -> Any:
    """Deep copy into plain JSON types, so a template never sees caller objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "model_dump"):
        return plain(value.model_dump())
    return str(value)


def alias_reasoning(messages: list[dict]) -> list[dict]:
    """Expose a message's reasoning under every name templates read it by."""
    out = []
    for m in messages:
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def parse_tool_call_arguments(messages: Sequence[Mapping]) -> list[dict]:
    """OpenAI sends ``tool_calls[].function.arguments`` as a JSON string; most templates
    expect an object (``arguments | tojson`` / ``arguments.items()``). Turn valid JSON
    object strings into dicts, leave anything else as it is."""
    out = []
    for m in plain(list(messages)):
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        parsed = json.loads(fn["arguments"])
                    except ValueError:
                        continue
                    if isinstance(parsed, dict):
                        fn["arguments"] = parsed
        out.append(m)
    return out


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None, **special_tokens: str):
        if not isinstance(source, str) or not source.strip():
            raise InputError("chat template is empty")
        self.source = source
        self.special_tokens = {"bos_token": bos_token, "eos_token": eos_token, **special_tokens}
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise InputError(f"chat template does not compile: {exc.message} (line {exc.lineno})") from None

    @classmethod
    def from_gguf(cls, path_or_reader: Any, *, fallback: str | None = None) -> ChatTemplate:
        """The template stored in ``tokenizer.chat_template`` (with the file's BOS/EOS text).

        ``fallback`` (e.g. :data:`CHATML`) is used when the GGUF has none; without it a
        missing template is an :class:`InputError`.
        """
        meta = metadata_from(path_or_reader)
        source = meta.get(Keys.Tokenizer.CHAT_TEMPLATE)
        name = os.fspath(path_or_reader) if isinstance(path_or_reader, (str, os.PathLike)) else "GGUF"
        if not source:
            if fallback is None:
                raise InputError(f"{name}: no chat template in the GGUF (tokenizer.chat_template)")
            source = fallback
        tokens = meta.get(Keys.Tokenizer.LIST) or []

        def text_of(key):
            tid = meta.get(key)
            if tid is None or not 0 <= int(tid) < len(tokens):
                return None
            t = tokens[int(tid)]
            return t.decode("utf-8", errors="replace") if isinstance(t, bytes) else str(t)

        return cls(
            source,
            bos_token=text_of(Keys.Tokenizer.BOS_ID),
            eos_token=text_of(Keys.Tokenizer.EOS_ID),
            unk_token=text_of(Keys.Tokenizer.UNK_ID),
            pad_token=text_of(Keys.Tokenizer.PAD_ID),
        )

    def render(
        self,
        messages: Sequence[Mapping],
        tools: Sequence[Mapping] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text; template errors (incl. ``raise_exception``) are :class:`InputError`."""
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
            raise InputError("messages must be a list")
        chat = plain(list(messages))
        for m in chat:
            if not isinstance(m, dict):
                raise InputError("every message must be an object")
        chat = alias_reasoning(chat)
        variables = {k: v for k, v in self.special_tokens.items() if v is not None}
        variables.update(plain(kwargs))
        try:
            return self._template.render(
                messages=chat,
                tools=plain(list(tools)) if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise InputError(f"chat template rejected the request: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise InputError(f"chat template failed on this request: {exc}") from None

    # ---- facts about the template the API needs ------------------------------------------

    @property
    def mentions_tools(self) -> bool:
        """Whether the template renders a ``tools`` list itself."""
        return "tools" in self.source

    @property
    def thinking_markers(self) -> tuple[str, str] | None:
        """The reasoning delimiters this template uses, if any."""
        for start, end in (("<think>", "</think>"), ("<|channel>", "<channel|>")):
            if start in self.source and end in self.source:
                return start, end
        return None
