"""``hf2q smoke``: does a converted chat model still do what its family must — answer a fact, call a
tool, write JSON, recall a fact from far back — at temperature 0, through the server's own chat path.

The cases come from the model's family (``Family.smoke_cases``, ``hf2q/arch/smoke_prompts.py``) or a
``--prompts`` file of the same shape; each request runs through ``hf2q.chat.LocalBackend``, which
renders with the GGUF's template, constrains where the request asks (``response_format``, a forced
``tool_choice``) and parses tool calls exactly as ``hf2q serve`` does, so a pass here is a pass
there. Exit 0 when every case passes, 1 when one fails, 3 for a model or file it cannot use.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf2q.errors import EXIT_FAILURE, InputError

KINDS = ("answer", "tool_call", "json", "recall")
_REQUEST_FIELDS = ("tools", "tool_choice", "response_format", "max_tokens")
DEFAULT_MAX_TOKENS = 48


# ---- cases -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One end-gate prompt and its pass rule (the fields are described in ``hf2q/arch/smoke_prompts.py``)."""

    name: str
    kind: str
    messages: tuple[dict, ...]
    expect: dict
    request: dict

    def body(self) -> dict:
        """The chat-completion request: greedy, thinking off (the rules read the answer, not the thoughts)."""
        return {"messages": list(self.messages), "temperature": 0.0, "max_tokens": DEFAULT_MAX_TOKENS,
                "chat_template_kwargs": {"enable_thinking": False}, **self.request}


def _expand_filler(raw: dict, where: str) -> list[dict]:
    filler = raw.get("filler", "")
    repeat = raw.get("filler_repeat", 1)
    if not isinstance(filler, str) or not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 0:
        raise InputError(f"{where}: 'filler' must be a string and 'filler_repeat' a non-negative integer")
    out = []
    for m in raw["messages"]:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
            raise InputError(f"{where}: each message needs a 'role' and a string 'content'")
        out.append({**m, "content": m["content"].replace("{filler}", filler * repeat)})
    return out


def _check_expect(kind: str, expect: Any, where: str) -> None:
    if not isinstance(expect, dict):
        raise InputError(f"{where}: 'expect' must be an object")
    if kind in ("answer", "recall"):
        wanted = expect.get("contains")
        if not isinstance(wanted, list) or not wanted or not all(isinstance(w, str) and w for w in wanted):
            raise InputError(f"{where}: a {kind} case needs expect.contains, a list of non-empty strings")
    elif kind == "tool_call":
        if not isinstance(expect.get("tool"), str) or not isinstance(expect.get("arguments", {}), dict):
            raise InputError(f"{where}: a tool_call case needs expect.tool (a name) and optional "
                             "expect.arguments (an object)")
    elif not isinstance(expect.get("schema"), dict) or not isinstance(expect.get("equals", {}), dict):
        raise InputError(f"{where}: a json case needs expect.schema (an object) and optional expect.equals")


def parse_cases(raw_cases: Any, source: str) -> list[Case]:
    """Validated ``Case`` s from JSON-shaped data; a mistake is one ``InputError`` naming the case."""
    if not isinstance(raw_cases, (list, tuple)) or not raw_cases:
        raise InputError(f"{source}: expected a non-empty JSON array of smoke cases")
    cases, seen = [], set()
    for i, raw in enumerate(raw_cases):
        where = f"{source}: case {i}"
        if not isinstance(raw, dict):
            raise InputError(f"{where}: expected an object")
        name, kind = raw.get("name"), raw.get("kind")
        if not isinstance(name, str) or not name:
            raise InputError(f"{where}: needs a 'name'")
        where = f"{source}: case {name!r}"
        if name in seen:
            raise InputError(f"{where}: the name is used twice")
        seen.add(name)
        if kind not in KINDS:
            raise InputError(f"{where}: 'kind' must be one of {', '.join(KINDS)}, got {kind!r}")
        if not isinstance(raw.get("messages"), list) or not raw["messages"]:
            raise InputError(f"{where}: needs 'messages', a non-empty list")
        _check_expect(kind, raw.get("expect"), where)
        request = {k: raw[k] for k in _REQUEST_FIELDS if k in raw}
        if kind == "tool_call" and not request.get("tools"):
            raise InputError(f"{where}: a tool_call case needs 'tools'")
        cases.append(Case(name, kind, tuple(_expand_filler(raw, where)), raw["expect"], request))
    return cases


def read_json_file(path: Path, option: str) -> Any:
    """The JSON in the file an option names; an unreadable or malformed one is one ``InputError``."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"cannot read {option}: {e.strerror}: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{option} {path}: not JSON: {e}") from None


def load_cases_file(path: Path) -> list[Case]:
    return parse_cases(read_json_file(path, "--prompts"), str(path))


def gguf_family(arch: str):
    """The family class (``hf2q/arch/``) that writes GGUF architecture ``arch``, or None."""
    from hf2q.arch.registry import FAMILIES

    return next((f for f in FAMILIES if f.architecture() == arch), None)


def family_cases(arch: str) -> list[Case]:
    """The shipped cases of the family whose GGUF architecture is ``arch``."""
    fam = gguf_family(arch)
    if fam is None:
        raise InputError(f"architecture {arch!r} has no smoke cases (no family of that name); give --prompts FILE")
    if fam.smoke_cases is None:
        raise InputError(f"architecture {arch!r} is not a chat model; it has no smoke cases")
    return parse_cases(fam.smoke_cases, f"the {arch} family's smoke cases")


# ---- pass rules --------------------------------------------------------------------------------------

def _schema_errors(value: Any, schema: dict, at: str = "$") -> list[str]:
    """Where ``value`` breaks ``schema`` — the JSON Schema words a smoke rule needs (type, properties,
    required, additionalProperties, items, enum, minimum, maximum)."""
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    kind = schema.get("type")
    if kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind in types:
        ok = isinstance(value, types[kind]) and not (kind != "boolean" and isinstance(value, bool))
    else:
        ok = True
    if not ok:
        return [f"{at} is not {kind}"]
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{at} is not one of {schema['enum']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{at} is below {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{at} is above {schema['maximum']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errors += [f"{at}.{k} is missing" for k in schema.get("required", ()) if k not in value]
        for k, v in value.items():
            if k in props:
                errors += _schema_errors(v, props[k], f"{at}.{k}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{at}.{k} is not allowed")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            errors += _schema_errors(v, schema["items"], f"{at}[{i}]")
    return errors


def _contains(text: str, wanted: Iterable[str]) -> tuple[bool, str]:
    missing = [w for w in wanted if w.casefold() not in text.casefold()]
    return (not missing, "contains " + ", ".join(map(repr, wanted)) if not missing
            else "missing " + ", ".join(map(repr, missing)))


def judge(case: Case, message: dict) -> tuple[bool, str]:
    """Whether the assistant ``message`` meets ``case``'s rule, and a short reason."""
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    if case.kind in ("answer", "recall"):
        return _contains(content, case.expect["contains"])
    if case.kind == "tool_call":
        if len(calls) != 1:
            return False, f"{len(calls)} tool calls (expected 1)"
        fn = calls[0].get("function") or {}
        if fn.get("name") != case.expect["tool"]:
            return False, f"called {fn.get('name')!r} (expected {case.expect['tool']!r})"
        try:
            args = json.loads(fn.get("arguments") or "")
        except json.JSONDecodeError:
            return False, f"arguments are not JSON: {fn.get('arguments')!r}"
        if not isinstance(args, dict):
            return False, "arguments are not a JSON object"
        for key, text in case.expect.get("arguments", {}).items():
            if key not in args:
                return False, f"argument {key!r} is missing"
            if str(text).casefold() not in str(args[key]).casefold():
                return False, f"argument {key}={args[key]!r} lacks {text!r}"
        return True, f"{fn['name']}({json.dumps(args, ensure_ascii=False)})"
    try:
        value = json.loads(content)
    except json.JSONDecodeError:
        return False, "the reply is not JSON"
    errors = _schema_errors(value, case.expect["schema"])
    if errors:
        return False, "schema: " + "; ".join(errors[:3])
    for key, want in case.expect.get("equals", {}).items():
        if not isinstance(value, dict) or value.get(key) != want:
            got = value.get(key) if isinstance(value, dict) else None
            return False, f"{key} is {got!r} (expected {want!r})"
    return True, "valid JSON matching the schema"


# ---- running -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    name: str
    kind: str
    passed: bool
    detail: str
    reply: dict
    seconds: float

    def as_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "passed": self.passed, "detail": self.detail,
                "reply": self.reply, "seconds": round(self.seconds, 3)}


def run_cases(backend, cases: Iterable[Case], on_outcome: Callable[[Outcome], None] = lambda o: None) -> list[Outcome]:
    """Each case through ``backend.stream`` (``hf2q.chat``'s backends), judged as it ends."""
    from hf2q.chat import ReplyRenderer

    out = []
    for case in cases:
        renderer = ReplyRenderer()
        t0 = time.perf_counter()
        try:
            backend.stream(case.body(), renderer.feed)
        except InputError as e:  # the request itself was refused (e.g. longer than the context)
            outcome = Outcome(case.name, case.kind, False, f"request refused: {e}", {}, time.perf_counter() - t0)
        else:
            message = renderer.message()
            passed, detail = judge(case, message)
            outcome = Outcome(case.name, case.kind, passed, detail, message, time.perf_counter() - t0)
        on_outcome(outcome)
        out.append(outcome)
    return out


def _reply_text(reply: dict) -> str:
    calls = reply.get("tool_calls") or []
    if calls:
        return "; ".join(f"{c['function']['name']}({c['function']['arguments']})" for c in calls)
    return reply.get("content", "")


def _table(model: str, outcomes: list[Outcome]):
    from rich.table import Table

    table = Table(title=f"hf2q smoke — {model}", title_justify="left")
    for col in ("case", "kind", "result", "why", "reply", "s"):
        table.add_column(col, overflow="fold", justify="right" if col == "s" else "left")
    for o in outcomes:
        table.add_row(o.name, o.kind, "[green]pass[/]" if o.passed else "[red]FAIL[/]", o.detail,
                      _reply_text(o.reply)[:120], f"{o.seconds:.1f}")
    return table


def run(args) -> int:
    if args.model:
        model_path = Path(args.model)
        if model_path.is_dir():
            raise InputError(f"{model_path} is a directory; smoke runs a GGUF (hf2q convert it first)")
        if not model_path.is_file():
            raise InputError(f"no such GGUF file: {model_path}")
    else:
        from hf2q.fetch import default_chat_model

        model_path = default_chat_model()
    from hf2q.engine.generate import check_generative_model

    header = check_generative_model(model_path)
    cases = load_cases_file(Path(args.prompts)) if args.prompts else family_cases(header.arch)
    from hf2q.chat import LocalBackend

    backend = LocalBackend(model_path, ctx=args.ctx)
    try:
        outcomes = run_cases(backend, cases)
    finally:
        backend.close()
    passed = all(o.passed for o in outcomes)
    if args.json or not sys.stdout.isatty():
        print(json.dumps({"model": model_path.name, "architecture": header.arch, "passed": passed,
                          "cases": [o.as_json() for o in outcomes]}, ensure_ascii=False, indent=2))
    else:
        from rich.console import Console

        console = Console()
        console.print(_table(model_path.name, outcomes))
        console.print(f"{sum(o.passed for o in outcomes)}/{len(outcomes)} passed",
                      style="green" if passed else "red")
    return 0 if passed else EXIT_FAILURE
