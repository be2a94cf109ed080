"""Chat templates: the model's own Jinja program that turns messages into a prompt.

Templates are untrusted code from model files, so they run in jinja2's
``ImmutableSandboxedEnvironment``. Everything else mirrors what transformers'
``apply_chat_template`` gives a template, because that is what model authors test
against: ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson``
filter that does not HTML-escape (``json.dumps`` with ``ensure_ascii=False``),
``raise_exception``, ``strftime_now``, a ``namespace`` that refuses underscore names, the
special-token strings as variables, and reasoning text visible under all of its usual
names (``reasoning_content``, ``thinking``, ``reasoning``).

A template is also a program that may never end: one render has a budget of wall time, loop
iterations (``range``), output characters and the size of what ``*`` / ``**`` build, checked
as it runs; over budget is an :class:`InputError` like any other template failure, so a
server answers 400 instead of spinning (it renders off its event loop as well).
"""

from __future__ import annotations

import contextvars
import json
import os
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from hf2q.errors import InputError
from hf2q.formats.gguf_keys import Keys
from hf2q.formats.gguf_parse import metadata_from

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

#: one render's budget; real templates use a tiny fraction of each
TIME_BUDGET_S = 5.0
MAX_LOOP_ITERATIONS = 1_000_000  # items produced by range(), summed over the render
MAX_OUTPUT_CHARS = 64 << 20  # plus twice the request's own text, which a template may repeat
MAX_BUILT_ITEMS = 16 << 20  # characters or items one ``*`` or ``**`` may produce


class _Budget:
    """What is left of one render's budget; charged from inside the sandbox as the template runs."""

    def __init__(self, seconds: float, max_output: int):
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.iterations = MAX_LOOP_ITERATIONS
        self.max_output = max_output

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise jinja2.exceptions.TemplateRuntimeError(f"ran longer than its {self.seconds:g} s budget")

    def iterate(self) -> None:
        self.iterations -= 1
        if self.iterations < 0:
            raise jinja2.exceptions.TemplateRuntimeError(f"looped more than {MAX_LOOP_ITERATIONS} times")
        if not self.iterations % 1024:
            self.tick()


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat_template_budget", default=None)


def _charge_tick() -> None:
    b = _budget.get()
    if b is not None:
        b.tick()


class _BudgetedRange(Sequence):
    """``range`` whose iteration is charged to the render's loop budget (indexing and ``len`` are free)."""

    def __init__(self, rng: range):
        self._rng = rng

    def __len__(self) -> int:
        return len(self._rng)

    def __getitem__(self, i):
        v = self._rng[i]
        return _BudgetedRange(v) if isinstance(v, range) else v

    def __iter__(self):
        b = _budget.get()
        for v in self._rng:
            if b is not None:
                b.iterate()
            yield v

    def __reversed__(self):
        return iter(_BudgetedRange(self._rng[::-1]))

    def __contains__(self, v) -> bool:
        return v in self._rng

    def __repr__(self) -> str:
        return repr(self._rng)


class _BudgetedList(list):
    """A request list (``messages``, ``tools``) whose iteration is charged like ``range``'s, so
    loops nested over the request are bounded too; otherwise an ordinary (immutable) list."""

    def __iter__(self):
        b = _budget.get()
        for v in super().__iter__():
            if b is not None:
                b.iterate()
            yield v

    def __getitem__(self, i):
        v = super().__getitem__(i)
        return _BudgetedList(v) if isinstance(i, slice) else v


def _budgeted_range(*args: int) -> _BudgetedRange:
    return _BudgetedRange(safe_range(*args))


def _built_size(operator: str, left: Any, right: Any) -> int:
    """Items ``left <operator> right`` would produce, estimated before building it (0: small)."""
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                return len(seq) * max(n, 0)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return abs(left).bit_length() * right // 8  # bytes of the resulting integer
    return 0


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if _built_size(operator, left, right) > MAX_BUILT_ITEMS:
            raise jinja2.exceptions.TemplateRuntimeError(f"'{operator}' would build more than {MAX_BUILT_ITEMS} items")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 — jinja's own signature
        _charge_tick()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        _charge_tick()
        return super().getattr(obj, attribute)


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
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.globals["range"] = _budgeted_range
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


def _text_size(messages: list[dict]) -> int:
    """Characters of the messages' own text (what a template may legitimately repeat)."""
    return sum(len(v) for m in messages for v in m.values() if isinstance(v, str))


def _collect(chunks, budget: _Budget) -> str:
    """Join the rendered chunks, stopping the render when it runs out of time or output room."""
    out, size = [], 0
    for chunk in chunks:
        size += len(chunk)
        if size > budget.max_output:
            raise jinja2.exceptions.TemplateRuntimeError(f"produced more than {budget.max_output} characters")
        budget.tick()
        out.append(chunk)
    return "".join(out)


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None, *,
                 time_budget_s: float = TIME_BUDGET_S, **special_tokens: str):
        if not isinstance(source, str) or not source.strip():
            raise InputError("chat template is empty")
        self.source = source
        self.time_budget_s = time_budget_s
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
        tool_list = plain(list(tools)) if tools is not None else None
        budget = _Budget(self.time_budget_s, MAX_OUTPUT_CHARS + 2 * _text_size(chat))
        token = _budget.set(budget)
        try:
            return _collect(self._template.generate(
                messages=_BudgetedList(chat),
                tools=_BudgetedList(tool_list) if tool_list is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            ), budget)
        except jinja2.exceptions.TemplateError as exc:
            raise InputError(f"chat template rejected the request: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError,
                RecursionError, MemoryError) as exc:
            raise InputError(f"chat template failed on this request: {type(exc).__name__}: {exc}") from None
        finally:
            _budget.reset(token)

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
