"""End-gate prompts of a chat family (``hf2q smoke``) and the fixed prompts of ``hf2q parity``.

A family class names its smoke set (``Family.smoke_cases``) so the family stays the one place
that says what a converted model of that kind must do. Each case is plain JSON-shaped data —
the same shape a ``hf2q smoke --prompts FILE`` file holds — so a user's own set and the
shipped ones go through one reader (``hf2q.smoke``).

A case: ``name``; ``kind`` (``answer``, ``tool_call``, ``json``, ``recall``); ``messages``;
optional request fields (``tools``, ``tool_choice``, ``response_format``, ``max_tokens``); and
``expect``, its pass rule:

* ``answer`` / ``recall`` — ``{"contains": [...]}``: the reply holds every string (case folded);
* ``tool_call`` — ``{"tool": NAME, "arguments": {key: text}}``: exactly one call, of NAME, whose
  arguments parse as a JSON object and hold each key with a value containing that text;
* ``json`` — ``{"schema": {...}, "equals": {...}}``: the reply parses, validates against the
  schema, and has those values.

``{filler}`` in a message is replaced by ``filler`` (a text) repeated ``filler_repeat`` times,
so a long-context case stays short here. The rules are ones SmolLM2-135M meets at
temperature 0; a tool call and a JSON answer are constrained (forced ``tool_choice``, a
``json_schema`` response format), since a model that small rarely volunteers either.
"""

from __future__ import annotations

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

_FILLER = "The grass is green. The sky is blue. The river runs to the sea. "

CHAT_CASES: tuple[dict, ...] = (
    {"name": "factual", "kind": "answer", "max_tokens": 24,
     "messages": [{"role": "user", "content": "What is the capital of France?"}],
     "expect": {"contains": ["Paris"]}},
    {"name": "tool-call", "kind": "tool_call", "max_tokens": 48,
     "messages": [{"role": "user", "content": "What is the weather in Paris right now?"}],
     "tools": [WEATHER_TOOL], "tool_choice": "required",
     "expect": {"tool": "get_weather", "arguments": {"city": "Paris"}}},
    {"name": "json", "kind": "json", "max_tokens": 48,
     "messages": [{"role": "user", "content": "Give me a JSON object describing a person named Alice who is "
                                              "30 years old."}],
     "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}},
     "expect": {"schema": PERSON_SCHEMA, "equals": {"name": "Alice", "age": 30}}},
    {"name": "long-recall", "kind": "recall", "max_tokens": 16,
     "messages": [{"role": "user", "content": "Remember this: the secret code is 7391. {filler}\n\n"
                                              "What is the secret code?"}],
     "filler": _FILLER, "filler_repeat": 60,
     "expect": {"contains": ["7391"]}},
)

#: raw-text prompts (no chat template) whose greedy continuations ``hf2q parity`` captures
PARITY_PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
)
