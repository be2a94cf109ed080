"""``hf2q smoke``: SmolLM2's family cases pass on the real model; a rule the model cannot meet fails
with exit 1; the pass rules judge what a client would parse (tool-call arguments, JSON against a schema)."""

from __future__ import annotations

import json

import pytest

from hf2q.arch.smoke_prompts import CHAT_CASES, PERSON_SCHEMA, WEATHER_TOOL
from hf2q.smoke import judge, parse_cases


def _case(kind: str, expect: dict, **extra):
    raw = {"name": "c", "kind": kind, "messages": [{"role": "user", "content": "x"}], "expect": expect, **extra}
    return parse_cases([raw], "test")[0]


@pytest.mark.slow
def test_smollm2_passes_its_family_cases(cli, smollm2_gguf):
    r = cli("smoke", smollm2_gguf, "--json")
    report = json.loads(r.out)
    assert r.code == 0, json.dumps(report["cases"], indent=1)
    assert report["passed"] and report["architecture"] == "llama"
    assert [c["name"] for c in report["cases"]] == [c["name"] for c in CHAT_CASES]
    by_name = {c["name"]: c for c in report["cases"]}
    call = by_name["tool-call"]["reply"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and "paris" in json.loads(call["arguments"])["city"].lower()
    assert json.loads(by_name["json"]["reply"]["content"]) == {"name": "Alice", "age": 30}
    assert "7391" in by_name["long-recall"]["reply"]["content"]


def test_a_rule_the_model_does_not_meet_fails_with_exit_1(cli, smollm2_gguf, tmp_path):
    json_case = {**next(c for c in CHAT_CASES if c["kind"] == "json")}
    json_case["expect"] = {**json_case["expect"], "equals": {"name": "Bob"}}
    cases = [{"name": "capital", "kind": "answer", "max_tokens": 12,
              "messages": [{"role": "user", "content": "What is the capital of France?"}],
              "expect": {"contains": ["Berlin"]}}, json_case]
    f = tmp_path / "cases.json"
    f.write_text(json.dumps(cases))
    r = cli("smoke", smollm2_gguf, "--prompts", f, "--json")
    assert r.code == 1
    capital, person = json.loads(r.out)["cases"]
    assert not capital["passed"] and capital["detail"] == "missing 'Berlin'"
    assert "Paris" in capital["reply"]["content"]  # the model answered; the rule said no
    # the schema constrained the in-process decode (unconstrained, SmolLM2 adds properties the schema
    # forbids); only the value rule fails
    assert not person["passed"] and person["detail"] == "name is 'Alice' (expected 'Bob')"


def _call(name: str, arguments: str) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": name, "arguments": arguments}}]}


@pytest.mark.parametrize("message, ok", [
    (_call("get_weather", '{"city": "Paris, France"}'), True),
    (_call("get_weather", '{"city": "Lyon"}'), False),
    (_call("get_time", '{"city": "Paris"}'), False),
    (_call("get_weather", '{"city": "Paris"'), False),  # arguments cut short: not JSON
    (_call("get_weather", '["Paris"]'), False),
    ({"role": "assistant", "content": "get_weather(Paris)"}, False),  # text that only looks like a call
])
def test_tool_call_rule(message, ok):
    case = _case("tool_call", {"tool": "get_weather", "arguments": {"city": "paris"}}, tools=[WEATHER_TOOL])
    assert judge(case, message)[0] is ok


@pytest.mark.parametrize("content, ok, why", [
    ('{"name": "Alice", "age": 30}', True, "valid JSON"),
    ('{"name": "Alice", "age": "30"}', False, "$.age is not integer"),
    ('{"name": "Alice"}', False, "$.age is missing"),
    ('{"name": "Alice", "age": 30, "city": "Oslo"}', False, "$.city is not allowed"),
    ('{"name": "Bob", "age": 30}', False, "name is 'Bob'"),
    ('{"name": "Alice", "age": true}', False, "$.age is not integer"),
    ("Alice is 30", False, "not JSON"),
])
def test_json_rule(content, ok, why):
    case = _case("json", {"schema": PERSON_SCHEMA, "equals": {"name": "Alice", "age": 30}})
    passed, detail = judge(case, {"role": "assistant", "content": content})
    assert passed is ok and why in detail


def test_filler_expands_into_the_message():
    case = _case("recall", {"contains": ["42"]}, filler="ab ", filler_repeat=3)
    raw = {"name": "c", "kind": "recall", "messages": [{"role": "user", "content": "[{filler}]"}],
           "expect": {"contains": ["42"]}, "filler": "ab ", "filler_repeat": 3}
    assert parse_cases([raw], "t")[0].messages[0]["content"] == "[ab ab ab ]"
    assert case.body()["temperature"] == 0.0


@pytest.mark.parametrize("cases, words", [
    ([], "non-empty JSON array"),
    ([{"name": "a", "kind": "poem", "messages": [{"role": "user", "content": "x"}], "expect": {}}], "'kind'"),
    ([{"name": "a", "kind": "answer", "messages": [{"role": "user", "content": "x"}], "expect": {}}],
     "expect.contains"),
    ([{"name": "a", "kind": "tool_call", "messages": [{"role": "user", "content": "x"}],
       "expect": {"tool": "f"}}], "needs 'tools'"),
])
def test_a_bad_prompts_file_is_exit_3(cli, smollm2_gguf, tmp_path, cases, words):
    f = tmp_path / "cases.json"
    f.write_text(json.dumps(cases))
    r = cli("smoke", smollm2_gguf, "--prompts", f)
    assert r.code == 3 and words in r.err and "Traceback" not in r.err


def test_a_missing_model_is_exit_3(cli, tmp_path):
    r = cli("smoke", tmp_path / "nope.gguf")
    assert r.code == 3 and "no such GGUF file" in r.err


def test_the_terminal_table_marks_a_failure():
    from rich.console import Console

    from hf2q.smoke import Outcome, _table

    console = Console(record=True, width=160, color_system=None)
    console.print(_table("m.gguf", [Outcome("factual", "answer", True, "contains 'Paris'", {"content": "Paris."}, 1.0),
                                    Outcome("json", "json", False, "the reply is not JSON", {"content": "hi"}, 2.0)]))
    text = console.export_text()
    assert "pass" in text and "FAIL" in text and "the reply is not JSON" in text


def test_an_embedding_model_has_no_smoke_cases(cli, tiny_checkpoint, tmp_path):
    out = tmp_path / "bert.gguf"
    assert cli("convert", tiny_checkpoint("bert"), "-q", "f16", "-o", out, "--no-integrity").code == 0
    r = cli("smoke", out)
    assert r.code == 3 and "not a chat model" in r.err
